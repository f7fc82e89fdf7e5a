"""nlearn-eval --workdir=DIR [--task=NAME] [--lengths=L1,L2] [--samples=N] [--variant=V] [--step=N]

Scores a checkpoint with one task of `nlearn.eval.tasks.TASKS` (default `perplexity`: validation loss
and perplexity). The last stdout line is one JSON object: {"task", "step", <the task's metrics>}; the
same with the config, the git commit and the task parameters goes to DIR/eval/<task>.json, and the
per-example records to DIR/eval/<task>.samples.jsonl.
"""

import json
import os
import subprocess

from absl import flags
from ml_collections import config_flags

from nlearn.cli.common import run as run_app

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config (default: the run's saved config.json).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding checkpoints.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: newest readable).")
_TASK = flags.DEFINE_string("task", "perplexity", "Evaluation task (nlearn.eval.tasks.TASKS).")
_LENGTHS = flags.DEFINE_list("lengths", [], "Prompt lengths in tokens to sweep, e.g. 512,2048,8192.")
_SAMPLES = flags.DEFINE_integer("samples", 0, "Examples per length (0: the task's default).")
_VARIANT = flags.DEFINE_string("variant", "", "The task's sub-task (e.g. niah: single_1, ..., all).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the generated examples.")
_CHUNK = flags.DEFINE_integer("chunk_size", 0, "Tokens per streaming step (0: train.seq_len).")
_OPTION = flags.DEFINE_multi_string("option", [], "Task option key=value (repeatable).")
flags.mark_flag_as_required("workdir")


def _lengths(values) -> tuple[int, ...]:
    from nlearn.errors import UserError

    out = []
    for v in values:
        try:
            out.append(int(v))
        except ValueError:
            raise UserError(f"--lengths must be positive integers, got {v!r}") from None
        if out[-1] < 1:
            raise UserError(f"--lengths must be positive integers, got {v!r}")
    return tuple(out)


def _options(values) -> dict:
    from nlearn.errors import UserError

    out = {}
    for v in values:
        key, sep, value = v.partition("=")
        if not sep or not key:
            raise UserError(f"--option must read key=value, got {v!r}")
        out[key] = value
    return out


def git_commit() -> str:
    """The source tree's commit ("" outside a git checkout)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def write_outputs(workdir: str, task: str, record: dict, samples: list) -> None:
    """eval/<task>.json (the record) and eval/<task>.samples.jsonl (one line per sample)."""
    out_dir = os.path.join(workdir, "eval")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{task}.json"), "w") as f:
        json.dump(record, f, indent=2)
    with open(os.path.join(out_dir, f"{task}.samples.jsonl"), "w") as f:
        for sample in samples:
            f.write(json.dumps(sample) + "\n")


def main(argv):
    from nlearn import config as config_lib
    from nlearn.tasks.haystack import text_tokenizer
    from nlearn.errors import UserError
    from nlearn.eval.restore import load_run_config, restore_params
    from nlearn.eval.tasks import TaskContext, get_task
    from nlearn.train.checkpoint import Checkpointer

    task = get_task(_TASK.value)  # an unknown task fails before any restore
    if _SAMPLES.value < 0 or _CHUNK.value < 0:
        raise UserError("--samples and --chunk_size must be >= 0")
    lengths, options = _lengths(_LENGTHS.value), _options(_OPTION.value)
    config = _CONFIG.value if _CONFIG.value is not None else load_run_config(_WORKDIR.value)
    config_lib.validate(config)
    Checkpointer(_WORKDIR.value, read_only=True).close()  # clear error before any data work
    setup, step, params = restore_params(config, _WORKDIR.value, _STEP.value)
    ctx = TaskContext(workdir=_WORKDIR.value, config=config, setup=setup, graphdef=setup.graphdef,
                      params=params, step=int(step), tokenizer=text_tokenizer(config), lengths=lengths,
                      samples=_SAMPLES.value, seed=_SEED.value, variant=_VARIANT.value,
                      chunk_size=_CHUNK.value, options=options)
    metrics, samples = task(ctx)
    result = {"task": _TASK.value, "step": int(step), **metrics}
    record = {**result, "parameters": ctx.parameters(), "commit": git_commit(), "config": config.to_dict()}
    write_outputs(_WORKDIR.value, _TASK.value, record, samples)
    if _TASK.value == "perplexity":  # where earlier releases wrote it
        with open(os.path.join(_WORKDIR.value, f"eval_step{step}.json"), "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result), flush=True)


def run():
    run_app(main)


if __name__ == "__main__":
    run()
