"""How long the train step (and the parameter init) takes to compile at 4 and at 24 layers, with and
without `model.scan_layers` (tiny widths): unrolled blocks compile one by one, a scan compiles one block
whatever the depth.

    python benchmarks/compile_time.py             # transformer, deltanet and hope; writes results/compile_time.md
    python benchmarks/compile_time.py --families=titans_lmm,hope:model.hope.mixer=attention --depths=4,24 --no-write

Each time is the best of `--repeats` fresh traces (CPU seconds to trace, lower and XLA-compile the jitted
train step on abstract inputs; nothing runs), next to the compiled program's instruction count; the init column is
the same for the jitted init of the train state. The bar: 24-layer scanned / 4-layer scanned <= 1.5.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "configs"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from results_md import write_results  # noqa: E402  (first: it configures the process for jax)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from timing import fmt, markdown_table  # noqa: E402
from nlearn.config import validate  # noqa: E402
from nlearn.train.state import _init_state, make_setup  # noqa: E402
from nlearn.train.step import make_train_step  # noqa: E402
from compare_lm import load_config, parse_row, split_rows  # noqa: E402

BAR = 1.5


def tiny_config(row: str, layers: int, scan: bool, args):
    """`row` (`family[:key=value...]`, as benchmarks/compare_lm.py reads it) at tiny widths and `layers` deep."""
    config = load_config(*parse_row(row))
    with config.unlocked():
        config.data.vocab_size = 256
        config.model.update(d_model=args.d_model, num_heads=2, num_layers=layers, scan_layers=scan)
        config.train.update(batch_size=args.batch, seq_len=args.seq_len)
    validate(config)
    return config


def _best_compile(make_lowered, repeats: int) -> tuple[float, int]:
    """Best-of-`repeats` CPU seconds of this process to trace, lower and compile (a fresh jit each time, so
    nothing is reused from an earlier compile: the work, which a shared machine's load barely changes,
    where wall seconds would measure the load), and the compiled HLO's instruction count (program size)."""
    best, size = float("inf"), 0
    for _ in range(repeats):
        t0 = time.process_time()
        compiled = make_lowered().compile()
        best = min(best, time.process_time() - t0)
        size = sum(" = " in line for line in compiled.as_text().splitlines())
    return best, size


def compile_seconds(config, repeats: int) -> tuple[float, int, float]:
    """The train step's compile seconds and HLO instruction count, and the state init's compile seconds."""
    setup = make_setup(config)
    batch = {k: jax.ShapeDtypeStruct((config.train.batch_size, config.train.seq_len), jnp.int32)
             for k in ("inputs", "targets")}

    def step():
        fn = make_train_step(setup.config, setup.graphdef, setup.optimizer, dtype=setup.dtype)
        return jax.jit(fn).lower(setup.abstract_state, batch)

    def init():  # what Setup.init_state compiles
        return jax.jit(lambda: _init_state(config, setup.optimizer), out_shardings=setup.state_shardings).lower()

    secs, size = _best_compile(step, repeats)
    return secs, size, _best_compile(init, repeats)[0]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="transformer,deltanet,hope")
    p.add_argument("--depths", default="4,24")
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--layouts", default="unrolled,scanned", help="which of unrolled,scanned to measure (the "
                   "unrolled deep Hope compiles for tens of minutes on 2 cores)")
    p.add_argument("--no-write", dest="write", action="store_false")
    args = p.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",")]
    low, high = min(depths), max(depths)
    layouts = [layout == "scanned" for layout in ("unrolled", "scanned") if layout in args.layouts.split(",")]
    rows, worst = [], 0.0
    for family in split_rows(args.families):
        secs, size, init = {}, {}, {}
        for scan in layouts:
            for layers in depths:
                key = scan, layers
                secs[key], size[key], init[key] = compile_seconds(tiny_config(family, layers, scan, args),
                                                                  args.repeats)
                print(f"{family} layers={layers} scan_layers={scan}: {secs[key]:.2f} s, {size[key]} HLO "
                      f"instructions; init {init[key]:.2f} s", flush=True)
        ratio = {scan: secs[scan, high] / secs[scan, low] for scan in layouts}
        worst = max(worst, ratio.get(True, 0.0))
        for scan in layouts:
            rows.append([family, "scanned" if scan else "unrolled"] + [fmt(secs[scan, d], 2) for d in depths]
                        + [f"{ratio[scan]:.2f}x"] + [str(size[scan, d]) for d in depths]
                        + [fmt(init[scan, d], 2) for d in depths] + [f"{init[scan, high] / init[scan, low]:.2f}x"])
    headers = (["family", "layers"] + [f"{d}L compile (s)" for d in depths] + [f"{high}L/{low}L"]
               + [f"{d}L HLO instructions" for d in depths] + [f"{d}L init compile (s)" for d in depths]
               + [f"init {high}L/{low}L"])
    table = markdown_table(headers, rows)
    verdict = f"scanned {high}L/{low}L at most {worst:.2f}x (bar <= {BAR}x): {'holds' if worst <= BAR else 'FAILS'}"
    print(table + "\n" + verdict)
    if args.write:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        note = (f"Train step (forward, backward, AdamW) of the tiny config at d_model={args.d_model}, batch "
                f"{args.batch} x {args.seq_len} tokens: CPU seconds to trace, lower and compile (best of "
                f"{args.repeats}; "
                "nothing runs) and the compiled HLO's instruction count; the init columns time the jitted init "
                f"of the train state (parameters and AdamW moments). {verdict}. Load average {load:.1f} when "
                "it finished: the ratios, taken in one run, are what to read.")
        command = " ".join(["python benchmarks/compile_time.py", *(sys.argv[1:] if argv is None else argv)])
        print(write_results("compile_time.md", "Train-step compile time against depth (model.scan_layers)",
                            command, table, note))


if __name__ == "__main__":
    main()
