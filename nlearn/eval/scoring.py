"""Log-likelihoods of token sequences through a model's decoding state (what lm-eval asks a model for).

`Scorer.pairs` scores many (context, continuation) pairs in batches: sorted by length, right-padded to a
few bucket lengths (powers of two up to the chunk size, then multiples of it), so compilations stay
bounded; right padding never changes a real position's output, since every family is causal.
`Scorer.document` streams one document through the state chunk by chunk (constant memory for recurrent
families).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nlearn.eval.streaming import Streamer

MIN_BUCKET = 16  # shortest padded length: requests shorter than this share one compiled shape


def bucket_length(length: int, chunk: int) -> int:
    """The padded length of a `length`-token input: the next power of two (>= MIN_BUCKET) up to `chunk`,
    beyond it the next multiple of `chunk`."""
    if length <= chunk:
        return min(max(MIN_BUCKET, 1 << (length - 1).bit_length()), chunk)
    return -(-length // chunk) * chunk


class Scorer:
    """Log-probabilities of token sequences under `graphdef`/`params`, fed `chunk_size` tokens a step."""

    def __init__(self, graphdef, params, *, chunk_size: int = 512, batch_size: int = 1, dtype=jnp.float32):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.streamer = Streamer(graphdef, params, chunk_size, dtype)
        self.chunk_size, self.batch_size = int(chunk_size), int(batch_size)

    def cache_grows(self) -> bool:
        """Whether the decoding cache's size grows with the stream (full attention keeps every token)."""
        def size(max_len):
            shapes = jax.eval_shape(lambda: nnx.merge(self.streamer.graphdef, self.streamer.params)
                                    .init_cache(1, max_len, self.streamer.dtype))
            return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))

        return size(2 * self.chunk_size) > size(self.chunk_size)

    def pairs(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
        """`(log-probability of the continuation, whether each of its tokens is the argmax)` per
        `(context, continuation)` pair of token ids (context non-empty), in request order."""
        for i, (context, continuation) in enumerate(requests):
            if len(context) < 1 or len(continuation) < 1:
                raise ValueError(f"request {i}: context and continuation need at least one token each")
        lengths = [len(c) + len(x) - 1 for c, x in requests]
        # Longest first within each bucket, so a batch's rows share one padded length.
        order = sorted(range(len(requests)), key=lambda i: (-bucket_length(lengths[i], self.chunk_size),
                                                           -lengths[i], i))
        out: list = [None] * len(requests)
        batch: list[int] = []
        for i in order:
            if batch and (len(batch) == self.batch_size or bucket_length(lengths[i], self.chunk_size)
                          != bucket_length(lengths[batch[0]], self.chunk_size)):
                self._score_batch(requests, batch, lengths, out)
                batch = []
            batch.append(i)
        if batch:
            self._score_batch(requests, batch, lengths, out)
        return out

    def _score_batch(self, requests, rows: list[int], lengths: list[int], out: list) -> None:
        width = bucket_length(lengths[rows[0]], self.chunk_size)
        inputs = np.zeros((self.batch_size, width), np.int32)  # unused rows stay padding
        targets = np.zeros_like(inputs)
        for r, i in enumerate(rows):
            seq = list(requests[i][0]) + list(requests[i][1])
            inputs[r, : lengths[i]], targets[r, : lengths[i]] = seq[:-1], seq[1:]
        cache = self.streamer.init_cache(self.batch_size, width)
        logprobs, hits, _ = self.streamer.score(inputs, targets, cache)
        for r, i in enumerate(rows):
            span = slice(lengths[i] - len(requests[i][1]), lengths[i])
            out[i] = (float(logprobs[r, span].sum()), bool(hits[r, span].all()))

    def document(self, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Log-probabilities of `tokens[1:]` (float64) and their greedy flags, the whole document streamed
        through one state in chunks of `chunk_size`."""
        if len(tokens) < 2:
            raise ValueError(f"a document needs at least 2 tokens (a prefix and one scored), got {len(tokens)}")
        n = len(tokens) - 1
        width = bucket_length(n, self.chunk_size)  # padded after the end: no new shape for the tail
        inputs, targets = np.zeros((1, width), np.int32), np.zeros((1, width), np.int32)
        inputs[0, :n], targets[0, :n] = tokens[:-1], tokens[1:]
        logprobs, hits, _ = self.streamer.score(inputs, targets, self.streamer.init_cache(1, width))
        return logprobs[0, :n], hits[0, :n]
