"""TTT-Linear (Sun et al. 2024): a linear learner with LayerNorm and residual, trained in the forward pass.

Per batch and head, `f(x; W, b) = x + LN(xW + b)` (LN with `ln_scale`, `ln_bias`, ε = 1e-6) and
`l_t = ½‖f(k_t) − v_t‖²`. Tokens are grouped in mini-batches of `minibatch`; inside one that
starts at `(W_s, b_s)`, every gradient is taken at `(W_s, b_s)` and token t reads with the prefix
of updates: `W_t = W_s − Σ_{j≤t} η_j ∇_W l_j(W_s)`, `o_t = f(q_t; W_t, b_t)` (seed 000 §4.7).

Dual form per mini-batch (the paper's; ttt-lm-jax), with `G = ∇_Z l` for `Z = K W_s + b_s`:
  `Z̄ = Q W_s + b_s − (tril(Q Kᵀ + 1) ⊙ η_j) G`,  `o = Q + LN(Z̄)`,
  `W ← W_s − (η ⊙ K)ᵀ G`,  `b ← b_s − Σ_j η_j G_j`,
so no per-token weight matrix is ever formed. A `lax.scan` runs over groups of mini-batches,
each group rematerialized (`jax.checkpoint`) in the backward pass: training stores one `(W, b)`
per group, never per token.

Streaming: the state remembers the mini-batch in progress (its start `(W_s, b_s)` and how many
of its tokens were seen), so feeding a sequence in pieces, or token by token with
`ttt_linear_step`, gives exactly the outputs of one call.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from nlearn.memory.chunking import check_gate, check_positive, check_qkv, from_chunks_first, pad_time, to_chunks_first
from nlearn.memory.linear_attention import HIGHEST, check_impl, check_state_shape

LN_EPS = 1e-6
TTT_IMPLS = ("dual", "recurrent")


class TTTState(NamedTuple):
    """Fast weights of TTT-Linear.

    W `[B,H,D,D]`, b `[B,H,D]`: the weights after the last token seen (what `o_t` read with).
    W_start, b_start: where the current mini-batch began; its gradients are taken there.
    pos: int32 scalar, tokens of the current mini-batch already seen (0 <= pos < minibatch);
    when 0, W_start == W.
    """

    W: jax.Array
    b: jax.Array
    W_start: jax.Array
    b_start: jax.Array
    pos: jax.Array


def ttt_linear_init_state(W0, b0, batch_size: int) -> TTTState:
    """State at a sequence start from `W0 [H,D,D]` or `[B,H,D,D]` and `b0 [H,D]` or `[B,H,D]`."""
    if W0.ndim not in (3, 4) or W0.shape[-1] != W0.shape[-2]:
        raise ValueError(f"W0 must have shape [H, D, D] or [B, H, D, D], got shape {tuple(W0.shape)}")
    h, d = W0.shape[-3], W0.shape[-1]
    if W0.ndim == 4 and W0.shape[0] != batch_size:
        raise ValueError(f"W0 batch dimension must be {batch_size}, got shape {tuple(W0.shape)}")
    if b0.shape not in ((h, d), (batch_size, h, d)):
        raise ValueError(f"b0 must have shape [H, D] = {(h, d)} or [B, H, D], got shape {tuple(b0.shape)}")
    w = jnp.broadcast_to(W0.astype(jnp.float32), (batch_size, h, d, d))
    b = jnp.broadcast_to(b0.astype(jnp.float32), (batch_size, h, d))
    return TTTState(w, b, w, b, jnp.zeros((), jnp.int32))


def _ln_parts(z):
    """LayerNorm over the last axis without affine: `(ẑ, 1/σ)`."""
    mu = jnp.mean(z, axis=-1, keepdims=True)
    zc = z - mu
    rstd = jax.lax.rsqrt(jnp.mean(zc * zc, axis=-1, keepdims=True) + LN_EPS)
    return zc * rstd, rstd


def _inner_grad(z, k, v, scale, bias):
    """`∇_Z ½‖k + LN(Z) − v‖²` per row: the LayerNorm backward of the residual error."""
    zh, rstd = _ln_parts(z)
    gzh = (k + scale * zh + bias - v) * scale
    return rstd * (gzh - jnp.mean(gzh, axis=-1, keepdims=True) - zh * jnp.mean(gzh * zh, axis=-1, keepdims=True))


def _read(x, z, scale, bias):
    """`f = x + LN(z)` with the per-head affine."""
    zh, _ = _ln_parts(z)
    return x + scale * zh + bias


def _minibatch(carry, x, scale, bias, precision):
    """Dual form of one mini-batch for all `[B,H]`.

    carry = (W, b, pending): W, b `[B,H,D,D]`, `[B,H,D]` are where the mini-batch starts, so
    gradients are taken there; `pending` is None, or the `(ΔW, Δb)` already applied inside this
    mini-batch by a previous call (a stream resumed mid-mini-batch), which reads and the update
    must include. x = (q, k, v `[B,H,C,D]`, ke = η ⊙ k, eta `[B,H,C]`, attn `[B,H,C,C]` =
    `tril(q kᵀ + 1) ⊙ η_j`); scale, bias `[H,1,D]`. Returns ((W', b'), Z̄ `[B,H,C,D]`), the
    pre-LayerNorm reads.
    """
    w, b, pending = carry
    q, k, v, ke, eta, attn = x
    c = q.shape[-2]
    z = jnp.einsum("bhcd,bhde->bhce", jnp.concatenate([k, q], axis=-2), w, precision=precision) + b[..., None, :]
    g = _inner_grad(z[..., :c, :], k, v, scale, bias)  # ∇_Z l_j at the start state
    zbar = z[..., c:, :] - jnp.einsum("bhij,bhjd->bhid", attn, g, precision=precision)
    w = w - jnp.einsum("bhjd,bhje->bhde", ke, g, precision=precision)
    b = b - jnp.sum(eta[..., None] * g, axis=-2)
    if pending is not None:
        dw, db = pending
        zbar = zbar - jnp.einsum("bhcd,bhde->bhce", q, dw, precision=precision) - db[..., None, :]
        w, b = w - dw, b - db
    return (w, b), zbar


def _ttt_dual(q, k, v, eta, state: TTTState, offset_static: bool, minibatch: int, group: int, scale, bias,
              precision):
    """Dual form over the sequence: `lax.scan` over groups of mini-batches, remat per group.

    `offset_static` means `state.pos` is known to be 0. Work that does not depend on the fast
    weights (the masked `q kᵀ` of every mini-batch, `η ⊙ k`, the read LayerNorm) runs outside
    the scan as large batched ops.
    """
    bsz, t, h, d = q.shape
    mb = minibatch
    span = mb * group  # tokens per scan step
    if offset_static:
        offset = 0
        length = -(-t // span) * span
        place = lambda x: pad_time(x, span)  # noqa: E731
    else:
        # Put the tokens at the in-progress position of the current mini-batch; the empty
        # slots before them have eta = 0 (and zero q, k, v), so they change nothing.
        offset = state.pos
        length = -(-(t + mb - 1) // span) * span

        def place(x):
            buf = jnp.zeros((bsz, length) + x.shape[2:], x.dtype)
            return jax.lax.dynamic_update_slice_in_dim(buf, x, offset, axis=1)

    n_steps = length // span
    q_c, k_c, v_c = (to_chunks_first(place(x), mb) for x in (q, k, v))  # [M,B,H,C,D], M mini-batches
    eta_c = to_chunks_first(place(eta), mb)  # [M,B,H,C]
    mask = jnp.tril(jnp.ones((mb, mb), bool))
    attn_c = jnp.where(mask, (jnp.einsum("...id,...jd->...ij", q_c, k_c, precision=precision) + 1.0)
                       * eta_c[..., None, :], 0.0)
    xs = tuple(x.reshape((n_steps, group) + x.shape[1:])
               for x in (q_c, k_c, v_c, k_c * eta_c[..., None], eta_c, attn_c))
    # Mini-batch holding the last real token; its start state is the next call's W_start.
    last_mb = (offset + t - 1) // mb
    need_mark = not (offset_static and t % mb == 0)
    sc, bi = scale[:, None, :], bias[:, None, :]

    def group_step(carry, x_grp, n0):
        w, b, pending, wm, bm = carry
        outs = []
        for i in range(group):
            if need_mark:
                hit = n0 + i == last_mb
                wm = jnp.where(hit, w, wm)
                bm = jnp.where(hit, b, bm)
            (w, b), zbar = _minibatch((w, b, pending), tuple(x[i] for x in x_grp), sc, bi, precision)
            if pending is not None:  # only the first mini-batch of a resumed stream has one
                pending = jax.tree_util.tree_map(jnp.zeros_like, pending)
            outs.append(zbar)
        return (w, b, pending, wm, bm), jnp.stack(outs)

    step = jax.checkpoint(group_step)

    def body(carry, xi):
        x_grp, idx = xi
        return step(carry, x_grp, idx * group)

    if offset_static:
        carry = (state.W, state.b, None, state.W, state.b)
    else:
        pending = (state.W_start - state.W, state.b_start - state.b)
        carry = (state.W_start, state.b_start, pending, state.W_start, state.b_start)
    carry, zbar = jax.lax.scan(body, carry, (xs, jnp.arange(n_steps)))
    w_fin, b_fin, _, wm, bm = carry
    zbar = from_chunks_first(zbar.reshape((n_steps * group,) + zbar.shape[2:]), length)
    if not offset_static:
        zbar = jax.lax.dynamic_slice_in_dim(zbar, offset, t, axis=1)
    zbar = zbar[:, :t]
    o = _read(q, zbar, scale, bias)
    new_pos = (offset + t) % mb
    if need_mark:
        at_boundary = new_pos == 0
        w_start = jnp.where(at_boundary, w_fin, wm)
        b_start = jnp.where(at_boundary, b_fin, bm)
    else:
        w_start, b_start = w_fin, b_fin
    return o, TTTState(w_fin, b_fin, w_start, b_start, jnp.asarray(new_pos, jnp.int32))


def _zeros_state(q, v):
    return jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), jnp.float32)


def _token_update(q_t, k_t, v_t, eta_t, state: TTTState, minibatch: int, scale, bias):
    """One token of the mini-batch schedule on `[B,H,D]` rows, `eta_t [B,H]`; scale `[H,D]`."""
    z = jnp.einsum("bhd,bhde->bhe", k_t, state.W_start, precision=HIGHEST) + state.b_start
    g = _inner_grad(z, k_t, v_t, scale, bias)  # [B,H,D]
    w = state.W - (eta_t[..., None] * k_t)[..., :, None] * g[..., None, :]
    b = state.b - eta_t[..., None] * g
    zq = jnp.einsum("bhd,bhde->bhe", q_t, w, precision=HIGHEST) + b
    o_t = _read(q_t, zq, scale, bias)
    pos = state.pos + 1
    full = pos == minibatch
    new = TTTState(w, b, jnp.where(full, w, state.W_start), jnp.where(full, b, state.b_start), jnp.where(full, 0, pos))
    return o_t, new


def _ttt_recurrent(q, k, v, eta, state: TTTState, minibatch: int, scale, bias):
    """Token-by-token reference of the same mini-batch schedule (`lax.scan` over time)."""

    def step(st, x):
        o_t, st = _token_update(*x, st, minibatch, scale, bias)
        return st, o_t

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, eta))
    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1), state


def _check_ln(ln_scale, ln_bias, h: int, d: int) -> None:
    for name, x in (("ln_scale", ln_scale), ("ln_bias", ln_bias)):
        if tuple(x.shape) != (h, d):
            raise ValueError(f"{name} must have shape [H, D] = {(h, d)}, got shape {tuple(x.shape)}")


def _check_state(state, bsz: int, h: int, d: int) -> TTTState:
    if not isinstance(state, TTTState):
        raise ValueError(f"initial_state must be a TTTState, got {type(state).__name__}")
    check_state_shape("initial_state.W", state.W, (bsz, h, d, d))
    check_state_shape("initial_state.W_start", state.W_start, (bsz, h, d, d))
    check_state_shape("initial_state.b", state.b, (bsz, h, d))
    check_state_shape("initial_state.b_start", state.b_start, (bsz, h, d))
    check_state_shape("initial_state.pos", state.pos, ())
    f32 = jnp.float32
    return TTTState(state.W.astype(f32), state.b.astype(f32), state.W_start.astype(f32), state.b_start.astype(f32),
                    jnp.asarray(state.pos, jnp.int32))


def ttt_linear(
    q,
    k,
    v,
    eta,
    *,
    W0=None,
    b0=None,
    ln_scale,
    ln_bias,
    minibatch: int = 16,
    initial_state: TTTState | None = None,
    impl: str = "dual",
    remat_group: int = 4,
    precision=HIGHEST,
):
    """TTT-Linear with mini-batch gradient descent, read after each token's own prefix of updates.

    Args:
      q, k, v: `[B, T, H, D]` (the residual needs Dk == Dv); eta: `[B, T, H]` inner rates.
      W0: `[H, D, D]` (learned init shared by the batch) or `[B, H, D, D]`; b0: `[H, D]` or
        `[B, H, D]`. Needed unless `initial_state` is given (which then replaces them).
      ln_scale, ln_bias: `[H, D]`, the inner LayerNorm's affine (ε = 1e-6).
      minibatch: tokens per inner mini-batch; T need not be a multiple (padding has eta = 0).
      initial_state: a `TTTState` from a previous call or `ttt_linear_init_state`.
      impl: "dual" (mini-batch dual form, scan over groups) or "recurrent" (token-by-token).
      remat_group: mini-batches per rematerialized scan step of the dual form.

    Returns: `(o [B,T,H,D] in q's dtype, TTTState)`.
    """
    bsz, t, h, d, dv = check_qkv(q, k, v)
    if dv != d:
        raise ValueError(f"ttt_linear needs v with the width of k (residual), got k {tuple(k.shape)}, v {tuple(v.shape)}")
    check_gate("eta", eta, bsz, t, h)
    check_positive("minibatch", minibatch)
    check_positive("remat_group", remat_group)
    check_impl(impl, TTT_IMPLS + ("chunked",))
    _check_ln(ln_scale, ln_bias, h, d)
    if initial_state is None:
        if W0 is None or b0 is None:
            raise ValueError("ttt_linear needs W0 and b0 when initial_state is None")
        if W0.shape[-3:] != (h, d, d):
            raise ValueError(f"W0 must have shape [H, D, D] = {(h, d, d)} or [B, H, D, D], got shape {tuple(W0.shape)}")
        state = ttt_linear_init_state(W0, b0, bsz)
    else:
        state = _check_state(initial_state, bsz, h, d)
    dtype = q.dtype
    q, k, v, eta = (x.astype(jnp.float32) for x in (q, k, v, eta))
    scale = ln_scale.astype(jnp.float32)
    bias = ln_bias.astype(jnp.float32)
    if impl == "recurrent":
        o, state = _ttt_recurrent(q, k, v, eta, state, minibatch, scale, bias)
    else:
        o, state = _ttt_dual(q, k, v, eta, state, initial_state is None, minibatch, remat_group, scale, bias,
                             precision)
    return o.astype(dtype), state


def ttt_linear_step(q_t, k_t, v_t, eta_t, state: TTTState, *, ln_scale, ln_bias, minibatch: int = 16):
    """One decode step: `[B,H,D]` rows, `eta_t [B,H]` -> `(o_t [B,H,D], TTTState)`.

    Keeps the mini-batch schedule (gradients at `state.W_start`, reads with the accumulated
    prefix), so stepping through a sequence reproduces `ttt_linear` exactly.
    """
    for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        if x.ndim != 3:
            raise ValueError(f"{name} must have shape [B, H, D], got shape {tuple(x.shape)}")
    if not (q_t.shape == k_t.shape == v_t.shape):
        raise ValueError(f"q_t, k_t, v_t must match, got {tuple(q_t.shape)}, {tuple(k_t.shape)}, {tuple(v_t.shape)}")
    bsz, h, d = k_t.shape
    if tuple(eta_t.shape) != (bsz, h):
        raise ValueError(f"eta_t must have shape [B, H] = {(bsz, h)}, got shape {tuple(eta_t.shape)}")
    check_positive("minibatch", minibatch)
    _check_ln(ln_scale, ln_bias, h, d)
    state = _check_state(state, bsz, h, d)
    f32 = [x.astype(jnp.float32) for x in (q_t, k_t, v_t, eta_t)]
    o, state = _token_update(*f32, state, minibatch, ln_scale.astype(jnp.float32), ln_bias.astype(jnp.float32))
    return o.astype(q_t.dtype), state
