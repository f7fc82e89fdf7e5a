"""Every registered family: builds from its config, finite logits, causal end to end, and
step-by-step decoding (recurrent state / bounded KV cache) equals the full forward."""

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nlearn import models
from test_model import jitted
from run_helpers import family_params
from nlearn.train.state import make_setup
from nlearn.train.step import make_train_step

FAMILIES = sorted(models.FAMILIES)
# tests/test_titans.py checks MAG's and MAL's causality and decoding across segments in the default suite.
COVERED_ELSEWHERE = ("titans_mag", "titans_mal")


def tiny(family, **model):
    config = importlib.import_module(family).get_config("tiny")
    with config.unlocked():
        config.data.vocab_size = 61
        config.model.update(dict(d_model=32, num_layers=2, num_heads=2), **model)
        if "memory" in config.model and "chunk_size" in config.model.memory:
            config.model.memory.chunk_size = 8  # several chunks in a short test sequence
    return config


@pytest.mark.parametrize("family", family_params(FAMILIES, also_slow=COVERED_ELSEWHERE))
def test_family_is_finite_and_causal(family):
    """Changing token j leaves every output before j as it was and changes every output from j on
    (the later ones only through the mixer: a model that ignores the context fails too)."""
    model = jitted(models.build(tiny(family)))
    tokens = jax.random.randint(jax.random.key(0), (2, 21), 0, 61)
    logits = model(tokens)
    assert logits.shape == (2, 21, 61) and bool(jnp.all(jnp.isfinite(logits)))
    j = 5  # later positions span chunk boundaries (chunk_size 8)
    changed = np.asarray(model(tokens.at[:, j].set((tokens[:, j] + 5) % 61)))
    np.testing.assert_allclose(changed[:, :j], np.asarray(logits[:, :j]), atol=1e-6)
    moved = np.max(np.abs(changed[:, j:] - np.asarray(logits[:, j:])), axis=-1)  # [B, T - j]
    assert np.all(moved > 1e-5), f"{family}: outputs at positions >= {j} that token {j} does not reach: " \
        f"{sorted(set((np.nonzero(moved <= 1e-5)[1] + j).tolist()))}"


@pytest.mark.parametrize("family", family_params(FAMILIES, also_slow=COVERED_ELSEWHERE))
def test_family_decoding_matches_full_forward(family):
    module = models.build(tiny(family))
    decode = jitted(module, "decode")
    tokens = jax.random.randint(jax.random.key(1), (2, 19), 0, 61)
    full = jitted(module)(tokens)
    logits, cache = decode(tokens[:, :7], module.init_cache(2, 19))
    steps = [logits]
    for i in range(7, 19):
        logits, cache = decode(tokens[:, i:i + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(full), atol=1e-4)


@pytest.mark.parametrize("family", family_params(FAMILIES, also_slow=COVERED_ELSEWHERE))
def test_train_step_returns_the_types_it_takes(family):
    """The state leaves a train step as it came in (dtype, weak type), so the jitted step compiles
    once, not again at step 2 (a weak-typed initial parameter cost titans_mac 12 s per shape)."""
    config = tiny(family)
    with config.unlocked():
        config.train.update(batch_size=2, seq_len=16)
    setup = make_setup(config)
    step = make_train_step(setup.config, setup.graphdef, setup.optimizer, dtype=jnp.float32)
    batch = {k: jax.ShapeDtypeStruct((2, 16), jnp.int32) for k in ("inputs", "targets")}
    before = jax.eval_shape(setup.init_state)
    after, _ = jax.eval_shape(step, before, batch)
    types = lambda tree: [(x.shape, x.dtype, x.weak_type) for x in jax.tree.leaves(tree)]  # noqa: E731
    assert types(after) == types(before)


def count_at_depth(config, layers: int) -> int:
    """Parameters of `config` at `layers` blocks, from counts at one and two (blocks are identical, so this
    is exact) without tracing a deep model."""
    counts = []
    for depth in (1, 2):
        with config.unlocked():
            config.model.num_layers = depth
        counts.append(models.count_params(config))
    return counts[0] + (layers - 1) * (counts[1] - counts[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_paper_presets_have_their_named_sizes(family):
    """Every paper preset of the family (counted without allocating, nnx.eval_shape) is within 15% of its name."""
    module = importlib.import_module(family)
    for preset in [p for p in module.PRESETS if p != "tiny"]:
        config = module.get_config(preset)
        n = count_at_depth(config, module.PRESETS[preset]["num_layers"])
        target = float(re.sub("[mb]$", "", preset)) * (1e9 if preset.endswith("b") else 1e6)
        assert abs(n - target) / target <= 0.15, f"{family}:{preset} has {n / 1e6:.1f}M parameters"
