"""Run feedback: progress lines, a JSONL metrics file, wandb (offline without a key), a loss plot."""

from __future__ import annotations

import json
import os
import time

from absl import logging

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
    """Appends one JSON object per line to `workdir/metrics.jsonl`.

    On resume, records past the restored step (written after the last checkpoint) are dropped so
    the file reads as one uninterrupted run.
    """

    def __init__(self, workdir: str, start_step: int):
        self.path = os.path.join(workdir, METRICS_FILE)
        if os.path.exists(self.path):
            kept = [line for line in open(self.path) if line.strip()
                    and json.loads(line).get("step", 0) <= start_step]
            with open(self.path, "w") as f:
                f.writelines(kept)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Progress:
    """One line per logging interval: step, loss, tokens/s, MFU and ETA."""

    def __init__(self, total_steps: int, start_step: int, tokens_per_step: int,
                 flops_per_token: float, peak_flops: float, enabled: bool = True):
        self.total, self.tokens_per_step = total_steps, tokens_per_step
        self.flops_per_token, self.peak = flops_per_token, peak_flops
        self.enabled = enabled
        self.mark_step, self.mark_time, self.paused_s = start_step, time.perf_counter(), 0.0

    def reset_clock(self, step: int) -> None:
        """Restart the rate measurement (after compilation or an eval)."""
        now = time.perf_counter()
        self.paused_s = now - self.mark_time  # what the reset excludes: the compiling step, an eval
        self.mark_step, self.mark_time = step, now

    def update(self, step: int, metrics: dict) -> dict:
        now = time.perf_counter()
        if step == self.mark_step:  # only the compiling first step so far: no rate to report
            if self.enabled:
                print(f"step {step:>6}/{self.total} | loss {metrics['loss']:.4f} | "
                      f"first step {self.paused_s:.1f}s (compilation)", flush=True)
            return dict(metrics)
        steps = max(step - self.mark_step, 1)
        rate = steps * self.tokens_per_step / max(now - self.mark_time, 1e-9)
        mfu = rate * self.flops_per_token / self.peak if self.peak else 0.0
        eta = (self.total - step) * self.tokens_per_step / max(rate, 1e-9)
        self.reset_clock(step)
        out = dict(metrics, tokens_per_sec=rate, mfu=mfu)
        if self.enabled:
            writes = f" | write cost {metrics['write_cost']:.3f}" if "write_cost" in metrics else ""
            print(f"step {step:>6}/{self.total} | loss {metrics['loss']:.4f}{writes} | "
                  f"{rate / 1e3:7.2f}k tok/s | MFU {100 * mfu:5.1f}% | ETA {format_duration(eta)}",
                  flush=True)
        return out


class Wandb:
    """wandb that never needs a key: offline unless one is configured, a no-op when disabled."""

    def __init__(self, config, workdir: str, run_id: str | None):
        mode = config.logging.wandb_mode
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        self.run = None
        if mode == "disabled":
            self.run_id = run_id
            return
        import wandb

        try:
            self.run = wandb.init(project=config.logging.wandb_project, dir=workdir, mode=mode,
                                  id=run_id, resume="allow", config=config.to_dict(),
                                  settings=wandb.Settings(silent=True))
            self.run_id = self.run.id
        except Exception as e:  # logging must never stop training
            logging.warning("wandb unavailable (%s); continuing without it", e)
            self.run_id = run_id

    def log(self, record: dict, step: int) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if k != "step"}, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


def plot_losses(workdir: str) -> str | None:
    """Write `workdir/loss.png` from metrics.jsonl (train loss and eval loss against step)."""
    path = os.path.join(workdir, METRICS_FILE)
    if not os.path.exists(path):
        return None
    from matplotlib.figure import Figure  # no pyplot: the process's backend stays the user's

    records = [json.loads(line) for line in open(path) if line.strip()]
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    out = os.path.join(workdir, "loss.png")
    fig.savefig(out, dpi=100, bbox_inches="tight")
    return out


def throughput(records: list[dict], tokens_per_step: int) -> float:
    """Training tokens/s over the logged intervals of a run's metrics.jsonl records (the trainer's
    clock starts after the first, compiling step and pauses for evals)."""
    tokens = seconds = 0.0
    prev = 1
    for r in records:
        if "tokens_per_sec" not in r:
            continue
        n = (r["step"] - prev) * tokens_per_step
        if n > 0 and r["tokens_per_sec"] > 0:
            tokens, seconds = tokens + n, seconds + n / r["tokens_per_sec"]
        prev = r["step"]
    return tokens / seconds if seconds else float("nan")
