"""The trainer's one step hook: what a run adds around the plain loop, chosen from the config.

`StepHook` is the plain run (`train.steps` steps of one jitted step, nothing else); the trainer calls
it at fixed points (start, after each step, after each eval, at each checkpoint). The step itself always
comes from `nlearn.train.step.make_train_step` with every option of the config; a hook only chooses the
optimizer's schedule arguments (`train.time_budget_s`, nlearn.train.time_budget) and the compiler options
(`train.cpu_opt_preset`, nlearn.train.cpu_preset), so it cannot drop a feature of the step.
"""

from __future__ import annotations

import jax

from nlearn.train import mesh as mesh_lib
from nlearn.train.cpu_preset import compiler_options
from nlearn.train.step import make_train_step


class StepHook:
    """The plain run; subclasses override the points they need."""

    def __init__(self, config, workdir: str, lead: bool):
        self.config, self.workdir, self.lead = config, workdir, lead
        self.compiler_options = compiler_options(config.train)  # of the jitted train and eval steps

    def plan(self, meta: dict | None) -> int:
        """The run's last step, given the restored checkpoint's metadata (None: a fresh run)."""
        return self.config.train.steps

    def optimizer(self, setup):
        """The train step's optimizer: an optax transformation, or a function of `schedule_args()` that
        returns one."""
        return setup.optimizer

    def schedule_args(self) -> tuple:
        """The extra (traced) arguments each call of the train step passes to `optimizer`."""
        return ()

    def jit_step(self, setup):
        """The jitted `(state, batch) -> (state, metrics)`: `jitted_step` called in the mesh's context with this
        hook's schedule arguments."""
        jitted = mesh_lib.in_mesh_context(self.jitted_step(setup), setup.mesh, setup.batch_sharding)
        return lambda state, batch: jitted(state, batch, *self.schedule_args())

    def jitted_step(self, setup):
        """The `jax.jit` of `make_train_step` with this hook's optimizer, `(state, batch, *schedule_args())`
        (`nlearn-compile` lowers it for a topology)."""
        step = make_train_step(self.config, setup.graphdef, self.optimizer(setup), dtype=setup.dtype)
        extra = (mesh_lib.replicated(setup.mesh),) * len(self.schedule_args())
        return jax.jit(step, in_shardings=(setup.state_shardings, setup.batch_sharding, *extra),
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
    from nlearn.train.time_budget import TimeBudget  # builds on StepHook

    return (TimeBudget if config.train.time_budget_s > 0 else StepHook)(config, workdir, lead)
