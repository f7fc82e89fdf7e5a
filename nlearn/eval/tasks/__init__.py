"""The `nlearn-eval --task=NAME` registry: names -> "module:function" entries, imported on first use.

A task is `run(ctx: TaskContext) -> (result: dict, samples: list[dict])`: `result` holds its headline
metric ("accuracy", or "loss" and "perplexity") and, for tasks swept over lengths, "by_length";
`samples` are the per-example records (inputs, targets, outputs) written to eval/<task>.samples.jsonl.
New tasks plug in with `TASKS["name"] = "package.module:function"` (or `register_task`). The language-model
tasks live here (`nlearn/eval/tasks/<name>.py`), the synthetic tasks' scorers beside their data
(`nlearn/tasks/<name>/score.py`).
"""

from __future__ import annotations

import importlib
from typing import Callable

from nlearn.errors import UserError
from nlearn.eval.tasks.context import TaskContext

TASKS: dict[str, str] = {
    "perplexity": "nlearn.eval.tasks.perplexity:run",
    "mqar": "nlearn.tasks.mqar.score:run",
    "niah": "nlearn.tasks.niah.score:run",
    "babilong": "nlearn.tasks.babilong.score:run",
    "per_position": "nlearn.eval.tasks.per_position:run",
}

TaskFn = Callable[[TaskContext], tuple[dict, list[dict]]]


def register_task(name: str, entry: str) -> None:
    """Make `--task=name` run `entry` ("package.module:function")."""
    if ":" not in entry:
        raise ValueError(f"task entry {entry!r} must read 'package.module:function'")
    TASKS[name] = entry


def get_task(name: str) -> TaskFn:
    """The task function `name` names; UserError for an unknown or unavailable task."""
    if name not in TASKS:
        raise UserError(f"unknown --task {name!r}; choose one of {', '.join(sorted(TASKS))}")
    module_name, fn_name = TASKS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise UserError(f"--task={name} is not available in this install (no module {module_name})") from e
        raise
    try:
        return getattr(module, fn_name)
    except AttributeError as e:
        raise UserError(f"--task={name}: {module_name} has no function {fn_name!r}") from e


__all__ = ["TASKS", "TaskContext", "get_task", "register_task"]
