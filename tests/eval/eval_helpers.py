"""Small models and run directories for the evaluation tests."""

from __future__ import annotations

import os
import sys

from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from run_helpers import load_family_config  # noqa: E402


def small_config(family: str, vocab: int = 97, **model):
    """`configs/<family>.py:tiny` at test width (d_model 32, 2 layers)."""
    config = load_family_config(family)
    with config.unlocked():
        config.data.vocab_size = vocab
        config.model.update(dict(d_model=32, num_layers=2, num_heads=2, mlp_dim=64), **model)
    return config


def split_model(config):
    """(graphdef, params) of a freshly initialised model."""
    from nlearn import models

    model = models.build(config)
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(params)


def make_run(config, workdir: str) -> str:
    """A run directory with `config.json` and an untrained checkpoint at step 0."""
    from nlearn import config as config_lib
    from nlearn.train.checkpoint import Checkpointer
    from nlearn.train.state import make_setup

    os.makedirs(workdir, exist_ok=True)
    config_lib.save_config(config, workdir)
    state = make_setup(config).init_state()
    ckpt = Checkpointer(workdir, async_save=False)
    ckpt.save(0, state, None, {})
    ckpt.close()
    return workdir
