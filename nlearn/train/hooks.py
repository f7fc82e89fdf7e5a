"""The trainer's one step hook: what a run adds around the plain loop, chosen from the config.

`StepHook` is the plain run (`train.steps` steps of one jitted step, nothing else); the trainer calls
it at fixed points (start, after each step, after each eval, at each checkpoint). Benchmark options
(`train.time_budget_s`, `train.cpu_opt_preset`) live in `nlearn.train.benchmark` and reach the run
only through the hook `make_hook` returns.
"""

from __future__ import annotations

import jax

from nlearn.train import mesh as mesh_lib
from nlearn.train import state_passing, write_penalty
from nlearn.train.step import make_train_step


class StepHook:
    """The plain run; subclasses override the points they need."""

    def __init__(self, config, workdir: str, lead: bool):
        self.config, self.workdir, self.lead = config, workdir, lead
        self.compiler_options = None  # `jax.jit` compiler options of the train and eval steps

    def plan(self, meta: dict | None) -> int:
        """The run's last step, given the restored checkpoint's metadata (None: a fresh run)."""
        return self.config.train.steps

    def jit_step(self, setup):
        """The jitted `(state, batch) -> (state, metrics)`, called in the mesh's context where it needs one."""
        return mesh_lib.in_mesh_context(self.jitted_step(setup), setup.mesh)

    def jitted_step(self, setup):
        """The `jax.jit` of the train step (`nlearn-compile` lowers it for a topology)."""
        t = self.config.train
        passing = ((t.state_passing, t.state_passing_from, state_passing.batch_axes(self.config))
                   if state_passing.enabled(self.config) else None)
        penalty = (t.write_penalty, t.write_penalty_from) if write_penalty.enabled(self.config) else None
        step = make_train_step(setup.graphdef, setup.optimizer, grad_accum=t.grad_accum, dtype=setup.dtype,
                               state_passing=passing, write_penalty=penalty)
        return jax.jit(step, in_shardings=(setup.state_shardings, setup.batch_sharding),
                       out_shardings=(setup.state_shardings, None), donate_argnums=0,
                       compiler_options=self.compiler_options)

    def after_step(self, step: int, batch: dict, metrics, began: float) -> int | None:
        """Called once step `step` is dispatched (`began`: `time.perf_counter()` before its batch was
        made); returns a new last step, or None to keep the current one."""
        return None

    def after_eval(self, seconds: float) -> None:
        """Called after each periodic evaluation with its wall time."""

    def meta(self) -> dict:
        """Entries saved with each checkpoint's metadata (read back by `plan` on resume)."""
        return {}


def make_hook(config, workdir: str, lead: bool) -> StepHook:
    """The hook `config.train` asks for: a time-budgeted run's, else the plain one."""
    from nlearn.train import benchmark  # builds on StepHook

    hook = (benchmark.TimeBudget if config.train.time_budget_s > 0 else StepHook)(config, workdir, lead)
    hook.compiler_options = benchmark.compiler_options(config.train)
    return hook
