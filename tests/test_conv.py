"""The short causal conv's hand-written backward against autodiff of its definition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nlearn.layers.conv import ShortConv, causal_conv, causal_conv_reference


@pytest.mark.parametrize("t,k", [(7, 4), (2, 4), (5, 1), (9, 3)])
def test_causal_conv_values_and_gradients_match_autodiff(t, k):
    keys = jax.random.split(jax.random.key(t * 10 + k), 4)
    past = jax.random.normal(keys[0], (2, k - 1, 5))
    x = jax.random.normal(keys[1], (2, t, 5))
    w = jax.random.normal(keys[2], (k, 5))
    probe = jax.random.normal(keys[3], (2, t, 5))  # a generic downstream gradient

    def loss(fn):
        return lambda *args: jnp.sum(jnp.sin(fn(*args)) * probe)

    np.testing.assert_allclose(causal_conv(past, x, w), causal_conv_reference(past, x, w), rtol=1e-6, atol=1e-6)
    fast = jax.grad(loss(causal_conv), argnums=(0, 1, 2))(past, x, w)
    slow = jax.grad(loss(causal_conv_reference), argnums=(0, 1, 2))(past, x, w)
    for name, a, b in zip(("past", "x", "w"), fast, slow):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


def test_short_conv_streams_with_its_cache_and_is_causal():
    conv = ShortConv(6, 4, init="uniform", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 11, 6))
    full, _ = conv(x)
    first, cache = conv(x[:, :5], conv.init_cache(2, 6))
    second, _ = conv(x[:, 5:], cache)
    np.testing.assert_allclose(jnp.concatenate([first, second], 1), full, rtol=1e-6, atol=1e-6)
    changed, _ = conv(x.at[:, 7:].set(0.0))
    np.testing.assert_allclose(changed[:, :7], full[:, :7], rtol=0, atol=0)
