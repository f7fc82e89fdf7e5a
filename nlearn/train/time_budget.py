"""`train.time_budget_s`, a run option reached through the trainer's step hook (`nlearn.train.hooks`).

It fits a run's step count to a wall-time budget, once, early in the run: a warmup-stable-decay schedule
holds its peak until the last `decay_fraction` of the steps, so the lr of every step taken during the
stable phase is the same whatever the total. The hook times a few steps at the task's own batch shape
(compilation and curriculum windows excluded) and, while still in the stable phase, picks the largest
total <= `train.steps` whose remaining steps fit in what is left of the budget. The run is then the one
`train.steps = <that total>` gives (the lr agrees to float32 rounding), and resuming keeps the chosen
total (it is saved with each checkpoint). On a fast machine every configured step fits and nothing
changes; on a slow one the decay simply starts sooner, so the run still ends fully decayed inside the
budget (a run cut off by a time limit would end at its peak lr instead).
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from nlearn.train.hooks import StepHook
from nlearn.train.optim import make_optimizer, warmup_steps, wsd_stable_end, wsd_total

TIMED_STEPS = 8  # steps of the task's shape timed before planning (after its compiling step)
SAFETY = 0.98  # fraction of the remaining budget the forecast may fill (timing noise, checkpoints)


_IMPORTED = time.monotonic()


def process_age_s() -> float:
    """Seconds since this process started (start-up and imports count toward a budget); from Linux
    /proc, elsewhere since this module's import. A rerun after a kill counts from its own start."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def shortest_total(step: int, configured: int, warmup: int, decay_fraction: float) -> int:
    """The fewest total steps whose WSD schedule is still stable at `step` (so the steps taken so far
    had the lr they would have had under it); `configured` if none shorter is."""
    for total in range(max(step, warmup + 1), configured + 1):
        if wsd_stable_end(total, warmup, decay_fraction) >= step:
            return total
    return configured


def fit_total(step: int, configured: int, *, elapsed_s: float, step_s: float, budget_s: float,
              extra_s_per_step: float = 0.0, shortest: int = 0) -> int:
    """The largest total <= `configured` whose remaining steps (at `step_s` each, plus
    `extra_s_per_step` for evals) fit in SAFETY of the budget left; never below `shortest`."""
    left = SAFETY * (budget_s - elapsed_s)
    fits = step + int(max(left, 0.0) // (step_s + extra_s_per_step))
    return int(min(configured, max(fits, shortest, step)))


class BudgetPlanner:
    """Watches the train loop's step times and decides the total once (see the module docstring)."""

    def __init__(self, train_config):
        self.t = train_config
        self.budget_s = float(train_config.time_budget_s)
        self.task_len = train_config.seq_len  # curriculum windows are shorter
        self.warmup = warmup_steps(train_config)
        self.durations: list[float] = []
        self.last_shape = None
        self.eval_s_per_step = 0.0  # the last periodic eval's time, spread over eval_every steps

    def wants_timing(self, shape: tuple) -> bool:
        """Whether the loop should block on this step (a `[B, T]` batch) to time it."""
        return shape[-1] == self.task_len

    def record_eval(self, seconds: float) -> None:
        if self.t.eval_every:
            self.eval_s_per_step = seconds / self.t.eval_every

    def observe(self, step: int, shape: tuple, seconds: float) -> int | None:
        """Time of the step that just ended at `step`; the chosen total once enough are timed."""
        shape = tuple(shape)
        if shape != self.last_shape:  # a new shape: its first step compiled
            self.last_shape, self.durations = shape, []
            return None
        self.durations.append(seconds)
        if len(self.durations) < TIMED_STEPS:
            return None
        shortest = shortest_total(step, self.t.steps, self.warmup, self.t.decay_fraction)
        return fit_total(step, self.t.steps, elapsed_s=process_age_s(), step_s=float(np.median(self.durations)),
                         budget_s=self.budget_s, extra_s_per_step=self.eval_s_per_step, shortest=shortest)

    def describe(self, step: int, total: int) -> str:
        step_s = float(np.median(self.durations))
        head = (f"time budget {self.budget_s:g}s: {process_age_s():.0f}s used by step {step}, "
                f"{1e3 * step_s:.0f} ms/step")
        if total >= self.t.steps:
            return f"{head}: all {self.t.steps} steps fit"
        start = wsd_stable_end(total, self.warmup, self.t.decay_fraction)
        text = f"{head}: training {total} of {self.t.steps} steps (the lr decays from step {start})"
        over = process_age_s() + (total - step) * step_s - self.budget_s
        if over > 0:  # clamped by shortest_total: the schedule so far allows no shorter run
            return text + f", the fewest that keep the lr of the steps so far: ~{over:.0f}s over the budget"
        return text + "; a faster machine would train more"


class TimeBudget(StepHook):
    """The step hook of a run with `train.time_budget_s > 0` (a "wsd" schedule): times its first steps,
    then lowers its total once (`BudgetPlanner`). The train step takes the total as traced scalars (its
    optimizer's schedule arguments), so choosing it mid-run compiles nothing again."""

    def __init__(self, config, workdir: str, lead: bool):
        super().__init__(config, workdir, lead)
        self.total = config.train.steps
        self.planner = None

    def plan(self, meta: dict | None) -> int:
        t = self.config.train
        saved = (meta or {}).get("budget")
        if saved and saved["configured_steps"] == t.steps:  # a resumed run keeps the total it chose...
            self.total = saved["planned_steps"]
            return self.total
        if saved and self.lead:  # ...unless the rerun changed the steps
            print(f"the checkpoint's run chose {saved['planned_steps']} of {saved['configured_steps']} steps "
                  f"for its time budget; with train.steps={t.steps} and train.time_budget_s="
                  f"{t.time_budget_s:g} this run plans anew", flush=True)
        self.planner = BudgetPlanner(t)
        return self.total

    def optimizer(self, setup):
        return lambda total: make_optimizer(self.config, total)

    def schedule_args(self) -> tuple:
        return (self._boundaries(self.total),)  # one transfer per total

    @functools.lru_cache(maxsize=4)
    def _boundaries(self, total: int):
        return jnp.asarray(wsd_total(self.config, total))

    def after_step(self, step: int, batch: dict, metrics, began: float) -> int | None:
        shape = batch["inputs"].shape
        if self.planner is None or not self.planner.wants_timing(shape):
            return None
        jax.block_until_ready(metrics)  # a timed step ends here
        chosen = self.planner.observe(step, shape, time.perf_counter() - began)
        if chosen is None:
            return None
        if jax.process_count() > 1:  # every process takes process 0's choice
            chosen = int(multihost_utils.broadcast_one_to_all(np.int32(chosen)))
        self.total = chosen
        if self.lead:
            print(self.planner.describe(step, chosen), flush=True)
            with open(os.path.join(self.workdir, "budget.json"), "w") as f:
                json.dump({"planned_steps": chosen, "configured_steps": self.config.train.steps, "at_step": step}, f)
        self.planner = None
        return chosen

    def after_eval(self, seconds: float) -> None:
        if self.planner is not None:
            self.planner.record_eval(seconds)

    def meta(self) -> dict:
        if self.planner is not None:  # not chosen yet
            return {}
        return {"budget": {"planned_steps": self.total, "configured_steps": self.config.train.steps}}
