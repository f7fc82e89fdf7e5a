"""Inner-learner ablation: one family, one override per run, same data and budget; results/ablations.md.

  python scripts/ablate.py --family=titans_lmm --steps=40 -- --config.train.batch_size=8

Each variant is a single `--config.model.memory.X=Y` override of the family's tiny preset; every
run sees the same batches in the same order (same seed), so the last step's training loss is taken
on the same batch for every variant. A variant the config refuses (e.g. `optimizer=adamq`) gets a
row with the one-line error instead of numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from nlearn.train.metrics import throughput  # noqa: E402
from results_md import write_results  # noqa: E402

# "" is the default inner learner (optimizer=momentum, objective=l2, minibatch=16, depth=2).
VARIANTS = ("", "optimizer=sgd", "optimizer=dgd", "optimizer=dgd_momentum", "objective=dot", "minibatch=4",
            "depth=3", "optimizer=adamq")



def run(family: str, variant: str, workdir: str, steps: int, extra: list[str]) -> dict:
    """Train one variant in its own process; its numbers, or its one-line error."""
    name = variant or "default"
    override = [f"--config.model.memory.{variant}"] if variant else []
    cmd = [sys.executable, "-m", "nlearn.cli.train", f"--config=configs/{family}.py:tiny",
           f"--workdir={workdir}", f"--config.train.steps={steps}", "--config.logging.wandb_mode=disabled",
           "--config.logging.plot=False", *extra, *override]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    minutes = (time.perf_counter() - start) / 60
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        return {"variant": name, "error": (errors or proc.stderr.strip().splitlines() or ["?"])[-1]}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    with open(os.path.join(workdir, "eval.json")) as f:
        result = json.load(f)
    with open(os.path.join(workdir, "config.json")) as f:
        train_cfg = json.load(f)["train"]
    train = [r for r in records if "loss" in r]
    return {"variant": name, "train_loss": train[-1]["loss"], "eval_loss": result["loss"],
            "tokens_per_sec": throughput(records, train_cfg["batch_size"] * train_cfg["seq_len"]),
            "minutes": minutes}


def table(rows: list[dict]) -> str:
    lines = ["| `model.memory` override | train loss (last step) | validation loss | train tok/s | wall time |",
             "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            why = "refused" if "invalid config value" in r["error"] else "failed"
            lines.append(f"| {r['variant']} | {why}: `{r['error']}` | | | |")
        else:
            lines.append(f"| {r['variant']} | {r['train_loss']:.3f} | {r['eval_loss']:.3f} | "
                         f"{r['tokens_per_sec']:,.0f} | {r['minutes']:.1f} min |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", default="titans_lmm")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; empty = default")
    parser.add_argument("--workdir", default=os.path.join(ROOT, "runs", "ablate"))
    parser.add_argument("--print-only", action="store_true", help="print the table, write no results file")
    parser.add_argument("--note", default="", help="sentence appended to the note above the table")
    parser.add_argument("--rows", default="", help="re-render the table from this file of printed JSON rows")
    parser.add_argument("overrides", nargs="*", help="extra --config.* overrides for every run")
    args = parser.parse_args()
    rows = []
    if args.rows:
        with open(args.rows) as f:
            rows = [json.loads(line) for line in f if line.startswith("{")]
    for i, variant in enumerate([] if args.rows else args.variants.split(",")):
        workdir = os.path.join(args.workdir, f"{args.family}-{i}")
        subprocess.run(["rm", "-rf", workdir])
        rows.append(run(args.family, variant, workdir, args.steps, args.overrides))
        print(json.dumps(rows[-1]), flush=True)
    body = table(rows)
    print(body)
    if not args.print_only:
        cmd = " ".join(["python scripts/ablate.py", f"--family={args.family}", f"--steps={args.steps}",
                        *(["--", *args.overrides] if args.overrides else [])])
        note = ("Built-in corpus. default = optimizer=momentum, objective=l2, minibatch=16, depth=2; every run "
                "sees the same batches. tok/s excludes compilation.")
        print(write_results("ablations.md", f"Inner-learner ablations ({args.family})", cmd, body,
                            f"{note} {args.note}".rstrip()))


if __name__ == "__main__":
    main()
