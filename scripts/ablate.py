"""Inner-learner ablation: one family, one override per run, same data and budget; README table.

  python scripts/ablate.py --family=titans_lmm --steps=60

Each variant is a single `--config.model.memory.X=Y` override of the family's tiny preset.
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

from nlearn.utils.readme import replace_section  # noqa: E402

VARIANTS = ("", "optimizer=sgd", "optimizer=dgd", "objective=dot",
            "minibatch=4", "depth=3")


def run(family: str, variant: str, workdir: str, steps: int, extra: list[str]) -> dict:
    override = [f"--config.model.memory.{variant}"] if variant else []
    cmd = [sys.executable, "-m", "nlearn.cli.train", f"--config=configs/{family}.py:tiny",
           f"--workdir={workdir}", f"--config.train.steps={steps}", "--config.logging.wandb_mode=disabled",
           "--config.logging.plot=False", *extra, *override]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"variant": variant or "default", "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    records = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
    train = [r["loss"] for r in records if "loss" in r]
    result = json.load(open(os.path.join(workdir, "eval.json")))
    return {"variant": variant or "default", "train_loss": train[-1], "eval_loss": result["loss"],
            "minutes": (time.perf_counter() - start) / 60}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", default="titans_lmm")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--workdir", default=os.path.join(ROOT, "runs", "ablate"))
    parser.add_argument("--no-readme", action="store_true")
    parser.add_argument("overrides", nargs="*", help="extra --config.* overrides for every run")
    args = parser.parse_args()
    rows = []
    for i, variant in enumerate(args.variants.split(",")):
        workdir = os.path.join(args.workdir, f"{args.family}-{i}")
        subprocess.run(["rm", "-rf", workdir])
        rows.append(run(args.family, variant, workdir, args.steps, args.overrides))
        print(json.dumps(rows[-1]), flush=True)
    lines = ["| `model.memory` override | final train loss | validation loss | wall time |", "|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error']} | | |")
        else:
            lines.append(f"| {r['variant']} | {r['train_loss']:.3f} | {r['eval_loss']:.3f} | "
                         f"{r['minutes']:.1f} min |")
    body = "\n".join(lines)
    print(body)
    if not args.no_readme:
        cmd = " ".join(["python scripts/ablate.py", f"--family={args.family}", f"--steps={args.steps}",
                        *args.overrides])
        replace_section("ablation", f"Made by `{cmd}` on the 2-core CPU (built-in corpus).\n\n{body}")


if __name__ == "__main__":
    main()
