"""Rotary position embeddings (RoPE), rotating pairs (x_i, x_{i+D/2}) as in LLaMA."""

from __future__ import annotations

import jax.numpy as jnp


def apply_rope(x_BTHK, positions, theta: float = 10000.0):
    """Rotate `x [B, T, H, K]` by absolute `positions`, `[T]` (shared by the batch: the sines are
    computed once, not per row) or `[B, T]` (K even)."""
    half = x_BTHK.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [K/2]
    angles = positions.astype(jnp.float32)[..., None, None, None] * freqs  # [(B,) T, 1, 1, K/2]
    # The two halves as an axis of 2: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) is x cos plus
    # the halves swapped (a flip) times (-sin, sin); no split and concatenate (~1.5x faster on CPU).
    sign = jnp.array([-1.0, 1.0], jnp.float32)[:, None]
    pairs = x_BTHK.astype(jnp.float32).reshape(x_BTHK.shape[:-1] + (2, half))
    out = pairs * jnp.cos(angles) + jnp.flip(pairs, -2) * (sign * jnp.sin(angles))
    return out.reshape(x_BTHK.shape).astype(x_BTHK.dtype)
