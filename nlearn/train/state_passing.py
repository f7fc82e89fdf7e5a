"""State passing: rows of a training batch start from the final recurrent state of the previous step's rows.

A recurrent model trained on windows of `seq_len` tokens only ever sees the states its first `seq_len`
tokens reach from its initial state; far past that length it meets states it was never trained on and fails
(the "unexplored states" of Buitrago Ruiz & Gu 2025, arXiv 2507.02782). With `train.state_passing = p`, each
row continues, with probability p, from the decoding state the same row ended the previous step with (no
gradient flows into it), else starts fresh: the rows' chains of windows have geometric lengths with mean
1 / (1 - p) windows. Each window is still `seq_len` tokens and a sequence of its own; only the state is
carried. `train.state_passing_from` starts it at a later step, as post-training (carried states from the
first step can keep a model from learning its task at all). The carried states (float32, one per row of the
global batch) are part of the train state, so a checkpoint resumes them exactly.

A decoding state may hold leaves shared by all rows, such as the place in the current mini-batch that Titans'
and TTT's memories keep (`pos`). Such a leaf is carried too, and a step passes states only when its carried
value (after the model's `rebase_cache`: titans_mac with per-segment RoPE positions counts its stream position
within the segment) is the one a fresh row starts with (a window that is a multiple of the mini-batch ends at
`pos = 0`): then a kept row continues exactly as streaming would. Otherwise every row of that step starts fresh, and the
step's `passing_blocked` metric says so (a counter of all tokens read, as Hope's or an attention cache's
position, is never back at 0: such a family's rows always start fresh).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nlearn import models
from nlearn.errors import UserError


def enabled(config) -> bool:
    return config.train.get("state_passing", 0.0) > 0


def _cache_shapes(config, batch: int, max_len: int):
    return jax.eval_shape(lambda: models.build(config).init_cache(batch, max_len, jnp.float32))


BLOCKED_WARNING = ("warning: step {step} passed no state: {family}'s decoding state keeps a value shared by all "
                   "rows that the last window did not bring back to where a fresh row starts (a mini-batch position "
                   "does when train.seq_len is a multiple of the mini-batch; a count of all tokens read never does)")
SHARED = -1  # `batch_axes`' entry for a leaf without a batch axis (one value for all rows)


def batch_axes(config):
    """Per leaf of the decoding cache, the axis that indexes batch rows (found by comparing the cache's
    shapes at two batch sizes), or SHARED for a leaf kept once for all rows; a UserError when the cache is
    not of a fixed size (an attention cache grows with `max_len`: there is no state to carry)."""
    seq_len = config.train.seq_len
    one, two, longer = (_cache_shapes(config, 1, seq_len), _cache_shapes(config, 2, seq_len),
                        _cache_shapes(config, 1, 2 * seq_len))

    def axis(a, b, c):
        if a.shape != c.shape:
            raise UserError(f"train.state_passing needs a fixed-size recurrent state; family "
                            f"{config.model.family!r} keeps a cache that grows with the input")
        differ = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        if len(differ) > 1:
            raise UserError(f"train.state_passing: family {config.model.family!r} keeps a decoding state leaf "
                            f"of shape {a.shape} whose size follows the batch along several axes")
        return differ[0] if differ else SHARED

    return jax.tree.map(axis, one, two, longer)


def shared_leaves_agree(carry, fresh, axes):
    """Whether every shared leaf of `carry` (bool scalar) holds the value a fresh row starts with, so that
    kept and fresh rows can share it; True for a state with no shared leaf."""
    same = [jnp.all(old == new.astype(old.dtype))
            for old, new, axis in zip(jax.tree.leaves(carry), jax.tree.leaves(fresh), jax.tree.leaves(axes))
            if axis == SHARED]
    return jnp.all(jnp.stack(same)) if same else jnp.bool_(True)


def start_states(carry, fresh, axes, keep_B):
    """The batch's initial states: row r starts from `carry`'s row r where `keep_B[r]` (bool `[B]`), else
    from `fresh` (the model's own initial state, e.g. zeros or learned initial weights); shared leaves from
    `fresh` (the caller keeps no row unless `shared_leaves_agree`). A curriculum stage with more rows than
    the carry holds (shorter windows, same tokens per step) starts its extra rows fresh."""

    def select(old, new, axis):
        if axis == SHARED:
            return new
        rows, b = old.shape[axis], new.shape[axis]
        old = (jax.lax.slice_in_dim(old, 0, b, axis=axis) if b <= rows else
               jnp.concatenate([old, jax.lax.slice_in_dim(new, rows, b, axis=axis)], axis=axis))
        shape = [1] * old.ndim
        shape[axis] = b
        return jnp.where(keep_B.reshape(shape), old, new)

    return jax.tree.map(select, carry, fresh, axes)


def next_carry(carry, final, axes):
    """`carry` with its first rows replaced by the batch's final states (no gradient), as many as both
    have."""

    def update(old, new, axis):
        new = jax.lax.stop_gradient(new).astype(old.dtype)
        if axis == SHARED:
            return new
        rows, b = old.shape[axis], new.shape[axis]
        if b >= rows:
            return jax.lax.slice_in_dim(new, 0, rows, axis=axis)
        return jnp.concatenate([new, jax.lax.slice_in_dim(old, b, rows, axis=axis)], axis=axis)

    return jax.tree.map(update, carry, final, axes)


def keep_rows(rng_data, step, batch: int, probability: float, first_step: int = 0):
    """Which rows continue this step (bool `[B]`): a draw from the run's RNG and the step, so a resumed run
    draws the same rows; none before `first_step` (`train.state_passing_from`, counted from 0 as
    `state["step"]`)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(rng_data), step), 0x5AFE)
    return jax.random.bernoulli(key, probability, (batch,)) & (step >= first_step)
