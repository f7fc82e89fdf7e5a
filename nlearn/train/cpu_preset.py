"""`train.cpu_opt_preset`: XLA:CPU's optimisation preset for a run's jitted train and eval steps."""

from __future__ import annotations

import jax

# `train.cpu_opt_preset` -> XLA:CPU's name for the preset.
CPU_OPT_PRESETS = {"default": "CPU_OPT_PRESET_DEFAULT", "fast_compile": "CPU_OPT_PRESET_FAST_COMPILE",
                   "fast_runtime": "CPU_OPT_PRESET_FAST_RUNTIME"}


def compiler_options(train_config) -> dict | None:
    """`jax.jit` compiler options from `train.cpu_opt_preset`, on the CPU backend only (the
    accelerators' compilers have no such option); None leaves XLA's defaults."""
    if train_config.cpu_opt_preset == "default" or jax.default_backend() != "cpu":
        return None
    return {"xla_cpu_opt_preset": CPU_OPT_PRESETS[train_config.cpu_opt_preset]}
