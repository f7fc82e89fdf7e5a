"""Rotary position embeddings (RoPE), rotating pairs (x_i, x_{i+D/2}) as in LLaMA."""

from __future__ import annotations

import jax.numpy as jnp


def apply_rope(x_BTHK, positions_BT, theta: float = 10000.0):
    """Rotate `x [B, T, H, K]` by absolute `positions [B, T]` (K even)."""
    half = x_BTHK.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [K/2]
    angles = positions_BT.astype(jnp.float32)[..., None] * freqs  # [B, T, K/2]
    sin = jnp.sin(angles)[:, :, None, :]
    cos = jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x_BTHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTHK.dtype)
