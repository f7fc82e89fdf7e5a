"""The fast-weight norm an evaluation reports: which cache leaves count, and no overflow in the norm."""

import jax.numpy as jnp
import numpy as np

from nlearn.eval.fast_weights import frobenius, max_fast_weight_norm
from nlearn.memory.neural_memory import NeuralMemoryState


def test_counts_memory_weights_not_momentum_or_attention():
    theta = (jnp.full((1, 1, 2, 2), 1.0), jnp.full((1, 1, 2, 2), 2.0))  # norms 2 and 4
    big = (jnp.full((1, 1, 2, 2), 100.0),) * 2
    state = NeuralMemoryState(theta, big, big, jnp.zeros((), jnp.int32))
    cache = [{"convs": [jnp.full((1, 3, 4), 100.0)], "state": state, "kv": (jnp.full((1, 4, 1, 2), 100.0),)}]
    assert float(max_fast_weight_norm(cache)) == 4.0
    assert float(max_fast_weight_norm([{"kv": (jnp.ones((1, 4, 1, 2)),)}])) == 0.0  # attention only


def test_norm_of_a_huge_state_is_finite_and_nan_is_reported():
    x = jnp.full((1, 2, 3, 4), 1e20, jnp.float32)  # squares overflow float32
    np.testing.assert_allclose(np.asarray(frobenius(x)), np.full((1, 2), 1e20 * np.sqrt(12)), rtol=1e-6)
    assert np.isnan(float(max_fast_weight_norm({"state": x.at[0, 0, 0, 0].set(jnp.inf)})))
