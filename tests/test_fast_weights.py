"""Overflow-safe norms and the fast-weight norm an evaluation reports: which cache leaves count, no overflow."""

import jax.numpy as jnp
import numpy as np

from nlearn.eval.fast_weights import frobenius, max_fast_weight_norm
from nlearn.memory.neural_memory import NeuralMemoryState


def test_counts_memory_weights_not_momentum_keys_or_attention():
    theta = (jnp.full((1, 1, 2, 2), 1.0), jnp.full((1, 1, 2, 2), 2.0))  # norms 2 and 4
    big = (jnp.full((1, 1, 2, 2), 100.0),) * 2
    state = NeuralMemoryState(theta, big, big, jnp.zeros((), jnp.int32), jnp.full((1, 1, 16, 2), 100.0))
    cache = [{"convs": [jnp.full((1, 3, 4), 100.0)], "state": state, "kv": (jnp.full((1, 4, 1, 2), 100.0),)}]
    assert float(max_fast_weight_norm(cache)) == 4.0
    assert float(max_fast_weight_norm([{"kv": (jnp.ones((1, 4, 1, 2)),)}])) == 0.0  # attention only


def test_norm_of_a_huge_state_is_finite_and_nan_is_reported():
    x = jnp.full((1, 2, 3, 4), 1e20, jnp.float32)  # squares overflow float32
    np.testing.assert_allclose(np.asarray(frobenius(x)), np.full((1, 2), 1e20 * np.sqrt(12)), rtol=1e-6)
    assert np.isnan(float(max_fast_weight_norm({"state": x.at[0, 0, 0, 0].set(jnp.inf)})))


def test_overflow_safe_rmsnorm():
    """The memories' output norm: the plain RMSNorm's values on ordinary rows, and rows of 1e20 (whose squares
    overflow float32, where the plain norm returns zeros) normalised as well."""
    from flax import nnx

    from nlearn.layers.core import RMSNorm

    safe, plain = (RMSNorm(8, overflow_safe=s, rngs=nnx.Rngs(0)) for s in (True, False))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 8)), jnp.float32)
    np.testing.assert_allclose(np.asarray(safe(x)), np.asarray(plain(x)), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(safe(x * 1e20)), np.asarray(plain(x)), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(plain(x * 1e20)) == 0)  # what the plain norm makes of them
