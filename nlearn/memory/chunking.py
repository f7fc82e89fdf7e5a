"""Shared pieces of the chunked ops: argument checks, padding to a chunk multiple, chunk reshapes.

Ops take `[B, T, H, D]` activations and `[B, T, H]` gates; the chunked forms work on
`[B, H, N, C, D]` (N chunks of C tokens). Padding is internal: callers pass any T.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def check_positive(name: str, value: int) -> None:
    """Refuse a non-positive chunk or mini-batch size with a message naming it."""
    if not isinstance(value, (int,)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_qkv(q, k, v) -> tuple[int, int, int, int, int]:
    """Validate `q, k: [B, T, H, Dk]`, `v: [B, T, H, Dv]`; return (B, T, H, Dk, Dv)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have shape [B, T, H, D], got shape {tuple(x.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"v must share [B, T, H] with k, got v {tuple(v.shape)} and k {tuple(k.shape)}"
        )
    b, t, h, dk = k.shape
    return b, t, h, dk, v.shape[-1]


def check_gate(name: str, gate, batch: int, length: int, heads: int) -> None:
    """Validate a per-token gate of shape `[B, T, H]`."""
    if gate.shape != (batch, length, heads):
        raise ValueError(
            f"{name} must have shape [B, T, H] = {(batch, length, heads)}, got shape {tuple(gate.shape)}"
        )


def pad_time(x, multiple: int, value: float = 0.0):
    """Pad axis 1 (time) of `x [B, T, ...]` up to a multiple of `multiple`."""
    t = x.shape[1]
    pad = (-t) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def place_at(x, offset, length: int):
    """`x [B, T, ...]` at time `offset` of zeros `[B, length, ...]`.

    How a stream resumes mid-mini-batch: its next piece goes `offset` tokens into a timeline of whole
    mini-batches (the empty slots before it have zero rates and change nothing). `offset` is an int
    (a static pad) or a traced scalar (a dynamic update).
    """
    if isinstance(offset, int):
        widths = [(0, 0)] * x.ndim
        widths[1] = (offset, length - offset - x.shape[1])
        return jnp.pad(x, widths)
    return lax.dynamic_update_slice_in_dim(jnp.zeros((x.shape[0], length) + x.shape[2:], x.dtype), x, offset, axis=1)


def take_at(y, offset, length: int):
    """The inverse of `place_at`: `y[:, offset:offset + length]` for an int or traced `offset`."""
    if isinstance(offset, int):
        return y[:, offset:offset + length]
    return lax.dynamic_slice_in_dim(y, offset, length, axis=1)


def to_chunks(x, chunk: int):
    """`[B, T, H, ...]` with T % chunk == 0 -> `[B, H, N, C, ...]`."""
    b, t, h = x.shape[:3]
    rest = x.shape[3:]
    x = x.reshape(b, t // chunk, chunk, h, *rest)
    return jnp.moveaxis(x, 3, 1)


def from_chunks(x, length: int):
    """`[B, H, N, C, ...]` -> `[B, length, H, ...]` (drops padding)."""
    b, h, n, c = x.shape[:4]
    rest = x.shape[4:]
    x = jnp.moveaxis(x, 1, 3).reshape(b, n * c, h, *rest)
    return x[:, :length]


def to_chunks_first(x, chunk: int):
    """`[B, T, H, ...]` -> `[N, B, H, C, ...]`, padding T with zeros to a multiple of `chunk`.

    Chunk-major layout: a `lax.scan` over chunks slices the leading axis without a transpose.
    """
    x = pad_time(x, chunk)
    b, t, h = x.shape[:3]
    rest = x.shape[3:]
    x = x.reshape(b, t // chunk, chunk, h, *rest)
    return jnp.moveaxis(x, (1, 3), (0, 2))


def from_chunks_first(x, length: int):
    """`[N, B, H, C, ...]` -> `[B, length, H, ...]` (drops padding)."""
    n, b, h, c = x.shape[:4]
    rest = x.shape[4:]
    x = jnp.moveaxis(x, (0, 2), (1, 3)).reshape(b, n * c, h, *rest)
    return x[:, :length]


def check_step(q_t, k_t, v_t, gates=()):
    """Shapes of one decode step: q_t, k_t `[B, H, Dk]`, v_t `[B, H, Dv]`, each `(name, gate)` `[B, H]`."""
    for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        if x.ndim != 3:
            raise ValueError(f"{name} must have shape [B, H, D], got shape {tuple(x.shape)}")
    if q_t.shape != k_t.shape or v_t.shape[:2] != k_t.shape[:2]:
        raise ValueError(
            f"q_t, k_t must match and v_t share [B, H], got q_t {tuple(q_t.shape)}, "
            f"k_t {tuple(k_t.shape)}, v_t {tuple(v_t.shape)}"
        )
    for name, x in gates:
        if tuple(x.shape) != tuple(k_t.shape[:2]):
            raise ValueError(f"{name} must have shape [B, H] = {tuple(k_t.shape[:2])}, got shape {tuple(x.shape)}")
