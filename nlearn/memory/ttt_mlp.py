"""TTT-MLP (Sun et al. 2024): a two-layer MLP learner with LayerNorm and residual, trained while reading.

Per batch and head, `f(x; θ) = x + LN(gelu(x W1 + b1) W2 + b2)` with θ = (W1 `[D,F]`, b1 `[F]`,
W2 `[F,D]`, b2 `[D]`), F = 4·D in the layer, LN per head with `ln_scale`, `ln_bias`, ε = 1e-6, and
GELU the tanh approximation (as in ttt-lm-jax's `nn.gelu`); the inner loss is
`l_t = ½‖f(k_t) − v_t‖²`. Tokens are grouped in mini-batches of `minibatch`; inside one that
starts at θ_s every gradient is taken at θ_s and token t reads with its own prefix of updates:
`θ_t = θ_s − Σ_{j≤t} η_j ∇l_j(θ_s)`, `o_t = f(q_t; θ_t)` (Sun et al. 2024; docs/architecture.md).

That is the neural memory (`nlearn.memory.neural_memory`) with inner optimizer `sgd`, no forgetting,
`bias=True`, `residual=True` and `layer_norm=(ln_scale, ln_bias)`: its chunked dual form, token-by-
token twin, streaming state and decode step run TTT-MLP. This module keeps TTT-MLP's named weights
and converts them to the memory's weights, whose last input row is the bias (`[W1; b1]`, `[W2; b2]`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from nlearn.memory.linear_attention import HIGHEST, check_state_shape
from nlearn.memory.neural_memory import NeuralMemoryState, neural_memory, neural_memory_step
from nlearn.memory.ttt import check_ttt_args, check_ttt_step_args

TTT_MLP_IMPLS = ("dual", "recurrent")
_MEMORY_IMPL = {"dual": "chunked", "recurrent": "recurrent"}


class TTTMLPWeights(NamedTuple):
    """Fast weights of the inner MLP: W1 `[B,H,D,F]`, b1 `[B,H,F]`, W2 `[B,H,F,D]`, b2 `[B,H,D]`."""

    W1: jax.Array
    b1: jax.Array
    W2: jax.Array
    b2: jax.Array


class TTTMLPState(NamedTuple):
    """Streaming state of TTT-MLP.

    weights: after the last token seen (what its read used). start: where the current mini-batch
    began; its gradients are taken there. pos: int32 scalar, tokens of the current mini-batch
    already seen (0 <= pos < minibatch); when 0, start == weights.
    """

    weights: TTTMLPWeights
    start: TTTMLPWeights
    pos: jax.Array


def _to_theta(w: TTTMLPWeights) -> tuple:
    """Named weights -> the memory's `([W1; b1], [W2; b2])`."""
    return (jnp.concatenate([w.W1, w.b1[..., None, :]], axis=-2), jnp.concatenate([w.W2, w.b2[..., None, :]], axis=-2))


def _from_theta(theta) -> TTTMLPWeights:
    w1, w2 = theta
    return TTTMLPWeights(w1[..., :-1, :], w1[..., -1, :], w2[..., :-1, :], w2[..., -1, :])


def _to_stream(state: TTTMLPState) -> NeuralMemoryState:
    theta = _to_theta(state.weights)
    return NeuralMemoryState(theta, tuple(jnp.zeros_like(w) for w in theta), _to_theta(state.start), state.pos)


def _from_stream(st: NeuralMemoryState) -> TTTMLPState:
    # Between mini-batches the memory leaves its start unused; TTT-MLP's start is then the weights.
    start = tuple(jnp.where(st.pos == 0, w, s) for w, s in zip(st.theta, st.theta_start))
    return TTTMLPState(_from_theta(st.theta), _from_theta(start), st.pos)


def _options(minibatch: int, ln_scale, ln_bias, precision, inner_step) -> dict:
    """The neural-memory settings that make it TTT-MLP."""
    return dict(optimizer="sgd", objective="l2", activation="gelu", residual=True, bias=True, minibatch=minibatch,
                layer_norm=(ln_scale.astype(jnp.float32), ln_bias.astype(jnp.float32)), precision=precision,
                inner_step=inner_step)


# --------------------------------------------------------------------------------------------
# Argument checks and the public functions
# --------------------------------------------------------------------------------------------
def _batched(name: str, x, shape: tuple[int, ...], batch_size: int):
    """`x` of shape `shape` (shared by the batch) or `[B, *shape]`, as float32 `[B, *shape]`."""
    if tuple(x.shape) not in (tuple(shape), (batch_size,) + tuple(shape)):
        dims = ", ".join(str(s) for s in shape)
        raise ValueError(f"{name} must have shape [{dims}] or [B={batch_size}, {dims}], got shape {tuple(x.shape)}")
    return jnp.broadcast_to(x.astype(jnp.float32), (batch_size,) + tuple(shape))


def ttt_mlp_init_state(W1_0, b1_0, W2_0, b2_0, batch_size: int) -> TTTMLPState:
    """State at a sequence start from the learned initial weights.

    W1_0 `[H,D,F]`, b1_0 `[H,F]`, W2_0 `[H,F,D]`, b2_0 `[H,D]`, each optionally with a leading
    batch axis `[B,...]`.
    """
    if W1_0.ndim not in (3, 4):
        raise ValueError(f"W1_0 must have shape [H, D, F] or [B, H, D, F], got shape {tuple(W1_0.shape)}")
    h, d, f = W1_0.shape[-3:]
    w = TTTMLPWeights(
        _batched("W1_0", W1_0, (h, d, f), batch_size),
        _batched("b1_0", b1_0, (h, f), batch_size),
        _batched("W2_0", W2_0, (h, f, d), batch_size),
        _batched("b2_0", b2_0, (h, d), batch_size),
    )
    return TTTMLPState(w, w, jnp.zeros((), jnp.int32))


def _check_state(state, bsz: int, h: int, d: int) -> TTTMLPState:
    """Validate a `TTTMLPState` for `[B,H,D]` activations; return it in float32."""
    if not isinstance(state, TTTMLPState):
        raise ValueError(f"initial_state must be a TTTMLPState, got {type(state).__name__}")
    f = state.weights.W1.shape[-1]
    shapes = TTTMLPWeights((bsz, h, d, f), (bsz, h, f), (bsz, h, f, d), (bsz, h, d))
    out = []
    for part in ("weights", "start"):
        for field, x, shape in zip(TTTMLPWeights._fields, getattr(state, part), shapes):
            check_state_shape(f"initial_state.{part}.{field}", x, shape)
        out.append(TTTMLPWeights(*(x.astype(jnp.float32) for x in getattr(state, part))))
    check_state_shape("initial_state.pos", state.pos, ())
    return TTTMLPState(out[0], out[1], jnp.asarray(state.pos, jnp.int32))


def ttt_mlp(q, k, v, eta, *, W1_0=None, b1_0=None, W2_0=None, b2_0=None, ln_scale, ln_bias, minibatch: int = 16,
            initial_state: TTTMLPState | None = None, impl: str = "dual", remat_group: int = 4, precision=HIGHEST,
            inner_step: str = "paper"):
    """TTT-MLP with mini-batch gradient descent, read after each token's own prefix of updates.

    Args:
      q, k, v: `[B, T, H, D]` (the residual needs Dk == Dv); eta: `[B, T, H]` inner rates.
      W1_0 `[H, D, F]`, b1_0 `[H, F]`, W2_0 `[H, F, D]`, b2_0 `[H, D]` (learned init shared by the
        batch; each may carry a leading `B`). F is the hidden width (4·D in the TTT paper).
        Needed unless `initial_state` is given (which then replaces them).
      ln_scale, ln_bias: `[H, D]`, the inner LayerNorm's affine (ε = 1e-6).
      minibatch: tokens per inner mini-batch; T need not be a multiple.
      initial_state: a `TTTMLPState` from a previous call or `ttt_mlp_init_state`.
      impl: "dual" (the memory's chunked dual form) or "recurrent" (token by token, `jax.grad`).
      remat_group: mini-batches per rematerialized scan step of the dual form.
      precision: of every matmul (HIGHEST: float32 products on any backend).
      inner_step: "paper" (the sum above) or a bounded step (`neural_memory`'s `inner_step`).

    Returns: `(o [B,T,H,D] in q's dtype, TTTMLPState)` with a float32 state.
    """
    bsz, _t, h, d = check_ttt_args("ttt_mlp", q, k, v, eta, minibatch=minibatch, remat_group=remat_group, impl=impl,
                                   impls=TTT_MLP_IMPLS, ln_scale=ln_scale, ln_bias=ln_bias)
    opts = _options(minibatch, ln_scale, ln_bias, precision, inner_step)
    run = dict(lr=eta, impl=_MEMORY_IMPL[impl], remat_group=remat_group, return_stream_state=True, **opts)
    if initial_state is None:
        missing = [n for n, x in zip(TTTMLPWeights._fields, (W1_0, b1_0, W2_0, b2_0)) if x is None]
        if missing:
            raise ValueError(f"ttt_mlp needs {', '.join(n + '_0' for n in missing)} when initial_state is None")
        if W1_0.ndim not in (3, 4) or tuple(W1_0.shape[-3:-1]) != (h, d):
            raise ValueError(f"W1_0 must have shape [H, D, F] = [{h}, {d}, F] or [B, H, D, F], "
                             f"got shape {tuple(W1_0.shape)}")
        weights = ttt_mlp_init_state(W1_0, b1_0, W2_0, b2_0, bsz).weights
        o, st = neural_memory(q, k, v, weights0=_to_theta(weights), **run)
    else:
        state = _check_state(initial_state, bsz, h, d)
        o, st = neural_memory(q, k, v, initial_state=_to_stream(state), **run)
    return o, _from_stream(st)


def ttt_mlp_step(q_t, k_t, v_t, eta_t, state: TTTMLPState, *, ln_scale, ln_bias, minibatch: int = 16,
                 precision=HIGHEST, inner_step: str = "paper"):
    """One decode step: `[B,H,D]` rows, `eta_t [B,H]` -> `(o_t [B,H,D], TTTMLPState)`.

    Keeps the mini-batch schedule (gradients at `state.start`, reads with the accumulated prefix),
    so stepping through a sequence reproduces `ttt_mlp` exactly.
    """
    check_ttt_step_args(q_t, k_t, v_t, eta_t, minibatch=minibatch, ln_scale=ln_scale, ln_bias=ln_bias)
    state = _check_state(state, *k_t.shape)
    o, st = neural_memory_step(q_t, k_t, v_t, lr=eta_t, state=_to_stream(state),
                               **_options(minibatch, ln_scale, ln_bias, precision, inner_step))
    return o, _from_stream(st)
