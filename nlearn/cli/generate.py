"""nlearn-generate --workdir=DIR --prompt="..." [--max_new_tokens=100 --temperature=0.8 --top_k=40]"""

from absl import flags

from nlearn.cli.common import run as run_app

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding checkpoints and config.json.")
_PROMPT = flags.DEFINE_string("prompt", "", "Text to continue.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 100, "Tokens to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 40, "Sample among the k most likely tokens; 0 = all.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: newest readable).")
flags.mark_flag_as_required("workdir")


def main(argv):
    from nlearn import data
    from nlearn.eval.generate import generate
    from nlearn.eval.restore import load_run_config, restore_params

    config = load_run_config(_WORKDIR.value)
    setup, step, params = restore_params(config, _WORKDIR.value, _STEP.value)
    tokenizer = data.get_tokenizer(config)
    ids = [int(i) for i in tokenizer.encode(_PROMPT.value)] or [tokenizer.eos_id]
    new = generate(setup.graphdef, params, ids, max_new_tokens=_MAX_NEW.value,
                   temperature=_TEMPERATURE.value, top_k=_TOP_K.value, seed=_SEED.value,
                   eos_id=tokenizer.eos_id)
    print(tokenizer.decode(ids + new), flush=True)


def run():
    run_app(main)


if __name__ == "__main__":
    run()
