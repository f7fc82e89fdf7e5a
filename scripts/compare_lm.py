"""Validation perplexity of several families on the built-in corpus at equal tokens.

Every family trains its `tiny` preset with the same data, steps, batch and sequence length, in its
own process; the table (family, parameters, tokens, perplexity, tokens/s, time) goes to
results/lm_comparison.md.

  python scripts/compare_lm.py --families=transformer,titans_lmm --steps=75
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



def train(family: str, workdir: str, steps: int, extra: list[str]) -> dict:
    """Train `family`'s tiny preset in its own process; its numbers, or its one-line error."""
    cmd = [sys.executable, "-m", "nlearn.cli.train", f"--config=configs/{family}.py:tiny",
           f"--workdir={workdir}", f"--config.train.steps={steps}",
           "--config.logging.wandb_mode=disabled", *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        return {"family": family, "error": (errors or proc.stderr.strip().splitlines() or ["?"])[-1]}
    with open(os.path.join(workdir, "eval.json")) as f:
        result = json.load(f)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    header = [l for l in proc.stdout.splitlines() if "M parameters" in l][0]
    final = [l for l in proc.stdout.splitlines() if l.startswith("final:")][0]
    tokens_per_step = int(header.split("tokens/step")[0].split(",")[-1])
    return {"family": family, "params_m": float(header.split(":")[1].split("M")[0]),
            "tokens": steps * tokens_per_step, "perplexity": result["perplexity"],
            "unigram": float(final.split("unigram baseline on the same tokens: ")[1].rstrip(")")),
            "tokens_per_sec": throughput(records, tokens_per_step),
            "minutes": (time.perf_counter() - start) / 60}


def table(rows) -> str:
    out = ["| family (tiny) | parameters | training tokens | validation perplexity | train tok/s | wall time |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['family']} | failed: `{r['error']}` | | | | |")
        else:
            out.append(f"| {r['family']} | {r['params_m']:.2f}M | {r['tokens'] / 1e6:.2f}M | "
                       f"{r['perplexity']:.1f} | {r['tokens_per_sec']:,.0f} | {r['minutes']:.1f} min |")
    ok = [r for r in rows if "unigram" in r]
    if ok:
        out.append(f"| unigram baseline | | | {ok[0]['unigram']:.1f} | | |")
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--families", default="transformer,titans_lmm")
    parser.add_argument("--steps", type=int, default=75)
    parser.add_argument("--workdir", default=os.path.join(ROOT, "runs", "compare"))
    parser.add_argument("--print-only", action="store_true", help="print the table, write no results file")
    parser.add_argument("--note", default="", help="sentence appended to the note above the table")
    parser.add_argument("overrides", nargs="*", help="extra --config.* overrides for every family")
    args = parser.parse_args()
    rows = []
    for family in args.families.split(","):
        workdir = os.path.join(args.workdir, family)
        subprocess.run(["rm", "-rf", workdir])
        rows.append(train(family, workdir, args.steps, args.overrides))
        print(json.dumps(rows[-1]), flush=True)
    body = table(rows)
    print(body)
    if not args.print_only:
        cmd = " ".join(["python scripts/compare_lm.py", f"--families={args.families}",
                        f"--steps={args.steps}", *(["--", *args.overrides] if args.overrides else [])])
        note = ("Every family trains its `tiny` preset on the same batches (same seed, steps, batch and "
                "sequence length) and is scored on the same held-out tokens. tok/s excludes compilation.")
        print(write_results("lm_comparison.md", "Language modelling: validation perplexity at equal tokens",
                            cmd, body, f"{note} {args.note}".rstrip()))


if __name__ == "__main__":
    main()
