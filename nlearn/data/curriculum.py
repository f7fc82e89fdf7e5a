"""MQAR curriculum: train first on shorter, easier windows, then on the task itself.

`data.mqar.curriculum = "64x4:300"` trains the first 300 steps on windows of 64 tokens with 4
key-value pairs, then on the configured task (train.seq_len, data.mqar.num_pairs). Stages are
comma-separated and run in order ("64x4:200,128x8:200"). Every stage keeps the tokens per step
of the task: a stage of length L uses batch_size * seq_len / L rows. Zoology trains MQAR on such
a mixture of lengths (most examples 64 tokens with 4 pairs); here the short windows come first
because a model learns the recall mechanism there in a fraction of the steps (deltanet: ~200
steps at 64x4 against 400-1100 at 256x16) and the long windows then only have to extend it.
Evaluation always uses the task's own windows.

`StagedIterator` hands out one stage's batches after another and checkpoints like a grain
iterator (get_state/set_state with bytes), so a resumed run continues in the right stage at the
right position.

A stage may also say where its queries start: "128x4@64:150" is 150 steps of 128-token windows
whose 4 pairs end at position 64 (filler before them) and whose queries all come from there on.
A model that attends within 64-token segments (titans_mac) can answer those only from its
memory, so such a stage trains the memory before attention learns to answer from nearby pairs
(data.mqar.query_start).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Callable, Iterator

import ml_collections

from nlearn.errors import UserError

_STAGE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*(?:@\s*(\d+)\s*)?:\s*(\d+)\s*$")


@dataclasses.dataclass(frozen=True)
class Stage:
    seq_len: int
    num_pairs: int
    steps: int
    query_start: int = 0  # where the pairs end and the queries start; 0: the pairs at the start


def parse_curriculum(spec: str, seq_len: int) -> list[Stage]:
    """'LxP:S,...' -> stages; UserError naming data.mqar.curriculum on any malformed part."""
    stages = []
    for part in [p for p in str(spec).split(",") if p.strip()]:
        m = _STAGE.match(part)
        if not m:
            raise UserError(f"data.mqar.curriculum: cannot read stage {part.strip()!r}; expected "
                            f"'LENxPAIRS:STEPS' or 'LENxPAIRS@QUERY_START:STEPS' stages separated "
                            f"by commas, e.g. '64x4:300' or '128x4@64:150,64x4:100'")
        length, pairs, start, steps = (int(g or 0) for g in m.groups())
        stage = Stage(length, pairs, steps, start)
        if stage.seq_len < 1 or seq_len % stage.seq_len:
            raise UserError(f"data.mqar.curriculum: stage length {stage.seq_len} must divide "
                            f"train.seq_len={seq_len} (each stage keeps the tokens per step)")
        if 4 * stage.num_pairs > stage.seq_len or stage.num_pairs < 1:
            raise UserError(f"data.mqar.curriculum: stage {part.strip()!r} needs 1 <= pairs <= "
                            f"length / 4 (the pairs, then one query slot per pair)")
        if stage.query_start and not (2 * stage.num_pairs <= stage.query_start
                                      <= stage.seq_len - 2 * stage.num_pairs):
            raise UserError(f"data.mqar.curriculum: stage {part.strip()!r} needs 2 * pairs <= query "
                            f"start <= length - 2 * pairs (the pairs, then one query slot per pair)")
        if stage.steps < 1:
            raise UserError(f"data.mqar.curriculum: stage {part.strip()!r} needs at least 1 step")
        stages.append(stage)
    return stages


def stage_config(config: ml_collections.ConfigDict, seq_len: int, num_pairs: int,
                 query_start: int = 0) -> ml_collections.ConfigDict:
    """The config of one stage (no curriculum of its own): windows of seq_len tokens with
    num_pairs pairs and queries from query_start, at the tokens per step of config."""
    c = ml_collections.ConfigDict(config.to_dict())
    c.train.batch_size = int(config.train.batch_size) * (int(config.train.seq_len) // seq_len)
    c.train.seq_len = seq_len
    c.data.mqar.num_pairs = num_pairs
    c.data.mqar.query_start = query_start
    c.data.mqar.curriculum = ""
    return c


class StagedIterator:
    """Batches of stage 0 for its steps, then stage 1, ..., then the task's for ever.

    Sub-iterators are built lazily (a stage that is already over when a run resumes costs
    nothing). State: the number of batches handed out plus the current stage's grain state."""

    def __init__(self, stages: list[Stage], make_iterator: Callable[[int], Iterator]):
        self.stages, self._make = stages, make_iterator
        self.ends = [sum(s.steps for s in stages[:i + 1]) for i in range(len(stages))]
        self.count, self._index, self._it = 0, -1, None

    def stage_index(self, count: int) -> int:
        """Which stage batch number `count` (0-based) belongs to; len(stages) = the task."""
        return next((i for i, end in enumerate(self.ends) if count < end), len(self.stages))

    def _iterator(self):
        index = self.stage_index(self.count)
        if index != self._index:
            self._close()
            self._index, self._it = index, self._make(index)
        return self._it

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._iterator())
        self.count += 1
        return batch

    def get_state(self) -> bytes:
        inner = self._iterator().get_state()
        if isinstance(inner, bytes):
            inner = inner.decode()
        return json.dumps({"count": self.count, "stage": self._index, "inner": inner}).encode()

    def set_state(self, state: bytes) -> None:
        saved = json.loads(state.decode() if isinstance(state, bytes) else state)
        self.count = int(saved["count"])
        it = self._iterator()
        if int(saved["stage"]) != self._index:
            raise UserError(f"the data checkpoint is from curriculum stage {saved['stage']} but "
                            f"step {self.count} belongs to stage {self._index}; was "
                            f"data.mqar.curriculum changed between runs?")
        inner = saved["inner"]
        it.set_state(inner.encode() if isinstance(inner, str) else inner)

    def start_prefetch(self) -> None:
        start = getattr(self._iterator(), "start_prefetch", None)
        if start is not None:
            start()

    def _close(self):
        close = getattr(self._it, "close", None)
        if close is not None:
            close()

    def close(self) -> None:
        self._close()
