"""Causal multi-head attention (full or sliding window) with RoPE and a bounded KV cache.

Training calls it on whole sequences. Generation passes a cache: a ring buffer of
`S = window` slots (or `max_len` for full attention), so memory per generated token is constant
when a window is set. New tokens attend to the cached slots and to each other causally.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nlearn.layers.core import Dense
from nlearn.layers.rope import apply_rope


def attention_mask(q_pos_T, k_pos_S, window: int):
    """`[T, S]` bool: key slot visible to query (causal, inside the window, slot filled)."""
    valid = (k_pos_S[None, :] >= 0) & (k_pos_S[None, :] <= q_pos_T[:, None])
    if window:
        valid &= k_pos_S[None, :] > q_pos_T[:, None] - window
    return valid


class Attention(nnx.Module):
    """Causal self-attention mixer: `x [B, T, D] -> y [B, T, D]`."""

    def __init__(self, d_model: int, num_heads: int, head_dim: int, *, window: int = 0,
                 rope_theta: float = 10000.0, std: float = 0.02, out_std: float = 0.02,
                 rngs: nnx.Rngs):
        self.num_heads, self.head_dim, self.window, self.rope_theta = num_heads, head_dim, window, rope_theta
        width = num_heads * head_dim
        self.q = Dense(d_model, width, axes=("embed", "heads"), std=std, rngs=rngs)
        self.k = Dense(d_model, width, axes=("embed", "heads"), std=std, rngs=rngs)
        self.v = Dense(d_model, width, axes=("embed", "heads"), std=std, rngs=rngs)
        self.o = Dense(width, d_model, axes=("heads", "embed"), std=out_std, rngs=rngs)

    def _heads(self, proj, x):
        b, t, _ = x.shape
        return proj(x).reshape(b, t, self.num_heads, self.head_dim)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        slots = self.window if self.window else max_len
        shape = (batch, slots, self.num_heads, self.head_dim)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
                "slot_pos": jnp.full((slots,), -1, jnp.int32), "next": jnp.zeros((), jnp.int32)}

    def __call__(self, x_BTD, cache=None):
        b, t, _ = x_BTD.shape
        start = 0 if cache is None else cache["next"]
        pos_T = start + jnp.arange(t, dtype=jnp.int32)
        pos_BT = jnp.broadcast_to(pos_T, (b, t))
        q = apply_rope(self._heads(self.q, x_BTD), pos_BT, self.rope_theta)
        k = apply_rope(self._heads(self.k, x_BTD), pos_BT, self.rope_theta)
        v = self._heads(self.v, x_BTD)
        if cache is None:
            window = (self.window - 1, 0) if self.window else None
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window)
            return self.o(y.reshape(b, t, -1)), None
        keys = jnp.concatenate([cache["k"].astype(k.dtype), k], axis=1)
        values = jnp.concatenate([cache["v"].astype(v.dtype), v], axis=1)
        key_pos = jnp.concatenate([cache["slot_pos"], pos_T])
        mask = attention_mask(pos_T, key_pos, self.window)[None, None]  # [1, 1, T, S+T]
        y = jax.nn.dot_product_attention(q, keys, values, mask=mask)
        slots = cache["slot_pos"].shape[0]
        keep = min(t, slots)  # only the newest `slots` tokens can stay in the ring
        idx = pos_T[-keep:] % slots
        new_cache = {
            "k": cache["k"].at[:, idx].set(k[:, -keep:].astype(cache["k"].dtype)),
            "v": cache["v"].at[:, idx].set(v[:, -keep:].astype(cache["v"].dtype)),
            "slot_pos": cache["slot_pos"].at[idx].set(pos_T[-keep:]),
            "next": start + t,
        }
        return self.o(y.reshape(b, t, -1)), new_cache
