"""FLOP accounting for MFU: a model's training FLOPs per token as its train step runs them, and this
machine's peak matmul rate.

Counted: 6 FLOPs per dense weight and token (forward + backward: every Dense `kernel`, and the embedding
table when it is the tied output head) plus each layer's token mixer by its family's own count
(`nlearn.models.flops`). Not counted: the forward that rematerialisation recomputes (MFU counts the
model's FLOPs, not the hardware's): `model.remat`'s, and the memory ops' own checkpointed chunk scans
(self-referential Titans and Hope run ~20% more matmul FLOPs than counted here; with those checkpoints
off, `nlearn-compile`'s count of the lowered program agrees within 4% for every family).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from nlearn import models


def dense_params(params, tie_embeddings: bool) -> int:
    """Weights applied once per token as a matmul: every Dense `kernel`, and the embedding table when
    it is the (tied) output head. An untied table is a lookup, memory weights are the ops' business."""
    n = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = str(getattr(path[-1], "key", path[-1]))
        if name == "kernel" or (tie_embeddings and name == "table"):
            n += int(leaf.size) if hasattr(leaf, "size") else int(jnp.size(leaf))
    return n


def mixer_flops_per_token(model_cfg, seq_len: int, backend: str | None = None) -> float:
    """One layer's token-mixer training FLOPs per token beyond its dense projections, by the family's
    record (`nlearn.models.Family.flops`; 0 with a warning for a family that has none)."""
    family = models.FAMILIES.get(model_cfg.family)
    count = family.flops if family is not None else None
    if count is None:
        from absl import logging

        logging.warning("nlearn.train.flops has no count for family %r: MFU counts its dense layers only",
                        model_cfg.family)
        return 0.0
    return count(model_cfg, seq_len, backend or jax.default_backend()) / seq_len


def flops_per_token(model_cfg, params, seq_len: int, backend: str | None = None) -> float:
    """Training FLOPs per token: 6 per dense weight (`dense_params` of the parameter tree, arrays or
    shapes) plus every layer's mixer (`mixer_flops_per_token`) at `seq_len`."""
    total = (6.0 * dense_params(params, model_cfg.tie_embeddings)
             + model_cfg.num_layers * mixer_flops_per_token(model_cfg, seq_len, backend))
    cms = model_cfg.get("cms")
    two_pass = cms is not None and cms["update"] == "ntp"  # Hope: pass 1 runs the model forward and back too
    return 2.0 * total if two_pass else total


@functools.lru_cache(maxsize=None)
def measure_matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Best-of-`repeats` float32 `n x n` matmul rate of the default device, in GFLOP/s: the peak
    for MFU and the machine line of the benchmark tables."""
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
