"""neural_memory: chunked == recurrent == a float64 NumPy per-token reference (values and gradients),
causality, streaming, decode, the pinned identities and the worked numbers of notebooks/01_memory_lab.ipynb."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nlearn.memory.delta import delta_rule
from nlearn.memory.linear_attention import linear_attention
from nlearn.memory.neural_memory import (
    NeuralMemoryState,
    init_state,
    neural_memory,
    neural_memory_step,
)

B, T, H, D, HID = 2, 37, 2, 8, 12  # T = 37 divides no mini-batch size used here
TOL = 3e-4
# Tests compile many small programs: LLVM -O0 cuts compile time ~3x and leaves the float math alone.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def run_fast(fn, *args):
    """Compile `fn` for these arguments with FAST_COMPILE and run it."""
    return jax.jit(fn).lower(*args).compile(FAST_COMPILE)(*args)


# ---------------------------------------------------------------------------------------------
# Independent float64 NumPy reference: one token at a time, hand-written backprop.

def _act(name):
    if name == "gelu":  # tanh approximation (jax.nn.gelu's default)
        c = np.sqrt(2.0 / np.pi)

        def f(z):
            return 0.5 * z * (1.0 + np.tanh(c * (z + 0.044715 * z**3)))

        def df(z):
            t = np.tanh(c * (z + 0.044715 * z**3))
            return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * z * z)
        return f, df
    if name == "tanh":
        return np.tanh, lambda z: 1.0 - np.tanh(z) ** 2
    if name == "silu":
        sig = lambda z: 1.0 / (1.0 + np.exp(-z))
        return (lambda z: z * sig(z)), (lambda z: sig(z) * (1.0 + z * (1.0 - sig(z))))
    raise KeyError(name)


def _dloss(objective, pred, target):
    if objective == "l2":
        return pred - target
    if objective == "dot":
        return -target
    return np.clip(pred - target, -1.0, 1.0)  # huber, delta = 1


def _loss(objective, pred, target):
    r = pred - target
    if objective == "l2":
        return 0.5 * np.sum(r * r)
    if objective == "dot":
        return -np.sum(pred * target)
    a = np.abs(r)
    return np.sum(np.where(a <= 1.0, 0.5 * r * r, a - 0.5))


def np_reference(q, k, v, lr, mu, alpha, weights0, *, residual=False, activation="gelu", objective="l2",
                 optimizer="momentum", minibatch=1, state=None, inner_step="paper"):
    """Returns o [B,T,H,Dv], (theta, U) as lists of [B,H,di,do], loss_before, loss_after [B,T,H]."""
    f, df = _act(activation)
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    bsz, t_len, heads = q.shape[:3]
    lr = np.asarray(lr, np.float64)
    mu = np.zeros_like(lr) if mu is None else np.asarray(mu, np.float64)
    alpha = np.zeros_like(lr) if alpha is None else np.asarray(alpha, np.float64)
    nl = len(weights0)
    if state is None:
        w0 = [np.broadcast_to(np.asarray(w, np.float64), (bsz,) + np.shape(w)[-3:]) for w in weights0]
        state = ([w.copy() for w in w0], [np.zeros_like(w) for w in w0])
    theta = [np.array(w, np.float64) for w in state[0]]
    U = [np.array(u, np.float64) for u in state[1]]
    o = np.zeros(v.shape)
    lb, la = np.zeros(lr.shape), np.zeros(lr.shape)
    parts = {"paper": (), "bounded": ("mean", "ema", "normalized")}.get(inner_step, tuple(inner_step.split("+")))

    def forward(ws, x):
        hs, zs, h = [], [], x
        for i, w in enumerate(ws):
            hs.append(h)
            z = h @ w
            zs.append(z)
            h = f(z) if i < nl - 1 else z
        return (h + x if residual else h), hs, zs

    for bi in range(bsz):
        for hi in range(heads):
            th = [w[bi, hi].copy() for w in theta]
            uu = [u[bi, hi].copy() for u in U]
            start, batch_inputs = None, []
            for t in range(t_len):
                if t % minibatch == 0:
                    start, batch_inputs = [w.copy() for w in th], []
                kt, vt = k[bi, t, hi], v[bi, t, hi]
                eta, m, a = lr[bi, t, hi], mu[bi, t, hi], 1.0 - alpha[bi, t, hi]
                if "mean" in parts:
                    eta = eta / minibatch
                if "ema" in parts and optimizer in ("momentum", "dgd_momentum"):
                    eta = eta * (1.0 - m)
                pred, hs, zs = forward(start, kt)
                delta = _dloss(objective, pred, vt)
                grads, gain = [None] * nl, [1.0] * nl
                last = max(float(delta @ delta), 1e-300)
                for i in reversed(range(nl)):
                    grads[i] = np.outer(hs[i], delta)
                    if "gain" in parts and i < nl - 1:  # gain: |δ_i|² / |δ_L|², the errors at the outputs
                        gain[i] = float(delta @ delta) / last
                    if i > 0:
                        delta = (start[i] @ delta) * df(zs[i - 1])
                lb[bi, t, hi] = _loss(objective, forward(th, kt)[0], vt)
                batch_inputs.append(hs)
                new = []
                for i in range(nl):
                    # normalised: layer i's step over 1 + |x|^2 of its input at the mini-batch start;
                    # overlap: over 1 + sum |x . x_j| of the mini-batch's inputs up to this token (b = 1: normalised)
                    # gain: the norm or overlap times the layer's downstream gain
                    e_i = eta
                    if "normalized" in parts or ("overlap" in parts and minibatch == 1):
                        e_i = eta / (1.0 + gain[i] * (hs[i] @ hs[i]))
                    elif "overlap" in parts:
                        e_i = eta / (1.0 + gain[i] * sum(abs(hs[i] @ xj[i]) for xj in batch_inputs))
                    if optimizer in ("sgd", "dgd"):
                        w = a * th[i] - e_i * grads[i]
                    else:
                        uu[i] = m * uu[i] - e_i * grads[i]
                        w = a * th[i] + uu[i]
                    if optimizer.startswith("dgd"):
                        w = w - e_i * np.outer(hs[i], hs[i] @ th[i])
                    new.append(w)
                th = new
                la[bi, t, hi] = _loss(objective, forward(th, kt)[0], vt)
                o[bi, t, hi] = forward(th, q[bi, t, hi])[0]
            for i in range(nl):
                theta[i][bi, hi] = th[i]
                U[i][bi, hi] = uu[i]
    return o, (theta, U), lb, la


# ---------------------------------------------------------------------------------------------
# Inputs

def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_inputs(seed=0, depth=2, *, t_len=T, b=B, dk=D, dv=D, hid=HID, batched_w=False):
    rng = np.random.default_rng(seed)
    q = _unit(rng.normal(size=(b, t_len, H, dk))).astype(np.float32)
    k = _unit(rng.normal(size=(b, t_len, H, dk))).astype(np.float32)
    v = rng.normal(size=(b, t_len, H, dv)).astype(np.float32)
    lr = rng.uniform(0.02, 0.25, size=(b, t_len, H)).astype(np.float32)
    mu = rng.uniform(0.1, 0.8, size=(b, t_len, H)).astype(np.float32)
    alpha = rng.uniform(0.0, 0.06, size=(b, t_len, H)).astype(np.float32)
    dims = [dk] + [hid] * (depth - 1) + [dv]
    lead = (b, H) if batched_w else (H,)
    w = tuple((rng.normal(size=lead + (dims[i], dims[i + 1])) / np.sqrt(dims[i])).astype(np.float32)
              for i in range(depth))
    return q, k, v, lr, mu, alpha, w


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))


# (depth, optimizer, objective, minibatch, momentum, decay, residual, activation[, inner_step])
GRID = [
    (2, "momentum", "l2", 8, True, True, False, "gelu"),
    (1, "momentum", "dot", 1, True, False, False, "gelu"),
    (3, "momentum", "huber", 8, False, True, False, "tanh"),
    (2, "momentum", "l2", 1, True, True, False, "silu"),
    (2, "sgd", "dot", 1, False, True, True, "gelu"),
    (3, "sgd", "l2", 8, False, False, False, "silu"),
    (1, "sgd", "huber", 8, False, True, False, "gelu"),
    (2, "dgd", "l2", 8, False, True, False, "gelu"),
    (1, "dgd_momentum", "dot", 8, True, True, False, "gelu"),
    (2, "dgd_momentum", "huber", 1, True, False, True, "tanh"),
    (2, "momentum", "l2", 8, True, True, False, "gelu", "bounded"),
    (2, "momentum", "l2", 1, True, True, False, "gelu", "bounded"),
    (2, "dgd_momentum", "l2", 8, True, True, False, "silu", "bounded"),
    (3, "dgd", "huber", 1, False, True, True, "gelu", "normalized"),
    (1, "sgd", "l2", 8, False, True, False, "gelu", "mean+normalized"),
    (2, "momentum", "l2", 8, True, True, False, "gelu", "ema+overlap"),
    (2, "dgd_momentum", "l2", 8, True, True, False, "silu", "ema+overlap"),
    (2, "dgd", "huber", 8, False, True, True, "gelu", "overlap"),
    (2, "momentum", "l2", 8, True, True, False, "gelu", "ema+overlap+gain"),
    (3, "momentum", "l2", 1, True, True, False, "silu", "ema+overlap+gain"),
    (2, "dgd_momentum", "huber", 8, True, True, True, "gelu", "normalized+gain"),
]
ARGN = ("q", "k", "v", "lr", "mu", "alpha", "weights0")


def _config_kwargs(cfg):
    _depth, opt, obj, mb, use_mu, use_decay, residual, act, *step = cfg
    kw = {"optimizer": opt, "objective": obj, "minibatch": mb, "residual": residual, "activation": act,
          "inner_step": step[0] if step else "paper"}
    return kw, use_mu, use_decay


def _scalar_fn(cfg, impl, r_o, r_w):
    """A scalar of the outputs, final weights and inner losses, and the pieces it is made of."""
    kw, use_mu, use_decay = _config_kwargs(cfg)

    def fn(q, k, v, lr, mu, alpha, w):
        o, (theta, U), (lb, la) = neural_memory(
            q, k, v, lr=lr, momentum=mu if use_mu else None, decay=alpha if use_decay else None,
            weights0=w, impl=impl, return_inner_loss=True, **kw)
        s = jnp.sum(o * r_o) + sum(jnp.sum(t * r) for t, r in zip(theta, r_w)) + 0.1 * jnp.sum(la)
        return s, (o, theta, U, lb, la)
    return fn


@functools.cache
def _values_and_grads(cfg, impl):
    """(scalar, aux), grads for the config's standard inputs (compiled once per config and impl)."""
    inputs = _inputs(cfg)
    r_o, r_w = _probe(cfg, inputs)

    def run(args, r_o, r_w):
        return jax.value_and_grad(_scalar_fn(cfg, impl, r_o, r_w), argnums=tuple(range(7)), has_aux=True)(*args)
    return run_fast(run, inputs, r_o, r_w)


def _values(cfg, impl):
    """Forward only: (o, θ, U, loss_before, loss_after)."""
    inputs = _inputs(cfg)
    r_o, r_w = _probe(cfg, inputs)
    return run_fast(lambda args: _scalar_fn(cfg, impl, r_o, r_w)(*args)[1], inputs)


def _inputs(cfg):
    return make_inputs(seed=GRID.index(cfg), depth=cfg[0])


def _probe(cfg, inputs):
    rng = np.random.default_rng(7)
    r_o = rng.normal(size=inputs[2].shape).astype(np.float32)
    r_w = tuple(rng.normal(size=(B,) + w.shape[-3:]).astype(np.float32) for w in inputs[6])
    return r_o, r_w


def _ids(c):
    return "-".join(map(str, c))


@pytest.mark.parametrize("cfg", GRID, ids=_ids)
def test_chunked_matches_recurrent_and_numpy(cfg):
    """Outputs, final (θ, U) and inner losses: chunked == recurrent == float64 NumPy."""
    aux_c, aux_r = _values(cfg, "chunked"), _values(cfg, "recurrent")
    kw, use_mu, use_decay = _config_kwargs(cfg)
    q, k, v, lr, mu, alpha, w = _inputs(cfg)
    o, (theta, U), lb, la = np_reference(q, k, v, lr, mu if use_mu else None, alpha if use_decay else None, w, **kw)
    ref = (o, theta, U if cfg[1] not in ("sgd", "dgd") else aux_r[2], lb, la)
    for name, a, b, c in zip(("o", "theta", "U", "loss_before", "loss_after"), aux_c, aux_r, ref):
        for x, y, z in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), jax.tree_util.tree_leaves(c)):
            assert rel_err(x, y) <= TOL, name
            assert rel_err(x, z) <= TOL, name


# Gradients (the expensive compiles) on a subset covering every optimizer and objective, b = 1 and
# > 1, depth 2 and 3, with and without momentum, decay and the residual.
# The bounded steps' gradients (~20 s each here) run under `make test-all`; their values stay in the default suite.
GRAD_GRID = [GRID[0], GRID[2], GRID[4], GRID[7], pytest.param(GRID[10], marks=pytest.mark.slow),
             pytest.param(GRID[12], marks=pytest.mark.slow), GRID[18]]  # GRID[18]: the Titans default step


@pytest.mark.parametrize("cfg", GRAD_GRID, ids=_ids)
def test_chunked_gradients_match_recurrent(cfg):
    """d(scalar of o, θ_T, inner losses)/d(q, k, v, η, μ, α, weights0): chunked == recurrent."""
    (_, aux_c), g_c = _values_and_grads(cfg, "chunked")
    (_, aux_r), g_r = _values_and_grads(cfg, "recurrent")
    for name, a, b in zip(ARGN, g_c, g_r):
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            assert np.all(np.isfinite(x)), name
            assert rel_err(x, y) <= TOL, f"grad {name}"


def _np_scalar(cfg, inputs, r_o, r_w):
    kw, use_mu, use_decay = _config_kwargs(cfg)
    q, k, v, lr, mu, alpha, w = inputs
    o, (theta, _), _, la = np_reference(q, k, v, lr, mu if use_mu else None, alpha if use_decay else None, w, **kw)
    return np.sum(o * r_o) + sum(np.sum(t * r) for t, r in zip(theta, r_w)) + 0.1 * np.sum(la)


@pytest.mark.parametrize("cfg", [GRID[0], GRID[4], GRID[7], GRID[10]], ids=_ids)
def test_gradients_match_numpy_finite_differences(cfg):
    """Directional derivatives of the chunked gradients vs central differences of the float64 reference."""
    inputs = _inputs(cfg)
    r_o, r_w = _probe(cfg, inputs)
    _, grads = _values_and_grads(cfg, "chunked")
    rng = np.random.default_rng(3)
    eps = 1e-5
    for idx, name in enumerate(ARGN):
        if (name == "mu" and not cfg[4]) or (name == "alpha" and not cfg[5]):
            continue
        direction = jax.tree_util.tree_map(lambda x: rng.normal(size=np.shape(x)), inputs[idx])
        analytic = sum(float(np.sum(np.asarray(g, np.float64) * d)) for g, d in
                       zip(jax.tree_util.tree_leaves(grads[idx]), jax.tree_util.tree_leaves(direction)))

        def shifted(sign, idx=idx, direction=direction):
            args = list(jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), inputs))
            args[idx] = jax.tree_util.tree_map(lambda x, dx: x + sign * eps * dx, args[idx], direction)
            return _np_scalar(cfg, args, r_o, r_w)

        numeric = (shifted(1) - shifted(-1)) / (2 * eps)
        assert abs(analytic - numeric) <= TOL * max(abs(numeric), 1.0), (name, analytic, numeric)


def test_batched_weights0():
    """weights0 given per batch element [B, H, ...] works and matches the reference."""
    q, k, v, lr, mu, alpha, w = make_inputs(seed=5, depth=2, batched_w=True)
    o, _ = run_fast(lambda *a: neural_memory(*a[:3], lr=a[3], momentum=a[4], decay=a[5], weights0=a[6], minibatch=4),
                    q, k, v, lr, mu, alpha, w)
    o_ref = np_reference(q, k, v, lr, mu, alpha, w, minibatch=4)[0]
    assert rel_err(o, o_ref) <= TOL


def test_grouped_scan_matches_recurrent():
    """Long enough for the scan to take several mini-batches per checkpointed step (with padding)."""
    q, k, v, lr, mu, alpha, w = make_inputs(seed=6, depth=1, t_len=131, b=1)

    def loss(impl, q, k, v, lr, mu, alpha, w):
        o, (theta, _U) = neural_memory(q, k, v, lr=lr, momentum=mu, decay=alpha, weights0=w, minibatch=2, impl=impl)
        return jnp.sum(jnp.sin(o)) + sum(jnp.sum(t) for t in theta), o

    grads = {impl: run_fast(jax.grad(functools.partial(loss, impl), argnums=(0, 1, 3, 6), has_aux=True),
                            q, k, v, lr, mu, alpha, w) for impl in ("chunked", "recurrent")}
    for a, b in zip(jax.tree_util.tree_leaves(grads["chunked"]), jax.tree_util.tree_leaves(grads["recurrent"])):
        assert rel_err(a, b) <= TOL


# ---------------------------------------------------------------------------------------------
# Causality and streaming

def _gates(lr, mu, alpha, s=slice(None)):
    return {"lr": lr[:, s], "momentum": mu[:, s], "decay": alpha[:, s]}


def test_causal():
    q, k, v, lr, mu, alpha, w = make_inputs(seed=11, depth=2)
    run = jax.jit(lambda *a: neural_memory(*a[:3], lr=a[3], momentum=a[4], decay=a[5], weights0=w,
                                           minibatch=8, optimizer="dgd_momentum")[0])
    run = run.lower(q, k, v, lr, mu, alpha).compile(FAST_COMPILE)
    o = run(q, k, v, lr, mu, alpha)
    p = 13  # inside a mini-batch
    bump = lambda x, f: np.concatenate([x[:, :p], f(x[:, p:])], axis=1)
    o2 = run(*(bump(x, lambda y: y + 0.5) for x in (q, k, v)), *(bump(x, lambda y: y * 0.5) for x in (lr, mu, alpha)))
    np.testing.assert_allclose(o2[:, :p], o[:, :p], rtol=0, atol=1e-6)
    assert np.max(np.abs(o2[:, p] - o[:, p])) > 1e-3


@pytest.mark.parametrize("impl,inner_step", [("chunked", "paper"), ("recurrent", "paper"), ("chunked", "bounded"),
                                             ("chunked", "ema+overlap+gain"), ("recurrent", "ema+overlap+gain")])
def test_stream_in_pieces(impl, inner_step):
    """Two pieces == one call: split on a mini-batch boundary with (θ, U); anywhere with the stream state."""
    q, k, v, lr, mu, alpha, w = make_inputs(seed=12, depth=2)
    kw = {"minibatch": 4, "impl": impl, "inner_step": inner_step}

    def pieces(q, k, v, lr, mu, alpha, w):
        full = neural_memory(q, k, v, weights0=w, **_gates(lr, mu, alpha), **kw)
        cut = 16  # a mini-batch boundary: the plain (θ, U) state carries on
        o1, st = neural_memory(q[:, :cut], k[:, :cut], v[:, :cut], weights0=w, **_gates(lr, mu, alpha, slice(0, cut)),
                               **kw)
        o2, st2 = neural_memory(q[:, cut:], k[:, cut:], v[:, cut:], initial_state=st,
                                **_gates(lr, mu, alpha, slice(cut, None)), **kw)
        # Mid-mini-batch splits (6 | 17 | 14 with mini-batch 4) through NeuralMemoryState.
        st3, outs = init_state(w, B, minibatch=4, inner_step=inner_step), []
        for s in (slice(0, 6), slice(6, 23), slice(23, None)):
            o_, st3 = neural_memory(q[:, s], k[:, s], v[:, s], initial_state=st3, return_stream_state=True,
                                    **_gates(lr, mu, alpha, s), **kw)
            outs.append(o_)
        return full, (jnp.concatenate([o1, o2], 1), st2), (jnp.concatenate(outs, 1), st3)

    (o, (theta, U)), (o_a, (th_a, U_a)), (o_b, st_b) = run_fast(pieces, q, k, v, lr, mu, alpha, w)
    assert isinstance(st_b, NeuralMemoryState) and int(st_b.pos) == T % 4
    for got, th, uu in ((o_a, th_a, U_a), (o_b, st_b.theta, st_b.U)):
        np.testing.assert_allclose(got, o, rtol=0, atol=1e-5)
        for a, b in zip(th + uu, theta + U):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_stream_state_with_traced_position():
    """A resumed chunked call whose position in the mini-batch is not known at trace time."""
    q, k, v, lr, mu, alpha, w = make_inputs(seed=13, depth=2)
    kw = {"minibatch": 8}

    def both(st):
        return neural_memory(q[:, 11:], k[:, 11:], v[:, 11:], initial_state=st,
                             **_gates(lr, mu, alpha, slice(11, None)),
                             **kw)[0]

    def prefix(q, k, v, lr, mu, alpha, w):
        full = neural_memory(q, k, v, weights0=w, **_gates(lr, mu, alpha), **kw)[0]
        _, st = neural_memory(q[:, :11], k[:, :11], v[:, :11], weights0=w, return_stream_state=True,
                              **_gates(lr, mu, alpha, slice(0, 11)), **kw)
        return full, st

    o, st = run_fast(prefix, q, k, v, lr, mu, alpha, w)
    np.testing.assert_allclose(run_fast(both, st), o[:, 11:], rtol=0, atol=1e-5)


def test_stream_state_with_known_position():
    """Resuming with a concrete position (static front padding instead of a dynamic placement)."""
    q, k, v, lr, mu, alpha, w = make_inputs(seed=16, depth=1, t_len=20)
    kw = {"minibatch": 8}

    def prefix(q, k, v, lr, mu, alpha, w):
        full = neural_memory(q, k, v, weights0=w, **_gates(lr, mu, alpha), **kw)
        _, st = neural_memory(q[:, :5], k[:, :5], v[:, :5], weights0=w, return_stream_state=True,
                              **_gates(lr, mu, alpha, slice(0, 5)), **kw)
        return full, st

    (o, (theta, _)), st = run_fast(prefix, q, k, v, lr, mu, alpha, w)
    assert int(st.pos) == 5
    # `st` is closed over, so its position is a constant when the second call is traced.
    o2, (theta2, _) = run_fast(lambda q, k, v, lr, mu, alpha: neural_memory(
        q[:, 5:], k[:, 5:], v[:, 5:], initial_state=st, **_gates(lr, mu, alpha, slice(5, None)), **kw),
        q, k, v, lr, mu, alpha)
    np.testing.assert_allclose(o2, o[:, 5:], rtol=0, atol=1e-5)
    np.testing.assert_allclose(theta2[0], theta[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("optimizer,inner_step", [("momentum", "paper"), ("dgd_momentum", "paper"),
                                                  ("dgd_momentum", "bounded"), ("momentum", "ema+overlap+gain")])
def test_decode_steps_equal_full_sequence(optimizer, inner_step):
    t_len = 13
    q, k, v, lr, mu, alpha, w = make_inputs(seed=14, depth=2, t_len=t_len)
    kw = {"minibatch": 4, "optimizer": optimizer, "inner_step": inner_step}
    o, (theta, U), (lb, la) = run_fast(
        lambda *a: neural_memory(*a[:3], weights0=a[6], return_inner_loss=True, **_gates(*a[3:6]), **kw),
        q, k, v, lr, mu, alpha, w)

    seq = tuple(jnp.asarray(x) for x in (q, k, v, lr, mu, alpha))

    def step(st, t):
        q, k, v, lr, mu, alpha = (x[:, t] for x in seq)
        return neural_memory_step(q, k, v, lr=lr, momentum=mu, decay=alpha, state=st, return_inner_loss=True, **kw)

    st = init_state(w, B, minibatch=4, inner_step=inner_step)
    step = jax.jit(step).lower(st, jnp.int32(0)).compile(FAST_COMPILE)
    for t in range(t_len):
        o_t, st, (lb_t, la_t) = step(st, jnp.int32(t))
        np.testing.assert_allclose(o_t, o[:, t], rtol=0, atol=1e-5)
        np.testing.assert_allclose(la_t, la[:, t], rtol=0, atol=1e-5)
        np.testing.assert_allclose(lb_t, lb[:, t], rtol=0, atol=1e-5)
    for a, b in zip(st.theta + st.U, theta + U):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_prefill_then_decode():
    """A prefill that ends mid-mini-batch hands its schedule to the decode step."""
    q, k, v, lr, mu, alpha, w = make_inputs(seed=15, depth=3, t_len=12)
    kw = {"minibatch": 8}

    def run(q, k, v, lr, mu, alpha, w):
        o = neural_memory(q, k, v, weights0=w, **_gates(lr, mu, alpha), **kw)[0]
        _, st = neural_memory(q[:, :10], k[:, :10], v[:, :10], weights0=w, return_stream_state=True,
                              **_gates(lr, mu, alpha, slice(0, 10)), **kw)
        steps = []
        for t in (10, 11):
            o_t, st = neural_memory_step(q[:, t], k[:, t], v[:, t], lr=lr[:, t], momentum=mu[:, t],
                                         decay=alpha[:, t], state=st, **kw)
            steps.append(o_t)
        return o[:, 10:], jnp.stack(steps, 1)

    o, steps = run_fast(run, q, k, v, lr, mu, alpha, w)
    np.testing.assert_allclose(steps, o, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Pinned identities

@pytest.mark.parametrize("case", ["sgd-l2-b1", "dgd-dot-b8"])
def test_depth1_equals_delta_rule(case):
    """L=1, l2, sgd, b=1, α=0 is the delta rule with β=η; so is DGD with the dot objective at any b."""
    q, k, v, lr, _, _, (w,) = make_inputs(seed=21, depth=1)
    w = np.eye(D, dtype=np.float32)[None].repeat(H, 0) * 0.3
    if case == "sgd-l2-b1":
        kw = {"optimizer": "sgd", "objective": "l2", "minibatch": 1}
    else:
        kw = {"optimizer": "dgd", "objective": "dot", "minibatch": 8}

    def both(q, k, v, lr, w):
        mine = neural_memory(q, k, v, lr=lr, weights0=(w,), **kw)
        ref = delta_rule(q, k, v, lr, initial_state=jnp.broadcast_to(w, (B, H, D, D)))
        return mine, ref

    (o, (theta, _)), (o_ref, s_ref) = run_fast(both, q, k, v, lr, w)
    assert rel_err(o, o_ref) <= TOL
    assert rel_err(theta[0], s_ref) <= TOL


@pytest.mark.parametrize("minibatch", [1, 8])
def test_dot_sgd_equals_linear_attention(minibatch):
    """dot objective, sgd, η = 1, α = 0, W_0 = 0 is unnormalized linear attention (any mini-batch)."""
    q, k, v, _, _, _, (w,) = make_inputs(seed=22, depth=1)
    ones = np.ones((B, T, H), np.float32)

    def both(q, k, v, ones, w):
        return (neural_memory(q, k, v, lr=ones, weights0=(w,), optimizer="sgd", objective="dot", minibatch=minibatch),
                linear_attention(q, k, v))

    (o, (theta, _)), (o_ref, s_ref) = run_fast(both, q, k, v, ones, np.zeros_like(w))
    assert rel_err(o, o_ref) <= TOL
    assert rel_err(theta[0], s_ref) <= TOL


# ---------------------------------------------------------------------------------------------
# The seed's worked numbers (scalar memory)

def _scalar(x):
    return jnp.asarray(np.asarray(x, np.float32).reshape(1, -1, 1, 1))


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_seed_two_token_example(impl):
    """w0 = 0, k = 1, v = (1, 3), η = 0.5: online reads (0.5, 1.75); one mini-batch of 2 reads (0.5, 2.0)."""
    one = _scalar([1.0, 1.0])
    v = _scalar([1.0, 3.0])
    lr = jnp.full((1, 2, 1), 0.5)
    w0 = (jnp.zeros((1, 1, 1)),)
    for mb, want in ((1, [0.5, 1.75]), (2, [0.5, 2.0])):
        o, _ = neural_memory(one, one, v, lr=lr, weights0=w0, optimizer="sgd", minibatch=mb, impl=impl)
        np.testing.assert_allclose(np.asarray(o).ravel(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_seed_titans_step(impl):
    """W = 2, U = 0.2, gradient −0.4 (k = 1, v = 2.4), μ = 0.5, η = 0.1, α = 0.1: U = 0.14, W = 1.94."""
    one = _scalar([1.0])
    g = lambda x: jnp.full((1, 1, 1), x)
    state = ((jnp.full((1, 1, 1, 1), 2.0),), (jnp.full((1, 1, 1, 1), 0.2),))
    o, (theta, U) = neural_memory(one, one, _scalar([2.4]), lr=g(0.1), momentum=g(0.5), decay=g(0.1),
                                  initial_state=state, impl=impl)
    np.testing.assert_allclose(float(U[0].ravel()[0]), 0.14, atol=1e-6)
    np.testing.assert_allclose(float(theta[0].ravel()[0]), 1.94, atol=1e-6)
    np.testing.assert_allclose(float(np.asarray(o).ravel()[0]), 1.94, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Argument errors and memory

@pytest.mark.parametrize("kw, words", [
    ({"optimizer": "adam"}, ["dgd", "dgd_momentum", "momentum", "sgd"]),
    ({"objective": "cosine"}, ["dot", "huber", "l2"]),
    ({"activation": "swish"}, ["gelu", "silu"]),
    ({"impl": "fast"}, ["chunked", "recurrent"]),
])
def test_unknown_names_list_valid_ones(kw, words):
    q, k, v, lr, _, _, w = make_inputs(depth=1, t_len=3)
    with pytest.raises(ValueError) as err:
        neural_memory(q, k, v, lr=lr, weights0=w, **kw)
    assert all(word in str(err.value) for word in words)


def test_bad_arguments():
    q, k, v, lr, mu, _, w = make_inputs(depth=2, t_len=3)
    with pytest.raises(ValueError, match="momentum"):
        neural_memory(q, k, v, lr=lr, momentum=mu, weights0=w, optimizer="sgd")
    with pytest.raises(ValueError, match="residual"):
        neural_memory(q, k, v[..., :4], lr=lr, weights0=(w[0], w[1][..., :4]), residual=True)
    with pytest.raises(ValueError, match="weight 1"):
        neural_memory(q, k, v, lr=lr, weights0=(w[0], w[0]))
    with pytest.raises(ValueError, match="minibatch"):
        neural_memory(q, k, v, lr=lr, weights0=w, minibatch=0)


def test_bfloat16_activations_learn_in_float32():
    q, k, v, lr, mu, alpha, w = make_inputs(seed=31, depth=2, t_len=12)

    def both(q, k, v, lr, mu, alpha, w):
        half = neural_memory(*(x.astype(jnp.bfloat16) for x in (q, k, v)), lr=lr, momentum=mu, decay=alpha,
                             weights0=w, minibatch=4)
        return half, neural_memory(q, k, v, lr=lr, momentum=mu, decay=alpha, weights0=w, minibatch=4)

    (o16, (th16, _)), (o32, _) = run_fast(both, q, k, v, lr, mu, alpha, w)
    assert o16.dtype == jnp.bfloat16 and th16[0].dtype == jnp.float32
    assert rel_err(np.asarray(o16, np.float32), o32) < 3e-2


def test_stream_position_must_fit_the_minibatch():
    q, k, v, lr, _, _, w = make_inputs(depth=1, t_len=3)
    st = init_state(w, B)._replace(pos=jnp.int32(5))
    with pytest.raises(ValueError, match="position 5"):
        neural_memory(q, k, v, lr=lr, initial_state=st, minibatch=4)


def test_backward_memory_has_no_per_token_weight_copies():
    """Compiled fwd+bwd temp memory stays far below one weight copy per token (T·|θ|) and barely grows
    with the mini-batch size."""
    t_len, dk, hid = 512, 16, 64
    q, k, v, lr, mu, alpha, w = make_inputs(depth=2, t_len=t_len, b=1, dk=dk, dv=dk, hid=hid)
    theta_bytes = 4 * H * sum(int(np.prod(x.shape[-2:])) for x in w)
    temps = {}
    for mb in (16, 64):
        f = jax.jit(jax.grad(lambda q, w, mb=mb: jnp.sum(neural_memory(q, k, v, lr=lr, weights0=w, minibatch=mb)[0])))
        temps[mb] = f.lower(q, w).compile(FAST_COMPILE).memory_analysis().temp_size_in_bytes
    assert temps[64] < 0.25 * t_len * theta_bytes
    # Weight copies per token of a mini-batch would add (64 - 16)·|θ| going from b = 16 to b = 64.
    assert temps[64] - temps[16] < 0.5 * (64 - 16) * theta_bytes
