"""Training in stages: the first batches from other streams (e.g. a curriculum of easier windows),
then the source's own stream for ever, checkpointed like one grain iterator."""

from __future__ import annotations

import json
from typing import Callable, Iterator, Sequence

from nlearn.errors import UserError


class StagedIterator:
    """`steps[0]` batches of stage 0, then `steps[1]` of stage 1, ..., then stage `len(steps)` (the
    source's own stream) for ever; `make_iterator(i)` builds stage i's iterator.

    Sub-iterators are built lazily (a stage that is already over when a run resumes costs
    nothing). State: the number of batches handed out plus the current stage's grain state."""

    def __init__(self, steps: Sequence[int], make_iterator: Callable[[int], Iterator]):
        self._make = make_iterator
        self.ends = [sum(steps[:i + 1]) for i in range(len(steps))]
        self.count, self._index, self._it = 0, -1, None

    def stage_index(self, count: int) -> int:
        """Which stage batch number `count` (0-based) belongs to; len(steps) = the source's own."""
        return next((i for i, end in enumerate(self.ends) if count < end), len(self.ends))

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
        inner = json.loads(inner) if isinstance(inner, (bytes, str)) else inner  # an object: states merge
        return json.dumps({"count": self.count, "stage": self._index, "inner": inner}).encode()

    def set_state(self, state: bytes) -> None:
        saved = json.loads(state.decode() if isinstance(state, bytes) else state)
        self.count = int(saved["count"])
        it = self._iterator()
        if int(saved["stage"]) != self._index:
            raise UserError(f"the data checkpoint is from training stage {saved['stage']} but "
                            f"step {self.count} belongs to stage {self._index}; was the data "
                            f"curriculum (e.g. data.mqar.curriculum) changed between runs?")
        inner = saved["inner"]
        it.set_state(inner.encode() if isinstance(inner, str) else json.dumps(inner).encode())

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
