"""nlearn-compile --config=configs/<family>.py:<preset> --topology=v5e:4x4 [--config.section.key=value ...]

Compiles the config's train step for a TPU topology (or `cpu`) on this machine and prints per-device
memory against the chip's HBM, FLOPs, a roofline step time and the collectives. When it does not fit, it
finds the `train.grad_accum` whose micro-batch does (same global batch) and reports that step too; it exits 1
when the config as given does not fit.
"""

import json
import os
import sys

from absl import flags
from ml_collections import config_flags

from nlearn.cli.common import run as run_app

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # see nlearn.train.compile

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file and preset, e.g. configs/titans_mac.py:340m.", lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", "cpu", "cpu (this machine's devices) or <chip>:<AxB[xC]>, "
                                "e.g. v5e:4x4, v5p:2x2x1, v4:2x2x1.")
_JSON = flags.DEFINE_string("json", None, "Also append the report as one JSON line to this file.")
_FIT = flags.DEFINE_bool("fit", True, "When the step does not fit, search train.grad_accum for a micro-batch "
                        "that does.")
flags.mark_flags_as_required(["config"])


def main(argv):
    from nlearn.train.compile import as_row, compile_step, describe, fitting_grad_accum

    report = compile_step(_CONFIG.value, _TOPOLOGY.value)
    print(describe(report), flush=True)
    if _JSON.value:
        with open(_JSON.value, "a") as f:
            f.write(json.dumps(as_row(report)) + "\n")
    if report.fits is False:
        if _FIT.value:
            print("searching train.grad_accum for a micro-batch that fits (the same global batch):", flush=True)
            found = fitting_grad_accum(_CONFIG.value, _TOPOLOGY.value, report, log=lambda m: print(m, flush=True))
            accum, trial = found or (None, None)
            if trial is None:
                print("no micro-batch to try: the batch has one sequence per batch shard", flush=True)
            elif trial.fits:
                print(f"fits with --config.train.grad_accum={accum}:\n{describe(trial)}", flush=True)
            else:
                print(f"does not fit even at one sequence per batch shard (--config.train.grad_accum={accum}; more "
                      f"chips, a larger chip, or mesh.tensor / mesh.sequence):\n{describe(trial)}", flush=True)
        sys.exit(1)


def run():
    run_app(main)


if __name__ == "__main__":
    run()
