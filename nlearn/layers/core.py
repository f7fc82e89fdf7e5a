"""Parameters with logical axis names, dense projections, embeddings and RMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nlearn.layers.batch_split import constrain


def head_dim(model_cfg) -> int:
    """Per-head width of a model config: `model.head_dim`, or `d_model // num_heads` when it is 0."""
    return model_cfg.head_dim or model_cfg.d_model // model_cfg.num_heads


def param(rngs: nnx.Rngs, shape, axes, std: float = 0.02, init: str = "normal") -> nnx.Param:
    """A float32 parameter tagged with logical axis names, mapped to the mesh by the config's rules when
    the trainer places the state (never eagerly at creation, so a layer builds with or without a mesh)."""
    if init == "normal":
        value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    elif init == "zeros":
        value = jnp.zeros(shape, jnp.float32)
    else:
        raise ValueError(f"unknown init {init!r}")
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


class Dense(nnx.Module):
    """`y = x W (+ b)` over the last axis; `W [d_in, d_out]` with logical axes `axes`."""

    def __init__(self, d_in: int, d_out: int, *, axes=("embed", "mlp"), bias: bool = False,
                 std: float = 0.02, rngs: nnx.Rngs):
        self.kernel = param(rngs, (d_in, d_out), axes, std)
        self.bias = param(rngs, (d_out,), axes[1:], init="zeros") if bias else None

    def __call__(self, x):
        y = x @ self.kernel[...].astype(x.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        return y


class Embed(nnx.Module):
    """Token embedding `[V, D]`; `attend` reuses it as the tied output head."""

    def __init__(self, vocab: int, d_model: int, *, std: float = 0.02, rngs: nnx.Rngs):
        self.table = param(rngs, (vocab, d_model), ("vocab", "embed"), std)

    def __call__(self, tokens_BT, dtype=jnp.float32):
        return constrain(jnp.take(self.table[...], tokens_BT, axis=0).astype(dtype))

    def attend(self, x_BTD):
        return constrain(x_BTD @ self.table[...].astype(x_BTD.dtype).T)


class RMSNorm(nnx.Module):
    """RMSNorm with a learned scale, computed in float32 and cast back to the input dtype.

    `overflow_safe`: each row is divided by its largest |x| before squaring (the same function up to
    rounding), so a row of |x| past ~1.8e19, whose squares overflow float32, still normalises instead of
    turning into zeros; the memories' output norms use it (a memory's read can be that large)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, axes=("embed",), overflow_safe: bool = False,
                 rngs: nnx.Rngs):
        self.scale = param(rngs, (dim,), axes, init="ones")
        self.eps = eps
        self.overflow_safe = overflow_safe

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        if self.overflow_safe:
            m = jax.lax.stop_gradient(jnp.max(jnp.abs(x32), axis=-1, keepdims=True))
            m = jnp.where(m > 0, m, 1.0)
            xs = x32 / m
            y = xs * jax.lax.rsqrt(jnp.mean(xs * xs, axis=-1, keepdims=True) + self.eps / (m * m))
        else:
            y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(x.dtype)


class SwiGLU(nnx.Module):
    """The Transformer++ feed-forward: `(silu(x W_gate) * x W_up) W_down`."""

    def __init__(self, d_model: int, hidden: int, *, std: float, out_std: float, rngs: nnx.Rngs):
        self.gate = Dense(d_model, hidden, axes=("embed", "mlp"), std=std, rngs=rngs)
        self.up = Dense(d_model, hidden, axes=("embed", "mlp"), std=std, rngs=rngs)
        self.down = Dense(hidden, d_model, axes=("mlp", "embed"), std=out_std, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def swiglu_width(d_model: int, mlp_dim: int) -> int:
    """`mlp_dim`, or ~8/3 d_model rounded up to a multiple of 64 when 0 (LLaMA convention)."""
    if mlp_dim:
        return mlp_dim
    return 64 * -(-(8 * d_model // 3) // 64)
