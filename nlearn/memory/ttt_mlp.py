"""TTT-MLP (Sun et al. 2024): a two-layer MLP learner with LayerNorm and residual, trained while reading.

Per batch and head, `f(x; θ) = x + LN(gelu(x W1 + b1) W2 + b2)` with θ = (W1 `[D,F]`, b1 `[F]`,
W2 `[F,D]`, b2 `[D]`), F = 4·D in the layer, LN per head with `ln_scale`, `ln_bias`, ε = 1e-6, and
GELU the tanh approximation (as in ttt-lm-jax's `nn.gelu`); the inner loss is
`l_t = ½‖f(k_t) − v_t‖²`. Tokens are grouped in mini-batches of `minibatch`; inside one that
starts at θ_s every gradient is taken at θ_s and token t reads with its own prefix of updates:
`θ_t = θ_s − Σ_{j≤t} η_j ∇l_j(θ_s)`, `o_t = f(q_t; θ_t)` (seed 000 §4.7). The last state of a
mini-batch starts the next.

Dual form of one mini-batch (no per-token weights are formed). At θ_s, for the keys:
  `Z1 = K W1 + b1`, `X2 = gelu(Z1)`, `Z2 = X2 W2 + b2`,
  `G2 = ∇_{Z2} l` (the LayerNorm backward of `k + LN(Z2) − v`), `G1 = (G2 W2ᵀ) ⊙ gelu'(Z1)`;
then the reads, each row t summing only j ≤ t (`A ⊙ η_j` below means column j scaled by η_j):
  `Z̄1 = Q W1 + b1 − (tril(Q Kᵀ + 1) ⊙ η_j) G1`,  `X̄2 = gelu(Z̄1)`,
  `Z̄2 = X̄2 W2 + b2 − (tril(X̄2 X2ᵀ + 1) ⊙ η_j) G2`,  `o = Q + LN(Z̄2)`;
and the carry `W1 −= (η⊙K)ᵀ G1`, `b1 −= Σ_j η_j G1_j`, `W2 −= (η⊙X2)ᵀ G2`, `b2 −= Σ_j η_j G2_j`.
Since `∇_{W1} l_j = k_jᵀ G1_j`, `∇_{W2} l_j = X2_jᵀ G2_j` and the biases get G1_j, G2_j, this is
the per-token schedule above rewritten exactly (`impl="recurrent"` computes it with `jax.grad`).

A `lax.scan` runs over groups of `remat_group` mini-batches, each group rematerialized
(`jax.checkpoint`) in the backward pass, so training stores O(T·D) activations plus one θ per
group, never one per token. Streaming: the state keeps the mini-batch in progress (its start θ_s
and how many of its tokens were seen), so pieces of any length, or `ttt_mlp_step` token by token,
reproduce one call exactly.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from nlearn.memory.chunking import check_gate, check_positive, check_qkv, from_chunks_first, pad_time, to_chunks_first
from nlearn.memory.linear_attention import HIGHEST, check_impl, check_state_shape
from nlearn.memory.ttt import _inner_grad, _read  # the same LayerNorm + residual inner model

TTT_MLP_IMPLS = ("dual", "recurrent")
_GELU_C = math.sqrt(2.0 / math.pi)


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


# --------------------------------------------------------------------------------------------
# The inner model and its hand-written gradient pieces
# --------------------------------------------------------------------------------------------
def gelu(x):
    """GELU, tanh approximation."""
    return jax.nn.gelu(x, approximate=True)


def gelu_grad(x):
    """Derivative of the tanh-approximate GELU: `½(1 + tanh u) + ½ x (1 − tanh² u) u'`."""
    u = _GELU_C * (x + 0.044715 * x * x * x)
    t = jnp.tanh(u)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * x * x)


def _f(x, w: TTTMLPWeights, scale, bias):
    """The inner model on rows `x [B,H,D]` with weights `[B,H,...]`; scale, bias `[H,D]`."""
    z1 = jnp.einsum("bhd,bhdf->bhf", x, w.W1, precision=HIGHEST) + w.b1
    z2 = jnp.einsum("bhf,bhfd->bhd", gelu(z1), w.W2, precision=HIGHEST) + w.b2
    return _read(x, z2, scale, bias)


# --------------------------------------------------------------------------------------------
# Dual form
# --------------------------------------------------------------------------------------------
def _mb_dual(wg: TTTMLPWeights, wr: TTTMLPWeights, x, scale, bias, precision):
    """Dual form of one mini-batch for all `[B,H]`.

    wg: where the gradients are taken (the mini-batch's start); wr: what reads and the update
    start from (the same except for a stream resumed mid-mini-batch, where wr already holds the
    earlier tokens' writes). x = (q, k, v `[B,H,C,D]`, eta `[B,H,C]`, attn1 `[B,H,C,C]` =
    `tril(q kᵀ + 1) ⊙ η_j`); scale, bias `[H,1,D]`. Returns (new weights, Z̄2 `[B,H,C,D]`).
    """
    q, k, v, eta, attn1 = x
    ein = lambda s, a, b: jnp.einsum(s, a, b, precision=precision)  # noqa: E731
    c = q.shape[-2]
    if wr is wg:  # one matmul for keys and queries
        z1 = ein("bhcd,bhdf->bhcf", jnp.concatenate([k, q], axis=-2), wg.W1) + wg.b1[..., None, :]
        z1k, z1q = z1[..., :c, :], z1[..., c:, :]
    else:
        z1k = ein("bhcd,bhdf->bhcf", k, wg.W1) + wg.b1[..., None, :]
        z1q = ein("bhcd,bhdf->bhcf", q, wr.W1) + wr.b1[..., None, :]
    x2k = gelu(z1k)
    g2 = _inner_grad(ein("bhcf,bhfd->bhcd", x2k, wg.W2) + wg.b2[..., None, :], k, v, scale, bias)
    g1 = ein("bhcd,bhfd->bhcf", g2, wg.W2) * gelu_grad(z1k)
    x2q = gelu(z1q - ein("bhij,bhjf->bhif", attn1, g1))
    mask = jnp.tril(jnp.ones((c, c), bool))
    attn2 = jnp.where(mask, (ein("bhif,bhjf->bhij", x2q, x2k) + 1.0) * eta[..., None, :], 0.0)
    z2q = ein("bhcf,bhfd->bhcd", x2q, wr.W2) + wr.b2[..., None, :] - ein("bhij,bhjd->bhid", attn2, g2)
    e = eta[..., None]
    new = TTTMLPWeights(
        wr.W1 - ein("bhcd,bhcf->bhdf", e * k, g1),
        wr.b1 - jnp.sum(e * g1, axis=-2),
        wr.W2 - ein("bhcf,bhcd->bhfd", e * x2k, g2),
        wr.b2 - jnp.sum(e * g2, axis=-2),
    )
    return new, z2q


def _scan(w0: TTTMLPWeights, xs, scale, bias, precision):
    """`lax.scan` over groups of mini-batches (xs: tuple of `[S, group, B, H, ...]`), each group
    rematerialized in the backward pass: only the weights entering each group are kept.

    Returns (final weights, weights entering each group `[S, B, H, ...]`, Z̄2 `[S, group, B, H, C, D]`).
    """

    def mb_step(w, x):
        return _mb_dual(w, w, x, scale, bias, precision)

    @jax.checkpoint
    def body(w, x_grp):  # the group's mini-batches by an inner scan: compiled once, not unrolled
        w_out, z = jax.lax.scan(mb_step, w, x_grp)
        return w_out, (w, z)

    w_fin, (w_in, z) = jax.lax.scan(body, w0, xs)
    return w_fin, w_in, z


def _start_of(target, w_grp, x_grp, first: int, scale, bias, precision):
    """Weights entering mini-batch `target` (traced), replaying the group that holds it from the
    weights entering it, `w_grp`; x_grp: that group's inputs `[group, B, H, ...]`, whose first
    mini-batch has global index `first` (traced). Only the streaming state needs this: a caller
    that drops the state (training) never runs it.
    """

    def step(carry, x):
        w, mark = carry
        xm, i = x
        mark = jax.tree.map(lambda m, w_: jnp.where(i == target, w_, m), mark, w)
        w, _ = _mb_dual(w, w, xm, scale, bias, precision)
        return (w, mark), None

    n = x_grp[0].shape[0]
    (_, mark), _ = jax.lax.scan(step, (w_grp, w_grp), (x_grp, first + jnp.arange(n)))
    return mark


def _ttt_mlp_dual(q, k, v, eta, state: TTTMLPState, offset_static: bool, minibatch: int, group: int,
                  scale, bias, precision):
    """Dual form over the sequence: weight-independent work (the masked `q kᵀ`) for all
    mini-batches at once, the scan, then every read's LayerNorm at once.

    `offset_static` means `state.pos` is known to be 0. Otherwise the call resumes a mini-batch in
    progress: the tokens are placed at its position (the empty slots before them have eta = 0 and
    change nothing) and that first mini-batch, whose gradients are taken at `state.start` but
    which reads and updates from `state.weights`, is done before the scan.
    """
    bsz, t = q.shape[:2]
    mb = minibatch
    span = mb * group  # tokens per scan step
    if offset_static:
        offset, peel = 0, 0
        length = -(-t // span) * span
    else:
        offset, peel = state.pos, 1
        length = mb + -(-(t - 1) // span) * span

    def place(x):
        if offset_static:
            return pad_time(x, span)
        buf = jnp.zeros((bsz, length) + x.shape[2:], x.dtype)
        return jax.lax.dynamic_update_slice_in_dim(buf, x, offset, axis=1)

    q_c, k_c, v_c = (to_chunks_first(place(x), mb) for x in (q, k, v))  # [M,B,H,C,D], M mini-batches
    eta_c = to_chunks_first(place(eta), mb)  # [M,B,H,C]
    mask = jnp.tril(jnp.ones((mb, mb), bool))
    attn1 = jnp.where(mask, (jnp.einsum("...id,...jd->...ij", q_c, k_c, precision=precision) + 1.0)
                      * eta_c[..., None, :], 0.0)
    parts = (q_c, k_c, v_c, eta_c, attn1)
    sc, bi = scale[:, None, :], bias[:, None, :]
    w = state.weights
    z_first = []
    if not offset_static:
        w, z0 = _mb_dual(state.start, state.weights, tuple(x[0] for x in parts), sc, bi, precision)
        z_first = [z0[None]]
    n_mb = length // mb
    n_steps = (n_mb - peel) // group
    xs = tuple(x[peel:].reshape((n_steps, group) + x.shape[1:]) for x in parts)
    w_fin, w_in, z = _scan(w, xs, sc, bi, precision)
    new_pos = (offset + t) % mb
    # The next call's mini-batch start: the final weights at a boundary; else the weights entering
    # the mini-batch of the last real token (`state.start` if that is the resumed first one).
    last_mb = (offset + t - 1) // mb
    if offset_static and t % mb == 0:
        start = w_fin
    elif n_steps:
        g_last = jnp.maximum(last_mb - peel, 0) // group
        pick = lambda a: jax.lax.dynamic_index_in_dim(a, g_last, keepdims=False)  # noqa: E731
        start = _start_of(last_mb, jax.tree.map(pick, w_in), tuple(pick(x) for x in xs), peel + g_last * group,
                          sc, bi, precision)
        if peel:
            start = jax.tree.map(lambda a, b: jnp.where(last_mb == 0, a, b), state.start, start)
    else:
        start = state.start
    start = jax.tree.map(lambda a, m: jnp.where(new_pos == 0, a, m), w_fin, start)
    z = jnp.concatenate(z_first + [z.reshape((-1,) + z.shape[2:])])
    z = from_chunks_first(z, length)
    if not offset_static:
        z = jax.lax.dynamic_slice_in_dim(z, offset, t, axis=1)
    o = _read(q, z[:, :t], scale, bias)
    return o, TTTMLPState(w_fin, start, jnp.asarray(new_pos, jnp.int32))


# --------------------------------------------------------------------------------------------
# Token-by-token reference (jax.grad of the inner loss) and the decode step
# --------------------------------------------------------------------------------------------
def _inner_loss(w: TTTMLPWeights, k_t, v_t, scale, bias):
    """Σ over batch and heads of `½‖f(k_t) − v_t‖²`; each `[b,h]` has its own weights, so the
    gradient of the sum is the per-head gradient."""
    err = _f(k_t, w, scale, bias) - v_t
    return 0.5 * jnp.sum(err * err)


def _token_update(q_t, k_t, v_t, eta_t, state: TTTMLPState, minibatch: int, scale, bias):
    """One token of the mini-batch schedule on `[B,H,D]` rows, `eta_t [B,H]`; scale `[H,D]`."""
    grads = jax.grad(_inner_loss)(state.start, k_t, v_t, scale, bias)
    step = lambda p, g: p - eta_t.reshape(eta_t.shape + (1,) * (p.ndim - 2)) * g  # noqa: E731
    w = jax.tree.map(step, state.weights, grads)
    o_t = _f(q_t, w, scale, bias)
    pos = state.pos + 1
    full = pos == minibatch
    start = jax.tree.map(lambda a, s: jnp.where(full, a, s), w, state.start)
    return o_t, TTTMLPState(w, start, jnp.where(full, 0, pos).astype(jnp.int32))


def _ttt_mlp_recurrent(q, k, v, eta, state: TTTMLPState, minibatch: int, scale, bias):
    """Token-by-token reference of the same schedule (`lax.scan` over time)."""

    def step(st, x):
        o_t, st = _token_update(*x, st, minibatch, scale, bias)
        return st, o_t

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, eta))
    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1), state


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


def _check_ln(ln_scale, ln_bias, h: int, d: int) -> None:
    for name, x in (("ln_scale", ln_scale), ("ln_bias", ln_bias)):
        if tuple(x.shape) != (h, d):
            raise ValueError(f"{name} must have shape [H, D] = {(h, d)}, got shape {tuple(x.shape)}")


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


def ttt_mlp(
    q,
    k,
    v,
    eta,
    *,
    W1_0=None,
    b1_0=None,
    W2_0=None,
    b2_0=None,
    ln_scale,
    ln_bias,
    minibatch: int = 16,
    initial_state: TTTMLPState | None = None,
    impl: str = "dual",
    remat_group: int = 4,
    precision=HIGHEST,
):
    """TTT-MLP with mini-batch gradient descent, read after each token's own prefix of updates.

    Args:
      q, k, v: `[B, T, H, D]` (the residual needs Dk == Dv); eta: `[B, T, H]` inner rates.
      W1_0 `[H, D, F]`, b1_0 `[H, F]`, W2_0 `[H, F, D]`, b2_0 `[H, D]` (learned init shared by the
        batch; each may carry a leading `B`). F is the hidden width (4·D in the TTT paper).
        Needed unless `initial_state` is given (which then replaces them).
      ln_scale, ln_bias: `[H, D]`, the inner LayerNorm's affine (ε = 1e-6).
      minibatch: tokens per inner mini-batch; T need not be a multiple (padding has eta = 0).
      initial_state: a `TTTMLPState` from a previous call or `ttt_mlp_init_state`.
      impl: "dual" (mini-batch dual form, scan over groups) or "recurrent" (token by token).
      remat_group: mini-batches per rematerialized scan step of the dual form.

    Returns: `(o [B,T,H,D] in q's dtype, TTTMLPState)` with a float32 state.
    """
    bsz, t, h, d, dv = check_qkv(q, k, v)
    if dv != d:
        raise ValueError(f"ttt_mlp needs v with the width of k (residual), got k {tuple(k.shape)}, v {tuple(v.shape)}")
    check_gate("eta", eta, bsz, t, h)
    check_positive("minibatch", minibatch)
    check_positive("remat_group", remat_group)
    check_impl(impl, TTT_MLP_IMPLS)
    _check_ln(ln_scale, ln_bias, h, d)
    if initial_state is None:
        if any(x is None for x in (W1_0, b1_0, W2_0, b2_0)):
            raise ValueError("ttt_mlp needs W1_0, b1_0, W2_0 and b2_0 when initial_state is None")
        if W1_0.ndim not in (3, 4) or tuple(W1_0.shape[-3:-1]) != (h, d):
            raise ValueError(f"W1_0 must have shape [H, D, F] = [{h}, {d}, F] or [B, H, D, F], "
                             f"got shape {tuple(W1_0.shape)}")
        state = ttt_mlp_init_state(W1_0, b1_0, W2_0, b2_0, bsz)
    else:
        state = _check_state(initial_state, bsz, h, d)
    dtype = q.dtype
    q, k, v, eta = (x.astype(jnp.float32) for x in (q, k, v, eta))
    scale, bias = ln_scale.astype(jnp.float32), ln_bias.astype(jnp.float32)
    if impl == "recurrent":
        o, state = _ttt_mlp_recurrent(q, k, v, eta, state, minibatch, scale, bias)
    else:
        o, state = _ttt_mlp_dual(q, k, v, eta, state, initial_state is None, minibatch, remat_group, scale, bias,
                                 precision)
    return o.astype(dtype), state


def ttt_mlp_step(q_t, k_t, v_t, eta_t, state: TTTMLPState, *, ln_scale, ln_bias, minibatch: int = 16):
    """One decode step: `[B,H,D]` rows, `eta_t [B,H]` -> `(o_t [B,H,D], TTTMLPState)`.

    Keeps the mini-batch schedule (gradients at `state.start`, reads with the accumulated prefix),
    so stepping through a sequence reproduces `ttt_mlp` exactly.
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
    rows = [x.astype(jnp.float32) for x in (q_t, k_t, v_t, eta_t)]
    o, state = _token_update(*rows, state, minibatch, ln_scale.astype(jnp.float32), ln_bias.astype(jnp.float32))
    return o.astype(q_t.dtype), state
