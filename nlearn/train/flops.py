"""FLOP accounting for MFU: model FLOPs per token and this machine's peak matmul rate."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp


def flops_per_token(model_cfg, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 N (matmuls, fwd + bwd) + causal attention scores.

    Embedding lookups are not FLOPs, but a tied head is a matmul, so N counts the table once.
    Attention adds 6 * layers * seq_len * width (QK^T and AV, causal half, fwd + bwd).
    """
    attention = 0.0
    if model_cfg.family == "transformer":
        width = model_cfg.num_heads * (model_cfg.head_dim or model_cfg.d_model // model_cfg.num_heads)
        context = min(seq_len, model_cfg.window) if model_cfg.window else seq_len
        attention = 6.0 * model_cfg.num_layers * context * width
    return 6.0 * n_params + attention


@functools.lru_cache(maxsize=None)
def measure_matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Best-of-`repeats` float32 `n x n` matmul rate of the default device, in GFLOP/s."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def run_peak_flops(peak_gflops_per_device: float) -> float:
    """The whole run's peak FLOP/s for MFU. Accelerators add up per device; the CPU devices of one
    process (e.g. several forced with --xla_force_host_platform_device_count) share its cores, whose
    rate the per-device measurement already is, so CPUs count processes."""
    units = jax.process_count() if jax.default_backend() == "cpu" else jax.device_count()
    return peak_gflops_per_device * 1e9 * units
