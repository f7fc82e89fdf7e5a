"""Short causal depthwise convolution over time, with a cache of the last K-1 inputs for decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nlearn.layers.core import param
from nlearn.memory.sequence_parallel import halo


class ShortConv(nnx.Module):
    """`y_t = sum_{i<K} w_i * x_{t-i}` per channel (causal), `x [B, T, C]`."""

    INITS = ("identity", "uniform")

    def __init__(self, channels: int, kernel: int = 4, *, init: str = "identity", channel_axis: str = "heads",
                 rngs: nnx.Rngs):
        """init="identity": the newest tap starts at 1, older taps ~N(0, 0.02) (the layer starts
        as a pass-through); "uniform": every tap ~U(-1/sqrt(K), 1/sqrt(K)), PyTorch's Conv1d
        default as in FLA's ShortConvolution (each channel starts as a random mix of the last K
        tokens, which speeds up learning token-shift circuits such as associative recall)."""
        if init not in self.INITS:
            raise ValueError(f"init={init!r}: valid {', '.join(self.INITS)}")
        self.kernel_size = kernel
        if init == "identity":
            w = 0.02 * param(rngs, (kernel, channels), ("conv", channel_axis))[...]
            w = w.at[-1].add(1.0)
        else:
            bound = 1.0 / kernel ** 0.5
            w = jax.random.uniform(rngs.params(), (kernel, channels), minval=-bound, maxval=bound)
        self.weight = nnx.Param(w, out_sharding=("conv", channel_axis), eager_sharding=False)

    def init_cache(self, batch: int, channels: int, dtype=jnp.float32):
        return jnp.zeros((batch, self.kernel_size - 1, channels), dtype)

    def __call__(self, x_BTC, cache=None):
        """Returns `(y [B, T, C], new_cache)`; `cache [B, K-1, C]` holds the previous inputs."""
        k = self.kernel_size
        b, t, c = x_BTC.shape
        past = jnp.zeros((b, k - 1, c), x_BTC.dtype) if cache is None else cache.astype(x_BTC.dtype)
        y = causal_conv(past, x_BTC, self.weight[...].astype(x_BTC.dtype))
        if cache is None:
            return y, None
        return y, jnp.concatenate([past, x_BTC], axis=1)[:, t:]  # the last K-1 inputs


def gate_conv(cfg, rngs: nnx.Rngs) -> ShortConv | None:
    """With `memory.gate_conv=True`, the short causal conv over `[B, T, d_model]` that a memory's write gates
    read (the last few tokens, as Mamba's dt reads its conv), the identity at first so a gate starts as the
    token's own; None without it."""
    if not cfg.memory.get("gate_conv", False):
        return None
    return ShortConv(cfg.d_model, cfg.memory.conv_size or 4, init="identity", channel_axis="embed", rngs=rngs)


def causal_conv_reference(past_BKC, x_BTC, w_KC):
    """`y_t = sum_i w_i * [past ‖ x]_{t+i}`, `past [B, K-1, C]`, `w [K, C]` (oldest tap first):
    the plain definition, differentiated by autodiff (the slow twin of `causal_conv`)."""
    t = x_BTC.shape[1]
    padded = jnp.concatenate([past_BKC, x_BTC], axis=1)  # [B, K-1+T, C]
    return sum(padded[:, i:i + t] * w_KC[i] for i in range(w_KC.shape[0]))


@jax.custom_vjp
def causal_conv(past_BKC, x_BTC, w_KC):
    """`causal_conv_reference` with a hand-written backward: autodiff's pads of every shifted slice
    and one reduction per tap cost ~4x the forward on CPU; here the input's gradient is the same
    conv run backwards over the output's gradient and the taps' are one contraction each."""
    return causal_conv_reference(past_BKC, x_BTC, w_KC)


def _causal_conv_fwd(past_BKC, x_BTC, w_KC):
    return causal_conv_reference(past_BKC, x_BTC, w_KC), (past_BKC, x_BTC, w_KC)


def _causal_conv_bwd(res, g_BTC):
    past, x, w = res
    k, (b, t, c) = w.shape[0], x.shape
    zeros = jnp.zeros((b, k - 1, c), g_BTC.dtype)
    g_padded = jnp.concatenate([zeros, g_BTC, zeros], axis=1)  # [B, T+2(K-1), C]
    # d[past ‖ x]_j = sum_i w_i g_{j-i}: tap i reaches input j from output j - i.
    d_padded = sum(g_padded[:, k - 1 - i:k - 1 - i + t + k - 1] * w[i] for i in range(k))
    padded = jnp.concatenate([past, x], axis=1)
    dw = jnp.stack([jnp.einsum("btc,btc->c", padded[:, i:i + t], g_BTC) for i in range(k)])
    return d_padded[:, :k - 1], d_padded[:, k - 1:], dw.astype(w.dtype)


causal_conv.defvjp(_causal_conv_fwd, _causal_conv_bwd)


def causal_conv_over_sequence(x_BTC, w_KC, axis_name: str):
    """`causal_conv` of this device's shard of the sequence (inside `shard_map` over `axis_name`):
    the previous shard's last K-1 inputs come across the boundary as the halo. The taps are marked as
    varying over the axis, so the hand-written backward's per-shard tap gradient is summed by the map."""
    w_KC = jax.lax.pcast(w_KC, axis_name, to="varying")
    return causal_conv(halo(x_BTC, w_KC.shape[0] - 1, axis_name), x_BTC, w_KC)
