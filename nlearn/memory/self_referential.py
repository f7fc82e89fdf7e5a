"""Self-referential Titans (Nested Learning §8, eqs. 83-90; the contract is HOPE.md §1).

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
    W_out,t = retain_t W_out,t−1 − lr_t hᵀ e

and reads o_t = M_memory[θ](q_t) with θ the state after token t's write ("after_write"), before it
("before_write", eq. 86) or at the chunk start ("chunk_start", eq. 90).

`adaptive_q` (choice): the q memory adapts the layer's static query, q_t = l2norm(M_q[θ^c_q](q_in_t)),
so the projection x W_q stays the input and the memory only learns a residual correction in context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from nlearn.memory.chunking import check_positive
from nlearn.memory.neural_memory import ACTIVATIONS, _sqrt_scan

HIGHEST = lax.Precision.HIGHEST
GENERATORS = ("k", "v", "lr", "retain")
SCALAR_MEMORIES = ("lr", "retain")
READS = ("after_write", "before_write", "chunk_start")
IMPLS = ("chunked", "recurrent")
L2_EPS = 1e-6


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
    read: str
    self_targets: bool
    adaptive_q: bool
    precision: object

    @property
    def period(self) -> int:
        return max(self.chunk_memory, self.chunk_other)


def memory_names(adaptive_q: bool = False) -> tuple:
    """The memories of the op, in a fixed order."""
    return GENERATORS + (("q",) if adaptive_q else ()) + ("memory",)


def _make_spec(*, chunk_memory, chunk_other, activation, dgd, read, self_targets, adaptive_q, lr_max,
               precision) -> _Spec:
    check_positive("chunk_memory", chunk_memory)
    check_positive("chunk_other", chunk_other)
    if max(chunk_memory, chunk_other) % min(chunk_memory, chunk_other):
        raise ValueError(f"chunk_memory ({chunk_memory}) and chunk_other ({chunk_other}) must divide one another")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; valid activations: {sorted(ACTIVATIONS)}")
    if read not in READS:
        raise ValueError(f"unknown read {read!r}; valid reads: {list(READS)}")
    if isinstance(lr_max, (int, float)) and not lr_max > 0:
        raise ValueError(f"lr_max must be positive, got {lr_max!r}")
    return _Spec(ACTIVATIONS[activation], memory_names(adaptive_q), chunk_memory, chunk_other, lr_max, bool(dgd),
                 read, bool(self_targets), bool(adaptive_q), precision)


# ----------------------------------------------------------------------------------------------
# Checks and state


def _check_inputs(x, q, lr_bias, retain_bias):
    if x.ndim != 4:
        raise ValueError(f"x must have shape [B, T, H, D], got shape {tuple(x.shape)}")
    if q.shape != x.shape:
        raise ValueError(f"q must have x's shape {tuple(x.shape)}, got shape {tuple(q.shape)}")
    heads = x.shape[2]
    for name, b in (("lr_bias", lr_bias), ("retain_bias", retain_bias)):
        if tuple(jnp.shape(b)) != (heads,):
            raise ValueError(f"{name} must have shape [H] = ({heads},), got shape {tuple(jnp.shape(b))}")


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
    """Fresh stream state: every memory at `weights0` (broadcast to `[B, H, ...]`), position 0."""
    weights = {n: tuple(jnp.broadcast_to(w, (batch,) + w.shape[-3:]) for w in pair) for n, pair in weights0.items()}
    return SelfRefTitansState(weights, weights, jnp.zeros((), jnp.int32))


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
                                  jnp.asarray(initial_state.pos, jnp.int32))
    _check_weights(initial_state, names, heads, dim, batch, "initial_state")
    return init_state(initial_state, batch)


def _cast_state(state: SelfRefTitansState, dt) -> SelfRefTitansState:
    cast = lambda ws: {n: tuple(w.astype(dt) for w in p) for n, p in ws.items()}  # noqa: E731
    return SelfRefTitansState(cast(state.weights), cast(state.start), state.pos)


# ----------------------------------------------------------------------------------------------
# Memory pieces on `[B, H, C, D]` token blocks and `[B, H, D, Dh]` weights


def _mm(spec: _Spec, a, b):
    return jnp.matmul(a, b, precision=spec.precision)


def _l2norm(z):
    return z * lax.rsqrt(jnp.sum(z * z, axis=-1, keepdims=True) + L2_EPS**2)


def _apply(spec: _Spec, name: str, pair, z, bias=None):
    """M_□(z) for z [B, H, C, D]: residual for vector memories, `+ b` for lr and retain."""
    w_in, w_out = pair
    y = _mm(spec, spec.act(_mm(spec, z, w_in)), w_out)
    if name in SCALAR_MEMORIES:
        return y[..., 0] + bias[:, None]
    return z + y


def _generate(spec: _Spec, start, x, q_in, lr_bias, retain_bias):
    """k, v, lr, log(retain), β = lr / retain and the read query of a block of tokens from the
    generators' chunk-start states (`[B, H, C, ...]`)."""
    k = _l2norm(_apply(spec, "k", start["k"], x))
    v = _apply(spec, "v", start["v"], x)
    log_retain = jax.nn.log_sigmoid(_apply(spec, "retain", start["retain"], x, retain_bias))
    beta = spec.lr_max * jax.nn.sigmoid(_apply(spec, "lr", start["lr"], x, lr_bias))
    retain = jnp.exp(log_retain)
    q = _l2norm(_apply(spec, "q", start["q"], q_in)) if spec.adaptive_q else q_in
    return dict(k=k, v=v, q=q, log_retain=log_retain, retain=retain, beta=beta, lr=beta * retain)


def _errors(spec: _Spec, name: str, pair, k, v, bias):
    """At the chunk-start state: h = act(k W_in), the output error e = M_□(k) − v̂_□ and the
    back-propagated δ = (e W_outᵀ) ⊙ act'(k W_in), so the gradients are hᵀe and kᵀδ."""
    w_in, w_out = pair
    h, dh = jax.jvp(spec.act, (_mm(spec, k, w_in),), (jnp.ones(k.shape[:-1] + w_in.shape[-1:], k.dtype),))
    pred = _mm(spec, h, w_out)
    if name in SCALAR_MEMORIES:
        # The bias cancels in e = M(k) − M(v); the target is the memory's own output at v.
        e = pred - _mm(spec, spec.act(_mm(spec, v, w_in)), w_out)
    else:
        target = _apply(spec, name, pair, v) if spec.self_targets else v
        e = pred + k - target
    delta = _mm(spec, e, jnp.swapaxes(w_out, -1, -2)) * dh
    return h, e, delta


def _bias(name, lr_bias, retain_bias):
    return {"lr": lr_bias, "retain": retain_bias}.get(name)


# ----------------------------------------------------------------------------------------------
# Recurrent form: one token at a time (the reference and the decode step)


def _token_step(spec: _Spec, lr_bias, retain_bias, state: SelfRefTitansState, x_t, q_t):
    """One token for all (batch, head): x_t, q_t [B, H, D]. Returns (o_t [B, H, D], new state)."""
    pos = state.pos
    fresh = {n: (pos % (spec.chunk_memory if n == "memory" else spec.chunk_other)) == 0 for n in spec.names}
    start = {n: tuple(jnp.where(fresh[n], c, s) for c, s in zip(state.weights[n], state.start[n]))
             for n in spec.names}
    x1, q1 = x_t[..., None, :], q_t[..., None, :]  # [B, H, 1, D]
    g = _generate(spec, start, x1, q1, lr_bias, retain_bias)
    k, lr, retain = g["k"], g["lr"][..., None], g["retain"][..., None]  # gates [B, H, 1, 1]
    k_col = jnp.swapaxes(k, -1, -2)  # [B, H, D, 1]
    new = {}
    for n in spec.names:
        h, e, delta = _errors(spec, n, start[n], k, g["v"], _bias(n, lr_bias, retain_bias))
        w_in, w_out = state.weights[n]
        step_in = delta + _mm(spec, k, w_in) if spec.dgd else delta
        new[n] = (retain * w_in - lr * _mm(spec, k_col, step_in),
                  retain * w_out - lr * _mm(spec, jnp.swapaxes(h, -1, -2), e))
    read_state = {"after_write": new, "before_write": state.weights, "chunk_start": start}[spec.read]["memory"]
    o = _apply(spec, "memory", read_state, g["q"])[..., 0, :]
    return o, SelfRefTitansState(new, start, (pos + 1) % spec.period)


def _recurrent(spec: _Spec, lr_bias, retain_bias, state, x, q):
    def body(st, xs):
        o, st = _token_step(spec, lr_bias, retain_bias, st, *xs)
        return st, o

    state, o = _sqrt_scan(body, state, (jnp.moveaxis(x, 1, 0), jnp.moveaxis(q, 1, 0)))
    return jnp.moveaxis(o, 0, 1), state


# ----------------------------------------------------------------------------------------------
# Public API


def self_referential_titans(x, q, *, weights0=None, lr_bias, retain_bias, lr_max, chunk_memory: int = 16,
                            chunk_other: int = 64, activation: str = "gelu", dgd: bool = True,
                            read: str = "after_write", self_targets: bool = True, adaptive_q: bool = False,
                            initial_state=None, impl: str = "chunked", precision=HIGHEST,
                            return_stream_state: bool = False):
    """Run self-referential Titans over a sequence.

    x, q: [B, T, H, D] (the layer has applied conv, projections and q's L2 norm).
    weights0: `{name: (W_in [H, D, Dh], W_out [H, Dh, D_out])}` for `memory_names(adaptive_q)`
      (`D_out` = D, or 1 for lr and retain; a leading B is allowed); lr_bias, retain_bias: [H].
    initial_state: a weights dict like the returned state (continues a stream split on a chunk
      boundary of both grids) or a `SelfRefTitansState` (resumes anywhere).
    Returns `(o [B, T, H, D], state)`: the final weights `{name: (W_in, W_out)}` as `[B, H, ...]`,
    or a `SelfRefTitansState` with `return_stream_state`.
    """
    spec = _make_spec(chunk_memory=chunk_memory, chunk_other=chunk_other, activation=activation, dgd=dgd,
                      read=read, self_targets=self_targets, adaptive_q=adaptive_q, lr_max=lr_max,
                      precision=precision)
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; valid impls: {list(IMPLS)}")
    _check_inputs(x, q, lr_bias, retain_bias)
    bsz, t_len, heads, dim = x.shape
    state = _as_state(initial_state, weights0, spec.names, bsz, heads, dim)
    out_dtype, dt = x.dtype, jnp.promote_types(x.dtype, jnp.float32)
    x, q = x.astype(dt), q.astype(dt)
    lr_bias, retain_bias = jnp.asarray(lr_bias, dt), jnp.asarray(retain_bias, dt)
    state = _cast_state(state, dt)
    if t_len == 0:
        o = jnp.zeros(x.shape, dt)
    else:  # the chunked form is not written yet: both impls run the token-by-token twin
        o, state = _recurrent(spec, lr_bias, retain_bias, state, x, q)
    o = o.astype(out_dtype)
    return o, (state if return_stream_state else state.weights)


def self_referential_titans_step(x_t, q_t, *, state: SelfRefTitansState, lr_bias, retain_bias, lr_max,
                                 chunk_memory: int = 16, chunk_other: int = 64, activation: str = "gelu",
                                 dgd: bool = True, read: str = "after_write", self_targets: bool = True,
                                 adaptive_q: bool = False, precision=HIGHEST):
    """Decode one token: x_t, q_t [B, H, D]; `state` from `init_state` or
    `self_referential_titans(..., return_stream_state=True)`. Returns `(o_t [B, H, D], state)`;
    steps equal the full sequence across chunk boundaries of both grids."""
    spec = _make_spec(chunk_memory=chunk_memory, chunk_other=chunk_other, activation=activation, dgd=dgd,
                      read=read, self_targets=self_targets, adaptive_q=adaptive_q, lr_max=lr_max,
                      precision=precision)
    if x_t.ndim != 3:
        raise ValueError(f"x_t must have shape [B, H, D], got shape {tuple(x_t.shape)}")
    _check_inputs(x_t[:, None], q_t[:, None] if q_t.ndim == 3 else q_t, lr_bias, retain_bias)
    bsz, heads, dim = x_t.shape
    if not isinstance(state, SelfRefTitansState):
        raise ValueError("state must be a SelfRefTitansState (from init_state or return_stream_state=True)")
    state = _as_state(state, None, spec.names, bsz, heads, dim)
    out_dtype, dt = x_t.dtype, jnp.promote_types(x_t.dtype, jnp.float32)
    state = _cast_state(state, dt)
    o, state = _token_step(spec, jnp.asarray(lr_bias, dt), jnp.asarray(retain_bias, dt), state,
                           x_t.astype(dt), q_t.astype(dt))
    return o.astype(out_dtype), state


self_referential_init_state = init_state  # the name the package exports
