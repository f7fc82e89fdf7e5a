"""Inner-loop optimizers of the neural memory: how a token's gradient changes the fast weights.

Every optimizer is an `InnerOptimizer` with a per-token `step` (used by `impl="recurrent"` and the
decode step). Optimizers that are linear recurrences of the form

    U_t = μ_t U_{t-1} − η_t g_t                          (momentum=True;  else U is untouched)
    W_t = a_t W_{t-1} − η_t [x_tᵀ x_t W_{t-1}] + U'_t     (bracket only when precondition=True)

with a_t = 1 − α_t and U'_t = U_t (momentum) or −η_t g_t (no momentum) also have the fast chunked
dual form; `linear_optimizer` builds those from the two flags. An optimizer with `chunkable=False`
(e.g. one that orthogonalises its update) only runs with `impl="recurrent"`.

Conventions: row vectors, so a layer maps x [d_in] to x W with W [d_in, d_out]; `theta`, `U`,
`grads` are tuples (one entry per layer) of `[B, H, d_in, d_out]`; `inputs` are the layer inputs
x [B, H, d_in] at the state where the token's mini-batch starts; gates are `[B, H, 1, 1]`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
from jax import lax

HIGHEST = lax.Precision.HIGHEST

Step = Callable[..., tuple[tuple, tuple]]


@dataclasses.dataclass(frozen=True)
class InnerOptimizer:
    """A named inner optimizer.

    step(theta, U, grads, inputs, eta, mu, a) -> (theta, U) advances one token.
    momentum: whether the `momentum` gate μ is accepted (U is a running update) — without it the
      state U passes through untouched and passing a momentum gate is an error.
    precondition: the DGD term −η xᵀx W (only meaningful with chunkable=True).
    chunkable: whether `impl="chunked"` can run it (the step must then be the linear form above).
    """

    name: str
    step: Step
    momentum: bool
    precondition: bool = False
    chunkable: bool = True


def linear_optimizer(name: str, *, momentum: bool, precondition: bool) -> InnerOptimizer:
    """Build the linear-recurrence optimizer selected by the two flags (see the module docstring)."""

    def step(theta, U, grads, inputs, eta, mu, a):
        if momentum:
            U = tuple(mu * u - eta * g for u, g in zip(U, grads))
            delta = U
        else:
            delta = tuple(-eta * g for g in grads)
        new = []
        for w, d, x in zip(theta, delta, inputs):
            w_new = a * w + d
            if precondition:
                # Per-token matmuls in float32 on every backend (as the ops' chunked forms by default).
                xw = jnp.einsum("bhi,bhio->bho", x, w, precision=HIGHEST)
                w_new = w_new - eta * jnp.einsum("bhi,bho->bhio", x, xw, precision=HIGHEST)
            new.append(w_new)
        return tuple(new), U

    return InnerOptimizer(name=name, step=step, momentum=momentum, precondition=precondition)


INNER_OPTIMIZERS: dict[str, InnerOptimizer] = {
    # Titans: U_t = μ_t U_{t-1} − η_t g_t, W_t = (1 − α_t) W_{t-1} + U_t.
    "momentum": linear_optimizer("momentum", momentum=True, precondition=False),
    # Plain (decayed) gradient descent: W_t = (1 − α_t) W_{t-1} − η_t g_t.
    "sgd": linear_optimizer("sgd", momentum=False, precondition=False),
    # Nested Learning DGD (eq. 88) per layer: W_t = ((1 − α_t) I − η_t xᵀx) W_{t-1} − η_t g_t.
    "dgd": linear_optimizer("dgd", momentum=False, precondition=True),
    # DGD's preconditioner with Titans' momentum: W_t = ((1 − α_t) I − η_t xᵀx) W_{t-1} + U_t.
    "dgd_momentum": linear_optimizer("dgd_momentum", momentum=True, precondition=True),
}


def get_inner_optimizer(optimizer: str | InnerOptimizer) -> InnerOptimizer:
    """Resolve a registry name (or pass an `InnerOptimizer` through); an unknown name lists the valid ones."""
    if isinstance(optimizer, InnerOptimizer):
        return optimizer
    if optimizer not in INNER_OPTIMIZERS:
        raise ValueError(f"unknown inner optimizer {optimizer!r}; valid optimizers: {sorted(INNER_OPTIMIZERS)}")
    return INNER_OPTIMIZERS[optimizer]
