"""optax AdamW with linear warmup then a cosine or warmup-stable-decay (WSD) schedule, global-norm
clipping, selective weight decay."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

NO_DECAY = ("embed", "norm", "scale", "bias")  # path fragments exempt from weight decay


SCHEDULES = ("cosine", "wsd")


def warmup_steps(train) -> int:
    """`train.warmup_steps`, at most all steps but one (of the configured total, whatever the run's)."""
    return min(train.warmup_steps, max(train.steps - 1, 0))


def learning_rate(config, total=None) -> optax.Schedule:
    """Linear warmup to `train.lr`, then down to `lr * min_lr_ratio` at `train.steps`: "cosine" decays
    all the way; "wsd" (warmup-stable-decay) holds the peak and decays linearly over the last
    `train.decay_fraction` of the steps, so a run keeps its full lr until shortly before its end.
    `train.decay_steps` > 0 ends the cosine there, the steps after it at the floor (e.g. a post-training phase).

    `total` (WSD only) replaces `train.steps`: `[steps, stable_end]` from `wsd_total`, which may be a
    traced int32 array: a time-budgeted run (`nlearn.train.time_budget`) chooses its total after compiling
    its train step. The boundary comes in computed by Python, as below, so both agree exactly."""
    t = config.train
    warmup = warmup_steps(t)
    end = t.lr * t.min_lr_ratio
    if t.schedule == "cosine":
        if total is not None:
            raise ValueError("only the wsd schedule takes a total other than train.steps")
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=t.lr, warmup_steps=warmup,
            decay_steps=max(t.get("decay_steps", 0) or t.steps, warmup + 1), end_value=end)
    if total is None:
        stable_end = wsd_stable_end(t.steps, warmup, t.decay_fraction)
        decay = t.steps - stable_end
        return optax.join_schedules(
            [optax.linear_schedule(0.0, t.lr, max(warmup, 1)), optax.constant_schedule(t.lr),
             optax.linear_schedule(t.lr, end, max(decay, 1))],
            boundaries=[warmup, stable_end])
    return _traced_wsd(t.lr, end, warmup, total)


def wsd_stable_end(steps: int, warmup: int, decay_fraction: float) -> int:
    """The step where a WSD schedule over `steps` leaves its peak (the last `decay_fraction` decays)."""
    return steps - min(max(1, round(decay_fraction * steps)), steps - warmup)


def wsd_total(config, steps: int) -> np.ndarray:
    """`[steps, stable_end]` (int32) of a WSD over `steps`, for `learning_rate(config, total)`."""
    t = config.train
    warmup = warmup_steps(t)
    return np.array([steps, wsd_stable_end(steps, warmup, t.decay_fraction)], np.int32)


def _traced_wsd(peak: float, end: float, warmup: int, total) -> optax.Schedule:
    """The WSD above with a traced total (optax's linear_schedule needs a Python length): the same
    formulas as optax's join of linear, constant and linear pieces, value for value."""
    total = jnp.asarray(total, jnp.int32)
    steps, stable_end = total[0], total[1]
    decay = steps - stable_end

    def ramp(count, start, length, begin_value, end_value):
        frac = 1 - jnp.clip(count - start, 0, length) / length
        return (begin_value - end_value) * frac + end_value

    def schedule(count):
        value = ramp(count, 0, max(warmup, 1), 0.0, peak)
        value = jnp.where(count < warmup, value, peak)
        return jnp.where(count < stable_end, value, ramp(count, stable_end, jnp.maximum(decay, 1), peak, end))

    return schedule


def decay_mask(params):
    """True for matrices that get weight decay: not norms, embeddings, biases or 1-D gates (the stacked
    blocks of `model.scan_layers=True` counted without their leading layers axis)."""
    from nlearn.models.lm import STACKED

    def keep(path, x):
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        names = "/".join(keys).lower()
        return x.ndim - (keys[:1] == [STACKED]) >= 2 and not any(frag in names for frag in NO_DECAY)

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(config, total=None) -> optax.GradientTransformation:
    """Clipping then AdamW on `learning_rate(config, total)` (`total`: see there)."""
    t = config.train
    parts = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
    parts.append(optax.adamw(learning_rate(config, total), b1=t.b1, b2=t.b2, eps=t.eps,
                             weight_decay=t.weight_decay, mask=decay_mask))
    return optax.chain(*parts)
