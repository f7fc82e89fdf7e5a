"""optax AdamW with linear warmup then a cosine or warmup-stable-decay (WSD) schedule, global-norm
clipping, selective weight decay."""

from __future__ import annotations

import jax
import optax

NO_DECAY = ("embed", "norm", "scale", "bias")  # path fragments exempt from weight decay


SCHEDULES = ("cosine", "wsd")


def schedule_name(train) -> str:
    """`train.schedule`; configs saved before the key existed trained (and resume) with the cosine."""
    return train.get("schedule", "cosine")


def learning_rate(config) -> optax.Schedule:
    """Linear warmup to `train.lr`, then down to `lr * min_lr_ratio` at `train.steps`: "cosine" decays
    all the way; "wsd" (warmup-stable-decay) holds the peak and decays linearly over the last
    `train.decay_fraction` of the steps, so a run keeps its full lr until shortly before its end."""
    t = config.train
    warmup = min(t.warmup_steps, max(t.steps - 1, 0))
    end = t.lr * t.min_lr_ratio
    if schedule_name(t) == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=t.lr, warmup_steps=warmup,
            decay_steps=max(t.steps, warmup + 1), end_value=end)
    decay = min(max(1, round(t.decay_fraction * t.steps)), t.steps - warmup)
    stable_end = t.steps - decay
    return optax.join_schedules(
        [optax.linear_schedule(0.0, t.lr, max(warmup, 1)), optax.constant_schedule(t.lr),
         optax.linear_schedule(t.lr, end, max(decay, 1))],
        boundaries=[warmup, stable_end])


def decay_mask(params):
    """True for matrices that get weight decay: not norms, embeddings, biases or 1-D gates."""
    def keep(path, x):
        names = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path).lower()
        return x.ndim >= 2 and not any(frag in names for frag in NO_DECAY)

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(config) -> optax.GradientTransformation:
    t = config.train
    parts = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
    parts.append(optax.adamw(learning_rate(config), b1=t.b1, b2=t.b2, eps=t.eps,
                             weight_decay=t.weight_decay, mask=decay_mask))
    return optax.chain(*parts)
