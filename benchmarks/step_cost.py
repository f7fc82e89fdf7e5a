"""One training step's time for several rows (a family's `tiny` preset with overrides), timed in turn within
one run so that each ratio to the first row is measured under the same load.

    python benchmarks/step_cost.py "titans_lmm:model.memory.inner_step=paper:model.memory.max_lr=0.01" titans_lmm
    python benchmarks/step_cost.py --batch=8 --seq_len=128 --steps=20 deltanet "deltanet:model.memory.gate_conv=True"

A row is `family[:key=value...]` as in benchmarks/compare_lm.py. Each row's step is compiled once, then the rows
take turns, one step each, `--steps` times (a step always continues its own row's state); the table gives the
median and minimum of each row and their ratios to the first row's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from compare_lm import load_config, parse_row, split_rows  # noqa: E402
from results_md import write_results  # noqa: E402
from timing import markdown_table  # noqa: E402


def compiled_step(row: str, batch: int, seq_len: int):
    """`(step, state, batch)` for a row: its train step jitted and run once (compilation excluded later)."""
    import jax
    import jax.numpy as jnp

    from nlearn.train.state import make_setup
    from nlearn.train.step import make_train_step

    family, overrides = parse_row(row)
    config = load_config(family, [*overrides, f"--config.train.batch_size={batch}",
                                  f"--config.train.seq_len={seq_len}"])
    setup = make_setup(config)
    step = jax.jit(make_train_step(config, setup.graphdef, setup.optimizer, dtype=setup.dtype))
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (batch, seq_len + 1), dtype=np.int32)
    data = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
    state, metrics = step(setup.init_state(), data)
    jax.block_until_ready(metrics)
    return step, state, data


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", nargs="+", help="family[:key=value...]; the first row is the reference")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row")
    parser.add_argument("--results", default="", help="also write the table to results/<this name>.md")
    args = parser.parse_args()
    import jax

    rows = [r for text in args.rows for r in split_rows(text)]
    compiled = {}
    for row in rows:
        print(f"compiling {row}", flush=True)
        compiled[row] = list(compiled_step(row, args.batch, args.seq_len))
    times = {row: [] for row in rows}
    for i in range(args.steps):
        for row in rows:
            step, state, data = compiled[row]
            began = time.perf_counter()
            state, metrics = step(state, data)
            jax.block_until_ready(metrics)
            times[row].append(time.perf_counter() - began)
            compiled[row][1] = state
        if (i + 1) % 5 == 0:
            print(f"{i + 1} of {args.steps} rounds", flush=True)
    first = rows[0]
    table = markdown_table(
        ["row (`tiny` + overrides)", "median ms", "min ms", "median / first row", "min / first row"],
        [[row, f"{np.median(t) * 1e3:.1f}", f"{min(t) * 1e3:.1f}",
          f"{np.median(t) / np.median(times[first]):.3f}", f"{min(t) / min(times[first]):.3f}"]
         for row, t in times.items()])
    print(f"train step of {args.batch} x {args.seq_len} tokens, {args.steps} steps per row, rows in turn:\n{table}")
    if args.results:
        command = "python benchmarks/step_cost.py " + " ".join(f'"{r}"' if ":" in r else r for r in args.rows) + (
            f" --batch={args.batch} --seq_len={args.seq_len} --steps={args.steps} --results={args.results}")
        note = (f"One train step of {args.batch} x {args.seq_len} tokens per row (compiled first), the rows timed "
                f"in turn, {args.steps} steps each; ratios are to the first row, measured in the same run.")
        print(write_results(f"{args.results}.md", "Train-step cost", command, table, note))


if __name__ == "__main__":
    main()
