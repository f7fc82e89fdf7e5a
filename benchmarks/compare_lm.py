"""Validation perplexity of model families on the built-in corpus at equal parameters and tokens.

A row is a family's `tiny` preset, optionally with overrides: `hope:model.hope.mixer=attention`
(several joined by `:`). Every row trains in its own process on the same batches (same data config,
seed, steps, batch and sequence length) and is scored on the same held-out tokens; `--seeds=0,1`
repeats every row per seed (the seed sets the initialisation and the batch order) and reports the
mean and the spread. The parameter counts are checked first (without allocating): a row more than 5%
from the tiny Transformer++ is flagged in the table and warned about.

  python benchmarks/compare_lm.py --steps=75                     # the five rows of results/lm_comparison.md
  python benchmarks/compare_lm.py --families=all --seeds=0,1     # every family: results/ladder.md
  python benchmarks/compare_lm.py --families=transformer,hope --params-only
  python benchmarks/compare_lm.py --steps=300 -- --config.train.seq_len=64   # overrides for every row

Each run prints one JSON line, and the runs behind a table are kept next to it (results/lm_comparison.jsonl,
results/ladder.jsonl). `--rows=LOG[,LOG]` re-renders the table from such lines instead of training; a later
file's run of a row and seed replaces an earlier one, so new rows join a table without rerunning the others:

  python benchmarks/compare_lm.py --families=hope --steps=100 --print-only -- ... > hope.log   # same overrides
  python benchmarks/compare_lm.py --families=<all rows> --rows=results/lm_comparison.jsonl,hope.log
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from nlearn.train.metrics import throughput  # noqa: E402
from results_md import write_results  # noqa: E402

FIVE_ROWS = "transformer,titans_lmm,hope,hope:model.hope.mixer=attention:model.mlp_dim=704,self_ref_titans"
# Hope-Attention with the SwiGLU width 704 of the transformer: the attention mixer has fewer parameters than
# the self-referential one, and this keeps the row at the transformer's count (+0.0% against -11%).
# In the ladder (`--families=all`) the hybrids (attention and a memory in every layer) drop a layer and narrow
# their SwiGLU to stand within 5% of the tiny Transformer++'s parameters (their tiny presets: +30-45%).
LADDER_OVERRIDES = {"titans_mac": "model.num_layers=3:model.mlp_dim=320",
                    "titans_mag": "model.num_layers=3:model.mlp_dim=576",
                    "titans_mal": "model.num_layers=3:model.mlp_dim=480"}
REFERENCE = "transformer"  # every row's parameter count is compared with this family's tiny preset
PARAM_TOLERANCE = 0.05
# The train keys every row must share (with the whole data section) to have seen the same batches.
SAME_TRAIN_KEYS = ("seed", "steps", "batch_size", "seq_len")


def split_rows(text: str) -> list[str]:
    """`--families` split at the commas outside brackets and quotes (`a,b:model.cms.periods=(16,64)`)."""
    rows, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            rows.append(text[start:i])
            start = i + 1
    rows.append(text[start:])
    return [r.strip() for r in rows if r.strip()]


def parse_row(row: str) -> tuple[str, list[str]]:
    """`family:key=value:...` -> (family, ["--config.key=value", ...])."""
    family, *overrides = row.split(":")
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value (e.g. model.hope.mixer=attention)")
    return family, [f"--config.{item}" for item in overrides]


def all_families() -> list[str]:
    """Every registered family that has a config file."""
    from nlearn import models

    return [f for f in sorted(models.FAMILIES) if os.path.exists(os.path.join(ROOT, "configs", f"{f}.py"))]


def load_config(family: str, overrides: list[str]):
    """`configs/<family>.py:tiny` with `--config.*` overrides, parsed and validated as the train CLI does."""
    from absl import flags
    from ml_collections import config_flags

    from nlearn.config import validate

    path = os.path.join(ROOT, "configs", f"{family}.py")
    if not os.path.isfile(path):
        raise ValueError(f"no config file configs/{family}.py (families: {', '.join(all_families())})")
    values = flags.FlagValues()
    argv = ["compare_lm", f"--config={path}:tiny", *overrides]
    config_flags.DEFINE_config_file("config", None, flag_values=values, lock_config=True, sys_argv=argv)
    try:
        values(argv)
        config = values.config
    except (KeyError, AttributeError) as e:  # an override naming a key the config lacks
        name = re.search(r"\w+", str(e)).group(0)
        culprits = [o.split("=", 1)[0] for o in overrides if f".{name}" in o.split("=", 1)[0]] or overrides
        raise ValueError(f"unknown config key {culprits[0].removeprefix('--config.')!r}") from None
    except flags.Error as e:
        raise ValueError(f"cannot apply {' '.join(overrides)}: {str(e).splitlines()[0]}") from None
    validate(config)
    return config


def param_counts(rows: list[str], common: list[str]) -> dict:
    """Each row's parameter count (abstract evaluation, nothing allocated); a row whose config does not
    load or validate stops the script with one line naming it."""
    from nlearn.cli.common import fail
    from nlearn.models import count_params

    out = {}
    for row in [REFERENCE, *rows]:
        if row not in out:
            try:
                family, overrides = parse_row(row)
                out[row] = count_params(load_config(family, [*common, *overrides]))
            except Exception as e:  # noqa: BLE001  (any failure to build is the row's to report)
                fail(f"row {row!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    return out


def param_warnings(counts: dict) -> list[str]:
    """One line per row whose count is more than PARAM_TOLERANCE away from the reference's."""
    ref = counts.get(REFERENCE)
    if not isinstance(ref, int):
        return [f"warning: no parameter count for {REFERENCE} to compare with"]
    return [f"warning: {row} has {n / 1e6:.2f}M parameters, {n / ref - 1:+.1%} from {REFERENCE}'s "
            f"{ref / 1e6:.2f}M (more than {PARAM_TOLERANCE:.0%}: not an equal-parameter comparison)"
            for row, n in counts.items() if isinstance(n, int) and abs(n / ref - 1) > PARAM_TOLERANCE]


def train(row: str, seed: int, workdir: str, steps: int, common: list[str]) -> dict:
    """Train one row at one seed in its own process; its numbers, or its one-line error."""
    family, overrides = parse_row(row)
    cmd = [sys.executable, "-m", "nlearn.cli.train", f"--config=configs/{family}.py:tiny",
           f"--workdir={workdir}", f"--config.train.steps={steps}", f"--config.train.seed={seed}",
           "--config.logging.wandb_mode=disabled", "--config.logging.plot=False", *common, *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    run = {"row": row, "seed": seed, "steps": steps, "common": common}
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        return {**run, "error": (errors or proc.stderr.strip().splitlines() or ["?"])[-1]}
    with open(os.path.join(workdir, "eval.json")) as f:
        result = json.load(f)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    with open(os.path.join(workdir, "config.json")) as f:
        config = json.load(f)
    config = config.get("config", config)
    tokens_per_step = config["train"]["batch_size"] * config["train"]["seq_len"]
    final = [line for line in proc.stdout.splitlines() if line.startswith("final:")][0]
    unigram = re.search(r"unigram baseline on the same tokens: ([0-9.]+)", final)
    params = re.search(r": ([0-9.]+)M parameters", proc.stdout)
    return {**run, "params_m": float(params.group(1)), "tokens": steps * tokens_per_step,
            "perplexity": result["perplexity"], "eval_tokens": result.get("tokens"),
            "unigram": float(unigram.group(1)) if unigram else None,
            "tokens_per_sec": throughput(records, tokens_per_step), "minutes": (time.perf_counter() - start) / 60,
            "same_batches": {"data": config["data"], **{k: config["train"][k] for k in SAME_TRAIN_KEYS}}}


def batch_settings(run: dict) -> dict:
    """What decides a run's batches: its `same_batches` less the option sections of other data sources
    (a `data.niah` section added to the config later leaves the built-in corpus's batches as they were)."""
    data = run["same_batches"]["data"]
    return {**run["same_batches"],
            "data": {k: v for k, v in data.items() if not isinstance(v, dict) or k == data.get("source")}}


def data_mismatches(runs: list[dict]) -> list[str]:
    """Runs of one seed that did not share the data config, seed, steps, batch, length or held-out tokens."""
    out = []
    for seed in sorted({r["seed"] for r in runs}):
        ok = [r for r in runs if r["seed"] == seed and "error" not in r]
        for r in ok[1:]:
            if batch_settings(r) != batch_settings(ok[0]) or r.get("eval_tokens") != ok[0].get("eval_tokens"):
                out.append(f"warning: seed {seed}: {r['row']} did not train or score on the same tokens as "
                           f"{ok[0]['row']}")
    return out


def summarise(runs: list[dict], order: list[str]) -> list[dict]:
    """One entry per row: mean perplexity over its seeds, half the seed range, per-seed values."""
    out = []
    for row in order:
        mine = [r for r in runs if r["row"] == row]
        good = [r for r in mine if "error" not in r]
        bad = [r for r in mine if "error" in r]
        entry = {"row": row, "seeds": [r["seed"] for r in good], "failed": [(r["seed"], r["error"]) for r in bad]}
        if good:
            ppl = [r["perplexity"] for r in good]
            entry.update(params_m=good[0]["params_m"], tokens=good[0]["tokens"], per_seed=ppl,
                         mean=statistics.fmean(ppl), spread=(max(ppl) - min(ppl)) / 2,
                         tokens_per_sec=statistics.fmean(r["tokens_per_sec"] for r in good),
                         minutes=statistics.fmean(r["minutes"] for r in good),
                         unigram=good[0].get("unigram"))
        out.append(entry)
    return out


def overlaps(entries: list[dict]) -> list[str]:
    """Neighbours in the perplexity order whose seed ranges overlap (their order is within seed noise)."""
    ranked = sorted((e for e in entries if len(e["seeds"]) > 1), key=lambda e: e["mean"])
    return [f"{a['row']} ~ {b['row']}" for a, b in zip(ranked, ranked[1:])
            if max(a["per_seed"]) >= min(b["per_seed"])]


def table(entries: list[dict], counts: dict) -> str:
    ref = counts.get(REFERENCE)
    out = [f"| row (`tiny` + overrides) | parameters | vs {REFERENCE} | training tokens | validation perplexity "
           "| per seed | train tok/s | wall time / run |", "|---|---|---|---|---|---|---|---|"]
    for e in entries:
        n = counts.get(e["row"])
        if isinstance(n, int) and isinstance(ref, int):
            delta = f"{n / ref - 1:+.1%}"
            delta = f"**{delta}** (over {PARAM_TOLERANCE:.0%})" if abs(n / ref - 1) > PARAM_TOLERANCE else delta
        else:
            delta = ""
        failed = "; ".join(f"seed {s} failed: `{err}`" for s, err in e["failed"]) or "not run"
        params = f"{n / 1e6:.2f}M" if isinstance(n, int) else f"{e['params_m']:.2f}M" if "params_m" in e else ""
        if "mean" not in e:
            out.append(f"| {e['row']} | {params} | {delta} | | {failed} | | | |")
            continue
        ppl = f"{e['mean']:.1f} ± {e['spread']:.1f}" if len(e["seeds"]) > 1 else f"{e['mean']:.1f}"
        seeds = ", ".join(f"{p:.1f}" for p in e["per_seed"]) + (f"; {failed}" if e["failed"] else "")
        out.append(f"| {e['row']} | {params} | {delta} | {e['tokens'] / 1e6:.2f}M | {ppl} | {seeds} "
                   f"| {e['tokens_per_sec']:,.0f} | {e['minutes']:.1f} min |")
    unigram = next((e["unigram"] for e in entries if e.get("unigram")), None)
    if unigram:
        out.append(f"| unigram baseline | | | | {unigram:.1f} | | | |")
    return "\n".join(out)


def params_table(counts: dict) -> str:
    ref = counts.get(REFERENCE)
    out = [f"| row | parameters | vs {REFERENCE} |", "|---|---|---|"]
    for row, n in counts.items():
        if isinstance(n, int):
            out.append(f"| {row} | {n / 1e6:.3f}M | {n / ref - 1:+.1%} |" if isinstance(ref, int)
                       else f"| {row} | {n / 1e6:.3f}M | |")
        else:
            out.append(f"| {row} | error: `{n}` | |")
    return "\n".join(out)


def read_runs(paths: str) -> list[dict]:
    """The runs printed in these files, one per row and seed: a later one replaces an earlier one."""
    runs = {}
    for path in paths.split(","):
        with open(path) as f:
            for line in f:
                if line.startswith('{"row"'):
                    run = json.loads(line)
                    runs[run["row"], run["seed"]] = run
    return list(runs.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=None,
                        help=f"comma-separated rows `family[:key=value...]`, or `all` (default: {FIVE_ROWS})")
    parser.add_argument("--steps", type=int, default=75)
    parser.add_argument("--seeds", default="0", help="comma-separated train.seed values, each row runs once per seed")
    parser.add_argument("--workdir", default=os.path.join(ROOT, "runs", "compare"))
    parser.add_argument("--params-only", action="store_true", help="print the parameter check and stop")
    parser.add_argument("--print-only", action="store_true", help="print the table, write no results file")
    parser.add_argument("--rows", default="", help="re-render from these files of printed JSON lines, train nothing")
    parser.add_argument("--note", default="", help="sentence appended to the note above the table")
    parser.add_argument("overrides", nargs="*", help="extra --config.* overrides for every row")
    args = parser.parse_args()
    ladder = args.families == "all"
    runs = read_runs(args.rows) if args.rows else []
    if ladder:
        rows = [f"{f}:{LADDER_OVERRIDES[f]}" if f in LADDER_OVERRIDES else f for f in all_families()]
    elif args.families:
        rows = split_rows(args.families)
    else:
        rows = list(dict.fromkeys(r["row"] for r in runs)) if runs else split_rows(FIVE_ROWS)
    if runs:  # the runs' own settings, so the recorded command is the one that made them
        runs = [r for r in runs if r["row"] in rows]
        args.steps, args.overrides = runs[0]["steps"], runs[0]["common"]
        args.seeds = ",".join(str(s) for s in sorted({r["seed"] for r in runs}))
    seeds = [int(s) for s in args.seeds.split(",")]
    counts = param_counts(rows, args.overrides)
    warnings = param_warnings(counts)
    for line in warnings if not args.rows else []:
        print(line, file=sys.stderr, flush=True)
    if args.params_only:
        print(params_table(counts))
        return
    for seed in seeds if not args.rows else []:
        for row in rows:
            workdir = os.path.join(args.workdir, f"{re.sub(r'[^A-Za-z0-9_.=-]+', '_', row)}-s{seed}")
            subprocess.run(["rm", "-rf", workdir])
            runs.append(train(row, seed, workdir, args.steps, args.overrides))
            print(json.dumps(runs[-1]), flush=True)
    mismatched = data_mismatches(runs)
    warnings += mismatched
    entries = summarise(runs, rows)
    if ladder:  # best first; rows without a result last
        entries.sort(key=lambda e: e.get("mean", float("inf")))
    body = table(entries, counts)
    print(body)
    for line in warnings:
        print(line, file=sys.stderr, flush=True)
    if args.print_only:
        return
    cmd = " ".join(["python benchmarks/compare_lm.py", f"--families={'all' if ladder else ','.join(rows)}",
                    f"--steps={args.steps}", f"--seeds={args.seeds}",
                    *(["--", *args.overrides] if args.overrides else [])])
    note = ("Every row trains on the same batches (for each seed: the same data, steps, batch and sequence "
            "length) and is scored on the same held-out tokens; the seed sets the initialisation and the batch "
            "order. Perplexity is the mean over seeds ± half their range; tok/s excludes compilation.")
    close = overlaps(entries)
    if close:
        note += " Neighbours whose seed ranges overlap (order within seed noise): " + ", ".join(close) + "."
    if mismatched:  # (the parameter check is the table's own column)
        note += " " + " ".join(w.replace("warning: seed", "Seed") + "." for w in mismatched)
    name, title = (("ladder.md", "Family ladder: every family's tiny preset at equal tokens") if ladder else
                   ("lm_comparison.md", "Language modelling: validation perplexity at equal tokens"))
    path = write_results(name, title, cmd, body, f"{note} {args.note}".rstrip())
    with open(path.removesuffix(".md") + ".jsonl", "w") as f:  # the runs, for `--rows` to re-render or extend
        f.writelines(json.dumps(r) + "\n" for r in runs)
    print(path)


if __name__ == "__main__":
    main()
