"""The one writer of `results/*.md`, shared by the experiment scripts: every file is a title, a line
saying which command made it on which machine and when, an optional note, then the table."""

from __future__ import annotations

import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nlearn.cli.common import configure_process  # noqa: E402

configure_process()  # as the console scripts: no TPU runtime errors where libtpu is installed but no TPU attached
RESULTS_DIR = os.path.join(ROOT, "results")


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), or "CPU"."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "CPU"


def machine(gflops: float | None = None) -> str:
    """'<CPU model>, <n> cores, f32 matmul <r> GFLOP/s': which machine a table came from (their speeds
    differ several-fold); `gflops` (measured now if None) is the 1024x1024 float32 matmul rate."""
    if gflops is None:
        from nlearn.train.flops import measure_matmul_gflops

        gflops = measure_matmul_gflops()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu_model()}, {cores} core{'s' if cores != 1 else ''}, f32 matmul {gflops:.0f} GFLOP/s"


def render(title: str, command: str, table: str, *, machine_text: str, date: str, note: str = "") -> str:
    """The file's text (see the module docstring)."""
    parts = [f"# {title}", f"Made by `{command}` on {machine_text}, {date}."]
    if note:
        parts.append(note.strip())
    parts.append(table.strip())
    return "\n\n".join(parts) + "\n"


def write_results(name: str, title: str, command: str, table: str, note: str = "",
                  directory: str = RESULTS_DIR) -> str:
    """Rewrite `results/<name>` whole, with this machine and today's date (UTC); returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    with open(path, "w") as f:
        f.write(render(title, command, table, machine_text=machine(), date=date, note=note))
    return path
