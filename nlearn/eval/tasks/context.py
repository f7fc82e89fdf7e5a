"""What every evaluation task receives: the restored run and the sweep the user asked for."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


@dataclasses.dataclass
class TaskContext:
    """One restored checkpoint plus the task's parameters (from the `nlearn-eval` flags).

    setup: `nlearn.train.state.Setup` of `config` (mesh, shardings, compute dtype).
    tokenizer: the run's sentencepiece tokenizer, or None for token corpora (MQAR).
    lengths: prompt lengths in tokens to sweep over; () = the task's default.
    samples: examples per length (per variant); 0 = the task's default.
    variant: a task's sub-task ("" = its default, "all" = every one where the task has several).
    chunk_size: tokens fed to the model per streaming step (0 = train.seq_len).
    options: further task-specific settings (`--option=key=value`).
    """

    workdir: str
    config: Any
    setup: Any
    graphdef: Any
    params: Any
    step: int
    tokenizer: Optional[Any] = None
    lengths: tuple[int, ...] = ()
    samples: int = 0
    seed: int = 0
    variant: str = ""
    chunk_size: int = 0
    options: dict = dataclasses.field(default_factory=dict)

    @property
    def stream_chunk(self) -> int:
        """Tokens per streaming step: `chunk_size`, else the training window."""
        return int(self.chunk_size or self.config.train.seq_len)

    def parameters(self) -> dict:
        """The task parameters recorded with a result (eval/<task>.json)."""
        return {"lengths": list(self.lengths), "samples": self.samples, "seed": self.seed,
                "variant": self.variant, "chunk_size": self.stream_chunk, "options": dict(self.options)}
