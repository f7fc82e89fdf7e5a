"""Timing helpers shared by the benchmark scripts: robust timings and tables (the machine's matmul
rate is `nlearn.train.flops.measure_matmul_gflops`).

Numbers from a shared machine are noisy, so `time_fn` reports the median of several runs after a
warm-up (compile) call, and also the minimum and the process CPU time (which other processes
competing for the cores inflate less than the wall clock).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import jax


@dataclass
class Timing:
    """Seconds per call: median and min of the wall clock, median CPU time, and all samples."""

    median: float
    min: float
    cpu_median: float
    compile_s: float
    samples: list[float] = field(default_factory=list)


def time_fn(fn: Callable, *args, n: int = 5, warmup: int = 1, max_seconds: float | None = None) -> Timing:
    """Time `fn(*args)` (a jitted function) with `block_until_ready`.

    A jitted `fn` is compiled ahead of time (`compile_s`); then `warmup` untimed calls and up to
    `n` timed ones. With `max_seconds`, a warm-up call that alone takes that long counts as the
    only sample, and timing stops once `max_seconds` were spent (at least one timed call).
    """
    t0 = time.perf_counter()
    if hasattr(fn, "lower"):
        fn = fn.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    walls, cpus = [], []
    for _ in range(warmup):
        c0, w0 = time.process_time(), time.perf_counter()
        jax.block_until_ready(fn(*args))
        if max_seconds is not None and time.perf_counter() - w0 >= max_seconds:
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
            return Timing(walls[0], walls[0], cpus[0], compile_s, walls)
    spent = 0.0
    for _ in range(max(1, n)):
        c0, w0 = time.process_time(), time.perf_counter()
        jax.block_until_ready(fn(*args))
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        spent += walls[-1]
        if max_seconds is not None and spent >= max_seconds:
            break
    return Timing(statistics.median(walls), min(walls), statistics.median(cpus), compile_s, walls)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; cells are formatted with `str`."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(list(headers)), sep] + [line(r) for r in cells])


def fmt(x: float | None, digits: int = 1) -> str:
    """A number for a table; `None` prints as an em dash."""
    if x is None:
        return "—"
    if abs(x) >= 1e5:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"
