"""Causal multi-head attention (full or sliding window) with RoPE, persistent memory tokens and a
bounded KV cache.

Training calls it on whole sequences; a sliding window is computed block by block (queries of a
block of `window` tokens attend to that block and the previous one), so its cost is O(T * window),
not O(T^2). Generation passes a cache: a ring buffer of `S = window` slots (or `max_len` for full
attention), so memory per generated token is constant when a window is set. New tokens attend to
the cached slots and to each other causally.

Persistent memory (Titans eq. 19): `num_persistent` learned, input-independent vectors `P [N_p, D]`
per layer. They go through the layer's own k/v projections (no RoPE: they have no position) and
are keys/values visible to every query, prepended to the sequence; they are never evicted from the
cache (they are parameters, recomputed at each call, so the cache does not hold them).

`conv_size > 0` puts a short causal depthwise conv after each of the q, k, v projections (Titans
§4.4 does so for its architectures); the cache then also holds the last `conv_size - 1`
projections, so decoding still matches the full forward.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from nlearn.layers.conv import ShortConv
from nlearn.layers.core import Dense, param
from nlearn.layers.rope import apply_rope
from nlearn.memory.sequence_parallel import SEQUENCE_AXIS, context_axis_size


def attention_mask(q_pos_T, k_pos_S, window: int):
    """`[T, S]` bool: key slot visible to query (causal, inside the window, slot filled)."""
    valid = (k_pos_S[None, :] >= 0) & (k_pos_S[None, :] <= q_pos_T[:, None])
    if window:
        valid &= k_pos_S[None, :] > q_pos_T[:, None] - window
    return valid


def masked_attention(q, k, v, mask):
    """Softmax attention `q [..., T, H, K]` over `k, v [..., S, H, K]` where `mask [..., T, S]` is
    True (it broadcasts against the leading dims). Scores and softmax in float32; every query must
    see at least one key."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("...thk,...shk->...hts", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(jnp.expand_dims(mask, -3), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("...hts,...shk->...thk", p, v)


def with_prefix_mask(mask, num_prefix: int):
    """Prepend `num_prefix` always-visible key columns to a `[..., T, S]` mask."""
    ones = jnp.ones(mask.shape[:-1] + (num_prefix,), bool)
    return jnp.concatenate([ones, mask], axis=-1)


def local_attention(q, k, v, window: int, prefix_k=None, prefix_v=None):
    """Causal sliding-window attention, `q, k, v [B, T, H, K]`: query i sees keys j with
    i - window < j <= i, plus the optional always-visible `prefix_k, prefix_v [B, P, H, K]`.

    Blocks of `window` queries attend to their own block and the previous one (P + 2 * window
    keys), so cost and memory are O(T * window)."""
    b, t, h, d = q.shape
    w = min(window, t)
    nb = -(-t // w)
    pad = nb * w - t
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    blocks = lambda x: x.reshape(b, nb, w, h, d)  # noqa: E731
    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    prev = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)  # noqa: E731
    keys = jnp.concatenate([prev(kb), kb], axis=2)  # [B, nb, 2w, H, K]
    values = jnp.concatenate([prev(vb), vb], axis=2)
    # Static mask: query i of block n is at n*w + i; key j at (n-1)*w + j.
    qpos = np.arange(nb)[:, None] * w + np.arange(w)[None, :]  # [nb, w]
    kpos = np.arange(nb)[:, None] * w - w + np.arange(2 * w)[None, :]  # [nb, 2w]
    rel = qpos[:, :, None] - kpos[:, None, :]
    mask = jnp.asarray((rel >= 0) & (rel < window) & (kpos[:, None, :] >= 0))  # [nb, w, 2w]
    if prefix_k is not None:
        n_p = prefix_k.shape[1]
        tile = lambda x: jnp.broadcast_to(x[:, None], (b, nb, n_p, h, d)).astype(keys.dtype)  # noqa: E731
        keys = jnp.concatenate([tile(prefix_k), keys], axis=2)
        values = jnp.concatenate([tile(prefix_v), values], axis=2)
        mask = with_prefix_mask(mask, n_p)
    y = masked_attention(qb, keys, values, mask)
    return y.reshape(b, nb * w, h, d)[:, :t]


def attend_over_sequence(q, k, v, window: int, prefix_kv=None):
    """Causal attention of `q, k, v [B, T, H, K]` with T split over the context mesh's `sequence`
    axis: each device all-gathers the keys and values and attends its own queries (memory
    O(T/P * T) per device; exact, not a ring)."""

    def shard(q, k, v, prefix_kv):
        t_local = q.shape[1]
        keys = jax.lax.all_gather(k, SEQUENCE_AXIS, axis=1, tiled=True)
        values = jax.lax.all_gather(v, SEQUENCE_AXIS, axis=1, tiled=True)
        q_pos = jax.lax.axis_index(SEQUENCE_AXIS) * t_local + jnp.arange(t_local)
        mask = attention_mask(q_pos, jnp.arange(keys.shape[1]), window)
        if prefix_kv is None:
            return jax.nn.dot_product_attention(q, keys, values, mask=mask[None, None])
        pk, pv = prefix_kv
        return masked_attention(q, jnp.concatenate([pk, keys], 1), jnp.concatenate([pv, values], 1),
                                with_prefix_mask(mask, pk.shape[1]))

    seq = P(None, SEQUENCE_AXIS)
    return jax.shard_map(shard, in_specs=(seq, seq, seq, P()), out_specs=seq, axis_names={SEQUENCE_AXIS})(
        q, k, v, prefix_kv)


class Attention(nnx.Module):
    """Causal self-attention mixer: `x [B, T, D] -> y [B, T, D]`.

    `out_proj=False` drops the output projection: `__call__` then returns the heads `[B, T, H*K]`
    (for callers that gate or mix them before projecting, e.g. Titans MAG)."""

    def __init__(self, d_model: int, num_heads: int, head_dim: int, *, window: int = 0,
                 num_persistent: int = 0, rope_theta: float = 10000.0, std: float = 0.02,
                 out_std: float = 0.02, out_proj: bool = True, conv_size: int = 0, rngs: nnx.Rngs):
        self.num_heads, self.head_dim, self.window, self.rope_theta = num_heads, head_dim, window, rope_theta
        width = num_heads * head_dim
        self.q = Dense(d_model, width, axes=("embed", "heads"), std=std, rngs=rngs)
        self.k = Dense(d_model, width, axes=("embed", "heads"), std=std, rngs=rngs)
        self.v = Dense(d_model, width, axes=("embed", "heads"), std=std, rngs=rngs)
        self.o = Dense(width, d_model, axes=("heads", "embed"), std=out_std, rngs=rngs) if out_proj else None
        # Unit scale, like the RMS-normalised token inputs the projections see.
        self.persistent = param(rngs, (num_persistent, d_model), (None, "embed"), std=1.0) if num_persistent else None
        self.convs = nnx.List([ShortConv(width, conv_size, rngs=rngs) for _ in range(3)]) if conv_size else None

    def _heads(self, proj, x):
        b, t, _ = x.shape
        return proj(x).reshape(b, t, self.num_heads, self.head_dim)

    def _rope(self, x_BTHK, pos_T):
        return apply_rope(x_BTHK, pos_T, self.rope_theta)

    def key_value(self, x_BTD, pos_T):
        """RoPE'd keys and values `[B, T, H, K]` of tokens at absolute positions `pos_T` (no conv:
        for entries that are not a stream, e.g. Titans MAC's retrieved tokens)."""
        return self._rope(self._heads(self.k, x_BTD), pos_T), self._heads(self.v, x_BTD)

    def init_conv_cache(self, batch: int, dtype=jnp.float32) -> list:
        """The q, k, v convs' caches (the last conv_size - 1 projections; [] without convs)."""
        width = self.num_heads * self.head_dim
        return [conv.init_cache(batch, width, dtype) for conv in self.convs] if self.convs is not None else []

    def qkv(self, x_BTD, pos_T, conv_cache=None):
        """RoPE'd queries, keys and values `[B, T, H, K]` of the stream tokens at `pos_T`, after
        the convs (which continue from `conv_cache` when given), and the new conv cache."""
        b, t, _ = x_BTD.shape
        heads, new_cache = [], []
        for i, proj in enumerate((self.q, self.k, self.v)):
            h = proj(x_BTD)
            if self.convs is not None:
                h, c = self.convs[i](h, None if conv_cache is None else conv_cache[i])
                new_cache.append(c)
            heads.append(h.reshape(b, t, self.num_heads, self.head_dim))
        q, k, v = heads
        return self._rope(q, pos_T), self._rope(k, pos_T), v, None if conv_cache is None else new_cache

    def persistent_kv(self, batch: int, dtype):
        """Keys and values `[B, N_p, H, K]` of the persistent tokens (no RoPE), or None."""
        if self.persistent is None:
            return None
        p = self.persistent[...].astype(dtype)[None]
        k, v = self._heads(self.k, p), self._heads(self.v, p)
        shape = (batch,) + k.shape[1:]
        return jnp.broadcast_to(k, shape), jnp.broadcast_to(v, shape)

    def project_out(self, y_BTHK):
        b, t = y_BTHK.shape[:2]
        y = y_BTHK.reshape(b, t, -1)
        return y if self.o is None else self.o(y)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        slots = self.window if self.window else max_len
        shape = (batch, slots, self.num_heads, self.head_dim)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype), "convs": self.init_conv_cache(batch, dtype),
                "slot_pos": jnp.full((slots,), -1, jnp.int32), "next": jnp.zeros((), jnp.int32)}

    def heads(self, x_BTD, cache=None):
        """Attention output per head `[B, T, H, K]` (before the output projection) and the cache."""
        b, t, _ = x_BTD.shape
        start = 0 if cache is None else cache["next"]
        pos_T = start + jnp.arange(t, dtype=jnp.int32)
        q, k, v, convs = self.qkv(x_BTD, pos_T, None if cache is None else cache["convs"])
        pkv = self.persistent_kv(b, k.dtype)
        if cache is None and context_axis_size() > 1:
            return attend_over_sequence(q, k, v, self.window, pkv), None
        if cache is None:
            if self.window:
                return local_attention(q, k, v, self.window, *(pkv or ())), None
            if pkv is None:
                return jax.nn.dot_product_attention(q, k, v, is_causal=True), None
            mask = with_prefix_mask(jnp.tril(jnp.ones((t, t), bool)), pkv[0].shape[1])
            return masked_attention(q, jnp.concatenate([pkv[0], k], 1), jnp.concatenate([pkv[1], v], 1),
                                    mask), None
        keys = jnp.concatenate([cache["k"].astype(k.dtype), k], axis=1)
        values = jnp.concatenate([cache["v"].astype(v.dtype), v], axis=1)
        key_pos = jnp.concatenate([cache["slot_pos"], pos_T])
        mask = attention_mask(pos_T, key_pos, self.window)  # [T, S+T]
        if pkv is None:
            y = jax.nn.dot_product_attention(q, keys, values, mask=mask[None, None])
        else:
            y = masked_attention(q, jnp.concatenate([pkv[0], keys], 1), jnp.concatenate([pkv[1], values], 1),
                                 with_prefix_mask(mask, pkv[0].shape[1]))
        slots = cache["slot_pos"].shape[0]
        keep = min(t, slots)  # only the newest `slots` tokens can stay in the ring
        idx = pos_T[-keep:] % slots
        new_cache = {
            "k": cache["k"].at[:, idx].set(k[:, -keep:].astype(cache["k"].dtype)),
            "v": cache["v"].at[:, idx].set(v[:, -keep:].astype(cache["v"].dtype)),
            "slot_pos": cache["slot_pos"].at[idx].set(pos_T[-keep:]),
            "convs": convs,
            "next": start + t,
        }
        return y, new_cache

    def __call__(self, x_BTD, cache=None):
        y, cache = self.heads(x_BTD, cache)
        return self.project_out(y), cache
