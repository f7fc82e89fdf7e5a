"""Does every family's paper preset fit a TPU pod slice, and how fast would a step be? Compiles each
(family, preset, topology)'s real train step on this CPU machine with `nlearn-compile` and writes
results/pod_fit.md (rows kept in results/pod_fit.jsonl, so a killed run resumes where it stopped).

  python benchmarks/pod_fit.py                       # every family at 340m/350m and 760m, v5e:4x4 and v5p:2x2x1
  python benchmarks/pod_fit.py --families=hope --topologies=v5e:2x2 --per_chip_batch=1
  python benchmarks/pod_fit.py --render_only

Each row: bf16 compute, remat on, scanned layers, `mesh.fsdp` = every chip (docs/pod.md's suggestion
within a slice), `train.batch_size` = per_chip_batch x chips at `train.seq_len`.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("transformer", "linear_attention", "deltanet", "gated_deltanet", "ttt_linear", "ttt_mlp", "titans_lmm",
            "titans_mac", "titans_mag", "titans_mal", "self_ref_titans", "hope")
SIZE_NAMES = {"340m": ("340m", "350m"), "760m": ("760m",)}  # TTT's papers name their 340m-class model 350m

_FAMILIES = flags.DEFINE_list("families", list(FAMILIES), "Families to compile.")
_SIZES = flags.DEFINE_list("sizes", ["340m", "760m"], "Preset sizes (340m also picks TTT's 350m).")
_TOPOLOGIES = flags.DEFINE_list("topologies", ["v5e:4x4", "v5p:2x2x1"], "TPU topologies (nlearn-compile's --topology).")
_PER_CHIP = flags.DEFINE_integer("per_chip_batch", 4, "Sequences per chip per step (train.batch_size / chips).")
_SEQ = flags.DEFINE_integer("seq_len", 2048, "Tokens per sequence.")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 1800, "Seconds one compile may take before its row records a timeout.")
_JSONL = flags.DEFINE_string("jsonl", os.path.join(ROOT, "results", "pod_fit.jsonl"), "Rows, one JSON per line.")
_OUT = flags.DEFINE_string("out", os.path.join(ROOT, "results", "pod_fit.md"), "The markdown table.")
_RENDER = flags.DEFINE_bool("render_only", False, "Only rewrite the table from the JSONL.")


def family_module(family: str):
    """`configs/<family>.py` as a module (configs/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"nlearn_pod_fit_{family}", os.path.join(ROOT, "configs",
                                                                                           f"{family}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def preset_of(family: str, size: str) -> str | None:
    presets = family_module(family).PRESETS
    return next((p for p in SIZE_NAMES[size] if p in presets), None)


def chips(topology: str) -> int:
    n = 1
    for d in topology.split(":")[1].split("x"):
        n *= int(d)
    return n


def run_row(family: str, preset: str, topology: str) -> dict:
    n = chips(topology)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, "-m", "nlearn.cli.compile", f"--config=configs/{family}.py:{preset}",
               f"--topology={topology}", f"--json={out}", "--nofit", "--config.model.dtype=bfloat16",
               "--config.model.remat=True", "--config.model.scan_layers=True", "--config.mesh.data=1",
               f"--config.mesh.fsdp={n}", f"--config.train.batch_size={_PER_CHIP.value * n}",
               f"--config.train.seq_len={_SEQ.value}"]
        began = time.time()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=_TIMEOUT.value)
        except subprocess.TimeoutExpired:
            return dict(family=family, preset=preset, topology=topology, per_chip=_PER_CHIP.value,
                        error=f"timeout after {_TIMEOUT.value} s")
        if os.path.exists(out):
            with open(out) as f:
                row = json.loads(f.read().splitlines()[-1])
        else:
            tail = [line for line in proc.stderr.splitlines() if line.strip()][-1:] or ["no output"]
            row = dict(family=family, error=tail[0][:300])
    row.update(preset=preset, topology=topology, per_chip=_PER_CHIP.value, wall_s=time.time() - began)
    return row


def row_key(row: dict) -> tuple:
    """A row's identity: family, preset, topology and sequences per chip."""
    per_chip = row.get("per_chip") or (row["batch"] // row["devices"] if row.get("batch") else _PER_CHIP.value)
    return row["family"], row["preset"], row["topology"], per_chip


def _gib(x) -> str:
    return "" if x is None else f"{x / 2**30:.2f}"


PAPER_BATCH = 256  # sequences per optimizer step at the paper-size presets (nlearn/presets.py)


def slice_name(topology: str) -> str:
    """Cloud TPU's name of a slice: v5e counts chips, v4/v5p count TensorCores (two a chip)."""
    chip = topology.split(":")[0]
    return f"{chip}-{chips(topology) * (1 if chip in ('v5e', 'v6e') else 2)}"


def recommendations(rows: list[dict]) -> list[str]:
    """Per preset: the first measured slice (v5e before v5p, more sequences per chip first) whose step fits, with
    the `train.grad_accum` that keeps the paper batch."""
    out = ["Recommended mesh per preset (the first measured row that fits; v5e before v5p, fsdp over every chip):",
           "", "| preset | slice | mesh | sequences per chip | train.grad_accum | total GiB per chip |",
           "|---|---|---|---|---|---|"]
    presets = sorted({(r["family"], r["preset"]) for r in rows},
                     key=lambda fp: (FAMILIES.index(fp[0]) if fp[0] in FAMILIES else 99, fp[1]))
    for family, preset in presets:
        fitting = sorted((r for r in rows if (r["family"], r["preset"]) == (family, preset) and r.get("fits")),
                         key=lambda r: (not r["topology"].startswith("v5e"), -(r["batch"] // r["devices"])))
        if not fitting:
            out.append(f"| {family}:{preset} | none measured fits | | | | |")
            continue
        r = fitting[0]
        per_chip = r["batch"] // r["devices"]
        out.append(f"| {family}:{preset} | {slice_name(r['topology'])} (`{r['topology']}`) | fsdp={r['devices']} "
                   f"| {per_chip} | {max(1, PAPER_BATCH // r['batch'])} | {_gib(r['total_bytes'])} |")
    return out


def first_pass_rows(rows: list[dict]) -> list[str]:
    """Hope's pass 1 (sequential passes over 16-token chunks) against the estimated step, per Hope row."""
    from nlearn.models.hope import first_pass_traffic
    from nlearn.train.compile import CHIPS

    out = ["Hope's first pass: `T / min(cms.periods) - 1` sequential whole-model passes per window, each reading "
           "every weight (forward and backward) and every sequence's float32 `Δ` (read twice, written once); "
           "memory-bound, so its time is at least these bytes at HBM bandwidth (nlearn.models.hope."
           "first_pass_traffic), added to the rest's roofline in the estimated step. Each preset's second row: "
           "the documented cheaper setting, periods 4x longer (a quarter of the passes; the rest of the step as "
           "compiled).", "",
           "| preset | topology | seqs/chip | passes | GB per chip | pass 1 ms (at least) | est. step ms | share |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["family"] != "hope" or not r.get("n_params"):
            continue
        cfg = family_module("hope").get_config(r["preset"]).model
        per_chip = row_key(r)[3]
        passes, traffic = first_pass_traffic(cfg, r["n_params"], r["seq_len"], per_chip)
        ms = traffic / CHIPS[r["topology"].split(":")[0]].hbm_bytes_per_s * 1e3
        step = (r.get("step_time_s") or 0) * 1e3 + (0 if "serial_time_s" in r else ms)  # rows before it: add it
        out.append(f"| {r['preset']} | {r['topology']} | {per_chip} | {passes} | {traffic / 1e9:.0f} | {ms:.0f} "
                   f"| {step:.0f} | {ms / step:.0%} |")
        variant = cfg.copy_and_resolve_references()
        with variant.unlocked():
            variant.cms.periods = tuple(4 * p for p in cfg.cms.periods)
        v_passes, v_traffic = first_pass_traffic(variant, r["n_params"], r["seq_len"], per_chip)
        v_ms = v_traffic / CHIPS[r["topology"].split(":")[0]].hbm_bytes_per_s * 1e3
        out.append(f"| {r['preset']}, cms.periods={variant.cms.periods} | {r['topology']} | {per_chip} | {v_passes} "
                   f"| {v_traffic / 1e9:.0f} | {v_ms:.0f} | {step - ms + v_ms:.0f} | {v_ms / (step - ms + v_ms):.0%} |")
    return out


def render(rows: list[dict], command: str) -> str:
    lines = [
        "# Pod fit: every family's paper presets compiled for TPU topologies on a CPU machine",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.node() or 'this machine'}, {os.cpu_count()} CPU cores, no TPU (libtpu compiles for "
        f"the topology; `jax.experimental.topologies`), one core per compile.  ",
        f"Date: {datetime.date.today().isoformat()}  ",
        f"Setting: bf16 compute, remat on, scanned layers, mesh.fsdp = every chip, {_PER_CHIP.value} sequences of "
        f"{_SEQ.value} tokens per chip per step (the paper batch of 256 x 2048 by `train.grad_accum`).",
        "",
        "Per chip: parameters and Adam state (float32) and the compiled program's temporaries, in GiB; HBM v5e "
        "16 GiB, v5p 95 GiB. FLOPs: the program's matmuls with every loop counted by its trip count (XLA's "
        "`cost_analysis()` counts a loop body once), without remat, over `nlearn/train/flops.py`'s count "
        "(ratio). Step time: roofline over the chip's published bf16 peak and HBM bandwidth with remat's "
        "recompute included, collectives not counted; MFU = flops.py's FLOPs / (step time x peak).",
        "",
        "Fits: arguments + temporaries + outputs - aliased <= HBM; XLA refuses a program whose temporaries "
        "alone exceed it (no: the compile stopped there; no*: XLA compiled it, the sum is over HBM). Ratio "
        "above 1.1 (self-referential Titans, Hope): their memory op checkpoints its own chunk scan, so the "
        "program runs that forward twice, and Hope's parallel pass rebuilds each period's CMS `Δ` from its "
        "first pass's gradient factors (an outer product per kernel); flops.py counts the model's FLOPs (with "
        "the op's checkpoints off the lowered program agrees within 4% for every family).",
        "",
        "| family | preset | topology | seqs/chip | params M | param+opt GiB | temp GiB | total GiB | fits "
        "| FLOPs/chip (XLA matmuls) | ratio to flops.py | est. step ms | est. MFU | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    size_of = {p: i for i, names in enumerate(SIZE_NAMES.values()) for p in names}
    rows = sorted(rows, key=lambda r: (size_of.get(r["preset"], 9), r["topology"] != "v5e:4x4",
                                       FAMILIES.index(r["family"]) if r["family"] in FAMILIES else 99,
                                       -row_key(r)[3]))
    for r in rows:
        if r.get("error") and r.get("temp_bytes") is None:
            lines.append(f"| {r['family']} | {r['preset']} | {r['topology']} | | | | | | error | | | | | "
                         f"{r['error'][:120]} |")
            continue
        ratio = r["model_matmul_flops"] / r["analytic_flops"] if r.get("model_matmul_flops") else None
        fits = {True: "yes", False: "**no**" if r.get("error") else "**no***", None: "?"}[r.get("fits")]
        step = r.get("step_time_s")
        lines.append(
            f"| {r['family']} | {r['preset']} | {r['topology']} | {r['batch'] // r['devices']} "
            f"| {r['n_params'] / 1e6:.0f} "
            f"| {_gib(r['param_bytes'] + r['opt_bytes'])} | {_gib(r.get('temp_bytes'))} | {_gib(r.get('total_bytes'))} "
            f"| {fits} | {r['hlo_matmul_flops']:.2e} | {'' if ratio is None else f'{ratio:.2f}'} "
            f"| {'' if step is None else f'{step * 1e3:.0f}'} "
            f"| {'' if r.get('mfu') is None else format(r['mfu'], '.0%')} "
            f"| {r.get('compile_s', 0):.0f} |")
    lines += ["", *first_pass_rows(rows), "", *recommendations(rows)]
    done = {(r["family"], r["preset"], r["topology"]) for r in rows if not r.get("error") or r.get("temp_bytes")}
    missing = [f"{f}:{p} {t}" for s in SIZE_NAMES for t in ("v5e:4x4", "v5p:2x2x1") for f in FAMILIES
               for p in [preset_of(f, s)] if p and (f, p, t) not in done]
    if missing:
        lines += ["", f"Not compiled yet ({len(missing)}; rerun the command to add them): {', '.join(missing)}."]
    return "\n".join(lines) + "\n"


def main(argv):
    rows = []
    if os.path.exists(_JSONL.value):
        with open(_JSONL.value) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    command = ("taskset -c 0 nice python benchmarks/pod_fit.py (rows missing from results/pod_fit.jsonl; "
               "--families/--sizes/--topologies pick which, --render_only rewrites the table)")
    if not _RENDER.value:
        done = {row_key(r) for r in rows}
        for size in _SIZES.value:
            for topology in _TOPOLOGIES.value:
                for family in _FAMILIES.value:
                    preset = preset_of(family, size)
                    if preset is None or (family, preset, topology, _PER_CHIP.value) in done:
                        continue
                    row = run_row(family, preset, topology)
                    rows.append(row)
                    with open(_JSONL.value, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(f"{family}:{preset} {topology}: fits {row.get('fits')} "
                          f"temp {_gib(row.get('temp_bytes'))} GiB "
                          f"({row.get('wall_s', 0):.0f} s) {row.get('error', '')[:100]}", flush=True)
                    with open(_OUT.value, "w") as f:
                        f.write(render(rows, command))
    with open(_OUT.value, "w") as f:
        f.write(render(rows, command))


if __name__ == "__main__":
    app.run(main)
