"""Linear attention (Katharopoulos et al. 2020) as an additive fast-weight memory.

Per batch and head, with row vectors: `S_t = S_{t-1} + k_tᵀ v_t` and `o_t = q_t S_t`, or, when
normalized, `o_t = q_t S_t / (q_t · c_t)` with `c_t = c_{t-1} + k_t` (docs/architecture.md, the ops contract).

Chunked forms (chunk of C tokens entering with state S): `o = Q S + tril(Q Kᵀ) V`,
`S' = S + Kᵀ V`. "chunked_scan" runs a `lax.scan` over chunks, rematerialized per chunk (the CPU
default); "chunked_parallel" gets every chunk's entering state from an exclusive cumulative sum of
the per-chunk `Kᵀ V` and does all chunks at once (the GPU/TPU default). Neither keeps a state per
token.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from nlearn.memory.chunking import (
    check_positive,
    check_qkv,
    check_step,
    from_chunks,
    from_chunks_first,
    pad_time,
    to_chunks,
    to_chunks_first,
)

HIGHEST = jax.lax.Precision.HIGHEST
_IMPLS = ("chunked", "chunked_scan", "chunked_parallel", "recurrent")


class LinearAttentionState(NamedTuple):
    """State of normalized linear attention: numerator `S [B,H,Dk,Dv]`, normalizer `c [B,H,Dk]`."""

    S: jax.Array
    c: jax.Array


def check_impl(impl: str, allowed=_IMPLS) -> None:
    """Refuse an unknown `impl=` with the allowed values."""
    if impl not in allowed:
        raise ValueError(f"impl must be one of {allowed}, got {impl!r}")


def resolve_chunked(impl: str) -> str:
    """Map `impl="chunked"` to the faster chunked form for the default backend.

    On CPU a `lax.scan` over chunks, rematerialized per chunk, wins: its tiles stay in cache and
    it allocates little (`benchmarks/bench_ops.py`). On GPU/TPU the form that does every chunk's
    intra-chunk work at once feeds the matrix units better.
    """
    if impl != "chunked":
        return impl
    return "chunked_scan" if jax.default_backend() == "cpu" else "chunked_parallel"


def check_state_shape(name: str, x, shape: tuple[int, ...]) -> None:
    """Refuse a state tensor whose shape is not `shape`, naming it."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got shape {tuple(x.shape)}")


def _initial(initial_state, normalize: bool, b: int, h: int, dk: int, dv: int):
    """Return float32 `(S, c)`; `c` is None when unnormalized."""
    if initial_state is None:
        s0 = jnp.zeros((b, h, dk, dv), jnp.float32)
        c0 = jnp.zeros((b, h, dk), jnp.float32) if normalize else None
        return s0, c0
    if normalize:
        if not isinstance(initial_state, tuple) or len(initial_state) != 2:
            raise ValueError(
                "initial_state of normalized linear_attention must be a (S, c) pair, "
                f"got {type(initial_state).__name__}"
            )
        s0, c0 = initial_state
        check_state_shape("initial_state.S", s0, (b, h, dk, dv))
        check_state_shape("initial_state.c", c0, (b, h, dk))
        return s0.astype(jnp.float32), c0.astype(jnp.float32)
    if isinstance(initial_state, tuple):
        raise ValueError("initial_state of unnormalized linear_attention must be an array S [B,H,Dk,Dv]")
    check_state_shape("initial_state", initial_state, (b, h, dk, dv))
    return initial_state.astype(jnp.float32), None


def _pack(s, c):
    return s if c is None else LinearAttentionState(s, c)


def _linear_attention_recurrent(q, k, v, s0, c0):
    """Token-by-token reference: `lax.scan` over time, one state per token."""

    def step(carry, x):
        s, c = carry
        q_t, k_t, v_t = x  # [B,H,Dk], [B,H,Dk], [B,H,Dv]
        s = s + k_t[..., :, None] * v_t[..., None, :]
        o_t = jnp.einsum("bhk,bhkv->bhv", q_t, s, precision=HIGHEST)
        if c is not None:
            c = c + k_t
            o_t = o_t / jnp.sum(q_t * c, axis=-1, keepdims=True)
        return (s, c), o_t

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v))
    (s, c), o = jax.lax.scan(step, (s0, c0), xs)
    return jnp.moveaxis(o, 0, 1), s, c


def _linear_attention_chunked_scan(q, k, v, s0, c0, chunk: int, precision):
    """Chunked form as a `lax.scan` over chunks, each step rematerialized in the backward pass:
    `o = Q S + tril(Q Kᵀ) V` (over `Q c + rowsum(tril(Q Kᵀ))` when normalized), `S += Kᵀ V`."""
    t = q.shape[1]
    ein = lambda spec, a, b: jnp.einsum(spec, a, b, precision=precision)  # noqa: E731
    xs = tuple(to_chunks_first(x, chunk) for x in (q, k, v))  # [N,B,H,C,D]
    n = xs[0].shape[0]
    pad_rows = (jnp.arange(n * chunk) >= t).reshape(n, 1, 1, chunk)  # padding: keep den != 0
    mask = jnp.tril(jnp.ones((chunk, chunk), bool))

    def step(carry, x):
        s, c = carry
        q_n, k_n, v_n, pad = x
        scores = jnp.where(mask, ein("...ik,...jk->...ij", q_n, k_n), 0.0)
        o = ein("...ck,...kv->...cv", q_n, s) + ein("...ij,...jv->...iv", scores, v_n)
        if c is not None:
            den = jnp.einsum("...ck,...k->...c", q_n, c, precision=precision) + jnp.sum(scores, -1)
            o = o / jnp.where(pad, 1.0, den)[..., None]
            c = c + jnp.sum(k_n, axis=-2)
        return (s + ein("...ck,...cv->...kv", k_n, v_n), c), o

    (s, c), o = jax.lax.scan(jax.checkpoint(step), (s0, c0), (*xs, pad_rows))
    return from_chunks_first(o, t), s, c


def _linear_attention_chunked_parallel(q, k, v, s0, c0, chunk: int, precision):
    """Chunk-parallel form: chunk states by an exclusive cumsum, causal `tril(QKᵀ)V` inside chunks."""
    t = q.shape[1]
    ein = lambda spec, a, b: jnp.einsum(spec, a, b, precision=precision)  # noqa: E731
    q_c, k_c, v_c = (to_chunks(pad_time(x, chunk), chunk) for x in (q, k, v))  # [B,H,N,C,D]
    kv = ein("bhnck,bhncv->bhnkv", k_c, v_c)  # per-chunk writes
    kv_incl = jnp.cumsum(kv, axis=2)
    s_prev = s0[:, :, None] + kv_incl - kv  # state entering each chunk
    s_fin = s0 + kv_incl[:, :, -1]
    mask = jnp.tril(jnp.ones((chunk, chunk), bool))
    scores = jnp.where(mask, ein("bhnik,bhnjk->bhnij", q_c, k_c), 0.0)
    o = ein("bhnck,bhnkv->bhncv", q_c, s_prev) + ein("bhnij,bhnjv->bhniv", scores, v_c)
    c_fin = None
    if c0 is not None:
        k_sum = jnp.sum(k_c, axis=3)  # [B,H,N,Dk]
        k_incl = jnp.cumsum(k_sum, axis=2)
        c_prev = c0[:, :, None] + k_incl - k_sum
        c_fin = c0 + k_incl[:, :, -1]
        den = jnp.einsum("bhnck,bhnk->bhnc", q_c, c_prev, precision=precision) + jnp.sum(scores, -1)
        # Padded rows have den == 0; give them 1 so no NaN reaches the (discarded) outputs or grads.
        pad_rows = jnp.arange(q_c.shape[2] * chunk).reshape(q_c.shape[2], chunk) >= t
        den = jnp.where(pad_rows, 1.0, den)
        o = o / den[..., None]
    return from_chunks(o, t), s_fin, c_fin


def linear_attention(
    q,
    k,
    v,
    *,
    normalize: bool = False,
    initial_state=None,
    impl: str = "chunked",
    chunk_size: int = 64,
    precision=HIGHEST,
):
    """Causal linear attention, `o_t = q_t S_t` with `S_t = S_{t-1} + k_tᵀ v_t`.

    Args:
      q, k: `[B, T, H, Dk]` (already featurized); v: `[B, T, H, Dv]`.
      normalize: divide by `q_t · c_t`, `c_t = c_{t-1} + k_t` (needs positive features).
      initial_state: `S [B,H,Dk,Dv]`, or `(S, c)` when normalized; zeros when None.
      impl: "chunked" ("chunked_scan" on CPU, "chunked_parallel" elsewhere), "chunked_scan"
        (scan over chunks, remat per chunk), "chunked_parallel" (all chunks at once, chunk
        states by a cumulative sum), or "recurrent" (token-by-token `lax.scan`).
      chunk_size: tokens per chunk of the chunked form (any positive int; T need not divide).
      precision: matmul precision of the chunked form.

    Returns:
      `(o [B,T,H,Dv] in q's dtype, final_state)`; the state is `S` (float32), or a
      `LinearAttentionState(S, c)` when normalized.
    """
    b, t, h, dk, dv = check_qkv(q, k, v)
    check_positive("chunk_size", chunk_size)
    check_impl(impl)
    s0, c0 = _initial(initial_state, normalize, b, h, dk, dv)
    dtype = q.dtype
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    impl = resolve_chunked(impl)
    if impl == "recurrent":
        o, s, c = _linear_attention_recurrent(q, k, v, s0, c0)
    elif impl == "chunked_scan":
        o, s, c = _linear_attention_chunked_scan(q, k, v, s0, c0, chunk_size, precision)
    else:
        o, s, c = _linear_attention_chunked_parallel(q, k, v, s0, c0, chunk_size, precision)
    return o.astype(dtype), _pack(s, c)


def linear_attention_step(q_t, k_t, v_t, state=None, *, normalize: bool = False):
    """One decode step: `q_t, k_t [B,H,Dk]`, `v_t [B,H,Dv]` -> `(o_t [B,H,Dv], state)`."""
    check_step(q_t, k_t, v_t)
    b, h, dk = k_t.shape
    s, c = _initial(state, normalize, b, h, dk, v_t.shape[-1])
    dtype = q_t.dtype
    q_t, k_t, v_t = (x.astype(jnp.float32) for x in (q_t, k_t, v_t))
    s = s + k_t[..., :, None] * v_t[..., None, :]
    o = jnp.einsum("bhk,bhkv->bhv", q_t, s, precision=HIGHEST)
    if c is not None:
        c = c + k_t
        o = o / jnp.sum(q_t * c, axis=-1, keepdims=True)
    return o.astype(dtype), _pack(s, c)
