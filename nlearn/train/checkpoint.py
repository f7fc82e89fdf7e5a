"""orbax checkpoints that carry everything needed to resume exactly.

One `CheckpointManager` item per concern: `state` (params, optimizer state, step, RNG),
`dataset` (the data iterator position of the whole global batch, joined from every process, so
any process count resumes it) and `meta` (resolved config, logger run id). Every process calls
save and restore (orbax writes the arrays cooperatively). Restoring tries the newest step first
and falls back, with a warning, to older ones if it is unreadable. Checkpoints written before
`dataset` keep their per-process `data` item (grain's handler) and resume as before.
"""

from __future__ import annotations

import json
import os

import grain
import orbax.checkpoint as ocp
from absl import logging

from nlearn import data as data_lib
from nlearn.errors import UserError
from nlearn.train import distributed


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), "checkpoints")


class Checkpointer:
    """Saves and restores train state, data-iterator state and metadata under `workdir`."""

    def __init__(self, workdir: str, *, keep: int = 3, async_save: bool = True, read_only: bool = False):
        directory = checkpoint_dir(workdir)
        if read_only and not os.path.isdir(directory):
            raise UserError(f"no checkpoints in {workdir!r} (expected {directory})")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=not read_only, read_only=read_only,
            enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(directory, options=options,
                                             item_names=("state", "data", "dataset", "meta"))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, data_iter, meta: dict, *, force: bool = False) -> None:
        if step in self.manager.all_steps():  # e.g. a stop signal right after a periodic save
            return
        args = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
        if data_iter is not None:
            states = distributed.exchange(f"data-state-{step}", data_iter.get_state())
            args["dataset"] = ocp.args.JsonSave(json.loads(data_lib.merge_states(states)))
        self.manager.save(step, args=ocp.args.Composite(**args), force=force)

    def restore(self, abstract_state, data_iter=None, step: int | None = None):
        """Restore `step` (or the newest readable one): returns `(step, state, meta)`.

        `data_iter`, when given, is moved to the saved position in place. Raises UserError
        when no checkpoint exists or none can be read.
        """
        steps = self.steps()
        if not steps:
            raise UserError(f"no checkpoint found in {self.manager.directory}")
        if step is not None:
            if step not in steps:
                raise UserError(f"no checkpoint for step {step} in {self.manager.directory}; available: {steps}")
            candidates = [step]
        else:
            candidates = steps[::-1]
        errors = []
        for s in candidates:
            args = {"state": ocp.args.StandardRestore(self._saved_part(s, abstract_state)),
                    "meta": ocp.args.JsonRestore()}
            legacy = not os.path.isdir(os.path.join(self.manager.directory, str(s), "dataset"))
            if data_iter is not None:
                args["data" if legacy else "dataset"] = (grain.checkpoint.CheckpointRestore(data_iter) if legacy
                                                         else ocp.args.JsonRestore())
            try:
                restored = self.manager.restore(s, args=ocp.args.Composite(**args))
            except Exception as e:  # corrupt or partial files: try the previous checkpoint
                msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                logging.warning("checkpoint at step %d is unreadable (%s); trying an older one", s, msg)
                errors.append(f"step {s}: {msg}")
                continue
            if data_iter is not None and not legacy:  # a UserError (a position it cannot take) is final
                data_iter.set_state(json.dumps(restored["dataset"]).encode())
            if errors:
                logging.warning("resumed from step %d after skipping unreadable checkpoints", s)
            return s, restored["state"], dict(restored["meta"])
        raise UserError(f"no readable checkpoint in {self.manager.directory} ({'; '.join(errors)})")

    def _saved_part(self, step: int, abstract_state):
        """`abstract_state` less its `carry` (train.state_passing's states) when the checkpoint has none: a run
        trained without state passing resumes with it, its rows starting fresh (the trainer fills `carry`)."""
        if "carry" not in abstract_state:
            return abstract_state
        try:
            saved = ocp.StandardCheckpointer().metadata(os.path.join(self.manager.directory, str(step), "state"))
            keys = set(saved.item_metadata.keys())
        except Exception:  # unreadable metadata: let the restore itself report the checkpoint
            return abstract_state
        return abstract_state if "carry" in keys else {k: v for k, v in abstract_state.items() if k != "carry"}

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
