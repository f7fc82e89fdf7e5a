"""Stability sweep: does every family's default train without nan where the old defaults diverged?

Every family's `tiny` preset (the ladder's rows: results/ladder.md) at the ladder's settings (100 steps of
8 x 128 tokens, warmup 10), seeds 0-2. The Titans presets (titans_lmm / mac / mag / mal) already have the
paper-shaped memory (depth 2, mini-batches of 16, momentum); `--rows` runs others, e.g. the old default
`titans_lmm:model.memory.inner_step=paper:model.memory.max_lr=0.01`. Each run reports its final training loss,
validation perplexity, the largest
fast-weight norm over the first eval sequences (`logging.fast_weights`) and whether it went nan. Runs are
appended to results/stability.jsonl as they finish and skipped when already there, so a stopped sweep
resumes; results/stability.md is rewritten after every run.

    python benchmarks/stability.py                       # the whole sweep (hours on 2 CPU cores)
    python benchmarks/stability.py --rows=titans_lmm --seeds=1
    python benchmarks/stability.py --render              # the table from the JSONL, train nothing
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from compare_lm import LADDER_OVERRIDES, all_families, split_rows, train  # noqa: E402
from results_md import RESULTS_DIR, write_results  # noqa: E402

STEPS = 100
COMMON = ["--config.train.seq_len=128", "--config.train.batch_size=8", "--config.train.warmup_steps=10",
          "--config.data.eval_tokens=16384", "--config.train.cpu_opt_preset=fast_compile",
          "--config.checkpoint.every_steps=1000", "--config.logging.fast_weights=True"]
TITANS = ("titans_lmm", "titans_mac", "titans_mag", "titans_mal")
JSONL = os.path.join(RESULTS_DIR, "stability.jsonl")


def default_rows() -> list[str]:
    """The ladder's rows, the Titans families first (theirs went nan with the old defaults)."""
    families = [f for f in TITANS if f in all_families()] + [f for f in all_families() if f not in TITANS]
    return [":".join([f] + ([LADDER_OVERRIDES[f]] if f in LADDER_OVERRIDES else [])) for f in families]


def read_done(path: str) -> dict:
    done = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    run = json.loads(line)
                    done[(run["row"], run["seed"])] = run
    return done


def run_row(row: str, seed: int, workdir: str) -> dict:
    """One training run from scratch and what the sweep records of it."""
    shutil.rmtree(workdir, ignore_errors=True)  # a stopped run's leftovers: it restarts
    run = train(row, seed, workdir, STEPS, COMMON)
    out = {"row": row, "seed": seed, "steps": STEPS}
    if "error" in run:
        return {**out, "error": run["error"], "nan": "nan" in run["error"]}
    with open(os.path.join(workdir, "eval.json")) as f:
        result = json.load(f)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    return {**out, "nan": False, "final_loss": losses[-1], "perplexity": result["perplexity"],
            "fast_weight_norm": result.get("fast_weight_norm"), "minutes": run["minutes"]}


def table(runs: list[dict]) -> str:
    lines = ["| row (`tiny` + overrides) | seed | final train loss | validation perplexity | max fast-weight norm "
             "| nan |", "|---|---|---|---|---|---|"]
    for r in runs:
        if "error" in r:
            lines.append(f"| {r['row']} | {r['seed']} | | | | {'**nan**' if r['nan'] else 'failed'}: "
                         f"`{r['error']}` |")
            continue
        norm = r.get("fast_weight_norm")
        lines.append(f"| {r['row']} | {r['seed']} | {r['final_loss']:.3f} | {r['perplexity']:.1f} | "
                     f"{'' if norm is None else f'{norm:.3g}'} | no |")
    return "\n".join(lines)


def render(runs: list[dict], command: str) -> str:
    nans = sum(r.get("nan", False) for r in runs)
    note = (f"{len(runs)} runs, {nans} nan. Each row trains {STEPS} steps of 8 x 128 tokens (warmup 10) from "
            "its family's default; the fast-weight norm is the largest Frobenius norm of any memory matrix after "
            "prefilling the first eval sequences (0: no memory).")
    return write_results("stability.md", "Stability sweep: every family's default at the ladder's settings",
                         command, table(runs), note)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="", help="rows to run (default: every family and the paper-shaped ones)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--workdir", default=os.path.join(ROOT, "runs", "stability"))
    parser.add_argument("--render", action="store_true", help="rewrite the table from the JSONL, train nothing")
    args = parser.parse_args()
    rows = split_rows(args.rows) if args.rows else default_rows()
    seeds = [int(s) for s in args.seeds.split(",")]
    command = "python benchmarks/stability.py" + (f" --rows={args.rows}" if args.rows else "") + (
        f" --seeds={args.seeds}" if args.seeds != "0,1,2" else "")
    done = read_done(JSONL)
    if not args.render:
        for row in rows:
            for seed in seeds:
                if (row, seed) in done:
                    continue
                name = row.replace(":", "_").replace("=", "-").replace("/", "_")
                run = run_row(row, seed, os.path.join(args.workdir, f"{name}-s{seed}"))
                print(json.dumps(run), flush=True)
                with open(JSONL, "a") as f:
                    f.write(json.dumps(run) + "\n")
                done[(row, seed)] = run
                render([done[k] for k in sorted(done)], command)
    runs = [done[k] for k in sorted(done)]
    if runs:
        print(f"wrote {render(runs, command)}\n{table(runs)}")


if __name__ == "__main__":
    main()
