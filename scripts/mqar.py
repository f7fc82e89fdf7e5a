"""`make mqar`: train every family on the common MQAR task and write the README table.

Each family runs `configs/mqar.py:<family>` in its own process (a fresh workdir under runs/mqar)
and reports accuracy on the answers, parameter count and wall-clock training time.
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

DEFAULT_FAMILIES = ("transformer", "linear_attention", "deltanet", "gated_deltanet", "titans_lmm",
                    "titans_mac", "titans_mag", "titans_mal", "ttt_linear", "ttt_mlp")


def run_family(family: str, workdir: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "nlearn.cli.train", f"--config=configs/mqar.py:{family}",
           f"--workdir={workdir}", "--config.logging.wandb_mode=disabled", *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        return {"family": family, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    result = json.load(open(os.path.join(workdir, "eval.json")))
    params = [l for l in proc.stdout.splitlines() if "M parameters" in l][0].split(":")[1].split("M")[0]
    return {"family": family, "accuracy": result["mqar_accuracy"], "params_m": float(params),
            "train_seconds": result["train_seconds"], "wall_seconds": seconds}


def table(rows: list[dict]) -> str:
    out = ["| family | MQAR accuracy | parameters | training time |", "|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['family']} | failed: {r['error']} | | |")
        else:
            out.append(f"| {r['family']} | {100 * r['accuracy']:.1f}% | {r['params_m']:.2f}M | "
                       f"{r['train_seconds'] / 60:.1f} min |")
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--families", default=",".join(DEFAULT_FAMILIES))
    parser.add_argument("--workdir", default=os.path.join(ROOT, "runs", "mqar"))
    parser.add_argument("--no-readme", action="store_true", help="print the table only")
    parser.add_argument("overrides", nargs="*", help="extra --config.* overrides for every family")
    args = parser.parse_args()
    rows = []
    for family in args.families.split(","):
        workdir = os.path.join(args.workdir, family)
        subprocess.run(["rm", "-rf", workdir])
        rows.append(run_family(family, workdir, args.overrides))
        print(json.dumps(rows[-1]), flush=True)
    body = table(rows)
    print(body)
    if not args.no_readme:
        note = ("Made by `make mqar` (`python scripts/mqar.py`): T=256, 16 pairs, vocabulary 512, "
                "2 layers, d_model=128, 1500 steps of 32 sequences, on this repo's 2-core CPU.")
        replace_section("mqar", f"{note}\n\n{body}")


if __name__ == "__main__":
    main()
