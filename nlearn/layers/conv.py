"""Short causal depthwise convolution over time, with a cache of the last K-1 inputs for decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nlearn.layers.core import param


class ShortConv(nnx.Module):
    """`y_t = sum_{i<K} w_i * x_{t-i}` per channel (causal), `x [B, T, C]`."""

    INITS = ("identity", "uniform")

    def __init__(self, channels: int, kernel: int = 4, *, init: str = "identity", rngs: nnx.Rngs):
        """init="identity": the newest tap starts at 1, older taps ~N(0, 0.02) (the layer starts
        as a pass-through); "uniform": every tap ~U(-1/sqrt(K), 1/sqrt(K)), PyTorch's Conv1d
        default as in FLA's ShortConvolution (each channel starts as a random mix of the last K
        tokens, which speeds up learning token-shift circuits such as associative recall)."""
        if init not in self.INITS:
            raise ValueError(f"init={init!r}: valid {', '.join(self.INITS)}")
        self.kernel_size = kernel
        if init == "identity":
            w = 0.02 * param(rngs, (kernel, channels), ("conv", "heads"))[...]
            w = w.at[-1].add(1.0)
        else:
            bound = 1.0 / kernel ** 0.5
            w = jax.random.uniform(rngs.params(), (kernel, channels), minval=-bound, maxval=bound)
        self.weight = nnx.Param(w, out_sharding=("conv", "heads"))

    def init_cache(self, batch: int, channels: int, dtype=jnp.float32):
        return jnp.zeros((batch, self.kernel_size - 1, channels), dtype)

    def __call__(self, x_BTC, cache=None):
        """Returns `(y [B, T, C], new_cache)`; `cache [B, K-1, C]` holds the previous inputs."""
        k = self.kernel_size
        b, t, c = x_BTC.shape
        past = jnp.zeros((b, k - 1, c), x_BTC.dtype) if cache is None else cache.astype(x_BTC.dtype)
        padded = jnp.concatenate([past, x_BTC], axis=1)  # [B, K-1+T, C]
        w = self.weight[...].astype(x_BTC.dtype)
        y = sum(padded[:, i:i + t] * w[i] for i in range(k))
        new_cache = None if cache is None else padded[:, -(k - 1):] if k > 1 else past
        return y, new_cache
