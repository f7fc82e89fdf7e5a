"""Ablations: one family, one variant per run, same data and budget; results/ablations.md (a section per family).

  python benchmarks/ablate.py --family=titans_lmm --steps=40 -- --config.train.batch_size=8
  python benchmarks/ablate.py --family=hope --steps=30 -- --config.train.batch_size=4

A variant is one or more space-separated `key=value` overrides of the family's tiny preset: a bare key
is under `model.memory` (`optimizer=sgd`), a dotted one under `model` (`cms.update=none`,
`hope.mixer=attention`, `memory.dgd=False`). Every run sees the same batches in the same order (same
seed), so the last step's training loss is taken on the same batch for every variant. A variant the
config refuses gets a row with the one-line error instead of numbers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from nlearn.train.metrics import throughput  # noqa: E402
from results_md import RESULTS_DIR, machine, render  # noqa: E402

# "" is the family's preset. titans_lmm: optimizer=momentum, objective=l2, minibatch=16, depth=2. hope: CMS
# periods (16, 64, 128) updated by the next-token loss, the self-referential mixer with DGD and self-targets.
VARIANTS = {
    "titans_lmm": ("", "optimizer=sgd", "optimizer=dgd", "optimizer=dgd_momentum", "objective=dot", "minibatch=4",
                   "depth=3", "optimizer=adamq"),
    "hope": ("", "cms.update=none", "cms.periods=(8,32,128)", "cms.periods=(16,64) cms.lr=(1e-3,1e-3)",
             "cms.periods=(16,) cms.lr=(1e-3,)", "hope.mixer=attention", "memory.dgd=False",
             "memory.self_targets=False", "memory.adaptive_q=True", "cms.periods=(16,32,64)"),
}
NOTES = {
    "titans_lmm": "default = optimizer=momentum, objective=l2, minibatch=16, depth=2.",
    "hope": "default = CMS periods (16, 64, 128) with cms.update=ntp, the self-referential mixer with DGD and "
            "self-targets; fewer levels split the same MLP width. docs/self_referential.md §4 has the paper's "
            "Table 6 (760M, perplexity): Hope 12.24, without DGD 13.41, without CMS 13.04, static values 13.90, "
            "static q 12.19.",
}


def overrides_of(variant: str) -> list[str]:
    """`--config.*` flags of a variant: bare keys under model.memory, dotted ones under model."""
    return [f"--config.model.{item}" if "." in item.split("=", 1)[0] else f"--config.model.memory.{item}"
            for item in variant.split()]


def split_variants(text: str) -> list[str]:
    """Comma-separated variants; commas inside parentheses (tuple values) stay."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur]


def run(family: str, variant: str, workdir: str, steps: int, extra: list[str]) -> dict:
    """Train one variant in its own process; its numbers, or its one-line error."""
    name = variant or "default"
    override = overrides_of(variant)
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


def table(rows: list[dict], family: str = "titans_lmm") -> str:
    section = "model.memory" if family == "titans_lmm" else "model"
    lines = [f"| `{section}` override | train loss (last step) | validation loss | train tok/s | wall time |",
             "|---|---|---|---|---|"]
    for r in rows:
        if "not_run" in r:
            lines.append(f"| {r['variant']} | not run | | | |")
        elif "error" in r:
            why = "refused" if "invalid config value" in r["error"] else "failed"
            lines.append(f"| {r['variant']} | {why}: `{r['error']}` | | | |")
        else:
            lines.append(f"| {r['variant']} | {r['train_loss']:.3f} | {r['eval_loss']:.3f} | "
                         f"{r['tokens_per_sec']:,.0f} | {r['minutes']:.1f} min |")
    return "\n".join(lines)


def write_section(name: str, title: str, command: str, body: str, note: str = "", directory: str = RESULTS_DIR) -> str:
    """Replace (or add) the `# title` section of results/<name> (made as `results_md.render` makes a file),
    keeping the other families' sections; returns the path."""
    path = os.path.join(directory, name)
    sections = []
    if os.path.exists(path):
        with open(path) as f:
            sections = ["# " + part.strip() + "\n" for part in ("\n" + f.read()).split("\n# ")[1:]]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    text = render(title, command, body, machine_text=machine(), date=date, note=note)
    sections = [sec for sec in sections if sec.splitlines()[0] != f"# {title}"] + [text]
    with open(path, "w") as f:
        f.write("\n".join(sections))
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", default="titans_lmm", choices=sorted(VARIANTS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--variants", default="", help="comma-separated (empty entry = the preset); default: "
                        "the family's list")
    parser.add_argument("--workdir", default=os.path.join(ROOT, "runs", "ablate"))
    parser.add_argument("--print-only", action="store_true", help="print the table, write no results file")
    parser.add_argument("--note", default="", help="sentence appended to the note above the table")
    parser.add_argument("--rows", default="", help="re-render the table from this file of printed JSON rows (the "
                        "variants without one are listed as not run)")
    parser.add_argument("overrides", nargs="*", help="extra --config.* overrides for every run")
    args = parser.parse_args()
    variants = split_variants(args.variants) if args.variants else list(VARIANTS[args.family])
    rows = []
    if args.rows:
        with open(args.rows) as f:
            rows = [json.loads(line) for line in f if line.startswith("{")]
        done = {r["variant"] for r in rows}  # the list's variants without a row are listed as not run
        rows += [{"variant": v or "default", "not_run": True} for v in variants if (v or "default") not in done]
    for i, variant in enumerate([] if args.rows else variants):
        workdir = os.path.join(args.workdir, f"{args.family}-{i}")
        subprocess.run(["rm", "-rf", workdir])
        rows.append(run(args.family, variant, workdir, args.steps, args.overrides))
        print(json.dumps(rows[-1]), flush=True)
    body = table(rows, args.family)
    print(body)
    if not args.print_only:
        cmd = " ".join(["python benchmarks/ablate.py", f"--family={args.family}", f"--steps={args.steps}",
                        *(["--", *args.overrides] if args.overrides else [])])
        note = f"Built-in corpus. {NOTES[args.family]} Every run sees the same batches. tok/s excludes compilation."
        print(write_section("ablations.md", f"Ablations ({args.family})", cmd, body, f"{note} {args.note}".rstrip()))


if __name__ == "__main__":
    main()
