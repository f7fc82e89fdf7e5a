"""Transformer++ model: shapes, causality, cached decoding, dtypes, parameter counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import transformer as transformer_config
from nlearn import models


def jitted(model, method="__call__"):
    """A jitted pure function of the model's method (eager NNX dispatch is slow on CPU)."""
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda state, *args: getattr(nnx.merge(graphdef, state), method)(*args))
    return lambda *args: fn(state, *args)


def small_config(**model):
    config = transformer_config.get_config("tiny")
    with config.unlocked():
        config.data.vocab_size = 101
        config.model.update(dict(d_model=32, num_layers=2, num_heads=4), **model)
    return config


@pytest.mark.parametrize("window", [0, 5])
def test_forward_shape_and_causality(window):
    model = jitted(models.build(small_config(window=window)))
    tokens = jax.random.randint(jax.random.key(0), (2, 17), 0, 101)
    logits = model(tokens)
    assert logits.shape == (2, 17, 101) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    changed = tokens.at[:, 9:].set((tokens[:, 9:] + 7) % 101)
    np.testing.assert_array_equal(np.asarray(model(changed)[:, :9]), np.asarray(logits[:, :9]))
    assert not np.allclose(model(changed)[:, 9:], logits[:, 9:])


@pytest.mark.parametrize("window", [0, 4])
def test_cached_decoding_matches_full_forward(window):
    module = models.build(small_config(window=window))
    decode = jitted(module, "decode")
    tokens = jax.random.randint(jax.random.key(1), (2, 15), 0, 101)
    full = jitted(module)(tokens)
    cache = module.init_cache(2, 15)
    logits, cache = decode(tokens[:, :6], cache)  # prefill
    steps = [logits]
    for i in range(6, 15):
        logits, cache = decode(tokens[:, i:i + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(full), atol=2e-5)
    if window:  # bounded cache: the ring buffer holds `window` slots whatever the length
        assert cache[0]["k"].shape[1] == window


def test_bfloat16_compute_stays_close():
    """bf16 compute (float32 master weights) gives the float32 logits up to bf16 rounding, relative to their scale."""
    from nlearn.train.step import cast_params

    config = small_config()
    model = models.build(config)
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jax.random.randint(jax.random.key(2), (1, 12), 0, 101)
    ref = jitted(model)(tokens)
    low = jitted(nnx.merge(graphdef, cast_params(nnx.to_pure_dict(params), jnp.bfloat16)))(tokens)
    assert low.dtype == jnp.float32
    # Within a few bf16 roundings (2^-8 relative each) of the logits' own scale: 0.4% RMS here.
    err, scale = np.asarray(low) - np.asarray(ref), np.sqrt(np.mean(np.square(np.asarray(ref))))
    assert np.sqrt(np.mean(np.square(err))) <= 0.02 * scale and np.abs(err).max() <= 0.05 * scale


def test_untied_head_and_remat_give_same_logits_and_gradients_as_plain():
    """Remat recomputes each block in the backward pass: the forward and every parameter's
    gradient must be those of the plain model (a remat that loses a gradient path fails here)."""
    config = small_config(tie_embeddings=False)
    plain = models.build(config)
    with config.unlocked():
        config.model.remat = True
    remat = models.build(config)
    tokens = jax.random.randint(jax.random.key(3), (1, 8), 0, 101)
    targets = jax.random.randint(jax.random.key(4), (1, 8), 0, 101)

    def loss_and_grads(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params):
            logits = nnx.merge(graphdef, params, rest)(tokens)
            return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

        return jax.jit(jax.value_and_grad(loss))(params)

    (loss_r, grads_r), (loss_p, grads_p) = loss_and_grads(remat), loss_and_grads(plain)
    np.testing.assert_allclose(float(loss_r), float(loss_p), rtol=1e-6)
    flat_r, flat_p = nnx.to_flat_state(grads_r), nnx.to_flat_state(grads_p)
    assert [k for k, _ in flat_r] == [k for k, _ in flat_p]
    for (path, g_r), (_, g_p) in zip(flat_r, flat_p):
        g_r, g_p = np.asarray(g_r[...]), np.asarray(g_p[...])
        assert np.any(g_p != 0), f"plain gradient of {path} is zero"
        np.testing.assert_allclose(g_r, g_p, rtol=1e-5, atol=1e-7, err_msg=f"gradient of {path}")
