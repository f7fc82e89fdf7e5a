"""Every family trains in bfloat16 (the dtype every accelerator run uses): the train step of its `tiny`
preset at tiny dims, from the same setup and step builder as `nlearn-train`, traced for every family and
run for one step (Hope included: its self-referential memories once left their scan in another dtype)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nlearn import models
from nlearn.train.state import make_setup
from nlearn.train.step import make_train_step
from test_families import tiny

FAMILIES = sorted(models.FAMILIES)


def bf16_tiny(family):
    config = tiny(family, dtype="bfloat16", num_layers=1)
    with config.unlocked():
        config.train.update(batch_size=2, seq_len=24)
        if family == "hope":  # every CMS level updates inside the window, so pass 1's scan runs
            config.model.cms.update(dict(periods=(4, 8), lr=(1e-3, 1e-3), decay=(0.01, 0.01)))
        if family in ("hope", "self_ref_titans"):
            config.model.memory.update(chunk_memory=4, chunk_other=8)
    return config


def bf16_step(family):
    config = bf16_tiny(family)
    setup = make_setup(config)
    assert setup.dtype == jnp.bfloat16
    return setup, make_train_step(config, setup.graphdef, setup.optimizer, dtype=setup.dtype)


def types(tree):
    return [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_step_traces_in_bfloat16(family):
    """The state leaves the bf16 step in the types it came in (float32 master weights, every scan's carry
    one dtype in and out)."""
    setup, step = bf16_step(family)
    batch = {k: jax.ShapeDtypeStruct((2, 24), jnp.int32) for k in ("inputs", "targets")}
    after, metrics = jax.eval_shape(step, setup.abstract_state, batch)
    assert types(after) == types(setup.abstract_state) and metrics["loss"].dtype == jnp.float32


# Every family traces in bf16 above; one of each kind of memory also runs a step here (the rest under `make test-all`).
BF16_STEP_FAMILIES = ("deltanet", "titans_mac", "self_ref_titans", "hope")


@pytest.mark.parametrize("family", [f if f in BF16_STEP_FAMILIES else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_family_trains_a_step_in_bfloat16(family):
    setup, step = bf16_step(family)
    step = jax.jit(step)
    tokens = jax.random.randint(jax.random.key(0), (2, 25), 0, 61)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    state = setup.init_state()
    before = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state["params"])
    after, metrics = step(state, batch)
    loss = float(metrics["loss"])
    assert np.isfinite(loss) and abs(loss - np.log(61)) < 1.0, f"{family}: loss {loss}"
    assert types(after["params"]) == types(before)  # float32 master weights stay float32
    grad_norm = float(metrics["grad_norm"])
    assert np.isfinite(grad_norm) and grad_norm > 0, f"{family}: gradient norm {grad_norm}"
