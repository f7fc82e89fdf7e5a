"""Load a run's resolved config and a checkpoint's parameters for evaluation and generation."""

from __future__ import annotations

import json
import os

import ml_collections

from nlearn import config as config_lib
from nlearn.errors import UserError
from nlearn.train.checkpoint import Checkpointer
from nlearn.train.state import make_setup


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
    """The config a run saved in its workdir (`config.json`), migrated to today's keys."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise UserError(f"{workdir!r} is not a run directory (no config.json); pass --config or train first")
    with open(path) as f:
        return config_lib.migrate(ml_collections.ConfigDict(json.load(f)))


def restore_params(config, workdir: str, step: int | None = None):
    """`(setup, step, params)` from the newest (or the given) readable checkpoint in `workdir`."""
    setup = make_setup(config)
    ckpt = Checkpointer(workdir, read_only=True)
    try:
        step, state, _ = ckpt.restore(setup.abstract_state, None, step)
    finally:
        ckpt.close()
    return setup, step, state["params"]
