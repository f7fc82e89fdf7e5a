"""TTT-Linear (Sun et al. 2024): a linear learner with LayerNorm and residual, trained in the forward pass.

Per batch and head, `f(x; W, b) = x + LN(xW + b)` (LN with `ln_scale`, `ln_bias`, ε = 1e-6) and
`l_t = ½‖f(k_t) − v_t‖²`. Tokens are grouped in mini-batches of `minibatch`; inside one that
starts at `(W_s, b_s)`, every gradient is taken at `(W_s, b_s)` and token t reads with the prefix
of updates: `W_t = W_s − Σ_{j≤t} η_j ∇_W l_j(W_s)`, `o_t = f(q_t; W_t, b_t)` (Sun et al. 2024; docs/architecture.md).

Dual form per mini-batch (the paper's; ttt-lm-jax), with `G = ∇_Z l` for `Z = K W_s + b_s`:
  `Z̄ = Q W_s + b_s − (tril(Q Kᵀ + 1) ⊙ η_j) G`,  `o = Q + LN(Z̄)`,
  `W ← W_s − (η ⊙ K)ᵀ G`,  `b ← b_s − Σ_j η_j G_j`,
so no per-token weight matrix is ever formed. Only the carry of `(W, b)` across mini-batches is
sequential: a loop over steps of `remat_group` mini-batches on the time-major inputs, with a
hand-written adjoint (`_ttt_scan`'s custom VJP) that stores, per token, the inner gradient and
the LayerNorm statistics, and one `(W, b)` per step; the states inside a step are recomputed.
Memory is linear in T and nothing of size `[D, D]` is kept per token.

Streaming: the state remembers the mini-batch in progress (its start `(W_s, b_s)` and how many
of its tokens were seen), so feeding a sequence in pieces, or token by token with
`ttt_linear_step`, gives exactly the outputs of one call.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from nlearn.memory.chunking import check_gate, check_positive, check_qkv, check_step, pad_time, place_at, take_at
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


def ln_parts(z):
    """LayerNorm over the last axis without affine: `(ẑ, 1/σ)`."""
    mu = jnp.mean(z, axis=-1, keepdims=True)
    zc = z - mu
    rstd = jax.lax.rsqrt(jnp.mean(zc * zc, axis=-1, keepdims=True) + LN_EPS)
    return zc * rstd, rstd


def _inner_grad(z, k, v, scale, bias):
    """`∇_Z ½‖k + LN(Z) − v‖²` per row: the LayerNorm backward of the residual error."""
    zh, rstd = ln_parts(z)
    gzh = (k + scale * zh + bias - v) * scale
    return rstd * (gzh - jnp.mean(gzh, axis=-1, keepdims=True) - zh * jnp.mean(gzh * zh, axis=-1, keepdims=True))


def _read(x, z, scale, bias):
    """`f = x + LN(z)` with the per-head affine."""
    zh, _ = ln_parts(z)
    return x + scale * zh + bias


def _row_sum(x):
    """Sum over the last axis, keepdims, as a matrix-vector product (on CPU a dot with a ones
    vector is cheaper than a small reduction)."""
    return jnp.einsum("...d,de->...e", x, jnp.ones((x.shape[-1], 1), x.dtype), precision=HIGHEST)


def _mb_forward(w, b, x, scale, bias, precision):
    """Dual form of one mini-batch for all `[B,H]` from its start state `(w, b)`.

    x = (q, k, v `[B,H,C,D]`, eta `[B,H,C]`); scale, bias `[H,1,D]`. Returns (W', b', Z̄, G, x̂, r,
    c): the pre-LayerNorm reads `Z̄ = Z_q − attn G` with `attn = tril(q kᵀ + 1) ⊙ η_j`, the inner
    gradients `G = ∇_Z l` at `Z = k w + b`, and what the backward pass needs of the LayerNorm:
    `x̂ = LN(Z)`, `r = 1/σ`, `c = mean(γ ⊙ x̂)` with `γ = (f(k) − v) ⊙ scale`.
    """
    q, k, v, eta = x
    n, d = q.shape[-2], q.shape[-1]
    ein = partial(jnp.einsum, precision=precision)
    z = ein("bhcd,bhde->bhce", jnp.concatenate([k, q], axis=-2), w) + b[..., None, :]
    zk = z[..., :n, :]
    zc = zk - _row_sum(zk) / d
    r = jax.lax.rsqrt(_row_sum(zc * zc) / d + LN_EPS)
    xh = zc * r
    gam = (k + scale * xh + bias - v) * scale
    a, c = _row_sum(gam) / d, _row_sum(gam * xh) / d
    g = r * (gam - a - xh * c)
    attn = _attn(q, k, eta, precision)
    zbar = z[..., n:, :] - ein("bhij,bhjd->bhid", attn, g)
    w = w - ein("bhjd,bhje->bhde", k * eta[..., None], g)
    b = b - ein("bhj,bhjd->bhd", eta, g)  # a dot: cheaper on CPU than a reduce over C
    return w, b, zbar, g, xh, r, c


def _attn(q, k, eta, precision):
    """`tril(q kᵀ + 1) ⊙ η_j` of one mini-batch `[B,H,C,C]`: token i reads j's update for j ≤ i."""
    c = q.shape[-2]
    qk1 = jnp.einsum("bhid,bhjd->bhij", q, k, precision=precision) + 1.0
    return jnp.where(jnp.tril(jnp.ones((c, c), bool)), qk1 * eta[..., None, :], 0.0)


def _inner_grad_bwd(dg, g, xh, r, c, k, v, scale, bias):
    """Adjoint of `G = _inner_grad(Z, k, v, scale, bias)` from the saved `x̂, r, c`.

    Returns `(dZ, dk, dv, dscale_rows, dbias_rows)`; the last two are per row (`[...,C,D]`) and
    still need summing over rows. Two stacked row reductions instead of autodiff's many.
    """
    d = xh.shape[-1]
    e = k + scale * xh + bias - v
    gam = e * scale
    r1, r2, r3 = _row_sum(dg), _row_sum(dg * xh), _row_sum(dg * g)
    a_bar, c_bar = -r * r1, -r * r2
    gam_bar = r * dg + (a_bar + c_bar * xh) / d
    e_bar = scale * gam_bar
    xh_bar = -r * c * dg + c_bar * gam / d + scale * e_bar
    r4, r6 = _row_sum(xh_bar * xh), _row_sum(xh_bar)
    r_bar = (r3 + r4) / r
    dz = r * xh_bar - (r * r * r_bar * xh + r * r6) / d  # Σ x̂ = 0
    return dz, e_bar, -e_bar, e * gam_bar + xh * e_bar, e_bar


def _tile(x, t0, mb):
    """Mini-batch at time `t0` of a time-major `[B,T,H,...]` array, as `[B,H,C,...]`."""
    return jnp.moveaxis(jax.lax.dynamic_slice_in_dim(x, t0, mb, axis=1), 1, 2)


def _put(buf, tile, t0):
    """Write a `[B,H,C,...]` tile back into a time-major buffer at `t0`."""
    return jax.lax.dynamic_update_slice_in_dim(buf, jnp.moveaxis(tile, 2, 1), t0, axis=1)


def _scan_forward(w0, b0, q, k, v, eta, scale, bias, mb, group, precision):
    """Loop over steps of `group` mini-batches on time-major `[B,T,H,D]` inputs (T a multiple of
    `mb·group`); tiles are sliced in place, so no chunk-major copies of the inputs are made.

    Returns (Z̄, G, x̂ `[B,T,H,D]`, r, c `[B,T,H,1]`, the states entering each step, final state).
    """
    bsz, t, h, d = q.shape
    span = mb * group
    n_steps = t // span
    f32 = jnp.float32
    bufs = (jnp.zeros((bsz, t, h, d), f32),) * 3 + (jnp.zeros((bsz, t, h, 1), f32),) * 2
    w_in = jnp.zeros((n_steps,) + w0.shape, f32)

    def body(s, carry):
        w, b, bufs, w_in = carry
        w_in = w_in.at[s].set(w)
        for i in range(group):
            t0 = (s * group + i) * mb
            x = (_tile(q, t0, mb), _tile(k, t0, mb), _tile(v, t0, mb), _tile(eta[..., None], t0, mb)[..., 0])
            w, b, *outs = _mb_forward(w, b, x, scale, bias, precision)
            bufs = tuple(_put(buf, o, t0) for buf, o in zip(bufs, outs))
        return w, b, bufs, w_in

    w_fin, b_fin, (zbar, g, xh, r, c), w_in = jax.lax.fori_loop(0, n_steps, body, (w0, b0, bufs, w_in))
    return zbar, g, (xh, r, c), w_in, w_fin, b_fin


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ttt_scan(w0, b0, xs, ln, mb, group, precision):
    """Sequential part of the dual form on time-major inputs: (Z̄, G `[B,T,H,D]`, W_fin, b_fin).

    w0, b0: start state `[B,H,D,D]`, `[B,H,D]`; xs = (q, k, v `[B,T,H,D]`, eta `[B,T,H]`) with T
    a multiple of `mb·group`; ln = (scale, bias) `[H,1,D]`.

    The custom VJP stores G and the LayerNorm's `x̂, r, c` of every token and the state entering
    each step of `group` mini-batches, recomputes the states inside a step, and walks back with
    the hand-written adjoints of `W' = W − (η⊙K)ᵀ G`, `b' = b − Σ η G`, `Z = [K;Q] W + b`,
    `Z̄ = Z_q − attn G` and of the inner LayerNorm gradient (`_inner_grad_bwd`).
    """
    zbar, g, _, _, w_fin, b_fin = _scan_forward(w0, b0, *xs, *ln, mb, group, precision)
    return zbar, g, w_fin, b_fin


def _ttt_scan_fwd(w0, b0, xs, ln, mb, group, precision):
    zbar, g, saved, w_in, w_fin, b_fin = _scan_forward(w0, b0, *xs, *ln, mb, group, precision)
    return (zbar, g, w_fin, b_fin), (xs, ln, g, saved, w_in)


def _ttt_scan_bwd(mb, group, precision, res, cts):
    (q, k, v, eta), (scale, bias), g_all, (xh_all, r_all, c_all), w_in = res
    dzbar_all, dg_out, dw_fin, db_fin = cts
    ein = partial(jnp.einsum, precision=precision)
    bsz, t, h, d = q.shape
    n_steps = w_in.shape[0]
    mask = jnp.tril(jnp.ones((mb, mb), bool))
    eta4 = eta[..., None]

    def body(j, carry):
        s = n_steps - 1 - j
        lam_w, lam_b, dscale, dbias, (dq_buf, dk_buf, dv_buf, deta_buf) = carry
        tiles = []
        ws = [w_in[s]]  # states entering each mini-batch of the step, recomputed as in the forward
        for i in range(group):
            t0 = (s * group + i) * mb
            tl = tuple(_tile(x, t0, mb) for x in (q, k, v, eta4, g_all, xh_all, r_all, c_all, dzbar_all, dg_out))
            tiles.append((t0, tl))
            if i < group - 1:
                ws.append(ws[-1] - ein("bhjd,bhje->bhde", tl[1] * tl[3], tl[4]))
        for i in reversed(range(group)):
            t0, (q_, k_, v_, eta_, g, xh, r, c, dzbar, dg_ext) = tiles[i]
            eta_ = eta_[..., 0]
            ke = k_ * eta_[..., None]
            # Z̄ = Z_q − attn G, attn = tril(q kᵀ + 1) ⊙ η_j.
            qk1 = ein("bhid,bhjd->bhij", q_, k_) + 1.0
            attn = jnp.where(mask, qk1 * eta_[..., None, :], 0.0)
            dattn = jnp.where(mask, -ein("bhid,bhjd->bhij", dzbar, g), 0.0)
            dqk = dattn * eta_[..., None, :]
            deta = jnp.sum(dattn * qk1, axis=-2)
            # W' = W − keᵀ G and b' = b − Σ η G, with lam_* the cotangents of W', b'.
            dg = (dg_ext - ein("bhij,bhid->bhjd", attn, dzbar) - ein("bhjd,bhde->bhje", ke, lam_w)
                  - eta_[..., None] * lam_b[..., None, :])
            dke = -ein("bhje,bhde->bhjd", g, lam_w)
            deta = deta + jnp.sum(dke * k_, axis=-1) - jnp.sum(g * lam_b[..., None, :], axis=-1)
            dzk, dk_inner, dv, dsc, dbi = _inner_grad_bwd(dg, g, xh, r, c, k_, v_, scale, bias)
            # Z = [K; Q] W + b.
            dz = jnp.concatenate([dzk, dzbar], axis=-2)
            lam_w = lam_w + ein("bhcd,bhce->bhde", jnp.concatenate([k_, q_], axis=-2), dz)
            lam_b = lam_b + ein("bhc,bhcd->bhd", jnp.ones(dz.shape[:-1], dz.dtype), dz)
            dkq = ein("bhce,bhde->bhcd", dz, ws[i])
            dq = dkq[..., mb:, :] + ein("bhij,bhjd->bhid", dqk, k_)
            dk = dkq[..., :mb, :] + dk_inner + dke * eta_[..., None] + ein("bhij,bhid->bhjd", dqk, q_)
            dq_buf, dk_buf, dv_buf = _put(dq_buf, dq, t0), _put(dk_buf, dk, t0), _put(dv_buf, dv, t0)
            deta_buf = _put(deta_buf, deta[..., None], t0)
            dscale, dbias = dscale + dsc, dbias + dbi
        return lam_w, lam_b, dscale, dbias, (dq_buf, dk_buf, dv_buf, deta_buf)

    rows = jnp.zeros((bsz, h, mb, d), jnp.float32)  # per-row sums of the affine's cotangents
    bufs = (jnp.zeros_like(q),) * 3 + (jnp.zeros(eta4.shape, jnp.float32),)
    dw0, db0, dscale, dbias, (dq, dk, dv, deta) = jax.lax.fori_loop(
        0, n_steps, body, (dw_fin, db_fin, rows, rows, bufs))
    dscale = jnp.sum(dscale, axis=(0, 2))[:, None, :]  # [B,H,C,D] -> [H,1,D]
    dbias = jnp.sum(dbias, axis=(0, 2))[:, None, :]
    return dw0, db0, (dq, dk, dv, deta[..., 0]), (dscale, dbias)


_ttt_scan.defvjp(_ttt_scan_fwd, _ttt_scan_bwd)


def _ttt_dual(q, k, v, eta, state: TTTState, offset_static: bool, minibatch: int, group: int, scale, bias,
              precision):
    """Dual form over the sequence: `_ttt_scan` over the mini-batches, then every read's
    LayerNorm at once.

    `offset_static` means `state.pos` is known to be 0. Otherwise the call resumes a mini-batch in
    progress: the tokens are placed at its position (the empty slots before them have eta = 0 and
    change nothing) and that first mini-batch, whose gradients are taken at `W_start` but which
    reads and updates from the current `W`, is done before the scan.
    """
    bsz, t, h, d = q.shape
    mb = minibatch
    span = mb * group  # tokens per loop step
    sc, bi = scale[:, None, :], bias[:, None, :]
    ein = partial(jnp.einsum, precision=precision)
    if offset_static:
        offset = 0
        xs = tuple(pad_time(x, span) for x in (q, k, v, eta))
        w, b = state.W, state.b
        first = None
    else:
        # Resume: gradients at W_start, reads and the update from W (they differ by what this
        # mini-batch already wrote in the previous call).
        offset = state.pos
        length = mb + -(-max(t - 1, 1) // span) * span
        placed = [place_at(x, offset, length) for x in (q, k, v, eta)]
        q0, k0, v0 = (jnp.moveaxis(x[:, :mb], 1, 2) for x in placed[:3])
        eta0 = jnp.moveaxis(placed[3][:, :mb], 1, 2)
        zk0 = ein("bhcd,bhde->bhce", k0, state.W_start) + state.b_start[..., None, :]
        g0 = _inner_grad(zk0, k0, v0, sc, bi)
        zbar0 = ein("bhcd,bhde->bhce", q0, state.W) + state.b[..., None, :] - ein(
            "bhij,bhjd->bhid", _attn(q0, k0, eta0, precision), g0)
        w = state.W - ein("bhjd,bhje->bhde", k0 * eta0[..., None], g0)
        b = state.b - jnp.sum(eta0[..., None] * g0, axis=-2)
        first = (zbar0, g0)
        xs = tuple(x[:, mb:] for x in placed)
    zbar, g, w_fin, b_fin = _ttt_scan(w, b, xs, (sc, bi), mb, group, precision)
    if first is None:
        k_time, eta_time = xs[1], xs[3]
    else:  # put the peeled mini-batch back in front
        zbar = jnp.concatenate([jnp.moveaxis(first[0], 2, 1), zbar], axis=1)
        g = jnp.concatenate([jnp.moveaxis(first[1], 2, 1), g], axis=1)
        k_time, eta_time = placed[1], placed[3]
        zbar = take_at(zbar, offset, t)
    o = _read(q, zbar[:, :t], scale, bias)
    # The next call's W_start: where the mini-batch holding the last token began. Later
    # mini-batches are padding and change nothing, so it is W_fin with that mini-batch's update
    # taken back (for the resumed first mini-batch: the old W_start).
    new_pos = (offset + t) % mb
    last = (offset + t - 1) // mb * mb
    g_m, k_m, eta_m = (jax.lax.dynamic_slice_in_dim(x, last, mb, axis=1) for x in (g, k_time, eta_time))
    w_start = w_fin + ein("bjhd,bjhe->bhde", k_m * eta_m[..., None], g_m)
    b_start = b_fin + ein("bjh,bjhd->bhd", eta_m, g_m)
    if first is not None:
        w_start = jnp.where(last == 0, state.W_start, w_start)
        b_start = jnp.where(last == 0, state.b_start, b_start)
    at_boundary = new_pos == 0
    w_start = jnp.where(at_boundary, w_fin, w_start)
    b_start = jnp.where(at_boundary, b_fin, b_start)
    return o, TTTState(w_fin, b_fin, w_start, b_start, jnp.asarray(new_pos, jnp.int32))


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


def check_ttt_args(op: str, q, k, v, eta, *, minibatch, remat_group, impl, impls, ln_scale, ln_bias):
    """The argument checks the TTT ops share; returns (B, T, H, D)."""
    bsz, t, h, d, dv = check_qkv(q, k, v)
    if dv != d:
        raise ValueError(f"{op} needs v with the width of k (residual), got k {tuple(k.shape)}, v {tuple(v.shape)}")
    check_gate("eta", eta, bsz, t, h)
    check_positive("minibatch", minibatch)
    check_positive("remat_group", remat_group)
    check_impl(impl, impls)
    _check_ln(ln_scale, ln_bias, h, d)
    return bsz, t, h, d


def check_ttt_step_args(q_t, k_t, v_t, eta_t, *, minibatch, ln_scale, ln_bias) -> None:
    """The argument checks of the TTT decode steps: `[B, H, D]` rows (v as wide as k), `eta_t [B, H]`."""
    check_step(q_t, k_t, v_t, (("eta_t", eta_t),))
    if v_t.shape != k_t.shape:
        raise ValueError(f"v_t must have the shape of k_t {tuple(k_t.shape)} (residual), got {tuple(v_t.shape)}")
    check_positive("minibatch", minibatch)
    _check_ln(ln_scale, ln_bias, *k_t.shape[1:])


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
      remat_group: mini-batches per loop step of the dual form: one `(W, b)` is stored per step
        and the others recomputed in the backward pass (4: a quarter of the memory of 1, at
        the same speed on CPU).

    Returns: `(o [B,T,H,D] in q's dtype, TTTState)`.
    """
    bsz, t, h, d = check_ttt_args("ttt_linear", q, k, v, eta, minibatch=minibatch, remat_group=remat_group, impl=impl,
                                  impls=TTT_IMPLS + ("chunked",), ln_scale=ln_scale, ln_bias=ln_bias)
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
    check_ttt_step_args(q_t, k_t, v_t, eta_t, minibatch=minibatch, ln_scale=ln_scale, ln_bias=ln_bias)
    bsz, h, d = k_t.shape
    state = _check_state(state, bsz, h, d)
    f32 = [x.astype(jnp.float32) for x in (q_t, k_t, v_t, eta_t)]
    o, state = _token_update(*f32, state, minibatch, ln_scale.astype(jnp.float32), ln_bias.astype(jnp.float32))
    return o.astype(q_t.dtype), state
