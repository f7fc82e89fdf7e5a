"""Titans long-term neural memory (LMM) / TTT-MLP: an MLP whose weights are trained while it reads.

Per batch element and head, the memory is an MLP `f(x; θ)` with weights θ = (W_1..W_L),
`W_i [d_in, d_out]`: h_0 = x, h_i = σ(h_{i-1} W_i) for i < L, z_L = h_{L-1} W_L, f(x) = z_L
(+ x when `residual`). Two inner-model options: `bias` stores each layer's bias as the last input
row of its weight, so the layer sees [h, 1] and every formula below holds with that input; and
`layer_norm=(scale, shift)` makes f(x) = LN(z_L)·scale + shift (+ x). TTT-MLP is this memory with
both, the residual and `sgd` (`nlearn.memory.ttt_mlp`). Token t writes by one step of an inner
optimizer on l_t(θ) = loss(f(k_t), v_t) and then reads o_t = f(q_t; θ_t) (read after write).
Mini-batches of b tokens take all their gradients at the state θ_{s(t)} where the mini-batch
starts (b = 1: fully online, θ_{t-1}):

    g_t = ∇_θ l_t(θ_{s(t)})
    momentum:  U_t = μ_t U_{t-1} − η_t g_t,  θ_t = (1 − α_t) θ_{t-1} + U_t
    sgd:       θ_t = (1 − α_t) θ_{t-1} − η_t g_t                       (U passes through)
    dgd:       per layer, with x_t that layer's input at θ_{s(t)} (for W_1: x_t = k_t),
               W_t = ((1 − α_t) I − η_t x_tᵀ x_t) W_{t-1} − η_t g_t             (U passes through)
    dgd_momentum: the same preconditioner with the momentum update U_t in place of −η_t g_t

`momentum=None` means μ = 0 (then "momentum" is decayed SGD whose state U holds −η_t g_t of the last
token); `decay=None` means α = 0. Activations: "gelu" is the tanh approximation (jax.nn.gelu's
default, also ttt-lm-jax's); "gelu_exact" is the erf form, several times slower to differentiate
twice on CPU.

DGD (Nested Learning eq. 88) is written there for column-vector memories, M_t = M_{t-1}(α_t I −
η_t k_t k_tᵀ) − η_t ∇L with α_t a retention. With our row vectors W = Mᵀ the symmetric preconditioner
moves to the input side, W_t = (a_t I − η_t kᵀk) W_{t-1} − η_t g_t with a_t = 1 − α_t (our α is a
forgetting rate, as in Titans); for an MLP every W_i gets the preconditioner of its own input x_i,
taken at the mini-batch start like the gradient (as in Nested Learning's chunk-wise eq. 90), while it
multiplies the current W_{t-1}. What it reduces to for L = 1, α = 0:
    dot objective (g = −kᵀv):  W_t = W_{t-1} + η_t k_tᵀ(v_t − k_t W_{t-1}) — exactly the delta rule
        with β = η, for every mini-batch size (the gradient does not depend on the state);
    l2, b = 1 (g = kᵀ(kW_{t-1} − v)):  W_t = (I − 2η_t k_tᵀk_t) W_{t-1} + η_t k_tᵀ v_t, a delta rule
        with β = 2η toward the target v/2 (the preconditioner doubles the erase).

DGD is only stable while η_t‖x_t‖² < 2 for every layer input (the preconditioner's eigenvalue
a_t − η_t‖x‖² must stay above −1): keys are unit-norm, but hidden activations of a deep memory are
not, so deep DGD memories need a small η.

Bounded steps (`inner_step`; "paper" is the steps above, "bounded" all three parts, or parts joined
by "+"). The paper's steps are not bounded: a mini-batch sums b gradients taken at one state, so b
keys that point alike make one step of ~b·η‖x‖²; momentum inside a mini-batch re-adds every stale
gradient on each later token (~b²/2 steps' worth for μ → 1); and the curvature along a hidden
layer's input h is ‖h‖², which nothing bounds. The parts, each a change of the step size only:
    mean:        η_t/b, the mini-batch's gradient averaged instead of summed;
    ema:         U_t = μ_t U_{t-1} − (1 − μ_t) η_t g_t (momentum as an exponential average: one
                 gradient moves θ by at most η_t g_t over all later tokens; for dgd_momentum the
                 preconditioner's η_t is scaled alike);
    normalized:  per layer, token t's gradient (and DGD term) over 1 + ‖x_t‖², x_t that layer's
                 input at the mini-batch start (the normalised-LMS step): the last layer's write then
                 moves its output toward the target by a fraction η_t‖x‖²/(1 + ‖x‖²) < η_t.
    overlap:     per layer, over 1 + Σ_j |x_t·x_j|, j the tokens of t's mini-batch up to t itself (so
                 ‖x_t‖² and the overlap with the earlier inputs; b = 1: "normalized"). Orthogonal inputs
                 each take a full normalised step, b inputs that point alike share about one: the
                 summed mini-batch stays bounded without averaging away a lone token's write.
    gain:        with normalized or overlap, each layer's ‖x_t‖² (or overlap) times the token's downstream
                 gain ‖δ_i,t‖² / ‖δ_L,t‖² (δ_i the error at layer i's output, δ_L at the memory's): a step on
                 layer i moves the output along its error by η‖x‖²‖δ_i‖² / ‖δ_L‖² to first order, so the
                 divisor bounds every layer's write as the normalised step bounds the last one's (whose gain
                 is 1). Without it a hidden layer's step grows with the later layers' weights (‖W_2‖² for
                 the first layer of a depth-2 memory), which the outer loop can make large.
With mean, ema and normalized, a mini-batch moves the last layer's output by less than max η of its
error, so for η ≤ 1 no write can overshoot (docs/paper_notes.md). The Titans default is
"ema+overlap+gain" ("bounded", mean+ema+normalized, averages a lone token's write down by b: MQAR does not
recall with it).

Two implementations with the same semantics:
- impl="recurrent": per-token `jax.grad` of the inner loss inside `lax.scan`; any inner model or
  optimizer step; √T-token groups are rematerialised (~2√T states kept for the backward pass).
- impl="chunked" (default), b > 1: one scan step per mini-batch, `SCAN_GROUP` mini-batches per
  rematerialised (`jax.checkpoint`) step, so backward memory is O(T·d + (T/(b·G))·|θ|). Within a
  mini-batch every layer's gradient is a sum of outer products x_jᵀ δ_j of its inputs and
  back-propagated errors at the start state; momentum and decay are linear recurrences whose b×b
  lower-triangular coefficient matrices come from cumulative products of a = 1 − α and μ, so
  θ_t = A_t θ_c + m_t U_c − Σ_j C_tj η_j x_jᵀ δ_j. Reads use the dual form
  y W_t = A_t y W_c + m_t y U_c − Σ_j C_tj η_j (y·x_j) δ_j layer by layer; DGD adds a unit
  lower-triangular solve for u_t = x_t W_{t-1} (as in the chunked delta rule). No per-token copy of
  the weights is ever formed.
- impl="chunked", b = 1: with a deep memory each token's gradient needs the previous token's
  weights, so a scan over tokens is inherent (grouping tokens into a dual-form chunk would change
  the schedule). The body is the lean per-token update: hand-written backprop, rank-1 updates, no
  coefficient matrices; √T-token groups are rematerialised, so the backward pass holds ~2√T weight
  copies. It runs any `InnerOptimizer`.

Streaming: `initial_state=(θ, U)` starts a new mini-batch, so a stream split on mini-batch
boundaries is exact. Splits anywhere (and the decode step) use `NeuralMemoryState`, which also
carries the mini-batch start state and the position in the mini-batch: pass
`return_stream_state=True` to get one, and give it back as `initial_state`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from nlearn.memory.chunking import (
    check_gate,
    check_positive,
    check_qkv,
    from_chunks,
    place_at,
    take_at,
    to_chunks,
)
from nlearn.memory.delta import unit_lower_inverse
from nlearn.memory.inner_optimizers import InnerOptimizer, get_inner_optimizer
from nlearn.memory.linear_attention import HIGHEST
from nlearn.memory.objectives import Objective, get_objective, output_grad
from nlearn.memory.ttt import ln_parts

ACTIVATIONS: dict[str, Callable] = {
    "gelu": lambda z: jax.nn.gelu(z, approximate=True),
    "gelu_exact": lambda z: jax.nn.gelu(z, approximate=False),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
    "identity": lambda z: z,
}

IMPLS = ("chunked", "recurrent")

# The parts of a bounded inner step (see `inner_step` in the module docstring); "paper" is none of them.
STEP_PARTS = ("mean", "ema", "normalized", "overlap", "gain")
STEP_ALIASES = {"paper": (), "bounded": ("mean", "ema", "normalized")}


def step_parts(inner_step: str) -> frozenset:
    """The parts an `inner_step` name selects: "paper", "bounded" (all parts) or parts joined by "+"."""
    if inner_step in STEP_ALIASES:
        return frozenset(STEP_ALIASES[inner_step])
    parts = inner_step.split("+")
    bad = [p for p in parts if p not in STEP_PARTS]
    if bad or len(set(parts)) != len(parts):
        raise ValueError(f"unknown inner_step {inner_step!r}; valid: {sorted(STEP_ALIASES)} or parts of "
                         f"{list(STEP_PARTS)} joined by '+'")
    if {"normalized", "overlap"} <= set(parts):
        raise ValueError(f"inner_step {inner_step!r}: 'overlap' already includes 'normalized'; pick one")
    if "gain" in parts and not {"normalized", "overlap"} & set(parts):
        raise ValueError(f"inner_step {inner_step!r}: 'gain' scales the divisor of 'normalized' or 'overlap'; "
                         "join it with one of them")
    return frozenset(parts)


class NeuralMemoryState(NamedTuple):
    """Streaming state: weights θ and momentum U (tuples of `[B, H, d_in, d_out]`), the state where
    the current mini-batch started, and the position in that mini-batch (int32 scalar, 0 = the next
    token starts a new mini-batch and `theta_start` is unused); with the "overlap" step also the keys
    `[B, H, b, Dk]` of the current mini-batch so far (None otherwise)."""

    theta: tuple
    U: tuple
    theta_start: tuple
    pos: jax.Array
    keys: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class _Spec:
    act: Callable
    residual: bool
    objective: Objective
    opt: InnerOptimizer
    minibatch: int
    precision: object = HIGHEST
    bias: bool = False  # every weight's last input row is its bias (the layer sees [x, 1])
    norm: tuple | None = None  # (scale, shift) [H, Dv] of a LayerNorm on the last layer's output
    step: frozenset = frozenset()  # the parts of the bounded step (`step_parts`)

    @property
    def normalized(self) -> bool:
        """Whether each token's step is over a divisor of its layer inputs ("normalized" or "overlap")."""
        return "normalized" in self.step or "overlap" in self.step

    @property
    def overlap(self) -> bool:
        return "overlap" in self.step and self.minibatch > 1


def _make_spec(activation, residual, objective, optimizer, minibatch, *, precision=HIGHEST, bias=False,
               layer_norm=None, inner_step: str = "paper") -> _Spec:
    check_positive("minibatch", minibatch)
    parts = step_parts(inner_step)
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; valid activations: {sorted(ACTIVATIONS)}")
    if layer_norm is not None and (len(layer_norm) != 2 or layer_norm[0].shape != layer_norm[1].shape
                                   or layer_norm[0].ndim != 2):
        raise ValueError("layer_norm must be a pair (scale, shift) of [H, Dv] arrays")
    return _Spec(ACTIVATIONS[activation], bool(residual), get_objective(objective),
                 get_inner_optimizer(optimizer), minibatch, precision, bool(bias),
                 None if layer_norm is None else tuple(layer_norm), parts)


def _step_gates(spec: _Spec, eta, mu):
    """The step size the optimizer sees: η/b with "mean" (the mini-batch's gradient averaged, not summed)
    and (1 − μ)η with "ema" (momentum as an exponential average: one gradient moves θ by at most η in all)."""
    if "mean" in spec.step and spec.minibatch > 1:
        eta = eta / spec.minibatch
    if "ema" in spec.step and mu is not None and spec.opt.momentum:
        eta = eta * (1.0 - mu)
    return eta


def _input_scale(x, gain=None):
    """1 / (1 + ‖x‖²) per token of a layer input x [..., d] (the normalised-LMS step's divisor); with the
    token's downstream `gain` [...], 1 / (1 + gain·‖x‖²)."""
    sq = jnp.sum(jnp.square(x), axis=-1)
    return 1.0 / (1.0 + (sq if gain is None else gain * sq))


def _overlap_scale(dots, mask, gain=None):
    """1 / (1 + Σ_j |x·x_j|) from `dots [..., b]` of an input with its mini-batch's inputs, `mask` marking
    the j up to the input itself (the "overlap" step's divisor); with `gain`, the sum times it."""
    total = jnp.sum(jnp.abs(dots) * mask, axis=-1)
    return 1.0 / (1.0 + (total if gain is None else gain * total))


def _gains(spec: _Spec, delta_norms):
    """Per layer, each token's downstream gain ‖δ_i‖² / ‖δ_L‖² from the squared error norms `delta_norms`
    (a list over layers of `[...]`), None for the last layer (gain 1) and for every layer without "gain".
    A step size to the outer loop (no gradient through it): differentiating it cost ~25% more backward time
    (depth 2, b = 16, T = 4096)."""
    if "gain" not in spec.step:
        return [None] * len(delta_norms)
    last = jax.lax.stop_gradient(delta_norms[-1])
    return [_ratio(jax.lax.stop_gradient(d), last) for d in delta_norms[:-1]] + [None]


def _ratio(a, b):
    """a / b where b > 0, else 1 (a token without error writes nothing), with finite gradients either way."""
    ok = b > 0
    return jnp.where(ok, a / jnp.where(ok, b, 1.0), 1.0)


def _squared_norms(deltas):
    return [jnp.sum(jnp.square(d), axis=-1) for d in deltas]


def _scale_step(grads, inputs, scales):
    """Each layer's gradient times its step scale (the "normalized" or "overlap" divisor's inverse), and the
    inputs the DGD preconditioner sees times its square root (so its term η xᵀx W is divided alike)."""
    grads = tuple(g * s[..., None, None] for g, s in zip(grads, scales))
    inputs = [x * jnp.sqrt(s)[..., None] for x, s in zip(inputs, scales)]
    return grads, inputs


# ----------------------------------------------------------------------------------------------
# Weights and state


def _check_weights(weights, dk: int, dv: int, spec: _Spec, batch: int | None = None) -> None:
    if not isinstance(weights, (tuple, list)) or len(weights) == 0:
        raise ValueError("weights0 must be a non-empty tuple of [H, d_in, d_out] or [B, H, d_in, d_out] arrays")
    d = dk
    for i, w in enumerate(weights):
        rows = d + 1 if spec.bias else d  # with biases, the last row of each weight
        if w.ndim not in (3, 4) or w.shape[-2] != rows:
            raise ValueError(
                f"weight {i} must have shape [H, {rows}, d_out] or [B, H, {rows}, d_out], got {tuple(w.shape)}")
        if batch is not None and w.ndim == 4 and w.shape[0] != batch:
            raise ValueError(f"weight {i} has batch {w.shape[0]}, expected {batch}")
        d = w.shape[-1]
    if d != dv:
        raise ValueError(f"the last weight must output Dv = {dv} features, got {d}")
    if spec.norm is not None and spec.norm[0].shape != (weights[0].shape[-3], dv):
        raise ValueError(f"layer_norm arrays must have shape [H, Dv] = {(weights[0].shape[-3], dv)}, "
                         f"got {tuple(spec.norm[0].shape)}")
    if spec.residual and dk != dv:
        raise ValueError(f"residual=True needs Dk == Dv, got Dk={dk}, Dv={dv}")


def init_state(weights0, batch: int, *, minibatch: int = 1, inner_step: str = "paper",
               bias: bool = False) -> NeuralMemoryState:
    """Fresh streaming state: θ = weights0 (broadcast to `[B, H, ...]`), U = 0, new mini-batch next; with the
    "overlap" step and `minibatch` > 1 also room for a mini-batch of keys (a decode loop's state keeps its shape)."""
    theta = tuple(jnp.broadcast_to(w, (batch,) + w.shape[-3:]) for w in weights0)
    zeros = tuple(jnp.zeros_like(w) for w in theta)
    keys = None
    if "overlap" in step_parts(inner_step) and minibatch > 1:
        w = theta[0]
        keys = jnp.zeros(w.shape[:2] + (minibatch, w.shape[2] - int(bias)), w.dtype)
    return NeuralMemoryState(theta, zeros, theta, jnp.zeros((), jnp.int32), keys)


neural_memory_init_state = init_state  # the name the package exports (like ttt_linear_init_state)


def _as_stream_state(initial_state, batch: int) -> tuple[NeuralMemoryState, bool]:
    """Normalise `initial_state`; the flag says whether it may start mid-mini-batch."""
    if isinstance(initial_state, NeuralMemoryState):
        st = initial_state
        return NeuralMemoryState(tuple(st.theta), tuple(st.U), tuple(st.theta_start),
                                 jnp.asarray(st.pos, jnp.int32), st.keys), True
    theta, U = initial_state
    theta, U = tuple(theta), tuple(U)
    if len(theta) != len(U):
        raise ValueError("initial_state (theta, U) must have one U per weight")
    for w, u in zip(theta, U):
        if w.ndim != 4 or w.shape[0] != batch or u.shape != w.shape:
            raise ValueError(f"initial_state arrays must be [B={batch}, H, d_in, d_out] and match")
    return NeuralMemoryState(theta, U, theta, jnp.zeros((), jnp.int32)), False


# ----------------------------------------------------------------------------------------------
# The inner model


def _apply(h, w, precision):
    """h [B, H, d] or [B, H, C, d] times w [B, H, d, e]."""
    if h.ndim == w.ndim - 1:
        return jnp.einsum("bhi,bhio->bho", h, w, precision=precision)
    return jnp.matmul(h, w, precision=precision)


def _layer_input(spec: _Spec, h):
    """What a layer multiplies by its weight: h, or [h, 1] when the weight's last row is a bias."""
    if not spec.bias:
        return h
    return jnp.concatenate([h, jnp.ones(h.shape[:-1] + (1,), h.dtype)], axis=-1)


def _head_rows(a, z):
    """A per-head `[H, D]` array shaped to broadcast against z `[B, H, D]` or `[B, H, C, D]`."""
    return a.reshape((a.shape[0],) + (1,) * (z.ndim - 3) + (a.shape[1],))


def _output(spec: _Spec, z, x):
    """The memory's output from the last layer's z and the input x: LayerNorm and residual if set."""
    if spec.norm is not None:
        scale, shift = spec.norm
        z = ln_parts(z)[0] * _head_rows(scale, z) + _head_rows(shift, z)
    return z + x if spec.residual else z


def _mlp(spec: _Spec, theta, x):
    """f(x; θ) and the input of every layer."""
    inputs = []
    h = x
    for i, w in enumerate(theta):
        h = _layer_input(spec, h)
        inputs.append(h)
        h = _apply(h, w.astype(h.dtype), spec.precision)
        if i < len(theta) - 1:
            h = spec.act(h)
    return _output(spec, h, x), inputs


def mlp_apply(theta, x, *, activation: str = "gelu", residual: bool = False, bias: bool = False, layer_norm=None,
              precision=HIGHEST):
    """The memory's read f(x; θ) without a write, the same function the op reads with.

    θ: tuple of `[B, H, d_in, d_out]` (`[B, H, d_in + 1, d_out]` with `bias`); x: `[B, H, d]` or
    `[B, H, T, d]` (heads before tokens) -> `[..., d_out]`; the weights are cast to x's dtype.
    """
    spec = _make_spec(activation, residual, "l2", "sgd", 1, precision=precision, bias=bias, layer_norm=layer_norm)
    return _mlp(spec, tuple(theta), x)[0]


# ----------------------------------------------------------------------------------------------
# Recurrent form (reference, decode step)


def _gate4(g):
    return g[..., None, None]


def _token_step(spec: _Spec, state: NeuralMemoryState, q, k, v, eta, mu, a, want_loss: bool):
    """One token for all (batch, head): q, k [B, H, Dk], v [B, H, Dv], gates [B, H]."""
    new_mb = state.pos == 0
    theta_s = tuple(jnp.where(new_mb, c, s) for c, s in zip(state.theta, state.theta_start))

    def inner_loss(theta):
        pred, inputs = _mlp(spec, theta, k)
        return jnp.sum(spec.objective(pred, v)), inputs

    grads, inputs = jax.grad(inner_loss, has_aux=True)(theta_s)
    gains = [None] * len(grads)
    if "gain" in spec.step:  # one token's gradient is x_iᵀ δ_i, so ‖δ_i‖² = ‖g_i‖² / ‖x_i‖² (the errors' norms)
        gains = _gains(spec, [_ratio(jnp.sum(jnp.square(g), axis=(-2, -1)), jnp.sum(jnp.square(x), axis=-1))
                              for g, x in zip(grads, inputs)])
    keys = state.keys
    if spec.overlap:  # this token's key joins the mini-batch's; each layer's divisor counts them up to it
        keys = _keys_buffer(state, k, spec.minibatch)
        slot = jnp.arange(spec.minibatch) == state.pos
        keys = jnp.where(slot[:, None], k[..., None, :], keys)
        earlier = _mlp(spec, theta_s, keys)[1]  # each layer's inputs at the start state, [B, H, b, d_i]
        mask = (jnp.arange(spec.minibatch) <= state.pos).astype(k.dtype)
        scales = [_overlap_scale(jnp.einsum("...d,...jd->...j", x, e, precision=spec.precision), mask, g)
                  for x, e, g in zip(inputs, earlier, gains)]
        grads, inputs = _scale_step(grads, inputs, scales)
    elif spec.normalized:
        grads, inputs = _scale_step(grads, inputs, [_input_scale(x, g) for x, g in zip(inputs, gains)])
    theta, U = spec.opt.step(state.theta, state.U, grads, inputs, _gate4(eta), _gate4(mu), _gate4(a))
    o = _mlp(spec, theta, q)[0]
    new = NeuralMemoryState(theta, U, theta_s, (state.pos + 1) % spec.minibatch, keys)
    losses = None
    if want_loss:
        losses = (spec.objective(_mlp(spec, state.theta, k)[0], v), spec.objective(_mlp(spec, theta, k)[0], v))
    return o, new, losses


def _keys_buffer(state: NeuralMemoryState, k, minibatch: int, fresh: bool = False):
    """The state's keys of the current mini-batch `[B, H, b, Dk]`; zeros for a state that has none and
    starts a new mini-batch (`fresh`, or a position known to be 0; any other is refused)."""
    if state.keys is not None:
        return state.keys.astype(k.dtype)
    if not fresh and _static_int(state.pos) != 0:
        raise ValueError("inner_step 'overlap' resumes mid-mini-batch only from a state that carries its "
                         "keys (init_state(..., minibatch=, inner_step=) or return_stream_state=True)")
    return jnp.zeros(k.shape[:2] + (minibatch, k.shape[-1]), k.dtype)


def _default_gates(spec: _Spec, eta, mu, a):
    if mu is None:
        mu = jnp.zeros_like(eta)
    if a is None:
        a = jnp.ones_like(eta)
    return eta, mu, a


def _sqrt_scan(step, carry, seqs):
    """`lax.scan(step, carry, seqs)` over time-major `seqs` with two-level checkpointing: groups of
    ~√T tokens are rematerialised, so the backward pass holds ~2√T carries instead of T.
    Padding tokens (up to a whole number of groups) leave the carry unchanged."""
    t_len = seqs[0].shape[0]
    group = max(1, round(t_len**0.5))
    t_pad = -(-t_len // group) * group

    def prep(x):
        x = jnp.pad(x, [(0, t_pad - t_len)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape((t_pad // group, group) + x.shape[1:])

    def masked(c, x):
        *x, live = x
        new, y = step(c, tuple(x))
        return jax.tree_util.tree_map(lambda n, o: jnp.where(live, n, o), new, c), y

    inner = step if t_pad == t_len else masked
    xs = tuple(prep(x) for x in seqs)
    if t_pad != t_len:
        xs = xs + (prep(jnp.arange(t_len) >= 0),)
    carry, ys = lax.scan(jax.checkpoint(lambda c, xg: lax.scan(inner, c, xg)), carry, xs)
    return carry, jax.tree_util.tree_map(lambda y: y.reshape((t_pad,) + y.shape[2:])[:t_len], ys)


def _recurrent(spec, state, q, k, v, eta, mu, a, want_loss):
    eta, mu, a = _default_gates(spec, eta, mu, a)
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, eta, mu, a))

    def body(st, x):
        o, st, losses = _token_step(spec, st, *x, want_loss)
        return st, (o, losses)

    state, (o, losses) = _sqrt_scan(body, state, xs)
    o = jnp.moveaxis(o, 0, 1)
    if want_loss:
        losses = tuple(jnp.moveaxis(l, 0, 1) for l in losses)
    return o, state, losses


# ----------------------------------------------------------------------------------------------
# Chunked (dual) form


_TINY = 1e-30


def _log_gate(g):
    """log g for a gate in [0, 1]; g = 0 maps to log(1e-30), so products through it are ~1e-30·(...)
    instead of exactly 0 (a saturated sigmoid gate has zero derivative anyway)."""
    return jnp.log(jnp.maximum(g, jnp.asarray(_TINY, g.dtype)))


def _transfer(g, precision):
    """g [..., c] -> (P [..., c, c], p [..., c]) with P[t, r] = Π_{r < m ≤ t} g_m for r ≤ t (else 0)
    and p[t] = Π_{m ≤ t} g_m. Sums of logs via a lower-triangular matmul: small, exact-order sums,
    and a cheap gradient (cumprod's gradient on CPU is a large associative scan)."""
    c = g.shape[-1]
    lg = _log_gate(g)
    idx = jnp.arange(c)
    tril = (idx[:, None] >= idx[None, :]).astype(g.dtype)
    later = idx[:, None] > idx[None, :]  # [m, r]: m > r
    seg = jnp.matmul(tril, jnp.where(later, lg[..., :, None], jnp.zeros((), g.dtype)), precision=precision)
    pmat = jnp.where(tril > 0, jnp.exp(seg), jnp.zeros((), g.dtype))
    pvec = jnp.exp(jnp.einsum("tm,...m->...t", tril, lg, precision=precision))
    return pmat, pvec


def _shift_vec(x, first: float):
    """x_prev[t] = x[t-1], x_prev[0] = first (the coefficient of the state before the token)."""
    return jnp.concatenate([jnp.full(x.shape[:-1] + (1,), first, x.dtype), x[..., :-1]], axis=-1)


def _shift_rows(x):
    return jnp.concatenate([jnp.zeros_like(x[..., :1, :]), x[..., :-1, :]], axis=-2)


def _swap(x):
    return jnp.swapaxes(x, -1, -2)


# Mini-batches per rematerialised scan step (unrolled) once there are at least 16 groups: the
# backward pass keeps one state per group instead of one per mini-batch (the forward is recomputed
# once either way); short sequences keep one mini-batch per step, which compiles faster.
SCAN_GROUP = 4


def _outer_sum(x, e, precision):
    """Σ_j x_jᵀ e_j for x [..., c, d_in], e [..., c, d_out] -> [..., d_in, d_out]."""
    return jnp.matmul(_swap(x), e, precision=precision)


def _chunk(spec: _Spec, theta_s, theta_c, U_c, xs, *, same_start: bool, use_mu: bool, want_loss: bool):
    """One mini-batch of c tokens (all arrays `[B, H, c, ...]`, gates `[B, H, c]`).

    theta_s: state where the mini-batch's gradients are taken; theta_c, U_c: current state (equal
    to theta_s except when a stream resumes mid-mini-batch). Returns the new (θ, U) and the reads.
    """
    q, k, v, eta, mu, a, act = xs
    opt = spec.opt
    nl = len(theta_c)
    dt = q.dtype
    c = q.shape[-2]
    prec = spec.precision
    mm = lambda x, y: jnp.matmul(x, y, precision=prec)  # noqa: E731

    # Key side at the start state: layer inputs x_i, pre-activations z_i, errors δ_i. When the
    # reads start from the same state, q meets W_1 in the same matmul as k.
    q_first = None
    if same_start:
        zz = mm(_layer_input(spec, jnp.concatenate([k, q], axis=-2)), theta_s[0])
        q_first = zz[..., c:, :]
        first_layer = zz[..., :c, :]
    inputs, zs, deltas = _key_side(spec, theta_s, k, v, first_layer if q_first is not None else None)
    # "normalized": token j's step on layer i is over 1 + ‖x_ij‖² (its gradient and its DGD term);
    # "overlap": over 1 + Σ_{r ≤ j} |x_ij·x_ir| (the mini-batch's tokens up to j, all in this chunk).
    gains = _gains(spec, _squared_norms(deltas))  # "gain": each token's downstream gain per layer
    if spec.overlap:
        tril = jnp.tril(jnp.ones((c, c), dt))
        scales = [_overlap_scale(mm(x, _swap(x)), tril, g) for x, g in zip(inputs, gains)]
    else:
        scales = [_input_scale(x, g) for x, g in zip(inputs, gains)] if spec.normalized else [None] * nl
    if spec.normalized:
        deltas = [d * s_[..., None] for d, s_ in zip(deltas, scales)]

    # Coefficients: θ_t = A_t θ_c + m_t U_c − Σ_j Cη_tj x_jᵀδ_j − Σ_j Dη_tj x_jᵀu_j.
    if a is None:
        dmat = jnp.broadcast_to(jnp.tril(jnp.ones((c, c), dt)), eta.shape + (c,))
        avec = jnp.ones_like(eta)
    else:
        dmat, avec = _transfer(a, prec)
    cm = jnp.ones_like(eta) if act is None else jnp.broadcast_to(act, eta.shape)
    mvec = pmat = None
    if opt.momentum:
        pmat, mprod = _transfer(mu, prec)
        cmat = mm(dmat, cm[..., :, None] * pmat)
        if use_mu:
            mvec = jnp.einsum("...tr,...r->...t", dmat, cm * mprod, precision=prec)
    else:
        cmat = dmat
    ceta = cmat * eta[..., None, :]
    # The DGD term's coefficients, one per layer (they differ only with "normalized").
    deta = [None] * nl
    if opt.precondition:
        deta = [dmat * (eta if s_ is None else eta * s_)[..., None, :] for s_ in scales]
    need_prev = opt.precondition or want_loss
    if need_prev:
        avec_p = _shift_vec(avec, 1.0)
        mvec_p = None if mvec is None else _shift_vec(mvec, 0.0)
        ceta_p = _shift_rows(ceta)
        deta_p = [None if d is None else _shift_rows(d) for d in deta]

    # DGD: u_t = x_t W_{t-1} solves (I + G ⊙ Dη_prev) u = A_prev x W_c + m_prev x U_c − (G ⊙ Cη_prev) δ.
    us = [None] * nl
    if opt.precondition:
        for i in range(nl):
            x = inputs[i]
            gram = mm(x, _swap(x))
            xw = zs[i] if same_start else mm(x, theta_c[i])
            rhs = avec_p[..., None] * xw - mm(gram * ceta_p, deltas[i])
            if mvec_p is not None:
                rhs = rhs + mvec_p[..., None] * mm(x, U_c[i])
            # (I + strictly lower)⁻¹ by block doubling: batched matmuls, no LAPACK call (whose
            # OpenBLAS threads fight XLA's on a small CPU) and no row-by-row solve.
            us[i] = mm(unit_lower_inverse(gram * deta_p[i], prec), rhs)

    cat = [None] * nl
    if mvec is not None:
        # y W_c and y U_c in one matmul against [W_c | U_c].
        cat = [jnp.concatenate([t_, u_], axis=-1) for t_, u_ in zip(theta_c, U_c)]

    def read(y0, av, mv, ce, de, first=None):
        y = y0
        for i in range(nl):
            y = _layer_input(spec, y)
            gy = mm(y, _swap(inputs[i]))
            yu = None
            if i == 0 and first is not None:
                yw = first
            elif mv is not None and cat[i] is not None:
                yy = mm(y, cat[i])
                yw, yu = yy[..., :theta_c[i].shape[-1]], yy[..., theta_c[i].shape[-1]:]
            else:
                yw = mm(y, theta_c[i])
            z = av[..., None] * yw - mm(gy * ce, deltas[i])
            if mv is not None:
                z = z + mv[..., None] * (mm(y, U_c[i]) if yu is None else yu)
            if de[i] is not None:
                z = z - mm(gy * de[i], us[i])
            y = spec.act(z) if i < nl - 1 else z
        return _output(spec, y, y0)

    o = read(q, avec, mvec, ceta, deta, q_first)
    losses = None
    if want_loss:
        before = spec.objective(read(k, avec_p, mvec_p, ceta_p, deta_p), v)
        after = spec.objective(read(k, avec, mvec, ceta, deta), v)
        losses = (before, after)

    # State after the last token of the chunk.
    theta_new, U_new = [], []
    a_last = avec[..., -1, None, None]
    for i in range(nl):
        x = inputs[i]
        err = ceta[..., -1, :, None] * deltas[i]
        if deta[i] is not None:
            err = err + deta[i][..., -1, :, None] * us[i]
        if opt.momentum:
            pe = (pmat[..., -1, :] * eta)[..., :, None] * deltas[i]
            both = _outer_sum(x, jnp.concatenate([err, pe], axis=-1), prec)
            dw, du = both[..., :err.shape[-1]], both[..., err.shape[-1]:]
            U_new.append(mprod[..., -1, None, None] * U_c[i] - du)
        else:
            dw = _outer_sum(x, err, prec)
            U_new.append(U_c[i])
        w = a_last * theta_c[i] - dw
        if mvec is not None:
            w = w + mvec[..., -1, None, None] * U_c[i]
        theta_new.append(w)
    return tuple(theta_new), tuple(U_new), o, losses


def _key_side(spec: _Spec, theta, k, v, z1=None):
    """Forward the keys through f(·; θ) and back-propagate the inner loss by hand.

    Returns the layer inputs x_i, pre-activations z_i and errors δ_i = ∂l/∂z_i, so that the
    per-token gradient of W_i is x_iᵀ δ_i (the gradient itself is never formed per token)."""
    nl = len(theta)
    inputs, zs, dacts = [], [], []
    h = k
    for i, w in enumerate(theta):
        h = _layer_input(spec, h)
        inputs.append(h)
        z = z1 if (i == 0 and z1 is not None) else _apply(h, w, spec.precision)
        zs.append(z)
        if i < nl - 1:
            h, d = jax.jvp(spec.act, (z,), (jnp.ones_like(z),))
            dacts.append(d)
    if spec.norm is None:
        delta = output_grad(spec.objective, _output(spec, zs[-1], k), v)
    else:  # through the LayerNorm by hand: δ = r (γ − mean γ − ẑ mean(γ ẑ)), γ = scale ⊙ ∂l/∂f
        zh, rstd = ln_parts(zs[-1])
        scale = _head_rows(spec.norm[0], zh)
        gam = scale * output_grad(spec.objective, _output(spec, zs[-1], k), v)
        delta = rstd * (gam - jnp.mean(gam, axis=-1, keepdims=True) - zh * jnp.mean(gam * zh, axis=-1, keepdims=True))
    deltas = [None] * nl
    for i in reversed(range(nl)):
        deltas[i] = delta
        if i > 0:
            w = theta[i][..., :-1, :] if spec.bias else theta[i]  # the bias row has no input to go back to
            delta = jnp.einsum("...o,...io->...i" if delta.ndim == w.ndim - 1 else "...co,...io->...ci",
                               delta, w, precision=spec.precision) * dacts[i - 1]
    return inputs, zs, deltas


def _online(spec: _Spec, state: NeuralMemoryState, q, k, v, eta, mu, a, *, want_loss: bool):
    """b = 1: every gradient needs the previous token's weights, so this is a scan over tokens with
    a lean body (hand-written backprop, explicit rank-1 updates, no dual form). The backward pass
    holds about 2√T weight copies (√T-token groups, each rematerialised), not one per token."""
    eta, mu, a = _default_gates(spec, eta, mu, a)
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, eta, mu, a))

    def token(carry, x):
        theta, U = carry
        q_t, k_t, v_t, eta_t, mu_t, a_t = x
        inputs, _, deltas = _key_side(spec, theta, k_t, v_t)
        # Outer products as dots (their backward is then a matvec, not a slow small reduction).
        if spec.normalized:  # scale the errors (vectors) rather than the gradients (matrices)
            scales = [_input_scale(x_, g_) for x_, g_ in zip(inputs, _gains(spec, _squared_norms(deltas)))]
            deltas = [d_ * s_[..., None] for d_, s_ in zip(deltas, scales)]
        grads = tuple(jnp.einsum("bhi,bho->bhio", x_, d_, precision=spec.precision) for x_, d_ in zip(inputs, deltas))
        if spec.normalized and spec.opt.precondition:  # what the DGD preconditioner sees
            inputs = [x_ * jnp.sqrt(s_)[..., None] for x_, s_ in zip(inputs, scales)]
        new_theta, new_U = spec.opt.step(theta, U, grads, inputs, _gate4(eta_t), _gate4(mu_t), _gate4(a_t))
        o_t = _mlp(spec, new_theta, q_t)[0]
        losses = None
        if want_loss:
            losses = (spec.objective(_mlp(spec, theta, k_t)[0], v_t),
                      spec.objective(_mlp(spec, new_theta, k_t)[0], v_t))
        return (new_theta, new_U), (o_t, losses)

    (theta, U), (o, losses) = _sqrt_scan(token, (state.theta, state.U), xs)
    o = jnp.moveaxis(o, 0, 1)
    if want_loss:
        losses = tuple(jnp.moveaxis(l_, 0, 1) for l_ in losses)
    return o, NeuralMemoryState(theta, U, theta, jnp.zeros((), jnp.int32)), losses


def _check_pos(pos, minibatch: int) -> None:
    p = _static_int(pos)
    if p is not None and not 0 <= p < minibatch:
        raise ValueError(f"stream state position {p} is outside a mini-batch of {minibatch} tokens")


def _static_int(x):
    if isinstance(x, jax.core.Tracer):
        return None
    return int(x)


def _chunked(spec, state, q, k, v, eta, mu, a, *, resumable: bool, want_loss: bool, want_start: bool,
             remat_group: int | None):
    t_len = q.shape[1]
    b = spec.minibatch
    use_mu = mu is not None
    if spec.opt.momentum and mu is None:
        mu = jnp.zeros_like(eta)
    p = _static_int(state.pos) if resumable else 0
    first = 1 if resumable else 0

    def n_chunks(n):
        # Mini-batches after the first (resumed) one go G at a time through the scan.
        g = remat_group or (SCAN_GROUP if n - first >= 16 * SCAN_GROUP else 1)
        return first + -(-(n - first) // g) * g, g

    # Lay the tokens on a timeline of whole mini-batches; position p of it is token 0.
    if p is None:
        p = state.pos
        n, group = n_chunks(-(-(t_len + b - 1) // b))
    else:
        n, group = n_chunks(-(-(p + t_len) // b))
    lv = n * b

    def place(x):
        return place_at(x, p, lv)

    idx = jnp.arange(lv)
    masked = not (isinstance(p, int) and p == 0 and lv == t_len)
    act = ((idx >= p) & (idx < p + t_len)).astype(q.dtype) if masked else None

    def gate(g, fill):
        g = place(g)
        if act is not None:
            g = jnp.where(act[None, :, None] > 0, g, jnp.asarray(fill, g.dtype))
        return jnp.moveaxis(to_chunks(g, b), 2, 0)

    def seq(x):
        return jnp.moveaxis(to_chunks(place(x), b), 2, 0)

    k_line = place(k)
    if spec.overlap and resumable:  # the resumed mini-batch's earlier tokens: their keys from the state
        earlier = jnp.pad(jnp.moveaxis(state.keys.astype(k.dtype), 2, 1), ((0, 0), (0, lv - b), (0, 0), (0, 0)))
        k_line = jnp.where((idx < p)[None, :, None, None], earlier, k_line)
    xs = (seq(q), jnp.moveaxis(to_chunks(k_line, b), 2, 0), seq(v), gate(eta, 0.0),
          None if mu is None else gate(mu, 1.0),
          None if a is None else gate(a, 1.0),
          None if act is None else act.reshape(n, b))

    def body(theta_s, carry, x, same_start):
        theta_c, U_c, start = carry
        theta_new, U_new, o, losses = _chunk(spec, theta_s, theta_c, U_c, x, same_start=same_start,
                                             use_mu=use_mu, want_loss=want_loss)
        if want_start:
            live = jnp.ones((), bool) if x[-1] is None else jnp.any(x[-1] > 0)
            start = tuple(jnp.where(live, s_, old) for s_, old in zip(theta_s, start))
        return (theta_new, U_new, start), (o, losses)

    tmap = jax.tree_util.tree_map

    def chunk_step(carry, x):
        return body(carry[0], carry, x, True)

    def scan_step(carry, xg):
        # G mini-batches per checkpointed step (unrolled): only every G-th state is kept for the
        # backward pass, which recomputes the G mini-batches from it.
        outs = []
        for j in range(group):
            carry, y = chunk_step(carry, tmap(lambda z, j=j: z[j], xg))
            outs.append(y)
        return carry, tmap(lambda *z: jnp.stack(z), *outs)

    carry = (state.theta, state.U, state.theta_start)
    outs = []
    if resumable:
        # The first mini-batch may have started before this call: gradients at theta_start, reads from θ.
        theta_s0 = tuple(jnp.where(state.pos == 0, c_, s_) for c_, s_ in zip(state.theta, state.theta_start))
        carry, y0 = body(theta_s0, carry, tmap(lambda z: z[0], xs), False)
        outs.append(tmap(lambda z: z[None], y0))
    if n > first:
        rest = tmap(lambda z: z[first:].reshape(((n - first) // group, group) + z.shape[1:]), xs)
        carry, ys = lax.scan(jax.checkpoint(scan_step), carry, rest)
        outs.append(tmap(lambda z: z.reshape((n - first,) + z.shape[2:]), ys))
    o, losses = tmap(lambda *z: jnp.concatenate(z, axis=0), *outs)

    def unchunk(y):
        y = jnp.moveaxis(y, 0, 2)  # [B, H, N, c, ...]
        return take_at(from_chunks(y, lv), p, t_len)

    o = unchunk(o)
    if want_loss:
        losses = tuple(unchunk(l_) for l_ in losses)
    theta, U, start = carry
    pos = (state.pos + t_len) % b
    keys = state.keys
    if spec.overlap:  # the keys of the mini-batch the stream stops in (unused when it stops on a boundary)
        last = lax.dynamic_slice_in_dim(k_line, jnp.minimum((p + t_len) // b, n - 1) * b, b, axis=1)
        keys = jnp.moveaxis(last, 1, 2)
    return o, NeuralMemoryState(theta, U, start, pos.astype(jnp.int32), keys), losses


# ----------------------------------------------------------------------------------------------
# Public API


def _in_dtype(spec: _Spec, dt) -> _Spec:
    """The spec with its LayerNorm affine in the dtype the memory learns in."""
    if spec.norm is None:
        return spec
    return dataclasses.replace(spec, norm=tuple(x.astype(dt) for x in spec.norm))


def neural_memory(q, k, v, *, lr, momentum=None, decay=None, weights0=None, residual: bool = False,
                  activation: str = "gelu", objective: str = "l2", optimizer: str = "momentum",
                  minibatch: int = 1, initial_state=None, impl: str = "chunked",
                  return_inner_loss: bool = False, return_stream_state: bool = False,
                  bias: bool = False, layer_norm=None, remat_group: int | None = None, precision=HIGHEST,
                  inner_step: str = "paper"):
    """Run the neural memory over a sequence.

    q, k: [B, T, H, Dk]; v: [B, T, H, Dv]; lr (η), momentum (μ), decay (α): [B, T, H].
    weights0: tuple of `[H, d_in, d_out]` (learned init shared by the batch) or `[B, H, d_in, d_out]`.
    initial_state: `(θ, U)` (replaces weights0 and the zero momentum; starts a new mini-batch) or a
      `NeuralMemoryState` (resumes anywhere, including mid-mini-batch).
    activation, objective, optimizer: registry names (`ACTIVATIONS`, `objectives.OBJECTIVES`,
      `inner_optimizers.INNER_OPTIMIZERS`); unknown names raise ValueError listing the valid ones.
    bias: every layer has a bias, stored as the last input row of its weight (`[.., d_in + 1, d_out]`).
    layer_norm: `(scale, shift)` `[H, Dv]` (outer-loop parameters): f(x) = LN(z_L)·scale + shift
      (+ x with `residual`), ε = 1e-6; with `bias` and `residual` this is TTT-MLP's inner model.
    remat_group: mini-batches per rematerialised scan step of the chunked form (default: `SCAN_GROUP`
      once there are 16 such groups, else 1).
    inner_step: "paper" (the steps above), "bounded" or parts of it joined by "+" (`STEP_PARTS`; see
      the module docstring).
    precision: of every matmul (HIGHEST: float32 products on GPU/TPU too, whatever
      `jax.default_matmul_precision` says; the optimizers' per-token steps always use HIGHEST).
    Returns `(o [B, T, H, Dv], (θ, U))`; with `return_stream_state` the state is a
    `NeuralMemoryState`; with `return_inner_loss` a third item `(loss_before, loss_after)`, each
    [B, T, H]: l_t at θ_{t-1} and at θ_t (the state just before and just after token t's write).
    """
    spec = _make_spec(activation, residual, objective, optimizer, minibatch, precision=precision, bias=bias,
                      layer_norm=layer_norm, inner_step=inner_step)
    if remat_group is not None:
        check_positive("remat_group", remat_group)
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; valid impls: {list(IMPLS)}")
    bsz, t_len, heads, dk, dv = check_qkv(q, k, v)
    check_gate("lr", lr, bsz, t_len, heads)
    if momentum is not None:
        if not spec.opt.momentum:
            raise ValueError(f"optimizer {spec.opt.name!r} takes no momentum gate")
        check_gate("momentum", momentum, bsz, t_len, heads)
    if decay is not None:
        check_gate("decay", decay, bsz, t_len, heads)
    if impl == "chunked" and not spec.opt.chunkable and spec.minibatch > 1:
        raise ValueError(f"optimizer {spec.opt.name!r} has no chunked form; use impl='recurrent' or minibatch=1")

    if initial_state is None:
        if weights0 is None:
            raise ValueError("pass weights0 or initial_state")
        _check_weights(weights0, dk, dv, spec, bsz)
        state, resumable = init_state(weights0, bsz), False
    else:
        state, resumable = _as_stream_state(initial_state, bsz)
        _check_weights(state.theta, dk, dv, spec, bsz)
    _check_pos(state.pos, spec.minibatch)
    if resumable and _static_int(state.pos) == 0:
        resumable = False
    # The memory learns in (at least) float32 whatever the activations' dtype; o comes back in q's.
    out_dtype, dt = q.dtype, jnp.promote_types(q.dtype, jnp.float32)
    q, k, v = (x.astype(dt) for x in (q, k, v))
    spec = _in_dtype(spec, dt)
    state = jax.tree_util.tree_map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
    if spec.overlap and state.keys is None:
        state = state._replace(keys=_keys_buffer(state, jnp.zeros((bsz, heads, dk), dt), spec.minibatch,
                                                 fresh=not resumable))
    eta = lr.astype(dt)
    mu = None if momentum is None else momentum.astype(dt)
    a = None if decay is None else (1.0 - decay).astype(dt)
    eta = _step_gates(spec, eta, mu)

    if t_len == 0:
        o = jnp.zeros((bsz, 0, heads, dv), dt)
        losses = (jnp.zeros((bsz, 0, heads), dt),) * 2
    elif impl == "recurrent":
        o, state, losses = _recurrent(spec, state, q, k, v, eta, mu, a, return_inner_loss)
    elif spec.minibatch == 1:
        o, state, losses = _online(spec, state, q, k, v, eta, mu, a, want_loss=return_inner_loss)
    else:
        o, state, losses = _chunked(spec, state, q, k, v, eta, mu, a, resumable=resumable,
                                    want_loss=return_inner_loss, want_start=return_stream_state,
                                    remat_group=remat_group)
    o = o.astype(out_dtype)
    out_state = state if return_stream_state else (state.theta, state.U)
    if return_inner_loss:
        return o, out_state, losses
    return o, out_state


def neural_memory_step(q, k, v, *, lr, momentum=None, decay=None, state: NeuralMemoryState,
                       residual: bool = False, activation: str = "gelu", objective: str = "l2",
                       optimizer: str = "momentum", minibatch: int = 1, return_inner_loss: bool = False,
                       bias: bool = False, layer_norm=None, precision=HIGHEST, inner_step: str = "paper"):
    """Decode one token: q, k [B, H, Dk], v [B, H, Dv], gates [B, H]; `state` from `init_state` or
    `neural_memory(..., return_stream_state=True)`. Returns `(o [B, H, Dv], state)` (plus
    `(loss_before, loss_after)` [B, H] with `return_inner_loss`); steps equal the full sequence."""
    spec = _make_spec(activation, residual, objective, optimizer, minibatch, precision=precision, bias=bias,
                      layer_norm=layer_norm, inner_step=inner_step)
    if momentum is not None and not spec.opt.momentum:
        raise ValueError(f"optimizer {spec.opt.name!r} takes no momentum gate")
    _check_pos(state.pos, spec.minibatch)
    out_dtype, dt = q.dtype, jnp.promote_types(q.dtype, jnp.float32)
    q, k, v = (x.astype(dt) for x in (q, k, v))
    spec = _in_dtype(spec, dt)
    mu = None if momentum is None else momentum.astype(dt)
    eta, mu, a = _default_gates(spec, _step_gates(spec, lr.astype(dt), mu), mu,
                                None if decay is None else (1.0 - decay).astype(dt))
    cast = lambda ws: tuple(w.astype(dt) for w in ws)  # noqa: E731
    st = NeuralMemoryState(cast(state.theta), cast(state.U), cast(state.theta_start),
                           jnp.asarray(state.pos, jnp.int32), None if state.keys is None else state.keys.astype(dt))
    o, st, losses = _token_step(spec, st, q, k, v, eta, mu, a, return_inner_loss)
    o = o.astype(out_dtype)
    if return_inner_loss:
        return o, st, losses
    return o, st
