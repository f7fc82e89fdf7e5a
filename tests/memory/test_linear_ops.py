"""The linear-memory ops against their recurrent twins and an independent float64 NumPy reference.

Error metric everywhere: `max|x − ref| / max|ref|` (gradients: per argument), ≤ 3e-4 in float32.
Gradients are those of a random linear functional of the outputs and the final state; the
NumPy check is a central finite difference of that functional along a random direction.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nlearn.memory import (
    LinearAttentionState,
    TTTState,
    delta_rule,
    delta_rule_step,
    gated_delta_rule,
    gated_delta_rule_step,
    linear_attention,
    linear_attention_step,
    ttt_linear,
    ttt_linear_init_state,
    ttt_linear_step,
    unit_lower_inverse,
)

TOL = 3e-4
B, H = 2, 2


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


# --------------------------------------------------------------------------------------------
# float64 NumPy references, one token at a time (vectorized over batch and heads only)
# --------------------------------------------------------------------------------------------
def np_linear_attention(q, k, v, normalize, state=None):
    b, t, h, dk = q.shape
    s = np.zeros((b, h, dk, v.shape[-1])) if state is None else np.array(state[0], np.float64)
    c = np.zeros((b, h, dk)) if state is None else np.array(state[1], np.float64)
    o = np.zeros((b, t, h, v.shape[-1]))
    for i in range(t):
        s = s + np.einsum("bhk,bhv->bhkv", k[:, i], v[:, i])
        c = c + k[:, i]
        o[:, i] = np.einsum("bhk,bhkv->bhv", q[:, i], s)
        if normalize:
            o[:, i] /= np.einsum("bhk,bhk->bh", q[:, i], c)[..., None]
    return o, [s, c] if normalize else [s]


def np_delta(q, k, v, beta, log_decay=None, state=None):
    b, t, h, dk = q.shape
    s = np.zeros((b, h, dk, v.shape[-1])) if state is None else np.array(state, np.float64)
    o = np.zeros((b, t, h, v.shape[-1]))
    for i in range(t):
        if log_decay is not None:
            s = np.exp(log_decay[:, i])[..., None, None] * s
        err = v[:, i] - np.einsum("bhk,bhkv->bhv", k[:, i], s)
        s = s + np.einsum("bhk,bhv->bhkv", k[:, i], beta[:, i][..., None] * err)
        o[:, i] = np.einsum("bhk,bhkv->bhv", q[:, i], s)
    return o, [s]


def np_layernorm_parts(z):
    zc = z - z.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt((zc**2).mean(-1, keepdims=True) + 1e-6)
    return zc * rstd, rstd


def np_ttt(q, k, v, eta, w0, b0, ln_scale, ln_bias, minibatch, state=None):
    """Mini-batch TTT-Linear: gradients at the mini-batch start, reads after each token's write."""
    b, t, h, d = q.shape
    if state is None:
        w = np.broadcast_to(w0, (b, h, d, d)).astype(np.float64)
        bias = np.broadcast_to(b0, (b, h, d)).astype(np.float64)
        ws, bs, pos = w.copy(), bias.copy(), 0
    else:
        w, bias, ws, bs = (np.array(x, np.float64) for x in state[:4])
        pos = int(state[4])
    o = np.zeros_like(q)
    for i in range(t):
        z = np.einsum("bhd,bhde->bhe", k[:, i], ws) + bs
        zh, rstd = np_layernorm_parts(z)
        err = k[:, i] + ln_scale * zh + ln_bias - v[:, i]  # f(k) - v
        gzh = err * ln_scale
        g = rstd * (gzh - gzh.mean(-1, keepdims=True) - zh * (gzh * zh).mean(-1, keepdims=True))
        w = w - np.einsum("bhd,bhe->bhde", eta[:, i][..., None] * k[:, i], g)
        bias = bias - eta[:, i][..., None] * g
        zq, _ = np_layernorm_parts(np.einsum("bhd,bhde->bhe", q[:, i], w) + bias)
        o[:, i] = q[:, i] + ln_scale * zq + ln_bias
        pos += 1
        if pos == minibatch:
            ws, bs, pos = w.copy(), bias.copy(), 0
    return o, [w, bias, ws, bs, pos]


# --------------------------------------------------------------------------------------------
# Op cases: inputs, the jax call (any impl), the NumPy call, what to differentiate
# --------------------------------------------------------------------------------------------
def make_inputs(op, t, seed=0, dk=8, dv=12):
    rng = np.random.default_rng(seed)
    if op == "ttt_linear":
        dv = dk
    x = {
        "q": rng.normal(size=(B, t, H, dk)),
        "k": unit(rng.normal(size=(B, t, H, dk))),
        "v": rng.normal(size=(B, t, H, dv)),
    }
    if op == "linear_attention_normalized":  # positive features keep the denominator away from 0
        x["q"], x["k"] = np.abs(x["q"]) + 0.1, np.abs(x["k"]) + 0.1
    if op in ("delta_rule", "gated_delta_rule"):
        x["beta"] = rng.uniform(0.1, 1.0, size=(B, t, H))
    if op == "gated_delta_rule":
        x["log_decay"] = -rng.uniform(0.0, 0.5, size=(B, t, H))
    if op == "ttt_linear":
        x["eta"] = rng.uniform(0.05, 0.5, size=(B, t, H))
        x["W0"] = 0.3 * rng.normal(size=(H, dk, dk))
        x["b0"] = 0.1 * rng.normal(size=(H, dk))
        x["ln_scale"] = 1.0 + 0.2 * rng.normal(size=(H, dk))
        x["ln_bias"] = 0.1 * rng.normal(size=(H, dk))
    return x


def state_leaves(state):
    if isinstance(state, TTTState):
        return [state.W, state.b, state.W_start, state.b_start]
    if isinstance(state, LinearAttentionState):
        return [state.S, state.c]
    return [state]


# Tests compile many small programs; LLVM's optimizer is most of that time and changes no results.
fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def call_op(x, op, impl=None, chunk=None, minibatch=6, state=None):
    """Call op on a dict of inputs; returns (o, state). `impl`/`chunk` None: the defaults."""
    kw = {} if impl is None else {"impl": impl}
    if chunk is not None and op != "ttt_linear":
        kw["chunk_size"] = chunk
    if op.startswith("linear_attention"):
        return linear_attention(x["q"], x["k"], x["v"], normalize=op.endswith("normalized"), initial_state=state, **kw)
    if op == "delta_rule":
        return delta_rule(x["q"], x["k"], x["v"], x["beta"], initial_state=state, **kw)
    if op == "gated_delta_rule":
        return gated_delta_rule(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], initial_state=state, **kw)
    params = {} if state is not None else {"W0": x["W0"], "b0": x["b0"]}
    return ttt_linear(x["q"], x["k"], x["v"], x["eta"], ln_scale=x["ln_scale"], ln_bias=x["ln_bias"],
                      minibatch=minibatch, initial_state=state, **params, **kw)


run_jax = fast_jit(call_op, static_argnames=("op", "impl", "chunk", "minibatch"))


@functools.partial(fast_jit, static_argnames=("op", "impl", "chunk"))
def run_with_grads(x, w_o, w_s, op, impl=None, chunk=None):
    """(o, state, gradients of `Σ w_o ⊙ o + Σ w_s ⊙ state` w.r.t. every input)."""
    (o, state), vjp = jax.vjp(lambda xx: call_op(xx, op, impl, chunk), x)
    cot_state = jax.tree_util.tree_map(jnp.zeros_like, state)
    if isinstance(state, TTTState):
        cot_state = cot_state._replace(W=w_s[0], b=w_s[1], W_start=w_s[2], b_start=w_s[3])
    elif isinstance(state, LinearAttentionState):
        cot_state = LinearAttentionState(*w_s)
    else:
        cot_state = w_s[0]
    (grads,) = vjp((w_o.astype(o.dtype), cot_state))
    return o, state, grads


def run_np(x, op, minibatch=6, state=None):
    if op.startswith("linear_attention"):
        return np_linear_attention(x["q"], x["k"], x["v"], op.endswith("normalized"), state)
    if op == "delta_rule":
        return np_delta(x["q"], x["k"], x["v"], x["beta"], None, state)
    if op == "gated_delta_rule":
        return np_delta(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], state)
    o, st = np_ttt(x["q"], x["k"], x["v"], x["eta"], x["W0"], x["b0"], x["ln_scale"], x["ln_bias"], minibatch, state)
    return o, st[:4]


OPS = ["linear_attention", "linear_attention_normalized", "delta_rule", "gated_delta_rule", "ttt_linear"]
FAST_IMPLS = {
    "linear_attention": [None, "chunked_parallel"],
    "linear_attention_normalized": [None, "chunked_parallel"],
    "delta_rule": [None, "chunked_parallel"],
    "gated_delta_rule": [None, "chunked_parallel"],
    "ttt_linear": [None],
}
T_MAIN, CHUNK = 37, 16  # divides no chunk size (and not the TTT mini-batch of 6)


def to_f32(x):
    return {k_: jnp.asarray(v_, jnp.float32) for k_, v_ in x.items()}


def grad_names(op):
    names = ["q", "k", "v"]
    return names + {"delta_rule": ["beta"], "gated_delta_rule": ["beta", "log_decay"],
                    "ttt_linear": ["eta", "W0", "b0", "ln_scale", "ln_bias"]}.get(op, [])


def weights(op, seed=2):
    """Random cotangents for the outputs and the state leaves (the linear functional)."""
    rng = np.random.default_rng(seed)
    ref_o, ref_state = run_np(make_inputs(op, T_MAIN, seed=1), op)
    return rng.normal(size=ref_o.shape), [rng.normal(size=np.shape(s)) for s in ref_state]


@pytest.mark.parametrize("op", OPS)
def test_values_and_gradients_match_recurrent_and_numpy(op):
    x = make_inputs(op, T_MAIN, seed=1)
    w_o, w_s = weights(op)
    ref_o, ref_state = run_np(x, op)
    xj, w_oj, w_sj = to_f32(x), jnp.asarray(w_o, jnp.float32), [jnp.asarray(w, jnp.float32) for w in w_s]
    rec_o, _, g_rec = run_with_grads(xj, w_oj, w_sj, op, "recurrent", CHUNK)
    assert rel_err(rec_o, ref_o) <= TOL
    for impl in FAST_IMPLS[op]:
        o, state, g = run_with_grads(xj, w_oj, w_sj, op, impl, CHUNK)
        assert o.dtype == jnp.float32 and o.shape == ref_o.shape
        assert rel_err(o, ref_o) <= TOL and rel_err(o, rec_o) <= TOL, impl
        for leaf, ref_leaf in zip(state_leaves(state), ref_state):
            assert leaf.dtype == jnp.float32 and rel_err(leaf, ref_leaf) <= TOL, impl
        for n in grad_names(op):
            assert rel_err(g[n], g_rec[n]) <= TOL, (impl, n)

    def functional_np(xx):
        o, st = run_np(xx, op)
        return float(np.sum(w_o * o) + sum(np.sum(w * s_) for w, s_ in zip(w_s, st)))

    rng, eps = np.random.default_rng(3), 1e-5
    for n in grad_names(op):  # central differences in float64 along a random direction
        d = rng.normal(size=x[n].shape)
        fd = (functional_np({**x, n: x[n] + eps * d}) - functional_np({**x, n: x[n] - eps * d})) / (2 * eps)
        ad = float(np.sum(np.asarray(g[n], np.float64) * d))
        assert abs(fd - ad) / np.linalg.norm(np.asarray(g[n])) <= TOL, (n, fd, ad)


@pytest.mark.parametrize("op", OPS)
def test_single_token_and_long_streams(op):
    """T = 1; T = 100 in one call and in two pieces (split mid-chunk, mid-mini-batch) via state."""
    x1 = make_inputs(op, 1, seed=9)
    o1, st1 = run_jax(to_f32(x1), op, None, CHUNK)
    ref_o1, ref_st1 = run_np(x1, op)
    assert rel_err(o1, ref_o1) <= TOL
    for a, b in zip(state_leaves(st1), ref_st1):
        assert rel_err(a, b) <= TOL
    t, split = 100, 41
    x = make_inputs(op, t, seed=3)
    ref_o, ref_state = run_np(x, op)
    xj = to_f32(x)
    o_full, st_full = run_jax(xj, op, None, CHUNK)
    assert rel_err(o_full, ref_o) <= TOL
    for a, b in zip(state_leaves(st_full), ref_state):
        assert rel_err(a, b) <= TOL
    timed = lambda v_: v_.ndim >= 3 and v_.shape[1] == t  # noqa: E731  (q, k, v and gates, not params)
    first = {k_: (v_[:, :split] if timed(v_) else v_) for k_, v_ in xj.items()}
    second = {k_: (v_[:, split:] if timed(v_) else v_) for k_, v_ in xj.items()}
    o_a, st_a = run_jax(first, op, None, CHUNK)
    o_b, st_b = run_jax(second, op, None, CHUNK, state=st_a)
    assert rel_err(jnp.concatenate([o_a, o_b], axis=1), o_full) <= TOL
    for a, b in zip(state_leaves(st_b), state_leaves(st_full)):
        assert rel_err(a, b) <= TOL
    if op == "ttt_linear":
        assert int(st_a.pos) == split % 6 and int(st_b.pos) == int(st_full.pos) == t % 6


@pytest.mark.parametrize("op", OPS)
def test_causal(op):
    p = 23
    x = make_inputs(op, T_MAIN, seed=4)
    y = {k_: v_.copy() for k_, v_ in x.items()}
    rng = np.random.default_rng(5)
    for name in ("q", "k", "v", "beta", "log_decay", "eta"):
        if name in y:
            y[name][:, p:] += rng.uniform(0.1, 0.3, size=y[name][:, p:].shape)
    w_o, w_s = weights(op)
    w_o, w_s = jnp.asarray(w_o, jnp.float32), [jnp.asarray(w, jnp.float32) for w in w_s]
    for impl in FAST_IMPLS[op] + ["recurrent"]:  # same programs as the gradient test
        o_x = run_with_grads(to_f32(x), w_o, w_s, op, impl, CHUNK)[0]
        o_y = run_with_grads(to_f32(y), w_o, w_s, op, impl, CHUNK)[0]
        np.testing.assert_allclose(o_x[:, :p], o_y[:, :p], rtol=1e-6, atol=1e-6)
        assert np.max(np.abs(o_x[:, p:] - o_y[:, p:])) > 1e-3


@pytest.mark.parametrize("op", OPS)
def test_decode_steps_equal_full_sequence(op):
    x = to_f32(make_inputs(op, T_MAIN, seed=6))
    o_full, st_full = run_jax(x, op, None, CHUNK)
    dk, dv = x["k"].shape[-1], x["v"].shape[-1]
    zeros = jnp.zeros((B, H, dk, dv), jnp.float32)
    if op.startswith("linear_attention"):
        step = fast_jit(functools.partial(linear_attention_step, normalize=op.endswith("normalized")))
        state = LinearAttentionState(zeros, jnp.zeros((B, H, dk))) if op.endswith("normalized") else zeros
        names = ("q", "k", "v")
    elif op == "delta_rule":
        step, state, names = fast_jit(delta_rule_step), zeros, ("q", "k", "v", "beta")
    elif op == "gated_delta_rule":
        step, state, names = fast_jit(gated_delta_rule_step), zeros, ("q", "k", "v", "beta", "log_decay")
    else:
        step = fast_jit(functools.partial(ttt_linear_step, ln_scale=x["ln_scale"], ln_bias=x["ln_bias"], minibatch=6))
        state, names = ttt_linear_init_state(x["W0"], x["b0"], B), ("q", "k", "v", "eta")
    outs = []
    for i in range(T_MAIN):
        o_t, state = step(*(x[n][:, i] for n in names), state)
        outs.append(o_t)
    assert rel_err(jnp.stack(outs, axis=1), o_full) <= TOL
    for a, b in zip(state_leaves(state), state_leaves(st_full)):
        assert rel_err(a, b) <= TOL
    if op == "ttt_linear":
        assert int(state.pos) == int(st_full.pos) == T_MAIN % 6


@pytest.mark.parametrize("op", OPS)
def test_bfloat16_inputs(op):
    x = make_inputs(op, T_MAIN, seed=7)
    ref_o, _ = run_np(x, op)
    xb = {k_: jnp.asarray(v_, jnp.bfloat16) for k_, v_ in x.items()}
    o, state = run_jax(xb, op, None, CHUNK)
    assert o.dtype == jnp.bfloat16
    assert all(leaf.dtype == jnp.float32 for leaf in state_leaves(state))
    assert rel_err(o, ref_o) <= 5e-2


def test_delta_ragged_chunk_size():
    """A chunk size that is not a power of two (the WY inverse pads it) gives the same numbers."""
    x = make_inputs("gated_delta_rule", T_MAIN, seed=8)
    ref_o, ref_state = run_np(x, "gated_delta_rule")
    for impl in ("chunked_scan", "chunked_parallel"):
        o, st = run_jax(to_f32(x), "gated_delta_rule", impl, 7)
        assert rel_err(o, ref_o) <= TOL and rel_err(st, ref_state[0]) <= TOL, impl


# --------------------------------------------------------------------------------------------
# The worked examples of notebooks/01_memory_lab.ipynb, exactly, through the public ops
# --------------------------------------------------------------------------------------------
la_jit = fast_jit(linear_attention, static_argnames=("normalize", "impl"))
delta_jit = fast_jit(delta_rule, static_argnames=("impl",))


def rows(*vectors):
    """A [1, T, 1, D] float32 sequence from row vectors."""
    return jnp.asarray(np.array(vectors, np.float64)[None, :, None, :], jnp.float32)


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_seed_normalized_linear_attention_read(impl):
    q = rows((1, 1), (1, 1))
    k = rows((1, 1), (1, 2))
    v = rows((2, 0), (0, 3))
    o, state = la_jit(q, k, v, normalize=True, impl=impl)
    np.testing.assert_allclose(o[0, 1, 0], [0.8, 1.8], rtol=1e-6)
    np.testing.assert_allclose(state.S[0, 0], [[2, 3], [2, 6]], rtol=1e-6)
    np.testing.assert_allclose(state.c[0, 0], [2, 3], rtol=1e-6)
    o_num, _ = la_jit(q, k, v, impl=impl)  # unnormalized read of the same memory: q S_2
    np.testing.assert_allclose(o_num[0, 1, 0], [4, 9], rtol=1e-6)


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_seed_two_additive_writes_store_identity(impl):
    k = rows((1, 0), (0, 1))
    _, s = la_jit(k, k, k, impl=impl)  # k1 -> v1 = (1,0), k2 -> v2 = (0,1)
    np.testing.assert_allclose(s[0, 0], np.eye(2), atol=0)
    probes = rows((1, 0), (0, 1), (0.5, 0.5))
    zeros = jnp.zeros_like(probes)
    reads, _ = la_jit(probes, zeros, zeros, initial_state=s, impl=impl)  # read only
    np.testing.assert_allclose(reads[0, :, 0], [[1, 0], [0, 1], [0.5, 0.5]], atol=0)


@pytest.mark.parametrize("impl", ["chunked", "chunked_parallel", "recurrent"])
def test_seed_delta_correction_and_interference(impl):
    w = jnp.eye(2, dtype=jnp.float32)[None, None]
    one = jnp.ones((1, 1, 1), jnp.float32)
    # Correction: (1,0) should now return (0,1); with beta = 1 the first row is replaced.
    _, w_new = delta_jit(rows((1, 0)), rows((1, 0)), rows((0, 1)), one, initial_state=w, impl=impl)
    np.testing.assert_allclose(w_new[0, 0], [[0, 1], [0, 1]], atol=1e-7)
    o_step, w_step = delta_rule_step(rows((1, 0))[:, 0], rows((1, 0))[:, 0], rows((0, 1))[:, 0], one[:, 0], w)
    np.testing.assert_allclose(w_step[0, 0], [[0, 1], [0, 1]], atol=1e-7)
    np.testing.assert_allclose(o_step[0, 0], [0, 1], atol=1e-7)
    # Interference: the overlapping key (0.8, 0.6) changes both probes' reads by
    # beta (q kᵀ)(v − k W).
    key, val, beta = np.array([0.8, 0.6]), np.array([0.2, 0.9]), 0.5
    w_old = np.asarray(w_new[0, 0], np.float64)
    _, w_after = delta_jit(rows(key), rows(key), rows(val), beta * one, initial_state=w_new, impl=impl)
    for probe in (np.array([1.0, 0.0]), np.array([0.0, 1.0])):
        change = probe @ (np.asarray(w_after[0, 0], np.float64) - w_old)
        expected = beta * (probe @ key) * (val - key @ w_old)
        np.testing.assert_allclose(change, expected, rtol=1e-6, atol=1e-7)
        assert np.all(np.abs(change) > 0.05)  # neither probe is protected


def test_unit_lower_inverse_matches_numpy():
    rng = np.random.default_rng(8)
    for c in (1, 24):
        a = np.tril(rng.normal(size=(3, c, c)), -1) * 0.3
        x = fast_jit(unit_lower_inverse)(jnp.asarray(a, jnp.float32))
        np.testing.assert_allclose(x, np.linalg.inv(np.eye(c) + a), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Argument errors name the argument and the shapes seen
# --------------------------------------------------------------------------------------------
def test_value_errors():
    q = jnp.zeros((2, 9, 3, 4))
    gate = jnp.zeros((2, 9, 3))
    w0, b0, ln = jnp.zeros((3, 4, 4)), jnp.zeros((3, 4)), jnp.ones((3, 4))
    cases = [
        (lambda: linear_attention(q[0], q, q), "q", "(9, 3, 4)"),
        (lambda: linear_attention(q, q[:, :5], q), "k", "(2, 5, 3, 4)"),
        (lambda: linear_attention(q, q, q[:, :5]), "v", "(2, 5, 3, 4)"),
        (lambda: linear_attention(q, q, q, chunk_size=0), "chunk_size", "0"),
        (lambda: linear_attention(q, q, q, impl="fast"), "impl", "fast"),
        (lambda: linear_attention(q, q, q, initial_state=jnp.zeros((2, 3, 4, 5))), "initial_state", "(2, 3, 4, 5)"),
        (lambda: delta_rule(q, q, q, gate[:, :4]), "beta", "(2, 4, 3)"),
        (lambda: delta_rule(q, q, q, gate, chunk_size=-3), "chunk_size", "-3"),
        (lambda: delta_rule(q, q, q, gate, chunk_size=2.5), "chunk_size", "2.5"),
        (lambda: gated_delta_rule(q, q, q, gate, gate[..., :1]), "log_decay", "(2, 9, 1)"),
        (lambda: ttt_linear(q, q, q, gate, W0=w0, b0=b0, ln_scale=ln, ln_bias=ln, minibatch=0), "minibatch", "0"),
        (lambda: ttt_linear(q, q, q, gate[:, 1:], W0=w0, b0=b0, ln_scale=ln, ln_bias=ln), "eta", "(2, 8, 3)"),
        (lambda: ttt_linear(q, q, q, gate, W0=w0[:, :2], b0=b0, ln_scale=ln, ln_bias=ln), "W0", "(3, 2, 4)"),
        (lambda: ttt_linear(q, q, q, gate, W0=w0, b0=b0[:1], ln_scale=ln, ln_bias=ln), "b0", "(1, 4)"),
        (lambda: ttt_linear(q, q, q, gate, W0=w0, b0=b0, ln_scale=ln[0], ln_bias=ln), "ln_scale", "(4,)"),
        (lambda: ttt_linear(q, q, jnp.zeros((2, 9, 3, 5)), gate, W0=w0, b0=b0, ln_scale=ln, ln_bias=ln), "v", "5"),
        (lambda: delta_rule_step(q[:, 0], q[:, 0], q[:, 0], gate[:, 0, :2]), "beta_t", "(2, 2)"),
        (lambda: linear_attention_step(q[:, 0], q[:, 0, :2], q[:, 0]), "k_t", "(2, 2, 4)"),
        (lambda: ttt_linear_step(q[:, 0], q[:, 0], q[:, 0], gate[:, 0], ttt_linear_init_state(w0, b0, 2),
                                 ln_scale=ln, ln_bias=ln, minibatch=-1), "minibatch", "-1"),
    ]
    for fn, name, shape in cases:
        with pytest.raises(ValueError) as info:
            fn()
        assert name in str(info.value) and shape in str(info.value), str(info.value)
