"""nlearn-train --config=configs/<family>.py:<preset> --workdir=DIR [--config.section.key=value ...]"""

from absl import flags
from ml_collections import config_flags

from nlearn.cli.common import run as run_app

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file and preset, e.g. configs/transformer.py:tiny.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, resolved config.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    import jax

    from nlearn import data
    from nlearn.train import distributed, train_and_evaluate

    config = _CONFIG.value
    result = train_and_evaluate(config, _WORKDIR.value)
    lead = jax.process_index() == 0
    distributed.finish()
    if "loss" in result and lead:
        line = (f"final: step {result['step']}, validation loss {result['loss']:.4f}, "
                f"perplexity {result['perplexity']:.2f} over {result['tokens']} tokens")
        if data.get_corpus(config).vocab_size is None:  # a text corpus: the unigram model is a baseline
            line += f" (unigram baseline on the same tokens: {data.unigram_perplexity(config):.2f})"
        print(line, flush=True)


def run():
    run_app(main)


if __name__ == "__main__":
    run()
