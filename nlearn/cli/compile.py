"""nlearn-compile --config=configs/<family>.py:<preset> --topology=v5e:4x4 [--config.section.key=value ...]

Compiles the config's train step for a TPU topology (or `cpu`) on this machine and prints per-device
memory against the chip's HBM, FLOPs, a roofline step time and the collectives; exits 1 when it does not fit.
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
flags.mark_flags_as_required(["config"])


def main(argv):
    from nlearn.train.compile import as_row, compile_step, describe

    report = compile_step(_CONFIG.value, _TOPOLOGY.value)
    print(describe(report), flush=True)
    if _JSON.value:
        with open(_JSON.value, "a") as f:
            f.write(json.dumps(as_row(report)) + "\n")
    if report.fits is False:
        sys.exit(1)


def run():
    run_app(main)


if __name__ == "__main__":
    run()
