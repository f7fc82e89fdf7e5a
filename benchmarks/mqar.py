"""`make mqar`: train every family on the common MQAR task and write results/mqar.md.

Each family runs `benchmarks/configs/mqar.py:<family>` in its own process (a fresh workdir under runs/mqar).
The budget is the preset's step count or `benchmarks/configs/mqar.py`'s TIME_LIMIT_S of wall time (a family's own
FAMILY_TIME_LIMIT_S where it has one), whichever comes first: at the limit the trainer gets SIGTERM, saves a
checkpoint and exits. Every run's last checkpoint is then scored by `nlearn-eval` (the trainer skips its own
final evaluation, so scoring is not charged to the budget). The table reports accuracy on the answers,
parameter count, the training process's wall time (start-up, compilation and checkpoints included) and the
steps it reached.
Each family trains once per seed (`--seeds`, default 0,1,2; `train.seed`) and its row gives the median accuracy
with every seed's figure. Runs of one seed can go to another process (`--seeds=2 --print-only`) and be
collected afterwards with `--reuse`.
`--merge` trains only the given families and puts their rows into the existing results/mqar.md (replacing
a family's old row), with one line under the table saying where and when each merged row was made.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from nlearn.config import base_config  # noqa: E402
from nlearn.tasks.curriculum import parse_curriculum  # noqa: E402
from results_md import RESULTS_DIR, machine, write_results  # noqa: E402

DEFAULT_FAMILIES = ("deltanet", "titans_lmm", "titans_mac", "linear_attention", "transformer")


def mqar_presets():
    """The `benchmarks/configs/mqar.py` module (not a package: loaded by path)."""
    spec = importlib.util.spec_from_file_location(
        "nlearn_config_mqar", os.path.join(ROOT, "benchmarks", "configs", "mqar.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def preset_fingerprint(presets, family: str, extra: list[str]) -> str:
    """A short hash of the family's resolved MQAR config plus extra overrides: `--reuse` keeps a
    row only when it was trained from the same preset."""
    resolved = presets.get_config(family).to_dict()
    if resolved["train"].get("schedule") == "cosine":
        # The cosine schedule is what runs did before the schedule keys existed (and ignores
        # decay_fraction): hash such a config as before, so their rows stay reusable.
        resolved["train"].pop("schedule")
        resolved["train"].pop("decay_fraction", None)
    if not resolved["train"].get("time_budget_s"):  # no budget: hash as before the key existed
        resolved["train"].pop("time_budget_s", None)
    if not resolved["data"]["mqar"].get("query_start"):  # the default layout: likewise
        resolved["data"]["mqar"].pop("query_start", None)
    config = json.dumps(resolved, sort_keys=True, default=str)
    return hashlib.sha1((config + "\0" + "\0".join(extra)).encode()).hexdigest()[:12]


def last_json(text: str) -> dict:
    """The last stdout line that parses as a JSON object."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output")


def run_family(family: str, workdir: str, extra: list[str], time_limit_s: float) -> dict:
    """Train `family` within the budget and score it; a dict for one table row."""
    cmd = [sys.executable, "-m", "nlearn.cli.train", f"--config=benchmarks/configs/mqar.py:{family}",
           f"--workdir={workdir}", "--config.logging.wandb_mode=disabled", "--config.train.final_eval=False",
           *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = False
    try:
        out, err = proc.communicate(timeout=time_limit_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the trainer saves a checkpoint at the current step
        out, err = proc.communicate()
        stopped = True
    seconds = time.perf_counter() - start
    params = [line for line in out.splitlines() if "M parameters" in line]
    # A run stopped at the limit is scored from its newest checkpoint even if the stop itself failed.
    if not params or (proc.returncode != 0 and not stopped):
        return {"family": family, "error": (err.strip().splitlines() or ["?"])[-1]}
    params = params[0].split(":")[1].split("M")[0]
    eval_path = os.path.join(workdir, "eval.json")
    if os.path.exists(eval_path):  # a run trained with its own final evaluation
        result = json.load(open(eval_path))
    else:  # score the newest checkpoint (the last step's, or the one saved at the time limit)
        ev = subprocess.run([sys.executable, "-m", "nlearn.cli.eval", f"--workdir={workdir}"], cwd=ROOT,
                            capture_output=True, text=True)
        if ev.returncode != 0:
            return {"family": family, "error": (ev.stderr.strip().splitlines() or ["?"])[-1]}
        result = last_json(ev.stdout)
    with open(os.path.join(workdir, "config.json")) as f:  # the run's resolved config, overrides included
        steps_total = steps_configured = int(json.load(f)["train"]["steps"])
    budget_path = os.path.join(workdir, "budget.json")  # a time-budgeted run's chosen total
    if os.path.exists(budget_path):
        with open(budget_path) as f:
            steps_total = int(json.load(f)["planned_steps"])
    return {"family": family, "accuracy": result["mqar_accuracy"], "params_m": float(params),
            "train_seconds": seconds, "step": int(result["step"]), "stopped_at_limit": stopped,
            "steps_total": steps_total, "steps_configured": steps_configured}


def seed_row(family: str, runs: list[dict]) -> dict:
    """One family's table row from its runs over seeds: the median accuracy and each seed's."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return {"family": family, "error": f"seed {failed[0]['seed']}: {failed[0]['error']}"}
    middle = sorted(runs, key=lambda r: r["accuracy"])[(len(runs) - 1) // 2]  # the median run (lower of two)
    return {**middle, "family": family, "accuracy": statistics.median(r["accuracy"] for r in runs),
            "seeds": {r["seed"]: r["accuracy"] for r in runs}}


def table(rows: list[dict], steps: int) -> str:
    """The results table; `steps` is the common budget, for rows that do not carry their own. Training time and
    steps are the median-accuracy run's."""
    out = ["| family | MQAR accuracy (median) | by seed | parameters | training time | steps |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['family']} | failed: {r['error']} | | | | |")
        else:
            total = r.get("steps_total", steps)
            reached = f"{r['step']} of {total}" + (" (time limit)" if r["stopped_at_limit"] else "")
            if r.get("steps_configured", total) > total:
                reached += f" (time budget; preset {r['steps_configured']})"
            by_seed = sorted(r.get("seeds", {}).items())
            seeds = (" / ".join(f"{100 * a:.1f}" for _, a in by_seed) + "% (seeds "
                     + ",".join(str(s) for s, _ in by_seed) + ")") if by_seed else ""
            out.append(f"| {r['family']} | {100 * r['accuracy']:.1f}% | {seeds} | "
                       f"{r['params_m']:.2f}M | {r['train_seconds'] / 60:.1f} min | {reached} |")
    return "\n".join(out)


def run_limits(presets, family: str, runs: list[dict]) -> str:
    """A merged row's note on runs that trained under another wall-time limit than the preset's (`--time-limit`)."""
    own = sorted({r["time_limit_s"] for r in runs if r.get("time_limit_s")} - {time_limit(presets, family, None)})
    if not own:
        return ""
    return f" Its runs' wall-time limit (`--time-limit`): {', '.join(f'{x / 60:g} minutes' for x in own)}."


def merge_rows(text: str, body: str, stamp: str) -> str:
    """`text` (a results file) with the rows of table `body` put in its table, each replacing the row of
    the same family or appended, and `stamp` ("<family>: ...") under the table, replacing an older stamp of
    that family."""
    lines = text.rstrip("\n").split("\n")
    rows = body.strip().split("\n")[2:]
    table = [i for i, line in enumerate(lines) if line.startswith("|")]
    if len(table) < 2:
        raise ValueError("no table to merge into")
    for row in rows:
        family = row.split("|")[1].strip()
        same = [i for i in table[2:] if lines[i].split("|")[1].strip() == family]
        if same:
            lines[same[0]] = row
        else:
            table.append(table[-1] + 1)
            lines.insert(table[-1], row)
    end = table[-1] + 1
    family = stamp.split(":")[0]
    stamps = [i for i in range(end, len(lines)) if lines[i].startswith("Merged row ")]
    same = [i for i in stamps if lines[i].startswith(f"Merged row {family}:")]
    if same:
        lines[same[0]] = f"Merged row {stamp}"
    elif stamps:
        lines.insert(stamps[-1] + 1, f"Merged row {stamp}")
    else:  # a paragraph of its own under the table
        lines[end:end] = ["", f"Merged row {stamp}"]
    return "\n".join(lines) + "\n"


def schedule(budget: dict) -> str:
    ratio = budget.get("min_lr_ratio", 0.0)
    if ratio == 1.0:
        return ", constant after warmup"
    if budget.get("schedule") == "wsd":
        return (f", constant after warmup, then linear to {ratio:g}x over the last "
                f"{budget.get('decay_fraction', base_config().train.decay_fraction):.0%} of the steps")
    return f", cosine to {ratio:g}x after warmup"


def curriculum_note(spec: str, batch_size: int, seq_len: int) -> str:
    """' Curriculum: the first N steps of B windows of L tokens with P pairs, then ...' (or '')."""
    if not spec:
        return ""
    parts = [f"{s.steps} steps of {batch_size * seq_len // s.seq_len} windows of {s.seq_len} tokens "
             f"with {s.num_pairs} pairs"
             + (f" queried from position {s.query_start} on" if s.query_start else "")
             for s in parse_curriculum(spec, seq_len)]
    return (" Curriculum: the first " + ", then ".join(parts) + " (the same tokens per step); "
            "evaluation is on the task only.")


def time_limit(presets, family: str, override: float | None = None) -> float:
    """Seconds of wall time for `family`: --time-limit, else the family's own cap, else TIME_LIMIT_S."""
    return override or presets.FAMILY_TIME_LIMIT_S.get(family, presets.TIME_LIMIT_S)


def own_limits(presets, families: list[str]) -> str:
    """' Per-family wall-time limits: family N minutes; ...' for those of `families` that have one, else ''."""
    chosen = [f"{f} {presets.FAMILY_TIME_LIMIT_S[f] / 60:g} minutes" for f in families
              if f in presets.FAMILY_TIME_LIMIT_S]
    return f" Per-family wall-time limits: {'; '.join(chosen)}." if chosen else ""


def note(presets, families: list[str], time_limit_s: float, load: str) -> str:
    """The paragraph above the table: task and budget, from benchmarks/configs/mqar.py."""
    task, model, budget = presets.TASK, presets.MODEL, presets.BUDGET
    text = (f"Task: T={task['seq_len']}, {task['num_pairs']} "
            f"pairs, vocabulary {task['vocab_size']}; model: {model['num_layers']} layers, "
            f"d_model={model['d_model']}, {model['num_heads']} heads, SwiGLU width {model['mlp_dim']}; "
            f"budget: {budget['steps']} steps of {budget['batch_size']} sequences (lr {budget['lr']:g}"
            f"{schedule(budget)}) or "
            f"{time_limit_s / 60:g} minutes of wall time, whichever comes first (start-up, compilation and "
            f"checkpoints count; scoring the last checkpoint afterwards does not). "
            f"Accuracy over {task['eval_examples']} held-out examples."
            f"{curriculum_note(presets.CURRICULUM, budget['batch_size'], task['seq_len'])}")
    text += per_family("Per-family overrides", presets.FAMILY_OVERRIDES, families)
    text += per_family("Per-family training", presets.FAMILY_TRAINING, families)
    return text + own_limits(presets, families) + f" Load average {load} at the end."


def per_family(label: str, by_family: dict[str, dict], families: list[str]) -> str:
    """' <label>: family: key=value, ...; ...' for those of `families` that have any, else ''."""
    chosen = {f: by_family[f] for f in families if f in by_family}
    if not chosen:
        return ""
    return f" {label}: " + "; ".join(
        f"{f}: {', '.join(f'{k}={v}' for k, v in o.items())}" for f, o in chosen.items()) + "."


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--families", default=",".join(DEFAULT_FAMILIES))
    parser.add_argument("--seeds", default="0,1,2", help="train.seed of each run; a row gives their median")
    parser.add_argument("--workdir", default=os.path.join(ROOT, "runs", "mqar"))
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds of wall time per family (default: benchmarks/configs/mqar.py "
                             "FAMILY_TIME_LIMIT_S, else TIME_LIMIT_S)")
    parser.add_argument("--print-only", action="store_true", help="print the table, write no results file")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the row of a family whose workdir holds a row.json trained from the "
                             "same preset (no retraining)")
    parser.add_argument("--merge", action="store_true",
                        help="put the given families' rows into the existing results/mqar.md instead of "
                             "rewriting it")
    parser.add_argument("overrides", nargs="*", help="extra --config.* overrides for every family")
    args = parser.parse_args()
    presets = mqar_presets()
    limit = args.time_limit or presets.TIME_LIMIT_S  # the table's note; families with their own cap say so
    families = args.families.split(",")
    seeds = [int(x) for x in args.seeds.split(",")]
    rows, reused, runs_of = [], [], {}
    for family in families:
        runs = []
        for seed in seeds:
            workdir = os.path.join(args.workdir, family, f"seed{seed}")
            extra = [f"--config.train.seed={seed}", *args.overrides]
            row_path = os.path.join(workdir, "row.json")
            fingerprint = preset_fingerprint(presets, family, extra)
            row = json.load(open(row_path)) if args.reuse and os.path.exists(row_path) else None
            if row is not None and row.get("preset") != fingerprint:
                print(f"{row_path} was trained from another preset; training {family} again", flush=True)
                row = None
            if row is not None:
                reused.append(f"{family} seed {seed}")
            else:
                subprocess.run(["rm", "-rf", workdir])
                seconds = time_limit(presets, family, args.time_limit)
                row = {**run_family(family, workdir, extra, seconds), "preset": fingerprint, "seed": seed,
                       "time_limit_s": seconds}
                os.makedirs(workdir, exist_ok=True)
                with open(row_path, "w") as f:
                    json.dump(row, f)
            runs.append(row)
            print(json.dumps(row), flush=True)
        rows.append(seed_row(family, runs))
        runs_of[family] = runs
    body = table(rows, presets.BUDGET["steps"])
    print(body)
    if args.merge and not args.print_only and not args.overrides:
        path = os.path.join(RESULTS_DIR, "mqar.md")
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        text = open(path).read()
        for family, row in zip(families, body.split("\n")[2:]):
            settings = per_family("settings", presets.FAMILY_OVERRIDES, [family]) + per_family(
                "training", presets.FAMILY_TRAINING, [family]) + own_limits(presets, [family])
            seeds_flag = f" --seeds={args.seeds}" if args.seeds != "0,1,2" else ""
            stamp = (f"{family}: `python benchmarks/mqar.py --families={family}{seeds_flag} --merge` on {machine()}, "
                     f"{date}, load average {load} at the end.{settings}{run_limits(presets, family, runs_of[family])}")
            text = merge_rows(text, "\n".join(body.split("\n")[:2] + [row]), stamp)
        with open(path, "w") as f:
            f.write(text)
        print(path)
    elif not args.print_only and not args.overrides:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        text = note(presets, families, limit, load) + (
            f" Each row trains seeds {args.seeds} (`train.seed`): the median accuracy, each seed's, and the median "
            "run's time and steps.")
        if reused:
            text += f" Runs reused from earlier invocations (`--reuse`): {', '.join(reused)}."
        command = f"python benchmarks/mqar.py --families={','.join(families)}" + (
            f" --seeds={args.seeds}" if args.seeds != "0,1,2" else "")
        print(write_results("mqar.md", "MQAR: multi-query associative recall", command, body, text))


if __name__ == "__main__":
    main()
