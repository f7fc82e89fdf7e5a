"""optax AdamW with linear warmup + cosine decay, global-norm clipping, selective weight decay."""

from __future__ import annotations

import jax
import optax

NO_DECAY = ("embed", "norm", "scale", "bias")  # path fragments exempt from weight decay


def learning_rate(config) -> optax.Schedule:
    t = config.train
    warmup = min(t.warmup_steps, max(t.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=warmup,
        decay_steps=max(t.steps, warmup + 1), end_value=t.lr * t.min_lr_ratio)


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
