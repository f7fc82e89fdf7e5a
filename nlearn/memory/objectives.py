"""Inner-loop objectives of the neural memory: the per-token loss l(f(k), v) its weights descend.

An objective is one small function `loss(pred [..., Dv], target [..., Dv]) -> [...]` (one loss per
token). Both implementations of `neural_memory` differentiate it with `jax.grad`, so a new objective
needs no hand-written gradient; add it to `OBJECTIVES` and a config string selects it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

Objective = Callable[[jax.Array, jax.Array], jax.Array]

HUBER_DELTA = 1.0


def l2(pred, target):
    """Associative-memory regression, ½‖f(k) − v‖² (the Titans / TTT objective)."""
    return 0.5 * jnp.sum(jnp.square(pred - target), axis=-1)


def dot(pred, target):
    """Negative dot-product similarity −⟨f(k), v⟩; its gradient does not depend on the memory's output."""
    return -jnp.sum(pred * target, axis=-1)


def huber(pred, target):
    """Huber loss (δ = 1) summed over features: ½r² for |r| ≤ δ, δ(|r| − δ/2) beyond; robust to outlier values."""
    r = pred - target
    a = jnp.abs(r)
    return jnp.sum(jnp.where(a <= HUBER_DELTA, 0.5 * r * r, HUBER_DELTA * (a - 0.5 * HUBER_DELTA)), axis=-1)


OBJECTIVES: dict[str, Objective] = {"l2": l2, "dot": dot, "huber": huber}


def get_objective(objective: str | Objective) -> Objective:
    """Resolve a registry name (or pass a callable through); an unknown name lists the valid ones."""
    if callable(objective):
        return objective
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; valid objectives: {sorted(OBJECTIVES)}")
    return OBJECTIVES[objective]


def output_grad(objective: Objective, pred, target):
    """∂l_t/∂pred_t for every token at once (per-token losses are independent, so grad of the sum)."""
    return jax.grad(lambda p: jnp.sum(objective(p, target)))(pred)
