"""Long inputs through a model's decoding state, chunk by chunk: prefill in pieces, then greedy decoding.

Recurrent families carry a fixed-size state, so memory stays constant with the input's length; attention
keeps its cache as it is (full attention: one slot per token, allocated for the whole stream; a sliding
window: a bounded ring). One jitted chunk step serves every chunk of the same shape (full chunks, tails cut
into powers of two, single tokens: streams of any length share them), and the cache is donated to it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nlearn.train.step import cast_params


def make_chunk_step(graphdef, dtype=jnp.float32) -> Callable:
    """Jitted `(params, tokens [B, T], targets [B, T] | None, cache) -> (last logits [B, V], losses [B, T]
    | None, cache)`; the losses are next-token cross-entropies of `targets` (no [B, T, V] leaves the step)."""

    def step(params, tokens_BT, targets_BT, cache):
        model = nnx.merge(graphdef, cast_params(params, dtype))
        logits_BTV, cache = model.decode(tokens_BT, cache)
        losses = (None if targets_BT is None
                  else optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT))
        return logits_BTV[:, -1], losses, cache

    return jax.jit(step, donate_argnums=(3,))


def make_score_step(graphdef, dtype=jnp.float32) -> Callable:
    """Jitted `(params, tokens [B, T], targets [B, T], cache) -> (log-probabilities of the targets [B, T],
    whether each target is the argmax [B, T], cache)`: what lm-eval's `(logprob, is_greedy)` sums over."""

    def step(params, tokens_BT, targets_BT, cache):
        model = nnx.merge(graphdef, cast_params(params, dtype))
        logits_BTV, cache = model.decode(tokens_BT, cache)
        logits_BTV = logits_BTV.astype(jnp.float32)
        logprobs = -optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT)
        return logprobs, jnp.argmax(logits_BTV, axis=-1) == targets_BT, cache

    return jax.jit(step, donate_argnums=(3,))


@dataclasses.dataclass
class Streamer:
    """Feeds token streams of any length through `graphdef`'s `decode` in chunks of `chunk_size`.

    `max_len` bounds what a full-attention cache must hold (prompt + generated tokens); recurrent and
    sliding-window caches ignore it.
    """

    graphdef: object
    params: object
    chunk_size: int = 512
    dtype: object = jnp.float32

    def __post_init__(self):
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")
        self._step = make_chunk_step(self.graphdef, self.dtype)
        self.span = getattr(nnx.merge(self.graphdef, self.params), "decode_span", 1)
        self._score_step = None  # compiled on first use (score)

    def init_cache(self, batch: int, max_len: int):
        """A fresh decoding cache whose leaves are distinct buffers (the chunk step donates them)."""
        cache = nnx.merge(self.graphdef, self.params).init_cache(batch, max_len, self.dtype)
        return jax.tree.map(lambda x: jnp.array(x, copy=True), cache)

    def chunks(self, length: int) -> Iterable[slice]:
        """Full chunks, then the tail in decreasing powers of two (137 = 128 + 8 + 1): prompts of any length
        reuse at most log2(chunk_size) + 2 compiled shapes. A model whose `decode_span` is above 1 (Hope, which
        reads a CMS chunk per step only in whole aligned spans) gets pieces of that span, then single tokens."""
        if self.span > 1:
            full = length - length % self.span
            yield from (slice(start, start + self.span) for start in range(0, full, self.span))
            yield from (slice(start, start + 1) for start in range(full, length))
            return
        full = length - length % self.chunk_size
        for start in range(0, full, self.chunk_size):
            yield slice(start, start + self.chunk_size)
        start, rest = full, length - full
        while rest:
            piece = 1 << (rest.bit_length() - 1)
            yield slice(start, start + piece)
            start, rest = start + piece, rest - piece

    def prefill(self, tokens_BT, cache):
        """Feed `tokens [B, T]` after what `cache` holds: (logits after the last token [B, V], cache)."""
        tokens_BT = np.asarray(tokens_BT, np.int32)
        if tokens_BT.ndim != 2 or tokens_BT.shape[1] == 0:
            raise ValueError(f"tokens must be [batch, length >= 1], got shape {tokens_BT.shape}")
        logits = None
        for s in self.chunks(tokens_BT.shape[1]):
            logits, _, cache = self._step(self.params, jnp.asarray(tokens_BT[:, s]), None, cache)
        return logits, cache

    def losses(self, tokens_BT, cache=None) -> np.ndarray:
        """Next-token cross-entropy `[B, T - 1]` of a stream `tokens [B, T]`, fed chunk by chunk."""
        tokens_BT = np.asarray(tokens_BT, np.int32)
        if tokens_BT.ndim != 2 or tokens_BT.shape[1] < 2:
            raise ValueError(f"tokens must be [batch, length >= 2], got shape {tokens_BT.shape}")
        inputs, targets = tokens_BT[:, :-1], tokens_BT[:, 1:]
        cache = self.init_cache(inputs.shape[0], inputs.shape[1]) if cache is None else cache
        out = []
        for s in self.chunks(inputs.shape[1]):
            _, loss, cache = self._step(self.params, jnp.asarray(inputs[:, s]), jnp.asarray(targets[:, s]), cache)
            out.append(np.asarray(loss))
        return np.concatenate(out, axis=1)

    def score(self, inputs_BT, targets_BT, cache):
        """Feed `inputs [B, T]` after what `cache` holds, chunk by chunk: (log-probabilities of `targets
        [B, T]` as float64 [B, T], whether each is the argmax [B, T], cache)."""
        inputs_BT, targets_BT = np.asarray(inputs_BT, np.int32), np.asarray(targets_BT, np.int32)
        if inputs_BT.shape != targets_BT.shape or inputs_BT.ndim != 2 or inputs_BT.shape[1] == 0:
            raise ValueError(f"inputs and targets must both be [batch, length >= 1], got {inputs_BT.shape} "
                             f"and {targets_BT.shape}")
        if self._score_step is None:
            self._score_step = make_score_step(self.graphdef, self.dtype)
        logprobs, hits = [], []
        for s in self.chunks(inputs_BT.shape[1]):
            lp, hit, cache = self._score_step(self.params, jnp.asarray(inputs_BT[:, s]),
                                              jnp.asarray(targets_BT[:, s]), cache)
            logprobs.append(np.asarray(lp, np.float64))
            hits.append(np.asarray(hit))
        return np.concatenate(logprobs, axis=1), np.concatenate(hits, axis=1), cache

    def greedy(self, logits_BV, cache, max_new_tokens: int, stop_ids: Sequence[int] = (),
               check_finite: bool = False):
        """Greedy continuation from `logits` (after a prefill): per row, the new ids up to (not including)
        the first of `stop_ids`, at most `max_new_tokens`. With `check_finite`, also per row whether every
        logit it was decoded from was finite (the argmax of a nan row is meaningless)."""
        rows = [[] for _ in range(logits_BV.shape[0])]
        done = np.zeros(len(rows), bool)
        finite = np.ones(len(rows), bool)
        for i in range(max_new_tokens):
            if check_finite:
                finite &= np.asarray(jnp.isfinite(logits_BV).all(axis=-1)) | done
            token = np.asarray(jnp.argmax(logits_BV, axis=-1), np.int32)
            for r, t in enumerate(token):
                done[r] |= int(t) in stop_ids
                if not done[r]:
                    rows[r].append(int(t))
            if done.all() or i == max_new_tokens - 1:
                break
            logits_BV, _, cache = self._step(self.params, jnp.asarray(token[:, None]), None, cache)
        return (rows, finite) if check_finite else rows

    def complete(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = (),
                 cache=None, check_finite: bool = False):
        """Greedy completion of one prompt (batch of one), streamed: the new token ids (and, with
        `check_finite`, whether every logit they came from was finite)."""
        if cache is None:
            cache = self.init_cache(1, len(prompt_ids) + max_new_tokens)
        logits, cache = self.prefill(np.asarray([prompt_ids], np.int32), cache)
        if not check_finite:
            return self.greedy(logits, cache, max_new_tokens, stop_ids)[0]
        rows, finite = self.greedy(logits, cache, max_new_tokens, stop_ids, check_finite=True)
        return rows[0], bool(finite[0])


def streamer_for(ctx, dtype: Optional[object] = None) -> Streamer:
    """A Streamer over a task context's model at its chunk size (float32 unless `dtype`)."""
    return Streamer(ctx.graphdef, ctx.params, ctx.stream_chunk, jnp.float32 if dtype is None else dtype)
