"""nlearn-eval --workdir=DIR [--config=...] [--step=N]: validation loss and perplexity as JSON.

The last stdout line is one JSON object: {"step", "loss", "perplexity", "tokens"}; it is also
written to DIR/eval_step<N>.json.
"""

import json
import os

from absl import flags
from ml_collections import config_flags

from nlearn.cli.common import run as run_app

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config (default: the run's saved config.json).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding checkpoints.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: newest readable).")
flags.mark_flag_as_required("workdir")


def main(argv):
    import jax

    from nlearn import config as config_lib
    from nlearn import data
    from nlearn.eval.perplexity import make_evaluator
    from nlearn.eval.restore import load_run_config, restore_params
    from nlearn.train.benchmark import compiler_options
    from nlearn.train.checkpoint import Checkpointer

    config = _CONFIG.value if _CONFIG.value is not None else load_run_config(_WORKDIR.value)
    config_lib.validate(config)
    Checkpointer(_WORKDIR.value, read_only=True).close()  # clear error before any data work
    setup, step, params = restore_params(config, _WORKDIR.value, _STEP.value)
    evaluate = make_evaluator(setup, compiler_options(config.train))  # as the trainer's evaluations
    result = {"step": int(step), **evaluate(params, data.make_eval_batches(
        config, process_index=jax.process_index(), process_count=jax.process_count()))}
    with open(os.path.join(_WORKDIR.value, f"eval_step{step}.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result), flush=True)


def run():
    run_app(main)


if __name__ == "__main__":
    run()
