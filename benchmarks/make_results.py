"""`make results`: turn the workdirs' `eval/*.json` (what `nlearn-eval --task=...` writes) into results/*.md
tables and plots.

  python benchmarks/make_results.py                          # every runs/*/ and runs/*/*/ with eval/*.json
  python benchmarks/make_results.py 'runs/niah/*' runs/lm --out=results

For the tasks it finds it writes niah.md (accuracy by length, and a length x depth heatmap per run,
niah_<label>.png), babilong.md (accuracy by qa task and length), per_position.md (every run's loss-by-position
curve on one plot, per_position.png), lm_eval.md (`--task=perplexity`) and mqar_eval.md (`--task=mqar`). A run is
labelled by its model family (plus its directory's name when several runs share a family). niah.md and
babilong.md keep, marked †, the rows of their previous version that no run of this render replaces (workdirs live
in /tmp or on machines that are gone; their figures stay), except rows without 95% intervals, which predate
RULER-comparable scoring.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from results_md import RESULTS_DIR, write_results  # noqa: E402

DEFAULT_PATTERNS = ("runs/*", "runs/*/*")


# ----------------------------------------------------------------------------------------------
# Reading the workdirs


def read_evals(workdir: str) -> dict:
    """`{task: record}` from `workdir/eval/*.json` (samples files and non-records skipped)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(workdir, "eval", "*.json"))):
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"error: cannot read {path}: {e}") from e
        if isinstance(record, dict) and "task" in record:
            out[record["task"]] = record
    return out


def find_runs(patterns) -> list[dict]:
    """Each directory matching a pattern that holds eval records: `{"workdir", "family", "seq_len", "evals"}`."""
    runs, seen = [], set()
    for pattern in patterns:
        for workdir in sorted(glob.glob(pattern)):
            workdir = os.path.normpath(workdir)
            if workdir in seen or not os.path.isdir(workdir):
                continue
            seen.add(workdir)
            evals = read_evals(workdir)
            if not evals:
                continue
            config = next((r["config"] for r in evals.values() if isinstance(r.get("config"), dict)), {})
            family = config.get("model", {}).get("family") or next(
                (r["family"] for r in evals.values() if "family" in r), os.path.basename(workdir))
            seq_len = config.get("train", {}).get("seq_len") or next(
                (r["train_seq_len"] for r in evals.values() if "train_seq_len" in r), None)
            runs.append({"workdir": workdir, "family": family, "seq_len": seq_len, "evals": evals})
    labels = [r["family"] for r in runs]
    for r in runs:
        unique = labels.count(r["family"]) == 1
        r["label"] = r["family"] if unique else f"{r['family']} ({os.path.basename(r['workdir'])})"
    return runs


def file_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_")


def pct(x) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


# ----------------------------------------------------------------------------------------------
# NIAH


NIAH_MULTIPLES = (1, 4, 16, 32)  # prompt lengths in the table, as multiples of the run's training window


def all_families() -> list[str]:
    """Every model family: one file each in configs/."""
    return sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".py"))


def multiple(length: int, seq_len) -> str:
    """'16x' for 4096 tokens of a 256-token window; '' without a window."""
    if not seq_len:
        return ""
    m = length / int(seq_len)
    return f"{m:g}x"


def qa_table(runs: list[dict], carried: list[dict] = (), task: str = "niah") -> str:
    """Accuracy per run and variant (rows; for babilong: its qa tasks), with its 95% interval, at 1x, 4x, 16x and
    32x the run's training window (columns; other lengths scored go to the last column), after the rows
    `carried` over from the previous table (marked), then
    a "not run" row for every family without a run."""
    heads = [f"{m}x" for m in NIAH_MULTIPLES]
    out = ["| run | variant | trained at | step | " + " | ".join(heads) + " | other lengths | overall |",
           "|---|---|---|---|" + "---|" * (len(heads) + 2)]
    for c in carried:
        out += [row.replace(f"| {c['label']} |", f"| {c['label']}{CARRIED} |", 1) for row in c["rows"]]
    for r in runs:
        record = r["evals"][task]
        variants = record.get("by_variant") or {"all": record}
        for name, v in variants.items():
            by_mult, other = {}, []
            for n, acc in sorted(v.get("by_length", {}).items(), key=lambda kv: int(kv[0])):
                m = multiple(int(n), r["seq_len"])
                ci = v.get("ci95_by_length", {}).get(n)
                interval = f" [{pct(ci[0])}, {pct(ci[1])}]" if ci else ""
                if m in heads:
                    by_mult[m] = f"{pct(acc)}{interval} ({n})"
                else:
                    other.append(f"{n}: {pct(acc)}")
            cells = [by_mult.get(h, "") for h in heads] + [", ".join(other)]
            out.append(f"| {r['label']} | {name} | {r['seq_len'] or '?'} | {record.get('step', '')} | "
                       + " | ".join(cells) + f" | {pct(v.get('accuracy'))} |")
    done = {r["family"] for r in [*runs, *carried]}
    for family in all_families():
        if family not in done:
            out.append(f"| {family} | not run |  |  | " + " | ".join("" for _ in heads) + " |  |  |")
    return "\n".join(out)


def niah_heatmap(label: str, record: dict, path: str) -> str:
    """Accuracy by prompt length (rows) and needle depth (columns), all variants together."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = record.get("by_length_depth", {})
    lengths = sorted(grid, key=int)
    depths = sorted({d for row in grid.values() for d in row}, key=float)
    acc = np.array([[grid[n].get(d, np.nan) for d in depths] for n in lengths], float)
    fig, ax = plt.subplots(figsize=(1.2 + 0.6 * len(depths), 1.0 + 0.4 * len(lengths)))
    ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i in range(len(lengths)):
        for j in range(len(depths)):
            if not np.isnan(acc[i, j]):
                ax.text(j, i, f"{100 * acc[i, j]:.0f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(depths)), [f"{d}%" for d in depths], fontsize=7)
    ax.set_yticks(range(len(lengths)), lengths, fontsize=7)
    ax.set(xlabel="needle depth", ylabel="prompt tokens", title=f"{label}: NIAH accuracy")
    ax.title.set_fontsize(8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


# Where a run writes and runs, not what it trains (a section, or one dotted key).
RUN_KEYS_IGNORED = ("workdir", "checkpoint", "logging", "wandb", "mesh", "data.cache_dir")


def flat(node, prefix: str = "") -> dict:
    """{"a.b.c": leaf as JSON} of a nested dict (JSON: a config's tuples compare equal to a record's lists)."""
    out = {}
    for key, value in node.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value)
    return out


def preset_overrides(family: str, config: dict) -> list[str]:
    """`--config.KEY=VALUE` flags that turn today's `benchmarks/configs/niah.py:<family>` into the run's `config`
    (keys the run's record lacks are skipped: they did not exist when it ran); None if the preset does not load."""
    import importlib.util

    path = os.path.join(ROOT, "benchmarks", "configs", "niah.py")
    spec = importlib.util.spec_from_file_location("nlearn_config_niah_results", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        preset = flat(module.get_config(family).to_dict())
    except Exception:  # noqa: BLE001 - a family the preset cannot build: no flags to show
        return None
    ran = flat(config)
    return [f"--config.{k}={flag_value(json.loads(ran[k]))}" for k in sorted(ran)
            if k in preset and ran[k] != preset[k]
            and not any(k == ignored or k.startswith(ignored + ".") for ignored in RUN_KEYS_IGNORED)]


def flag_value(value) -> str:
    """A config value as a --config flag takes it (False, 0.2, text; lists as JSON)."""
    if isinstance(value, (str, bool, int, float)):
        return str(value)
    return json.dumps(value)


def qa_commands(runs: list[dict], task: str = "niah") -> str:
    """The training and scoring command of each run, as its eval record has them."""
    lines = []
    for r in runs:
        record = r["evals"][task]
        params = record.get("parameters", {})
        flags = [f"--workdir={r['workdir']}", f"--task={task}"]
        if params.get("variant"):
            flags.append(f"--variant={params['variant']}")
        if params.get("lengths"):
            flags.append("--lengths=" + ",".join(str(n) for n in params["lengths"]))
        if params.get("samples"):
            flags.append(f"--samples={params['samples']}")
        overrides = preset_overrides(r["family"], record.get("config", {}))
        train = " ".join([f"--config=benchmarks/configs/niah.py:{r['family']}", f"--workdir={r['workdir']}"]
                         + (overrides or []))
        unmatched = "" if overrides is not None else "  # not from benchmarks/configs/niah.py"
        lines.append(f"    nlearn-train {train}" + unmatched
                     + f"\n    nlearn-eval {' '.join(flags)}")
        note = os.path.join(r["workdir"], "note.txt")  # what the commands cannot say (a resumed run, ...)
        if os.path.exists(note):
            with open(note) as f:
                lines.append("    # " + " ".join(f.read().split()))
    return "\n".join(lines)


CARRIED = " †"  # after the label of a row carried over from the previous niah.md


def row_label(row: str) -> str:
    """The run label of a niah.md table row, without the carried-over mark."""
    return row.split(" | ")[0][2:].removesuffix(CARRIED.strip()).strip()


def earlier_qa_runs(path: str) -> list[dict]:
    """The runs an existing niah.md or babilong.md shows, `{"label", "family", "workdir", "rows", "commands",
    "image"}`, read back from its command block, table and image lines: the only place their figures survive once
    a workdir is gone (workdirs live in /tmp or on machines that are given back)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        text = f.read()
    groups = []  # one per run: its indented command lines ("nlearn-train", "nlearn-eval", "# note")
    for line in text.splitlines():
        if line.startswith("    nlearn-train "):
            groups.append([line])
        elif groups and line.startswith("    "):
            groups[-1].append(line)
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| run |")
            and "| not run |" not in line]
    images = {m.group(1): m.group(0) for m in re.finditer(r"!\[([^\]]*)\]\(([^)]*)\)", text)}
    earlier = []
    for group in groups:
        family = re.search(r"--config=\S+\.py:(\S+)", group[0])
        workdir = re.search(r"--workdir=(\S+)", group[0])
        if not family or not workdir:
            continue
        family, workdir = family.group(1), os.path.normpath(workdir.group(1))
        # A run relabelled by its directory owns that label; the family's bare label only where it has none.
        by_dir = f"{family} ({os.path.basename(workdir)})"
        mine = ([row for row in rows if row_label(row) == by_dir]
                or [row for row in rows if row_label(row) == family])
        if not mine:
            continue
        label = row_label(mine[0])
        earlier.append({"label": label, "family": family, "workdir": workdir, "image": images.get(label, ""),
                        "rows": [row.replace(f"| {label}{CARRIED} |", f"| {label} |", 1) for row in mine],
                        "commands": group})
    return earlier


def carried_qa_runs(path: str, live: list[dict]) -> list[dict]:
    """The runs of an existing table that no run of this render replaces: only a run of the same workdir
    does, or one of the same directory name and family (a workdir copied elsewhere). A live run whose short
    label an earlier run of another workdir holds is relabelled with its directory's name first, so a new run
    of a family never takes the place of that family's earlier row. Rows without 95% intervals (scored
    before RULER-comparable scoring) are not carried. Delete the file to start afresh."""
    earlier = earlier_qa_runs(path)
    for r in live:
        workdir = os.path.normpath(r["workdir"])
        if any(e["label"] == r["label"] and e["workdir"] != workdir for e in earlier):
            r["label"] = f"{r['family']} ({os.path.basename(workdir)})"
    live_dirs = {os.path.normpath(r["workdir"]) for r in live}
    live_labels = {r["label"] for r in live}
    return [e for e in earlier if e["workdir"] not in live_dirs and e["label"] not in live_labels
            and all("[" in row for row in e["rows"])]


# task: (file, title, what the heatmaps show; "" for none)
QA_TABLES = {
    "niah": ("niah.md", "Needle in a haystack", "length x needle depth, all variants"),
    "babilong": ("babilong.md", "BABILong-style qa (nlearn's bAbI simulator in held-out corpus text)", ""),
}


def write_qa(runs: list[dict], out_dir: str, command: str, task: str) -> list[str]:
    """The accuracy table of `task` (niah or babilong), its heatmaps and every run's commands."""
    runs = [r for r in runs if task in r["evals"]]
    if not runs:
        return []
    filename, title, heatmaps = QA_TABLES[task]
    carried = carried_qa_runs(os.path.join(out_dir, filename), runs)
    images = [c["image"] for c in carried if c["image"]]
    if heatmaps:
        for r in runs:
            name = f"{task}_{file_label(r['label'])}.png"
            niah_heatmap(r["label"], r["evals"][task], os.path.join(out_dir, name))
            images.append(f"![{r['label']}]({name})")
    scoring = runs[0]["evals"][task].get("scoring", "")
    commands = [line for c in carried for line in c["commands"]]
    note = ("Accuracy at 1x, 4x, 16x and 32x the run's training window (\"trained at\", tokens; the prompt length "
            "in brackets, reply included as RULER counts it) with its 95% interval"
            + (f"; scoring: {scoring}" if scoring else "") + "."
            + (f" Heatmaps: {heatmaps}." if heatmaps else "")
            + (f" Rows marked{CARRIED} are kept from an earlier render whose workdirs this one did not read."
               if carried else "")
            + " The runs:\n\n" + "\n".join(commands + [qa_commands(runs, task)]))
    table = qa_table(runs, carried, task) + ("\n\n" + "\n".join(images) if images else "")
    return [write_results(filename, title, command, table, note, directory=out_dir)]


# ----------------------------------------------------------------------------------------------
# Loss by position


def per_position_table(runs: list[dict]) -> str:
    out = ["| run | step | training tokens | trained at | positions | documents | loss within window | beyond window | "
           "inner loss before / after write |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        e = r["evals"]["per_position"]
        inner = e.get("inner_loss")
        inner = "" if not inner else f"{inner['mean_before']:.3f} / {inner['mean_after']:.3f}"
        beyond = e.get("beyond_window_loss")
        beyond = "" if beyond is None else f"{beyond:.3f}"
        seen = tokens_seen(e)
        out.append(f"| {r['label']} | {e.get('step', '')} | {'' if seen is None else f'{seen:,}'} | "
                   f"{e.get('train_seq_len', r['seq_len'])} | {e['length']} | "
                   f"{e['documents']} ({e.get('source', '')}) | {e['within_window_loss']:.3f} | "
                   f"{beyond} | {inner} |")
    return "\n".join(out)


def write_per_position(runs: list[dict], out_dir: str, command: str) -> list[str]:
    from nlearn.eval.tasks.per_position import plot_loss_by_position

    runs = [r for r in runs if "per_position" in r["evals"]]
    if not runs:
        return []
    plot_loss_by_position({r["label"]: r["evals"]["per_position"] for r in runs},
                          os.path.join(out_dir, "per_position.png"), "Loss by position, held-out documents")
    note = ("Mean next-token loss (nats) by token position over held-out documents fed from their first token "
            "through the streaming state; bands: 95% over documents; dashed: the training window. Inner loss: "
            "each memory layer's own objective on its (k_t, v_t) before and after the token's write, mean over "
            "heads and layers.")
    table = per_position_table(runs) + "\n\n![loss by position](per_position.png)"
    return [write_results("per_position.md", "Loss by position", command, table, note, directory=out_dir)]


# ----------------------------------------------------------------------------------------------
# Perplexity and MQAR


def tokens_seen(record: dict):
    train = record.get("config", {}).get("train", {})
    if not train:
        return None
    return int(record["step"]) * int(train["batch_size"]) * int(train["seq_len"])


def metric_table(runs: list[dict], task: str, columns: list[tuple[str, str]]) -> str:
    """One row per run: label, step, training tokens, then `(header, key)` columns of its eval record."""
    out = ["| run | step | training tokens | " + " | ".join(h for h, _ in columns) + " |",
           "|---|---|---|" + "---|" * len(columns)]
    for r in runs:
        e = r["evals"][task]
        seen = tokens_seen(e)
        cells = []
        for _, key in columns:
            value = e.get(key)
            cells.append("" if value is None else (pct(value) if "accuracy" in key else f"{value:.3f}"))
        out.append(f"| {r['label']} | {e.get('step', '')} | {'' if seen is None else f'{seen:,}'} | "
                   + " | ".join(cells) + " |")
    return "\n".join(out)


def write_metric_tables(runs: list[dict], out_dir: str, command: str) -> list[str]:
    written = []
    lm = [r for r in runs if "perplexity" in r["evals"]]
    if lm:
        table = metric_table(lm, "perplexity", [("validation loss", "loss"), ("perplexity", "perplexity")])
        written.append(write_results("lm_eval.md", "Language modelling: validation perplexity of the checkpoints",
                                     command, table, "From `nlearn-eval --task=perplexity` of each workdir.",
                                     directory=out_dir))
    mqar = [r for r in runs if "mqar" in r["evals"]]
    if mqar:
        key = "mqar_accuracy" if all("mqar_accuracy" in r["evals"]["mqar"] for r in mqar) else "accuracy"
        table = metric_table(mqar, "mqar", [("MQAR accuracy", key)])
        written.append(write_results("mqar_eval.md", "MQAR: recall of the checkpoints", command, table,
                                     "From `nlearn-eval --task=mqar` of each workdir.", directory=out_dir))
    return written


def main(argv=None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdirs", nargs="*", help=f"workdir globs (default: {' '.join(DEFAULT_PATTERNS)})")
    parser.add_argument("--out", default=RESULTS_DIR, help="directory of the tables and plots (default results/)")
    args = parser.parse_args(argv)
    patterns = args.workdirs or [os.path.join(ROOT, p) for p in DEFAULT_PATTERNS]
    runs = find_runs(patterns)
    if not runs:
        raise SystemExit(f"error: no eval/*.json in {' '.join(patterns)}; run nlearn-eval --task=... on a workdir "
                         "first")
    os.makedirs(args.out, exist_ok=True)
    command = "make results" if not args.workdirs else "python benchmarks/make_results.py " + " ".join(args.workdirs)
    written = (write_qa(runs, args.out, command, "niah") + write_qa(runs, args.out, command, "babilong")
               + write_per_position(runs, args.out, command)
               + write_metric_tables(runs, args.out, command))
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
