"""TTT-MLP: the dual form against the `jax.grad` recurrent twin and an independent float64 NumPy
reference with hand-written gradients (values, gradients, streaming, causality, decode, errors).

Error metric: `max|x − ref| / max|ref|` (gradients: per argument), ≤ 3e-4 in float32. Gradients
are those of a random linear functional of the outputs and every state leaf; the NumPy check is a
central finite difference of that functional along a random direction.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nlearn.memory import TTTMLPState, ttt_mlp, ttt_mlp_init_state, ttt_mlp_step

TOL = 3e-4
B, H, D, F = 2, 2, 8, 32
MB, GROUP = 6, 2  # mini-batch; mini-batches per remat'd scan step (T = 37 spans four steps)
T_MAIN = 37  # a multiple of neither the mini-batch nor the scan step
PARAMS = ("W1_0", "b1_0", "W2_0", "b2_0", "ln_scale", "ln_bias")
GRAD_NAMES = ("q", "k", "v", "eta") + PARAMS

fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


# --------------------------------------------------------------------------------------------
# float64 NumPy reference, one token at a time, gradients of the inner loss written out by hand
# --------------------------------------------------------------------------------------------
GELU_C = np.sqrt(2.0 / np.pi)


def np_gelu(x):
    return 0.5 * x * (1.0 + np.tanh(GELU_C * (x + 0.044715 * x**3)))


def np_gelu_grad(x):
    t = np.tanh(GELU_C * (x + 0.044715 * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t**2) * GELU_C * (1.0 + 3 * 0.044715 * x**2)


def np_ln(z):
    zc = z - z.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt((zc**2).mean(-1, keepdims=True) + 1e-6)
    return zc * rstd, rstd


def np_f(x, w, scale, bias):
    """Inner model on `[B,H,D]` rows; returns (f(x), Z1, X2, Z2)."""
    z1 = np.einsum("bhd,bhdf->bhf", x, w[0]) + w[1]
    x2 = np_gelu(z1)
    z2 = np.einsum("bhf,bhfd->bhd", x2, w[2]) + w[3]
    return x + scale * np_ln(z2)[0] + bias, z1, x2, z2


def np_grads(k, v, w, scale, bias):
    """∇ of ½‖f(k) − v‖² w.r.t. (W1, b1, W2, b2): LayerNorm backward, then through W2 and GELU."""
    fk, z1, x2, z2 = np_f(k, w, scale, bias)
    zh, rstd = np_ln(z2)
    gzh = (fk - v) * scale
    g2 = rstd * (gzh - gzh.mean(-1, keepdims=True) - zh * (gzh * zh).mean(-1, keepdims=True))
    g1 = np.einsum("bhd,bhfd->bhf", g2, w[2]) * np_gelu_grad(z1)
    return [np.einsum("bhd,bhf->bhdf", k, g1), g1, np.einsum("bhf,bhd->bhfd", x2, g2), g2]


def np_ttt_mlp(x, minibatch, state=None):
    """Mini-batch TTT-MLP: gradients at the mini-batch start, reads after each token's write."""
    q, k, v, eta = x["q"], x["k"], x["v"], x["eta"]
    b, t = q.shape[:2]
    if state is None:
        shapes = ((b, H, D, F), (b, H, F), (b, H, F, D), (b, H, D))  # inits may be [H, ...] or [B, H, ...]
        w = [np.broadcast_to(np.asarray(x[n], np.float64), s).copy() for n, s in zip(PARAMS[:4], shapes)]
        ws, pos = [a.copy() for a in w], 0
    else:
        w = [np.array(a, np.float64) for a in state.weights]
        ws = [np.array(a, np.float64) for a in state.start]
        pos = int(state.pos)
    o = np.zeros_like(q)
    for i in range(t):
        grads = np_grads(k[:, i], v[:, i], ws, x["ln_scale"], x["ln_bias"])
        e = eta[:, i]
        w = [p - e.reshape(e.shape + (1,) * (p.ndim - 2)) * g for p, g in zip(w, grads)]
        o[:, i] = np_f(q[:, i], w, x["ln_scale"], x["ln_bias"])[0]
        pos += 1
        if pos == minibatch:
            ws, pos = [a.copy() for a in w], 0
    return o, w + ws, pos


# --------------------------------------------------------------------------------------------
# Inputs and jax calls
# --------------------------------------------------------------------------------------------
def make_inputs(t, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(B, t, H, D))
    return {
        "q": rng.normal(size=(B, t, H, D)),
        "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
        "v": rng.normal(size=(B, t, H, D)),
        "eta": rng.uniform(0.05, 0.5, size=(B, t, H)),
        "W1_0": 0.3 * rng.normal(size=(H, D, F)),
        "b1_0": 0.1 * rng.normal(size=(H, F)),
        "W2_0": 0.3 * rng.normal(size=(H, F, D)),
        "b2_0": 0.1 * rng.normal(size=(H, D)),
        "ln_scale": 1.0 + 0.2 * rng.normal(size=(H, D)),
        "ln_bias": 0.1 * rng.normal(size=(H, D)),
    }


def to_f32(x):
    return {k_: jnp.asarray(v_, jnp.float32) for k_, v_ in x.items()}


def leaves(state):
    """The 8 weight leaves of a state: weights then start."""
    return list(state.weights) + list(state.start)


def call(x, impl="dual", minibatch=MB, state=None):
    init = {} if state is not None else {n: x[n] for n in PARAMS[:4]}
    return ttt_mlp(x["q"], x["k"], x["v"], x["eta"], ln_scale=x["ln_scale"], ln_bias=x["ln_bias"],
                   minibatch=minibatch, initial_state=state, impl=impl, remat_group=GROUP, **init)


run = fast_jit(call, static_argnames=("impl", "minibatch"))


@functools.partial(fast_jit, static_argnames=("impl",))
def run_with_grads(x, w_o, w_s, impl):
    """(o, state, gradients of `Σ w_o ⊙ o + Σ w_s ⊙ state leaves` w.r.t. every input)."""
    (o, state), vjp = jax.vjp(lambda xx: call(xx, impl), x)
    half = len(w_s) // 2
    cot = TTTMLPState(type(state.weights)(*w_s[:half]), type(state.start)(*w_s[half:]),
                      np.zeros((), jax.dtypes.float0))
    (grads,) = vjp((w_o, cot))
    return o, state, grads


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------
def test_values_and_gradients_match_recurrent_and_numpy():
    x = make_inputs(T_MAIN, seed=1)
    ref_o, ref_leaves, ref_pos = np_ttt_mlp(x, MB)
    rng = np.random.default_rng(2)
    w_o = rng.normal(size=ref_o.shape)
    w_s = [rng.normal(size=a.shape) for a in ref_leaves]
    args = (to_f32(x), jnp.asarray(w_o, jnp.float32), [jnp.asarray(w, jnp.float32) for w in w_s])
    rec_o, rec_state, g_rec = run_with_grads(*args, "recurrent")
    o, state, g = run_with_grads(*args, "dual")
    assert o.dtype == jnp.float32 and o.shape == ref_o.shape
    assert rel_err(rec_o, ref_o) <= TOL and rel_err(o, ref_o) <= TOL and rel_err(o, rec_o) <= TOL
    assert int(state.pos) == int(rec_state.pos) == ref_pos == T_MAIN % MB
    for leaf, rec_leaf, ref_leaf in zip(leaves(state), leaves(rec_state), ref_leaves):
        assert leaf.dtype == jnp.float32 and rel_err(leaf, ref_leaf) <= TOL and rel_err(rec_leaf, ref_leaf) <= TOL
    for n in GRAD_NAMES:
        assert rel_err(g[n], g_rec[n]) <= TOL, n

    def functional_np(xx):
        o_, lv, _ = np_ttt_mlp(xx, MB)
        return float(np.sum(w_o * o_) + sum(np.sum(w * a) for w, a in zip(w_s, lv)))

    rng, eps = np.random.default_rng(3), 1e-5
    for n in GRAD_NAMES:  # central differences in float64 along a random direction
        d = rng.normal(size=x[n].shape)
        fd = (functional_np({**x, n: x[n] + eps * d}) - functional_np({**x, n: x[n] - eps * d})) / (2 * eps)
        ad = float(np.sum(np.asarray(g[n], np.float64) * d))
        assert abs(fd - ad) / np.linalg.norm(np.asarray(g[n])) <= TOL, (n, fd, ad)


def test_default_minibatch_single_token_and_batched_init():
    """T = 37 with the default mini-batch of 16 (padded); T = 1; per-sequence `[B, ...]` inits."""
    x = make_inputs(T_MAIN, seed=4)
    o, state = run(to_f32(x), minibatch=16)
    ref_o, ref_leaves, ref_pos = np_ttt_mlp(x, 16)
    assert rel_err(o, ref_o) <= TOL and int(state.pos) == ref_pos == 5
    for a, b in zip(leaves(state), ref_leaves):
        assert rel_err(a, b) <= TOL
    x1 = make_inputs(1, seed=5)
    x1["W1_0"] = np.stack([x1["W1_0"], 0.5 * x1["W1_0"]])  # a different init per sequence
    x1["b2_0"] = np.stack([x1["b2_0"], -x1["b2_0"]])
    o1, st1 = run(to_f32(x1))
    ref_o1, ref_leaves1, _ = np_ttt_mlp(x1, MB)
    assert rel_err(o1, ref_o1) <= TOL and int(st1.pos) == 1
    for a, b in zip(leaves(st1), ref_leaves1):
        assert rel_err(a, b) <= TOL


def test_streaming_in_pieces():
    """Pieces of 17, 1, 14, 3, 2 tokens (mini-batch 6, scan steps of 12): a split mid-mini-batch;
    a single token that completes one; a piece from a boundary whose last mini-batch is not in its
    last scan step; one that stays inside the resumed mini-batch; one that resumes and crosses."""
    x = to_f32(make_inputs(T_MAIN, seed=6))
    o_full, st_full = run(x)
    outs, state, start = [], None, 0
    for end in (17, 18, 32, 35, T_MAIN):
        piece = {k_: (v_[:, start:end] if v_.ndim >= 3 and v_.shape[1] == T_MAIN else v_) for k_, v_ in x.items()}
        o, state = run(piece, state=state)
        assert int(state.pos) == end % MB
        outs.append(o)
        start = end
    assert rel_err(jnp.concatenate(outs, axis=1), o_full) <= TOL
    for a, b in zip(leaves(state), leaves(st_full)):
        assert rel_err(a, b) <= TOL


@pytest.mark.parametrize("impl", ["dual", "recurrent"])
def test_causal(impl):
    p = 23  # inside a mini-batch
    x = make_inputs(T_MAIN, seed=7)
    y = {k_: v_.copy() for k_, v_ in x.items()}
    rng = np.random.default_rng(8)
    for name in ("q", "k", "v", "eta"):
        y[name][:, p:] += rng.uniform(0.1, 0.3, size=y[name][:, p:].shape)
    o_x, _ = run(to_f32(x), impl=impl)
    o_y, _ = run(to_f32(y), impl=impl)
    np.testing.assert_allclose(o_x[:, :p], o_y[:, :p], rtol=1e-6, atol=1e-6)
    assert np.max(np.abs(o_x[:, p:] - o_y[:, p:])) > 1e-3


def test_decode_steps_equal_full_sequence():
    x = to_f32(make_inputs(T_MAIN, seed=9))
    o_full, st_full = run(x)
    step = fast_jit(functools.partial(ttt_mlp_step, ln_scale=x["ln_scale"], ln_bias=x["ln_bias"], minibatch=MB))
    state = ttt_mlp_init_state(*(x[n] for n in PARAMS[:4]), B)
    outs = []
    for i in range(T_MAIN):
        o_t, state = step(x["q"][:, i], x["k"][:, i], x["v"][:, i], x["eta"][:, i], state)
        outs.append(o_t)
    assert rel_err(jnp.stack(outs, axis=1), o_full) <= TOL
    assert int(state.pos) == int(st_full.pos) == T_MAIN % MB
    for a, b in zip(leaves(state), leaves(st_full)):
        assert rel_err(a, b) <= TOL


def test_bfloat16_inputs():
    x = make_inputs(T_MAIN, seed=10)
    ref_o, _, _ = np_ttt_mlp(x, MB)
    o, state = run({k_: jnp.asarray(v_, jnp.bfloat16) for k_, v_ in x.items()})
    assert o.dtype == jnp.bfloat16 and all(leaf.dtype == jnp.float32 for leaf in leaves(state))
    assert rel_err(o, ref_o) <= 5e-2


def test_value_errors():
    q, eta = jnp.zeros((2, 9, 3, 4)), jnp.zeros((2, 9, 3))
    w = dict(W1_0=jnp.zeros((3, 4, 16)), b1_0=jnp.zeros((3, 16)), W2_0=jnp.zeros((3, 16, 4)), b2_0=jnp.zeros((3, 4)))
    ln = dict(ln_scale=jnp.ones((3, 4)), ln_bias=jnp.zeros((3, 4)))
    state = ttt_mlp_init_state(*w.values(), 2)
    cases = [
        (lambda: ttt_mlp(q, q, q, eta, **w, **ln, minibatch=0), "minibatch", "0"),
        (lambda: ttt_mlp(q, q, q, eta, **w, **ln, minibatch=2.5), "minibatch", "2.5"),
        (lambda: ttt_mlp(q, q, q, eta, **w, **ln, remat_group=-1), "remat_group", "-1"),
        (lambda: ttt_mlp(q, q, q, eta, **w, **ln, impl="fast"), "impl", "fast"),
        (lambda: ttt_mlp(q[0], q, q, eta, **w, **ln), "q", "(9, 3, 4)"),
        (lambda: ttt_mlp(q, q, jnp.zeros((2, 9, 3, 5)), eta, **w, **ln), "v", "5"),
        (lambda: ttt_mlp(q, q, q, eta[:, 1:], **w, **ln), "eta", "(2, 8, 3)"),
        (lambda: ttt_mlp(q, q, q, eta, **{**w, "W1_0": jnp.zeros((3, 5, 16))}, **ln), "W1_0", "(3, 5, 16)"),
        (lambda: ttt_mlp(q, q, q, eta, **{**w, "b1_0": jnp.zeros((3, 8))}, **ln), "b1_0", "(3, 8)"),
        (lambda: ttt_mlp(q, q, q, eta, **{**w, "W2_0": jnp.zeros((3, 4, 16))}, **ln), "W2_0", "(3, 4, 16)"),
        (lambda: ttt_mlp(q, q, q, eta, **{**w, "b2_0": jnp.zeros((5, 3, 4))}, **ln), "b2_0", "(5, 3, 4)"),
        (lambda: ttt_mlp(q, q, q, eta, **w, **{**ln, "ln_scale": jnp.ones((4,))}), "ln_scale", "(4,)"),
        (lambda: ttt_mlp(q, q, q, eta, **w, **{**ln, "ln_bias": jnp.ones((3, 5))}), "ln_bias", "(3, 5)"),
        (lambda: ttt_mlp(q, q, q, eta, W1_0=w["W1_0"], **ln), "b1_0, W2_0, b2_0", "initial_state is None"),
        (lambda: ttt_mlp(q, q, q, eta, **ln, initial_state=state.weights), "initial_state", "TTTMLPWeights"),
        (lambda: ttt_mlp(q[:1], q[:1], q[:1], eta[:1], **ln, initial_state=state), "initial_state.weights.W1",
         "(2, 3, 4, 16)"),
        (lambda: ttt_mlp_step(q[:, 0], q[:, 0], q[:, 0], eta[:, 0, :2], state, **ln), "eta_t", "(2, 2)"),
        (lambda: ttt_mlp_step(q[:, 0], q[:, 0, :2], q[:, 0], eta[:, 0], state, **ln), "k_t", "(2, 2, 4)"),
        (lambda: ttt_mlp_step(q[:, 0], q[:, 0], q[:, 0], eta[:, 0], state, **ln, minibatch=-1), "minibatch", "-1"),
    ]
    for fn, name, shape in cases:
        with pytest.raises(ValueError) as info:
            fn()
        assert name in str(info.value) and shape in str(info.value), str(info.value)
