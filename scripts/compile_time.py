"""How long the train step takes to compile at 4 and at 24 layers, with and without `model.scan_layers`
(tiny widths): unrolled blocks compile one by one, a scan compiles one block whatever the depth.

    python scripts/compile_time.py                        # transformer and deltanet, writes results/compile_time.md
    python scripts/compile_time.py --families=titans_lmm --depths=4,24 --no-write

Each time is the best of `--repeats` fresh traces (trace + lower + XLA compile of the jitted train step
on abstract inputs; nothing runs), next to the compiled program's instruction count. The bar: 24-layer
scanned / 4-layer scanned <= 1.5.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "configs"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from nlearn.bench import fmt, markdown_table  # noqa: E402
from nlearn.config import validate  # noqa: E402
from nlearn.train.state import make_setup  # noqa: E402
from nlearn.train.step import make_train_step  # noqa: E402
from results_md import write_results  # noqa: E402

BAR = 1.5


def tiny_config(family: str, layers: int, scan: bool, args):
    config = importlib.import_module(family).get_config("tiny")
    with config.unlocked():
        config.data.vocab_size = 256
        config.model.update(d_model=args.d_model, num_heads=2, num_layers=layers, scan_layers=scan)
        config.train.update(batch_size=args.batch, seq_len=args.seq_len)
    validate(config)
    return config


def compile_seconds(config, repeats: int) -> tuple[float, int]:
    """Best-of-`repeats` wall seconds to trace, lower and compile the train step (a fresh jit each time,
    so nothing is reused from an earlier compile), and the compiled HLO's instruction count (a measure
    of program size that the machine's load does not change)."""
    setup = make_setup(config)
    batch = {k: jax.ShapeDtypeStruct((config.train.batch_size, config.train.seq_len), jnp.int32)
             for k in ("inputs", "targets")}
    best, size = float("inf"), 0
    for _ in range(repeats):
        step = make_train_step(setup.graphdef, setup.optimizer, grad_accum=1, dtype=setup.dtype)
        t0 = time.perf_counter()
        compiled = jax.jit(step).lower(setup.abstract_state, batch).compile()
        best = min(best, time.perf_counter() - t0)
        size = sum(" = " in line for line in compiled.as_text().splitlines())
    return best, size


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="transformer,deltanet")
    p.add_argument("--depths", default="4,24")
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-write", dest="write", action="store_false")
    args = p.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",")]
    low, high = min(depths), max(depths)
    rows, worst = [], 0.0
    for family in args.families.split(","):
        secs, size = {}, {}
        for scan in (False, True):
            for layers in depths:
                secs[scan, layers], size[scan, layers] = compile_seconds(tiny_config(family, layers, scan, args),
                                                                         args.repeats)
                print(f"{family} layers={layers} scan_layers={scan}: {secs[scan, layers]:.2f} s, "
                      f"{size[scan, layers]} HLO instructions", flush=True)
        ratio = {scan: secs[scan, high] / secs[scan, low] for scan in (False, True)}
        worst = max(worst, ratio[True])
        for scan in (False, True):
            rows.append([family, "scanned" if scan else "unrolled"] + [fmt(secs[scan, d], 2) for d in depths]
                        + [f"{ratio[scan]:.2f}x"] + [str(size[scan, d]) for d in depths])
    headers = (["family", "layers"] + [f"{d}L compile (s)" for d in depths] + [f"{high}L/{low}L"]
               + [f"{d}L HLO instructions" for d in depths])
    table = markdown_table(headers, rows)
    verdict = f"scanned {high}L/{low}L at most {worst:.2f}x (bar <= {BAR}x): {'holds' if worst <= BAR else 'FAILS'}"
    print(table + "\n" + verdict)
    if args.write:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        note = (f"Train step (forward, backward, AdamW) of the tiny config at d_model={args.d_model}, batch "
                f"{args.batch} x {args.seq_len} tokens: seconds to trace, lower and compile (best of {args.repeats}; "
                f"nothing runs) and the compiled HLO's instruction count. {verdict}. Load average {load:.1f} when "
                "it finished: the ratios, taken in one run, are what to read; absolute seconds vary with the load.")
        command = " ".join(["python scripts/compile_time.py", *(sys.argv[1:] if argv is None else argv)])
        print(write_results("compile_time.md", "Train-step compile time against depth (model.scan_layers)",
                            command, table, note))


if __name__ == "__main__":
    main()
