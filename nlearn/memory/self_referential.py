"""Self-referential Titans (Nested Learning §8, eqs. 83-90; the contract is docs/self_referential.md §1).

Per batch row and head, memories □ ∈ {k, v, lr, retain, memory} (plus q with `adaptive_q`) are
2-layer MLPs with fast weights (W_in [D, Dh], W_out [Dh, D_out]) and meta-learned initial states:

    M_□(z) = z + act(z W_in) W_out            k, v, memory, q (D_out = D)
    M_□(z) = act(z W_in) W_out + b_□          lr, retain (D_out = 1, b_□ a static per-head bias)

The `memory` lives on the `chunk_memory` grid, every other memory on the `chunk_other` grid; θ^c_□
is memory □'s state at the start of the token's chunk on its grid. Token t generates

    k_t = l2norm(M_k[θ^c](x_t)),  v_t = M_v[θ^c](x_t),  retain_t = sigmoid(M_retain[θ^c](x_t)),
    lr_t = lr_max · retain_t · sigmoid(M_lr[θ^c](x_t)),  q_t = l2norm(M_q[θ^c](q_in_t)) with adaptive_q,

targets v̂_□,t = M_□[θ^c_□](v_t) (v_t itself for k, v, q, memory when `self_targets=False`), and
writes every memory by one DGD step on ½‖M_□(k_t) − v̂_□,t‖² with the gradient at θ^c_□:

    e = M_□[θ^c](k_t) − v̂,  h = act(k_t W^c_in),  δ = (e W^cᵀ_out) ⊙ act'(k_t W^c_in)
    W_in,t  = (retain_t I − lr_t k_tᵀk_t) W_in,t−1 − lr_t k_tᵀ δ      (dgd=False: retain_t W_in,t−1 − …)
    W_out,t = retain_t W_out,t−1 − lr_t hᵀ e     (dgd_output: (retain_t I − lr_t hᵀh) W_out,t−1 − lr_t hᵀ e)

and reads o_t = M_memory[θ](q_t) with θ the state after token t's write ("after_write"), before it
("before_write", eq. 86) or at the chunk start ("chunk_start", eq. 90).

`dgd_output` (choice; by default DGD acts on the input layer only): the output layer's write gets the
same preconditioner with its own input h as the key. The gradients of a chunk are all taken at its
start state, so without it the output layers' steps add up over a chunk (about C·lr·|h|² along a
repeated h, unbounded); with it the sequential factor (retain − lr|h|²) keeps the accumulated move
along h near the error, as DGD does for the input layer along k (for lr·|h|² ≤ 1 + retain).

`targets="initial"` (choice; the default targets are `"chunk"`): v̂_□,t = M_□[θ_□,0](v_t) from the memory's
meta-learned initial weights, a target network that never moves inside the sequence. With the chunk-start
targets each write also moves its own target, so the error map is not a contraction (as TD learning with a
learned target) and trained generators drive the fast weights to overflow within tens of tokens; with fixed
targets every write is a plain regression step toward them.

`retain_to="initial"` (choice; by default retention pulls toward zero): retention toward the memory's
meta-learned initial weights, W_t = W_0 + retain_t (W_{t−1} − W_0) − …, so a memory that forgets returns to what
the outer loop taught it instead of to zero (for W' = W − W_0 the same recurrence with the DGD step's gradient
δ + k W_0, so the chunked form runs on W' and adds W_0 back).

`inner_step="normalized"` (choice; the default steps are `"plain"`): normalised steps, so a write cannot
amplify. The input layers' keys k are unit vectors, so DGD's factor retain − lr|k|² stays in [0, 1], but the
curvature along k of the loss through the output layer is |k|²·‖W_out‖²·act'², and the output layers' key h is
not normalised: once the weights grow, either step turns into an amplifier within a chunk. Normalised, the
input layers' gradient term is divided by 1 + ‖W^c_out‖²_F and the output layers write with lr_t / (1 + ‖h_t‖²)
(the normalised LMS step).

`adaptive_q` (choice): the q memory adapts the layer's static query, q_t = l2norm(M_q[θ^c_q](q_in_t)),
so the projection x W_q stays the input and the memory only learns a residual correction in context.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nlearn.memory.chunking import check_positive
from nlearn.memory.delta import unit_lower_inverse
from nlearn.memory.neural_memory import ACTIVATIONS, _sqrt_scan

HIGHEST = lax.Precision.HIGHEST
GENERATORS = ("k", "v", "lr", "retain")
SCALAR_MEMORIES = ("lr", "retain")
READS = ("after_write", "before_write", "chunk_start")
TARGETS = ("chunk", "initial")
RETAIN_TOS = ("zero", "initial")
INNER_STEPS = ("plain", "normalized")
IMPLS = ("chunked", "recurrent")
L2_EPS = 1e-6
# The one bound on lr_max: lr_t = lr_max · retain_t · sigmoid(·) ≤ lr_max · retain_t, and the keys are unit
# vectors, so DGD's factor retain_t − lr_t‖k‖² ≥ retain_t (1 − lr_max) stays ≥ 0 (no write flips the memory
# along k) exactly while lr_max ≤ 1.
LR_MAX_BOUND = 1.0


class SelfRefTitansState(NamedTuple):
    """Stream state: the current weights of every memory (`{name: (W_in [B, H, D, Dh], W_out [B, H, Dh,
    D_out])}`), each memory's chunk-start weights on its own grid (used while `pos` is inside a chunk),
    and the stream position modulo the larger chunk size (int32 scalar)."""

    weights: dict
    start: dict
    pos: jax.Array


@dataclasses.dataclass(frozen=True)
class _Spec:
    act: Callable
    names: tuple
    chunk_memory: int
    chunk_other: int
    lr_max: float
    dgd: bool
    dgd_output: bool
    read: str
    self_targets: bool
    targets: str
    inner_step: str
    adaptive_q: bool
    precision: object
    retain_to: str = "zero"

    @property
    def period(self) -> int:
        return max(self.chunk_memory, self.chunk_other)


def memory_names(adaptive_q: bool = False) -> tuple:
    """The memories of the op, in a fixed order."""
    return GENERATORS + (("q",) if adaptive_q else ()) + ("memory",)


def _make_spec(*, chunk_memory, chunk_other, activation, dgd, dgd_output, read, self_targets, adaptive_q, lr_max,
               precision, targets="chunk", inner_step="plain", retain_to="zero") -> _Spec:
    check_positive("chunk_memory", chunk_memory)
    check_positive("chunk_other", chunk_other)
    if max(chunk_memory, chunk_other) % min(chunk_memory, chunk_other):
        raise ValueError(f"chunk_memory ({chunk_memory}) and chunk_other ({chunk_other}) must divide one another")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; valid activations: {sorted(ACTIVATIONS)}")
    if read not in READS:
        raise ValueError(f"unknown read {read!r}; valid reads: {list(READS)}")
    if targets not in TARGETS:
        raise ValueError(f"unknown targets {targets!r}; valid targets: {list(TARGETS)}")
    if retain_to not in RETAIN_TOS:
        raise ValueError(f"unknown retain_to {retain_to!r}; valid choices: {list(RETAIN_TOS)}")
    if inner_step not in INNER_STEPS:
        raise ValueError(f"unknown inner_step {inner_step!r}; valid inner steps: {list(INNER_STEPS)}")
    if isinstance(lr_max, (int, float)) and not 0 < lr_max <= LR_MAX_BOUND:
        raise ValueError(f"lr_max must be in (0, {LR_MAX_BOUND:g}] (above it DGD's factor retain - lr |k|^2 can turn "
                         f"negative), got {lr_max!r}")
    return _Spec(ACTIVATIONS[activation], memory_names(adaptive_q), chunk_memory, chunk_other, lr_max, bool(dgd),
                 bool(dgd_output), read, bool(self_targets), targets, inner_step, bool(adaptive_q), precision,
                 retain_to)


# ----------------------------------------------------------------------------------------------
# Checks and state


def _check_inputs(x, q, lr_bias, retain_bias, write_gate=None):
    if x.ndim != 4:
        raise ValueError(f"x must have shape [B, T, H, D], got shape {tuple(x.shape)}")
    if q.shape != x.shape:
        raise ValueError(f"q must have x's shape {tuple(x.shape)}, got shape {tuple(q.shape)}")
    heads = x.shape[2]
    for name, b in (("lr_bias", lr_bias), ("retain_bias", retain_bias)):
        if tuple(jnp.shape(b)) != (heads,):
            raise ValueError(f"{name} must have shape [H] = ({heads},), got shape {tuple(jnp.shape(b))}")
    if write_gate is not None and tuple(jnp.shape(write_gate)) != x.shape[:3]:
        raise ValueError(f"write_gate must have shape [B, T, H] = {tuple(x.shape[:3])}, "
                         f"got shape {tuple(jnp.shape(write_gate))}")


def _check_weights(weights, names, heads: int, dim: int, batch: int | None, what: str = "weights0") -> None:
    if not isinstance(weights, dict) or set(weights) != set(names):
        got = sorted(weights) if isinstance(weights, dict) else type(weights).__name__
        raise ValueError(f"{what} must be a dict with keys {sorted(names)}, got {got}")
    for name in names:
        pair = weights[name]
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"{what}[{name!r}] must be a pair (W_in, W_out)")
        w_in, w_out = pair
        d_out = 1 if name in SCALAR_MEMORIES else dim
        if w_in.ndim not in (3, 4) or w_in.shape[-3:-1] != (heads, dim):
            raise ValueError(f"{what}[{name!r}] W_in must have shape [H, D, Dh] = [{heads}, {dim}, Dh] "
                             f"(or with a leading B), got {tuple(w_in.shape)}")
        dh = w_in.shape[-1]
        if w_out.ndim != w_in.ndim or w_out.shape[-3:] != (heads, dh, d_out):
            raise ValueError(f"{what}[{name!r}] W_out must have shape [H, Dh, D_out] = [{heads}, {dh}, {d_out}] "
                             f"(or with a leading B), got {tuple(w_out.shape)}")
        if batch is not None and w_in.ndim == 4 and (w_in.shape[0] != batch or w_out.shape[0] != batch):
            raise ValueError(f"{what}[{name!r}] has batch {w_in.shape[0]}, expected {batch}")


def init_state(weights0, batch: int) -> SelfRefTitansState:
    """Fresh stream state: every memory at `weights0` (broadcast to `[B, H, ...]`), position 0, in at least
    float32 (the op learns in float32 whatever the compute dtype, so a scan's carry keeps one dtype)."""
    weights = {n: tuple(jnp.broadcast_to(w.astype(jnp.promote_types(w.dtype, jnp.float32)), (batch,) + w.shape[-3:])
                        for w in pair) for n, pair in weights0.items()}
    return SelfRefTitansState(weights, weights, np.zeros((), np.int32))  # numpy: static under jit


def _position(pos):
    """The stream position as int32, left a numpy value when it is one (a position known when tracing lets
    the chunked form compute only the chunks the tokens touch)."""
    if isinstance(pos, (int, np.integer, np.ndarray)):
        return np.asarray(pos, np.int32)
    return jnp.asarray(pos, jnp.int32)


def _as_state(initial_state, weights0, names, batch, heads, dim) -> SelfRefTitansState:
    if initial_state is None:
        if weights0 is None:
            raise ValueError("pass weights0 or initial_state")
        _check_weights(weights0, names, heads, dim, batch)
        return init_state(weights0, batch)
    if isinstance(initial_state, SelfRefTitansState):
        _check_weights(initial_state.weights, names, heads, dim, batch, "initial_state.weights")
        _check_weights(initial_state.start, names, heads, dim, batch, "initial_state.start")
        return SelfRefTitansState(dict(initial_state.weights), dict(initial_state.start),
                                  _position(initial_state.pos))
    _check_weights(initial_state, names, heads, dim, batch, "initial_state")
    return init_state(initial_state, batch)


def _initial_weights(spec: _Spec, weights0, heads: int, dim: int, dt):
    """The fixed initial weights that `targets="initial"` takes its targets from and `retain_to="initial"`
    retains toward (else None)."""
    if spec.targets != "initial" and spec.retain_to != "initial":
        return None
    if weights0 is None:
        which = "targets='initial' takes the targets" if spec.targets == "initial" else "retain_to='initial' retains"
        raise ValueError(f"{which} from weights0: pass weights0")
    _check_weights(weights0, spec.names, heads, dim, None)
    return {n: tuple(w.astype(dt) for w in weights0[n]) for n in spec.names}


def _cast_state(state: SelfRefTitansState, dt) -> SelfRefTitansState:
    cast = lambda ws: {n: tuple(w.astype(dt) for w in p) for n, p in ws.items()}  # noqa: E731
    return SelfRefTitansState(cast(state.weights), cast(state.start), state.pos)


# ----------------------------------------------------------------------------------------------
# Memory pieces on `[B, H, C, D]` token blocks and `[B, H, D, Dh]` weights


def _mm(spec: _Spec, a, b):
    return jnp.matmul(a, b, precision=spec.precision)


def _l2norm(z):
    return z * lax.rsqrt(jnp.sum(z * z, axis=-1, keepdims=True) + L2_EPS**2)


def _apply(spec: _Spec, pair, z):
    """M_□(z) = z + act(z W_in) W_out of a residual memory (memory, q) for z [B, H, C, D]."""
    return z + _mm(spec, spec.act(_mm(spec, z, pair[0])), pair[1])


def _first_layers(spec: _Spec, names, weights, z):
    """act(z W_in) of several memories from one matmul against their stacked input layers."""
    h = spec.act(_mm(spec, z, jnp.concatenate([weights[n][0] for n in names], axis=-1)))
    return _split_columns(h, [weights[n][0].shape[-1] for n in names])


def _split_columns(a, widths):
    cuts = list(itertools.accumulate(widths))[:-1]
    return jnp.split(a, cuts, axis=-1) if cuts else [a]


def _generate(spec: _Spec, start, x, q_in, lr_bias, retain_bias, gate=None):
    """k, v, lr, log(retain), β = lr / retain and the read query of a block of tokens from the
    generators' chunk-start states (`[B, H, C, ...]`); a write gate g [B, H, C] scales the token's step
    (β ← g β, log retain ← g log retain), so g = 0 leaves every memory as it was."""
    out = {}
    for n, h in zip(GENERATORS, _first_layers(spec, GENERATORS, start, x)):
        y = _mm(spec, h, start[n][1])
        out[n] = y[..., 0] + _bias(n, lr_bias, retain_bias)[:, None] if n in SCALAR_MEMORIES else x + y
    k = _l2norm(out["k"])
    log_retain = jax.nn.log_sigmoid(out["retain"])
    beta = spec.lr_max * jax.nn.sigmoid(out["lr"])
    if gate is not None:
        log_retain, beta = gate * log_retain, gate * beta
    retain = jnp.exp(log_retain)
    q = _l2norm(_apply(spec, start["q"], q_in)) if spec.adaptive_q else q_in
    return dict(k=k, v=out["v"], q=q, log_retain=log_retain, retain=retain, beta=beta, lr=beta * retain)


def _errors(spec: _Spec, names, start, k, v, target0=None):
    """Per memory at its chunk-start state: h = act(k W_in), the output error e = M_□(k) − v̂_□ and the
    back-propagated δ = (e W_outᵀ) ⊙ act'(k W_in), so the gradients are hᵀe and kᵀδ. The targets v̂ come
    from the same states (keys and values then go through the stacked input layers of all `names` in one
    matmul) or, with target0 (`targets="initial"`), from the initial weights."""
    c = k.shape[-2]
    widths = [start[n][0].shape[-1] for n in names]
    keys = k if target0 is not None else jnp.concatenate([k, v], axis=-2)
    z = _mm(spec, keys, jnp.concatenate([start[n][0] for n in names], axis=-1))
    h, dh = jax.jvp(spec.act, (z,), (jnp.ones_like(z),))
    if target0 is not None:
        h_targets = _split_columns(spec.act(_mm(spec, v, jnp.concatenate([target0[n][0] for n in names], -1))),
                                   widths)
    out = {}
    for i, (n, hn, dn) in enumerate(zip(names, _split_columns(h, widths), _split_columns(dh, widths))):
        w_out = start[n][1]
        y = _mm(spec, hn, w_out)  # [.., C or 2C, D_out]: at the keys (then at the values)
        y_v = y[..., c:, :] if target0 is None else _mm(spec, h_targets[i], target0[n][1])
        if n in SCALAR_MEMORIES:
            # The bias cancels in e = M(k) − M(v); the target is the memory's own output at v.
            e = y[..., :c, :] - y_v
        else:
            e = y[..., :c, :] + k - ((v + y_v) if spec.self_targets else v)
        delta = _mm(spec, e, jnp.swapaxes(w_out, -1, -2)) * dn[..., :c, :]
        if spec.inner_step == "normalized":
            delta = delta / (1.0 + jnp.sum(w_out * w_out, axis=(-2, -1)))[..., None, None]
        out[n] = (hn[..., :c, :], e, delta)
    return out


def _targets_from(spec: _Spec, w0):
    """The initial weights as `_errors`' target weights with `targets="initial"`, else None."""
    return w0 if spec.targets == "initial" else None


def _output_lr_scale(spec: _Spec, h):
    """The output layers' lr factor per token: 1 (plain) or 1 / (1 + ‖h‖²) (normalized), h [.., C, Dh]."""
    return None if spec.inner_step == "plain" else 1.0 / (1.0 + jnp.sum(h * h, axis=-1))


def _bias(name, lr_bias, retain_bias):
    return {"lr": lr_bias, "retain": retain_bias}.get(name)


# ----------------------------------------------------------------------------------------------
# Recurrent form: one token at a time (the reference and the decode step)


def _token_step(spec: _Spec, lr_bias, retain_bias, state: SelfRefTitansState, x_t, q_t, w0=None, gate_t=None):
    """One token for all (batch, head): x_t, q_t [B, H, D], gate_t [B, H] or None. Returns (o_t [B, H, D],
    new state)."""
    pos = state.pos
    fresh = {n: (pos % (spec.chunk_memory if n == "memory" else spec.chunk_other)) == 0 for n in spec.names}
    start = {n: tuple(jnp.where(fresh[n], c, s) for c, s in zip(state.weights[n], state.start[n]))
             for n in spec.names}
    x1, q1 = x_t[..., None, :], q_t[..., None, :]  # [B, H, 1, D]
    g = _generate(spec, start, x1, q1, lr_bias, retain_bias, None if gate_t is None else gate_t[..., None])
    k, lr, retain = g["k"], g["lr"][..., None], g["retain"][..., None]  # gates [B, H, 1, 1]
    k_col = jnp.swapaxes(k, -1, -2)  # [B, H, D, 1]
    new = {}
    pieces = _errors(spec, spec.names, start, k, g["v"], _targets_from(spec, w0))
    for n in spec.names:
        h, e, delta = pieces[n]
        w_in, w_out = state.weights[n]
        step_in = delta + _mm(spec, k, w_in) if spec.dgd else delta
        step_out = e + _mm(spec, h, w_out) if spec.dgd_output else e
        scale = _output_lr_scale(spec, h)
        lr_out = lr if scale is None else lr * scale[..., None]
        kept_in, kept_out = retain * w_in, retain * w_out
        if spec.retain_to == "initial":  # what retention lets go returns to the initial weights
            kept_in, kept_out = kept_in + (1 - retain) * w0[n][0], kept_out + (1 - retain) * w0[n][1]
        new[n] = (kept_in - lr * _mm(spec, k_col, step_in),
                  kept_out - lr_out * _mm(spec, jnp.swapaxes(h, -1, -2), step_out))
    read_state = {"after_write": new, "before_write": state.weights, "chunk_start": start}[spec.read]["memory"]
    o = _apply(spec, read_state, g["q"])[..., 0, :]
    return o, SelfRefTitansState(new, start, (pos + 1) % spec.period)


def _recurrent(spec: _Spec, lr_bias, retain_bias, state, x, q, w0=None, gate=None):
    def body(st, xs):
        x_t, q_t, *gate_t = xs
        o, st = _token_step(spec, lr_bias, retain_bias, st, x_t, q_t, w0=w0, gate_t=gate_t[0] if gate_t else None)
        return st, o

    xs = (x, q) if gate is None else (x, q, gate)
    state, o = _sqrt_scan(body, state, tuple(jnp.moveaxis(z, 1, 0) for z in xs))
    return jnp.moveaxis(o, 0, 1), state


# ----------------------------------------------------------------------------------------------
# Chunked form: per chunk, generation and errors in parallel, one WY pass per layer and grid


class _Decay(NamedTuple):
    """In-chunk retention products from G_t = Σ_{m≤t} log retain_m: e^G [.., C], Γ_tj = e^{G_t − G_j}
    (j ≤ t, else 0) [.., C, C], tail_j = e^{G_C − G_j} and e^{G_C} [.., 1, 1]; the read matrices are Γ
    (after the write) or Γ_tj / retain_t on j < t (before it), with the matching e^G."""

    tail: jax.Array
    last: jax.Array
    read_eg: jax.Array
    read_gamma: jax.Array
    gamma: jax.Array
    eg: jax.Array


def _decay(log_retain, read: str) -> _Decay:
    c = log_retain.shape[-1]
    idx = jnp.arange(c)
    g = jnp.cumsum(log_retain, axis=-1)
    diff = g[..., :, None] - g[..., None, :]
    incl = idx[:, None] >= idx[None, :]
    gamma = jnp.where(incl, jnp.exp(jnp.where(incl, diff, 0.0)), 0.0)
    eg = jnp.exp(g)
    read_eg, read_gamma = eg, gamma
    if read == "before_write":
        strict = idx[:, None] > idx[None, :]
        prev = diff - log_retain[..., :, None]
        read_gamma = jnp.where(strict, jnp.exp(jnp.where(strict, prev, 0.0)), 0.0)
        read_eg = jnp.exp(g - log_retain)
    return _Decay(jnp.exp(g[..., -1:] - g), jnp.exp(g[..., -1])[..., None, None], read_eg, read_gamma, gamma, eg)


def _decayed_memory(spec: _Spec, dec: _Decay, s, keys, u, y=None):
    """The linear recurrence S_t = retain_t S_{t−1} + key_tᵀ u_t over a chunk entering with S = s:
    the chunk-end state and, for y [.., C, d], the per-token reads y_t S_t (or y_t S_{t−1})."""
    s_end = dec.last * s + _mm(spec, jnp.swapaxes(keys * dec.tail[..., None], -1, -2), u)
    if y is None:
        return s_end, None
    scores = _mm(spec, y, jnp.swapaxes(keys, -1, -2)) * dec.read_gamma
    return s_end, dec.read_eg[..., None] * _mm(spec, y, s) + _mm(spec, scores, u)


def _layer_values(spec: _Spec, g, dec: _Decay, s, keys, grad, dgd: bool):
    """u_t of a layer written as S_t = retain_t S_{t−1} + key_tᵀ u_t (keys: k for the input layer, h for
    the output layer; grad: δ or e): −lr_t grad_t without DGD; with DGD the gated delta rule (a = retain,
    β = lr / retain, values −retain·grad) solved in WY form, u = (I + strict(β K Kᵀ ⊙ Γ))⁻¹ (−lr grad −
    (β e^G ⊙ K) S)."""
    rhs = -g["lr"][..., None] * grad
    if not dgd:
        return rhs
    k, beta = keys, g["beta"]
    kk = _mm(spec, k, jnp.swapaxes(k, -1, -2))
    c = kk.shape[-1]
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    tinv = unit_lower_inverse(jnp.where(strict, beta[..., :, None] * kk * dec.gamma, 0.0), spec.precision)
    return _mm(spec, tinv, rhs - _mm(spec, (beta * dec.eg)[..., None] * k, s))


def _write_chunk(spec: _Spec, g, dec, names, start, cur, q=None, w0=None):
    """Chunk-end weights of `names` from the errors at their chunk-start states (the DGD solve shared
    by all their input layers) and, with q, the memory's read o_t = q_t + act(q_t W_in) W_out at the
    `read` state: q_t W_in,t from the WY outputs, act(·) W_out,t as a masked decayed attention. With
    `retain_to="initial"` the recurrences run on W − W_0 (the DGD steps' gradients then gain key·W_0)."""
    pieces = _errors(spec, names, start, g["k"], g["v"], _targets_from(spec, w0))
    anchor = {n: w0[n] if spec.retain_to == "initial" else (None, None) for n in names}  # (W_in,0, W_out,0)

    def off(w, a):  # the recurrence's variable: W, or W − W_0
        return w if a is None else w - a

    def on(w, a):
        return w if a is None else w + a

    def grad(key, gr, a, dgd):
        return gr if a is None or not dgd else gr + _mm(spec, key, a)

    u_in = _layer_values(spec, g, dec, jnp.concatenate([off(cur[n][0], anchor[n][0]) for n in names], axis=-1),
                         g["k"], jnp.concatenate([grad(g["k"], pieces[n][2], anchor[n][0], spec.dgd) for n in names],
                                                 axis=-1), spec.dgd)
    new, out, col = {}, None, 0
    for n in names:
        h, e, _ = pieces[n]
        a_in, a_out = anchor[n]
        width = cur[n][0].shape[-1]
        reads = n == "memory" and q is not None
        per_token = reads and spec.read != "chunk_start"
        w_in, zq = _decayed_memory(spec, dec, off(cur[n][0], a_in), g["k"], u_in[..., col:col + width],
                                   q if per_token else None)
        w_in = on(w_in, a_in)
        col += width
        hq = None
        if reads:
            hq = spec.act(on(zq, None if a_in is None else _mm(spec, q, a_in)) if per_token
                          else _mm(spec, q, start[n][0]))
        scale = _output_lr_scale(spec, h)
        g_out = g if scale is None else dict(g, lr=g["lr"] * scale, beta=g["beta"] * scale)
        u_out = _layer_values(spec, g_out, dec, off(cur[n][1], a_out), h, grad(h, e, a_out, spec.dgd_output),
                              spec.dgd_output)
        w_out, yo = _decayed_memory(spec, dec, off(cur[n][1], a_out), h, u_out, hq if per_token else None)
        w_out = on(w_out, a_out)
        if reads:
            out = q + (on(yo, None if a_out is None else _mm(spec, hq, a_out)) if per_token
                       else _mm(spec, hq, start[n][1]))
        new[n] = (w_in, w_out)
    return new, out


def _block(spec: _Spec, lr_bias, retain_bias, carry, xs, resume=None, w0=None):
    """One period of L = max(chunk sizes) tokens: the generators' chunks, then the memory's.

    carry: (current weights, the chunk-start weights of the last chunk holding a live token, or None).
    xs: x, q [B, H, L, D], the write gate [B, H, L] (or None) and the live-token mask [L] (None: all live).
    resume: (stored chunk-start weights, stream position) for the first block of a stream resumed inside a chunk."""
    weights, last_start = carry
    x, q, gate, live = xs
    weights, last_start = dict(weights), None if last_start is None else dict(last_start)

    def starts(names, j, size):
        out = {n: weights[n] for n in names}
        if resume is not None:
            stored, p = resume
            inside = (p // size == j) & (p % size != 0)
            out = {n: tuple(jnp.where(inside, s_, c_) for s_, c_ in zip(stored[n], out[n])) for n in names}
        return out

    def record(names, start, sl):
        if last_start is not None:
            any_live = True if live is None else jnp.any(live[sl])
            for n in names:
                last_start[n] = tuple(jnp.where(any_live, s_, o_) for s_, o_ in zip(start[n], last_start[n]))

    gens = [n for n in spec.names if n != "memory"]
    size = spec.chunk_other
    parts = []
    for j in range(spec.period // size):
        sl = slice(j * size, (j + 1) * size)
        start = starts(gens, j, size)
        g = _generate(spec, start, x[..., sl, :], q[..., sl, :], lr_bias, retain_bias,
                      None if gate is None else gate[..., sl])
        if live is not None:
            on = live[sl]
            g.update(lr=jnp.where(on, g["lr"], 0.0), beta=jnp.where(on, g["beta"], 0.0),
                     log_retain=jnp.where(on, g["log_retain"], 0.0))
        new, _ = _write_chunk(spec, g, _decay(g["log_retain"], spec.read), gens, start, weights, w0=w0)
        weights.update(new)
        record(gens, start, sl)
        parts.append(g)
    gen = {key: jnp.concatenate([p_[key] for p_ in parts], axis=2) for key in ("k", "v", "q", "lr", "beta",
                                                                              "log_retain")}
    size = spec.chunk_memory
    outs = []
    for i in range(spec.period // size):
        sl = slice(i * size, (i + 1) * size)
        g = {key: val[:, :, sl] for key, val in gen.items()}
        start = starts(["memory"], i, size)
        new, o = _write_chunk(spec, g, _decay(g["log_retain"], spec.read), ["memory"], start, weights, q=g["q"],
                              w0=w0)
        weights.update(new)
        record(["memory"], start, sl)
        outs.append(o)
    return (weights, last_start), jnp.concatenate(outs, axis=2)


def _static_int(x):
    return None if isinstance(x, jax.core.Tracer) else int(x)


def _pieces(p: int, t_len: int, size: int) -> list:
    """Tokens [p, p + t_len) cut at the multiples of `size`: (slice into the tokens, starts a chunk?)."""
    out, a = [], p
    while a < p + t_len:
        b = min((a // size + 1) * size, p + t_len)
        out.append((slice(a - p, b - p), a % size == 0))
        a = b
    return out


def _segment(spec: _Spec, lr_bias, retain_bias, state: SelfRefTitansState, x, q, p: int, w0=None, gate=None):
    """Tokens at static positions [p, p + t) of one period (x, q [B, H, t, D], gate [B, H, t], p + t <= L):
    only the chunks they touch, each cut to its tokens; a piece that starts inside a chunk reads the stored
    chunk-start weights. The padded block with its dead tokens masked computes the same at the cost of the
    whole period."""
    weights, starts = dict(state.weights), dict(state.start)
    gens = [n for n in spec.names if n != "memory"]
    parts = []
    for sl, fresh in _pieces(p, x.shape[2], spec.chunk_other):
        start = {n: weights[n] if fresh else starts[n] for n in gens}
        g = _generate(spec, start, x[..., sl, :], q[..., sl, :], lr_bias, retain_bias,
                      None if gate is None else gate[..., sl])
        new, _ = _write_chunk(spec, g, _decay(g["log_retain"], spec.read), gens, start, weights, w0=w0)
        weights.update(new)
        starts.update(start)
        parts.append(g)
    gen = {key: jnp.concatenate([g[key] for g in parts], axis=2) for key in ("k", "v", "q", "lr", "beta",
                                                                           "log_retain")}
    outs = []
    for sl, fresh in _pieces(p, x.shape[2], spec.chunk_memory):
        g = {key: val[:, :, sl] for key, val in gen.items()}
        start = {"memory": weights["memory"] if fresh else starts["memory"]}
        new, o = _write_chunk(spec, g, _decay(g["log_retain"], spec.read), ["memory"], start, weights, q=g["q"],
                              w0=w0)
        weights.update(new)
        starts.update(start)
        outs.append(o)
    return jnp.concatenate(outs, axis=2), weights, starts


def _chunked(spec: _Spec, lr_bias, retain_bias, state: SelfRefTitansState, x, q, want_start: bool, w0=None,
             gate=None):
    """Blocks of L = max(chunk sizes) tokens through a rematerialised `lax.scan`; the stream's
    position p puts token 0 at index p of a timeline of whole blocks whose other tokens write nothing."""
    bsz, t_len, heads, dim = x.shape
    size = spec.period
    p = _static_int(state.pos)
    if p is not None and p % size + t_len <= size and t_len < size:  # inside one period: its chunks only
        o, weights, starts = _segment(spec, lr_bias, retain_bias, state, jnp.swapaxes(x, 1, 2),
                                      jnp.swapaxes(q, 1, 2), p % size, w0,
                                      None if gate is None else jnp.swapaxes(gate, 1, 2))
        pos = np.asarray((p + t_len) % size, np.int32)
        return jnp.swapaxes(o, 1, 2), SelfRefTitansState(weights, starts if want_start else state.start, pos)
    if p is not None:
        p %= size
        n = -(-(p + t_len) // size)

        def place(z):
            return jnp.pad(z, [(0, 0), (p, n * size - p - t_len)] + [(0, 0)] * (z.ndim - 2))
    else:
        p = state.pos % size
        n = -(-(t_len + size - 1) // size)

        def place(z):
            return lax.dynamic_update_slice(jnp.zeros((bsz, n * size) + z.shape[2:], z.dtype), z,
                                            (0, p) + (0,) * (z.ndim - 2))

    def blocks(z):  # [B, n·L, H, ...] -> [n, B, H, L, ...]
        return jnp.moveaxis(place(z).reshape(bsz, n, size, *z.shape[2:]), (1, 3), (0, 2))

    idx = jnp.arange(n * size).reshape(n, size)
    masked = not (isinstance(p, int) and p == 0 and n * size == t_len)
    live = ((idx >= p) & (idx < p + t_len)) if masked else None
    xs = (blocks(x), blocks(q), None if gate is None else blocks(gate), live)
    carry = (state.weights, dict(state.start) if want_start else None)
    tmap = jax.tree_util.tree_map
    outs = []
    first = 0
    if not (isinstance(p, int) and p == 0):
        carry, o0 = _block(spec, lr_bias, retain_bias, carry, tmap(lambda z: z[0], xs), resume=(state.start, p),
                           w0=w0)
        outs.append(o0[None])
        first = 1
    if n > first:
        step = jax.checkpoint(lambda c, z: _block(spec, lr_bias, retain_bias, c, z, w0=w0))
        carry, o = lax.scan(step, carry, tmap(lambda z: z[first:], xs))
        outs.append(o)
    o = jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]  # [n, B, H, L, D]
    o = jnp.moveaxis(o, (0, 2), (1, 3)).reshape(bsz, n * size, heads, dim)
    o = o[:, p:p + t_len] if isinstance(p, int) else lax.dynamic_slice_in_dim(o, p, t_len, axis=1)
    weights, last_start = carry
    pos = ((state.pos + t_len) % size).astype(jnp.int32)
    return o, SelfRefTitansState(weights, last_start if want_start else state.start, pos)


# ----------------------------------------------------------------------------------------------
# Public API


def self_referential_titans(x, q, *, weights0=None, lr_bias, retain_bias, lr_max, chunk_memory: int = 16,
                            chunk_other: int = 64, activation: str = "gelu", dgd: bool = True,
                            dgd_output: bool = False, read: str = "after_write", self_targets: bool = True,
                            adaptive_q: bool = False, targets: str = "chunk", inner_step: str = "plain",
                            retain_to: str = "zero", initial_state=None, impl: str = "chunked", precision=HIGHEST,
                            return_stream_state: bool = False, write_gate=None):
    """Run self-referential Titans over a sequence.

    x, q: [B, T, H, D] (the layer has applied conv, projections and q's L2 norm).
    weights0: `{name: (W_in [H, D, Dh], W_out [H, Dh, D_out])}` for `memory_names(adaptive_q)`
      (`D_out` = D, or 1 for lr and retain; a leading B is allowed); lr_bias, retain_bias: [H].
    dgd_output: DGD on the output layers too (see the module docstring; off as in docs/self_referential.md).
    targets: "chunk" (docs/self_referential.md: v̂ from each memory's chunk-start state) or "initial" (v̂ from weights0,
      which must then be given, also with initial_state; see the module docstring).
    inner_step: "plain" (docs/self_referential.md) or "normalized" (see the module docstring).
    retain_to: "zero" (docs/self_referential.md) or "initial" (toward weights0, which must then be given).
    initial_state: a weights dict like the returned state (continues a stream split on a chunk
      boundary of both grids) or a `SelfRefTitansState` (resumes anywhere).
    write_gate: None, or [B, T, H] in [0, 1]: token t's step scaled by g_t (lr and the log of retain), so a
      closed gate (0) leaves every memory exactly as it was (the layer's `memory.lr_gate`).
    Returns `(o [B, T, H, D], state)`: the final weights `{name: (W_in, W_out)}` as `[B, H, ...]`,
    or a `SelfRefTitansState` with `return_stream_state`.
    """
    spec = _make_spec(chunk_memory=chunk_memory, chunk_other=chunk_other, activation=activation, dgd=dgd,
                      dgd_output=dgd_output, read=read, self_targets=self_targets, adaptive_q=adaptive_q,
                      lr_max=lr_max, precision=precision, targets=targets, inner_step=inner_step,
                      retain_to=retain_to)
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; valid impls: {list(IMPLS)}")
    _check_inputs(x, q, lr_bias, retain_bias, write_gate)
    bsz, t_len, heads, dim = x.shape
    state = _as_state(initial_state, weights0, spec.names, bsz, heads, dim)
    out_dtype, dt = x.dtype, jnp.promote_types(x.dtype, jnp.float32)
    x, q = x.astype(dt), q.astype(dt)
    gate = None if write_gate is None else jnp.asarray(write_gate).astype(dt)
    lr_bias, retain_bias = jnp.asarray(lr_bias, dt), jnp.asarray(retain_bias, dt)
    state = _cast_state(state, dt)
    w0 = _initial_weights(spec, weights0, heads, dim, dt)
    if t_len == 0:
        o = jnp.zeros(x.shape, dt)
    elif impl == "recurrent":
        o, state = _recurrent(spec, lr_bias, retain_bias, state, x, q, w0, gate)
    else:
        o, state = _chunked(spec, lr_bias, retain_bias, state, x, q, want_start=return_stream_state, w0=w0,
                            gate=gate)
    o = o.astype(out_dtype)
    return o, (state if return_stream_state else state.weights)


def self_referential_titans_step(x_t, q_t, *, state: SelfRefTitansState, lr_bias, retain_bias, lr_max,
                                 chunk_memory: int = 16, chunk_other: int = 64, activation: str = "gelu",
                                 dgd: bool = True, dgd_output: bool = False, read: str = "after_write",
                                 self_targets: bool = True, adaptive_q: bool = False, targets: str = "chunk",
                                 inner_step: str = "plain", retain_to: str = "zero", weights0=None,
                                 precision=HIGHEST, write_gate_t=None):
    """Decode one token: x_t, q_t [B, H, D]; `state` from `init_state` or
    `self_referential_titans(..., return_stream_state=True)`; weights0 as there (needed by
    `targets="initial"` and `retain_to="initial"`); write_gate_t [B, H] or None as `write_gate` there. Returns
    `(o_t [B, H, D], state)`; steps equal the full sequence across chunk boundaries of both grids."""
    spec = _make_spec(chunk_memory=chunk_memory, chunk_other=chunk_other, activation=activation, dgd=dgd,
                      dgd_output=dgd_output, read=read, self_targets=self_targets, adaptive_q=adaptive_q,
                      lr_max=lr_max, precision=precision, targets=targets, inner_step=inner_step,
                      retain_to=retain_to)
    if x_t.ndim != 3:
        raise ValueError(f"x_t must have shape [B, H, D], got shape {tuple(x_t.shape)}")
    _check_inputs(x_t[:, None], q_t[:, None] if q_t.ndim == 3 else q_t, lr_bias, retain_bias,
                  None if write_gate_t is None else jnp.asarray(write_gate_t)[:, None])
    bsz, heads, dim = x_t.shape
    if not isinstance(state, SelfRefTitansState):
        raise ValueError("state must be a SelfRefTitansState (from init_state or return_stream_state=True)")
    state = _as_state(state, None, spec.names, bsz, heads, dim)
    out_dtype, dt = x_t.dtype, jnp.promote_types(x_t.dtype, jnp.float32)
    state = _cast_state(state, dt)
    o, state = _token_step(spec, jnp.asarray(lr_bias, dt), jnp.asarray(retain_bias, dt), state,
                           x_t.astype(dt), q_t.astype(dt), _initial_weights(spec, weights0, heads, dim, dt),
                           None if write_gate_t is None else jnp.asarray(write_gate_t).astype(dt))
    return o.astype(out_dtype), state


self_referential_init_state = init_state  # the name the package exports
