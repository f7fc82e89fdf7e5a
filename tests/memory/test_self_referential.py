"""self_referential_titans: chunked == recurrent == an independent float64 per-token reference written
from docs/self_referential.md §1 (values and gradients), the identities listed there, causality, streaming
and decode."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nlearn.memory import (
    SelfRefTitansState,
    gated_delta_rule,
    neural_memory,
    self_referential_init_state,
    self_referential_titans,
    self_referential_titans_step,
)

B, T, H, D, HID = 2, 23, 2, 8, 6  # T = 23 divides no chunk size used here
LR_MAX = 0.5
TOL = 3e-4
SCALAR = ("lr", "retain")
# Tests compile many small programs: LLVM -O0 cuts compile time ~3x and leaves the float math alone.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def run_fast(fn, *args):
    """Compile `fn` for these arguments with FAST_COMPILE and run it."""
    return jax.jit(fn).lower(*args).compile(FAST_COMPILE)(*args)


def sr_fast(x, q, **kw):
    """self_referential_titans through `run_fast` (array keyword arguments are traced, others static)."""
    arrays = {k: v for k, v in kw.items() if k in ("weights0", "lr_bias", "retain_bias", "initial_state")}
    static = {k: v for k, v in kw.items() if k not in arrays}
    return run_fast(lambda x, q, arrays: self_referential_titans(x, q, **arrays, **static), x, q, arrays)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---------------------------------------------------------------------------------------------
# Independent float64 reference: docs/self_referential.md §1 token by token, explicit outer products.

def _act(name):
    """(σ, σ'); gelu is the tanh approximation, written out; σ' by forward-mode autodiff of σ."""
    c = np.sqrt(2.0 / np.pi)
    f = {"gelu": lambda z: 0.5 * z * (1.0 + jnp.tanh(c * (z + 0.044715 * z**3))),
         "tanh": jnp.tanh, "identity": lambda z: z}[name]
    return f, lambda z: jax.jvp(f, (z,), (jnp.ones_like(z),))[1]


EIN = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def _mem(n, w, z, bias, f):
    """M_□(z) for z [B, H, D], w = (W_in [B, H, D, Dh], W_out [B, H, Dh, D_out])."""
    y = EIN("bhf,bhfo->bho", f(EIN("bhd,bhdf->bhf", z, w[0])), w[1])
    return y[..., 0] + bias[n] if n in SCALAR else z + y


def _unit(z):
    return z / jnp.sqrt(jnp.sum(z * z, -1, keepdims=True))


def _generated(start, xt, bias, f, lr_max=LR_MAX, gate=None):
    """k, v, retain, lr of tokens xt [B, H, D] from the generators' states (docs/self_referential.md §1); a
    write gate g [B, H] makes the token's step a fraction g of one: retain^g and g·lr_max·sigmoid(·)·retain^g."""
    k = _unit(_mem("k", start["k"], xt, bias, f))
    v = _mem("v", start["v"], xt, bias, f)
    retain = jax.nn.sigmoid(_mem("retain", start["retain"], xt, bias, f))
    rate = lr_max * jax.nn.sigmoid(_mem("lr", start["lr"], xt, bias, f))
    if gate is not None:
        retain, rate = retain**gate, gate * rate
    return k, v, retain, rate * retain


def dgd_write(cur, k, grad, lr, retain, dgd=True, anchor=None):
    """W_t = (retain I − lr kᵀk) W_{t−1} − lr·grad (without DGD: retain W_{t−1} − lr·grad); gates [B, H]. With
    an anchor W_0 the retention keeps W_0 + retain (W_{t−1} − W_0) instead of retain W_{t−1}."""
    lr, retain = lr[..., None, None], retain[..., None, None]
    new = retain * cur - lr * grad
    if anchor is not None:
        new = new + (1.0 - retain) * anchor
    if dgd:
        new = new - lr * k[..., :, None] * EIN("bhd,bhdf->bhf", k, cur)[..., None, :]
    return new


def reference(x, q, weights0, lr_bias, retain_bias, *, lr_max=LR_MAX, chunk_memory, chunk_other, activation="gelu",
              dgd=True, dgd_output=False, read="after_write", self_targets=True, adaptive_q=False, targets="chunk",
              inner_step="plain", retain_to="zero", write_gate=None):
    """o [B, T, H, D] and the final weights; call it under `jax.enable_x64(True)` with float64 inputs."""
    f, df = _act(activation)
    bsz, t_len = x.shape[:2]
    names = ("k", "v", "lr", "retain") + (("q",) if adaptive_q else ()) + ("memory",)
    bias = {"lr": lr_bias, "retain": retain_bias}
    weights = {n: tuple(jnp.broadcast_to(w, (bsz,) + w.shape) for w in weights0[n]) for n in names}
    initial, start, outs = dict(weights), {}, []
    for t in range(t_len):
        for n in names:
            if t % (chunk_memory if n == "memory" else chunk_other) == 0:
                start[n] = weights[n]
        k, v, retain, lr = _generated(start, x[:, t], bias, f, lr_max, None if write_gate is None else write_gate[:, t])
        qt = _unit(_mem("q", start["q"], q[:, t], bias, f)) if adaptive_q else q[:, t]
        new = {}
        for n in names:
            w_in, w_out = start[n]
            z = EIN("bhd,bhdf->bhf", k, w_in)
            source = initial[n] if targets == "initial" else start[n]  # the state v̂ comes from
            target = _mem(n, source, v, bias, f) if (self_targets or n in SCALAR) else v
            e = _mem(n, start[n], k, bias, f) - target
            e = e[..., None] if n in SCALAR else e
            delta = EIN("bho,bhfo->bhf", e, w_out) * df(z)
            if inner_step == "normalized":  # the input layer's gradient over 1 + ‖W_out‖²
                delta = delta / (1.0 + jnp.sum(w_out**2, (-2, -1)))[..., None]
            g_in = k[..., :, None] * delta[..., None, :]
            g_out = f(z)[..., :, None] * e[..., None, :]
            lr_out = lr / (1.0 + jnp.sum(f(z) ** 2, -1)) if inner_step == "normalized" else lr
            a_in, a_out = initial[n] if retain_to == "initial" else (None, None)
            new[n] = (dgd_write(weights[n][0], k, g_in, lr, retain, dgd, a_in),
                      dgd_write(weights[n][1], f(z), g_out, lr_out, retain, dgd_output, a_out))
        state = {"after_write": new, "before_write": weights, "chunk_start": start}[read]["memory"]
        outs.append(_mem("memory", state, qt, bias, f))
        weights = new
    return jnp.stack(outs, axis=1), weights


# ---------------------------------------------------------------------------------------------
# Inputs

def make_weights(rng, adaptive_q=False, hid=HID, dim=D, w_out_std=0.1, heads=H):
    names = ("k", "v", "lr", "retain") + (("q",) if adaptive_q else ()) + ("memory",)
    out = {}
    for n in names:
        d_out = 1 if n in SCALAR else dim
        out[n] = (jnp.asarray(rng.normal(size=(heads, dim, hid)) / np.sqrt(dim), jnp.float32),
                  jnp.asarray(w_out_std * rng.normal(size=(heads, hid, d_out)), jnp.float32))
    return out


def make_inputs(seed=0, t_len=T, adaptive_q=False, batch=B):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(batch, t_len, H, D)), jnp.float32)
    q = rng.normal(size=(batch, t_len, H, D))
    q = jnp.asarray(q / np.linalg.norm(q, axis=-1, keepdims=True), jnp.float32)
    w0 = make_weights(rng, adaptive_q)
    lr_bias = jnp.asarray([-1.0, 0.0], jnp.float32)
    retain_bias = jnp.asarray([3.0, 2.0], jnp.float32)
    return x, q, w0, lr_bias, retain_bias


def f64(tree):
    return jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a), jnp.float64), tree)


def op_kwargs(cfg):
    return dict(lr_max=LR_MAX, chunk_memory=cfg.get("cm", 2), chunk_other=cfg.get("co", 4),
                activation=cfg.get("act", "gelu"), dgd=cfg.get("dgd", True), dgd_output=cfg.get("dgo", False),
                read=cfg.get("read", "after_write"),
                self_targets=cfg.get("st", True), adaptive_q=cfg.get("aq", False), targets=cfg.get("tg", "chunk"),
                inner_step=cfg.get("os", "plain"), retain_to=cfg.get("rt", "zero"))


# ---------------------------------------------------------------------------------------------
# Recurrent twin vs the reference

RECURRENT_CFGS = [
    dict(read="after_write"),
    dict(read="before_write", dgd=False, cm=4, co=2),
    dict(read="chunk_start", st=False, aq=True, act="tanh"),
    dict(read="before_write", dgo=True),
    dict(cm=4, co=2, tg="initial", os="normalized", dgo=True),
    dict(cm=2, co=4, rt="initial", dgo=True, read="before_write"),
]


@pytest.mark.parametrize("cfg", RECURRENT_CFGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_recurrent_matches_reference(cfg):
    x, q, w0, lb, rb = make_inputs(1, adaptive_q=cfg.get("aq", False))
    o, state = run_fast(lambda *a: self_referential_titans(*a[:2], weights0=a[2], lr_bias=a[3], retain_bias=a[4],
                                                           impl="recurrent", **op_kwargs(cfg)), x, q, w0, lb, rb)
    with jax.enable_x64(True):
        o_ref, w_ref = reference(*f64((x, q, w0, lb, rb)), **op_kwargs(cfg))
        o_ref, w_ref = np.asarray(o_ref), jax.tree_util.tree_map(np.asarray, w_ref)
    assert np.all(np.isfinite(o_ref)) and np.abs(np.asarray(o) - np.asarray(q)).max() > 1e-3
    assert rel_err(o - q, o_ref - np.asarray(q)) <= TOL  # the memory's part of o (o = q + ...)
    for n in w_ref:
        for a, b in zip(state[n], w_ref[n]):
            assert rel_err(a, b) <= TOL, n


def test_step_equals_sequence_across_both_grids():
    cfg = dict(cm=2, co=4)
    x, q, w0, lb, rb = make_inputs(2, t_len=11)
    o, _ = sr_fast(x, q, weights0=w0, lr_bias=lb, retain_bias=rb, impl="recurrent", **op_kwargs(cfg))
    step = jax.jit(functools.partial(self_referential_titans_step, lr_bias=lb, retain_bias=rb, **op_kwargs(cfg)))
    state = self_referential_init_state(w0, B)
    outs = []
    for t in range(x.shape[1]):
        o_t, state = step(x[:, t], q[:, t], state=state)
        outs.append(o_t)
    assert isinstance(state, SelfRefTitansState)
    assert rel_err(jnp.stack(outs, 1), o) <= 1e-5


@pytest.mark.parametrize("kwargs, culprit", [
    (dict(chunk_memory=3, chunk_other=4), "chunk_memory"),
    (dict(read="later"), "read"),
    (dict(activation="swish2"), "activation"),
    (dict(chunk_other=0), "chunk_other"),
    (dict(impl="fast"), "impl"),
    (dict(targets="moving"), "targets"),
    (dict(inner_step="nlms"), "inner_step"),
    (dict(retain_to="one"), "retain_to"),
])
def test_bad_arguments_name_the_culprit(kwargs, culprit):
    x, q, w0, lb, rb = make_inputs(0, t_len=4)
    kw = dict(lr_max=LR_MAX, weights0=w0, lr_bias=lb, retain_bias=rb) | kwargs
    with pytest.raises(ValueError, match=culprit):
        self_referential_titans(x, q, **kw)


def test_initial_targets_and_retention_need_weights0():
    x, q, w0, lb, rb = make_inputs(0, t_len=4)
    with pytest.raises(ValueError, match="targets='initial' takes the targets from weights0"):
        self_referential_titans(x, q, initial_state=self_referential_init_state(w0, B), targets="initial",
                                lr_max=LR_MAX, lr_bias=lb, retain_bias=rb)
    with pytest.raises(ValueError, match="retain_to='initial' retains from weights0"):
        self_referential_titans(x, q, initial_state=self_referential_init_state(w0, B), retain_to="initial",
                                lr_max=LR_MAX, lr_bias=lb, retain_bias=rb)


def test_bad_shapes_name_the_argument():
    x, q, w0, lb, rb = make_inputs(0, t_len=4)
    kw = dict(lr_max=LR_MAX, weights0=w0, lr_bias=lb, retain_bias=rb)
    with pytest.raises(ValueError, match="q must"):
        self_referential_titans(x, q[..., :4], **kw)
    with pytest.raises(ValueError, match="retain_bias"):
        self_referential_titans(x, q, **(kw | dict(retain_bias=rb[:1])))
    with pytest.raises(ValueError, match=r"weights0\['lr'\] W_out"):
        self_referential_titans(x, q, **(kw | dict(weights0=w0 | {"lr": (w0["lr"][0], w0["k"][1])})))
    with pytest.raises(ValueError, match="weights0 must be a dict"):
        self_referential_titans(x, q, **(kw | dict(adaptive_q=True)))


# ---------------------------------------------------------------------------------------------
# Chunked default == recurrent == reference, values and gradients

def cfg_id(cfg):
    return ",".join(f"{k}={v}" for k, v in cfg.items()) or "default"


def _objective(o, state, r_o, r_w):
    """A scalar that reaches every output and every final weight."""
    leaves = jax.tree_util.tree_leaves(state)
    return jnp.sum(o * r_o) + sum(jnp.sum(w * r) for w, r in zip(leaves, jax.tree_util.tree_leaves(r_w)))


def _probe(cfg, seed=3):
    x, q, w0, lb, rb = make_inputs(seed, t_len=GRAD_T, adaptive_q=cfg.get("aq", False))
    rng = np.random.default_rng(seed + 100)
    r_o = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    r_w = jax.tree_util.tree_map(lambda w: jnp.asarray(rng.normal(size=(B,) + w.shape), jnp.float32), w0)
    return (x, q, w0, lb, rb), r_o, r_w


def op_grads(cfg, impl):
    args, r_o, r_w = _probe(cfg)

    def loss(x, q, w0, lb, rb):
        o, st = self_referential_titans(x, q, weights0=w0, lr_bias=lb, retain_bias=rb, impl=impl, **op_kwargs(cfg))
        return _objective(o, st, r_o, r_w), o

    (_, o), g = run_fast(jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True), *args)
    return o, g


def ref_grads(cfg):
    args, r_o, r_w = _probe(cfg)
    with jax.enable_x64(True):
        def loss(*a):
            o, st = reference(*a, **op_kwargs(cfg))
            return _objective(o, st, f64(r_o), f64(r_w)), o

        (_, o), g = jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True)(*f64(args))
        return np.asarray(o), jax.tree_util.tree_map(np.asarray, g)


def assert_grads_close(got, want, tol=TOL):
    names = ["x", "q", "weights0", "lr_bias", "retain_bias"]
    for name, a, b in zip(names, got, want):
        paths = jax.tree_util.tree_leaves_with_path(b)
        for (path, bb), aa in zip(paths, jax.tree_util.tree_leaves(a)):
            assert np.linalg.norm(bb) > 0, f"zero reference gradient {name}{jax.tree_util.keystr(path)}"
            assert rel_err(aa, bb) <= tol, f"grad {name}{jax.tree_util.keystr(path)}: {rel_err(aa, bb):.2e}"


GRAD_T = 11  # divides no chunk size used here
GRAD_CFGS = [
    # the default: memory chunks inside the generators' chunks, initial targets, normalised steps, DGD on both layers
    dict(cm=2, co=4, tg="initial", os="normalized", dgo=True),
    dict(cm=4, co=2, read="before_write", dgd=False, st=False),
    dict(cm=2, co=4, dgo=True),  # DGD on the output layers too
    dict(cm=4, co=4, read="chunk_start", aq=True),
    dict(cm=2, co=4, os="normalized"),  # HOPE.md's chunk targets with the normalised steps
    dict(cm=2, co=4, rt="initial", os="normalized", dgo=True),  # retention toward the initial weights
]
# The default suite checks one configuration; the others and the full sweep are slow.
GRAD_PARAMS = GRAD_CFGS[:1] + [pytest.param(c, marks=pytest.mark.slow) for c in GRAD_CFGS[1:]]
SWEEP = [dict(cm=cm, co=co, read=r, dgd=d, st=s) for (cm, co) in ((2, 4), (4, 4), (4, 2))
         for r in ("after_write", "before_write", "chunk_start") for d in (True, False) for s in (True, False)]
SWEEP += [dict(cm=cm, co=co, read=r, dgo=True) for (cm, co) in ((2, 4), (4, 2)) for r in ("after_write", "chunk_start")]
SWEEP += [dict(cm=cm, co=co, read=r, st=s, tg="initial") for (cm, co) in ((2, 4), (4, 2))
          for r in ("after_write", "before_write") for s in (True, False)]
SWEEP += [dict(cm=cm, co=co, os="normalized", dgo=d) for (cm, co) in ((2, 4), (4, 2)) for d in (True, False)]
SWEEP += [dict(cm=cm, co=co, rt="initial", read=r, dgd=d, dgo=d) for (cm, co) in ((2, 4), (4, 2))
          for r in ("after_write", "before_write", "chunk_start") for d in (True, False)]


def test_the_default_suites_gradient_case_is_the_layers_default():
    """GRAD_CFGS[0], whose chunked-vs-reference gradients the default suite checks, is the layer's default
    memory (`memory_config()`), at chunks short enough to compile quickly (as by default, the memory's chunks
    split the generators' chunks)."""
    from nlearn.models.self_referential import memory_config

    default = memory_config()
    want = {k: default[k] for k in ("lr_max", "activation", "dgd", "dgd_output", "read", "self_targets",
                                    "adaptive_q", "targets", "inner_step")}
    got = op_kwargs(GRAD_CFGS[0])
    assert {k: got[k] for k in want} == want
    for c in (got, default):
        assert c["chunk_memory"] < c["chunk_other"] and c["chunk_other"] % c["chunk_memory"] == 0


@pytest.mark.parametrize("cfg", GRAD_PARAMS, ids=cfg_id)
def test_chunked_matches_reference_values_and_gradients(cfg):
    o, g = op_grads(cfg, "chunked")
    o_ref, g_ref = ref_grads(cfg)
    q = np.asarray(_probe(cfg)[0][1])
    assert rel_err(np.asarray(o) - q, o_ref - q) <= TOL
    assert_grads_close(g, g_ref)


@pytest.mark.parametrize("cfg", [dict(cm=2, co=4, rt="initial", dgo=True),
                                 dict(cm=4, co=2, rt="initial", read="chunk_start", dgd=False)], ids=cfg_id)
def test_retention_toward_the_initial_weights_chunked_matches_reference(cfg):
    """`retain_to="initial"`: the chunked form (run on W − W_0) equals the reference's W_0 + retain (W − W_0) − …,
    outputs and final weights, over a length that divides neither grid; with every retain near 0 the memory
    returns to W_0 where retention toward zero empties it."""
    x, q, w0, lb, rb = make_inputs(4, t_len=13)
    o, state = sr_fast(x, q, weights0=w0, lr_bias=lb, retain_bias=rb, **op_kwargs(cfg))
    with jax.enable_x64(True):
        o_ref, w_ref = reference(*f64((x, q, w0, lb, rb)), **op_kwargs(cfg))
        o_ref, w_ref = np.asarray(o_ref), jax.tree_util.tree_map(np.asarray, w_ref)
    assert rel_err(np.asarray(o) - np.asarray(q), o_ref - np.asarray(q)) <= TOL
    for n in w_ref:
        for a, b in zip(state[n], w_ref[n]):
            assert rel_err(a, b) <= TOL, n
    forget = jnp.full_like(rb, -30.0)  # retain ~ 1e-13: each token keeps nothing of the last state
    tiny_lr = jnp.full_like(lb, -30.0)
    for retain_to, want in (("initial", w0), ("zero", None)):
        _, end = sr_fast(x, q, weights0=w0, lr_bias=tiny_lr, retain_bias=forget, **(op_kwargs(cfg) | dict(
            retain_to=retain_to)))
        for a, b in zip(end["memory"], want["memory"] if want else (0.0, 0.0)):
            np.testing.assert_allclose(np.asarray(a), np.broadcast_to(np.asarray(b), a.shape), atol=1e-6)


@pytest.mark.slow
def test_recurrent_gradients_match_chunked():
    cfg = GRAD_CFGS[1]
    _, g_c = op_grads(cfg, "chunked")
    _, g_r = op_grads(cfg, "recurrent")
    for a, b in zip(jax.tree_util.tree_leaves(g_r), jax.tree_util.tree_leaves(g_c)):
        assert rel_err(a, b) <= TOL


SWEEP_GRIDS = sorted({(c["cm"], c["co"]) for c in SWEEP})


@pytest.mark.slow
@pytest.mark.parametrize("grid", SWEEP_GRIDS, ids=lambda g: f"cm={g[0]},co={g[1]}")
def test_sweep_chunked_recurrent_reference(grid):
    """Every option combination of the sweep on one chunk grid (one test per grid, each combination named
    in its failure)."""
    for cfg in [c for c in SWEEP if (c["cm"], c["co"]) == grid]:
        o_c, g_c = op_grads(cfg, "chunked")
        o_r, g_r = op_grads(cfg, "recurrent")
        o_ref, g_ref = ref_grads(cfg)
        q = np.asarray(_probe(cfg)[0][1])
        try:
            for o in (o_c, o_r):
                assert rel_err(np.asarray(o) - q, o_ref - q) <= TOL, "output"
            assert_grads_close(g_c, g_ref)
            assert_grads_close(g_r, g_ref)
        except AssertionError as e:
            raise AssertionError(f"{cfg_id(cfg)}: {e}") from e


def test_every_initial_state_gets_a_gradient():
    """Full backprop: each memory's meta-learned initial weights (both layers) and both biases move the
    output alone (no loss on the final state), so none is cut off from learning."""
    cfg = dict(cm=2, co=4, aq=True)
    x, q, w0, lb, rb = make_inputs(5, adaptive_q=True)
    r_o = jnp.asarray(np.random.default_rng(9).normal(size=x.shape), jnp.float32)

    def loss(w0, lb, rb):
        o = self_referential_titans(x, q, weights0=w0, lr_bias=lb, retain_bias=rb, **op_kwargs(cfg))[0]
        return jnp.sum(o * r_o)

    g_w, g_lb, g_rb = run_fast(jax.grad(loss, argnums=(0, 1, 2)), w0, lb, rb)
    for n, pair in g_w.items():
        for layer, g in zip(("W_in", "W_out"), pair):
            assert float(jnp.linalg.norm(g)) > 1e-6 * float(jnp.linalg.norm(w0[n][0])), f"{n} {layer}"
    assert float(jnp.min(jnp.abs(g_lb))) > 0 and float(jnp.min(jnp.abs(g_rb))) > 0


# ---------------------------------------------------------------------------------------------
# Identities of docs/self_referential.md §1

def test_chunk_size_one_is_eqs_86_to_88():
    """Chunk sizes 1: every memory generates, targets and takes its gradient at θ_{t−1}, and
    read="before_write" reads M_memory,t−1(q_t): eqs. 86-88 token by token."""
    cfg = dict(cm=1, co=1, read="before_write")
    x, q, w0, lb, rb = make_inputs(6, t_len=9)
    o = sr_fast(x, q, weights0=w0, lr_bias=lb, retain_bias=rb, **op_kwargs(cfg))[0]
    with jax.enable_x64(True):
        o_ref = np.asarray(reference(*f64((x, q, w0, lb, rb)), **op_kwargs(cfg))[0])
    assert rel_err(np.asarray(o - q), o_ref - np.asarray(q)) <= TOL


def test_linear_memory_dgd_is_gated_delta_rule():
    """A linear memory M(z) = z W with DGD, chunk size 1 and ½-L2 loss is gated_delta_rule with a = retain,
    β = 2·lr/retain and values retain·v̂/2 (checked on the DGD write `dgd_write` the reference uses)."""
    rng = np.random.default_rng(7)
    t_len, dv = 12, 5
    k = rng.normal(size=(B, t_len, H, D))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    vhat = rng.normal(size=(B, t_len, H, dv))
    retain = rng.uniform(0.8, 1.0, size=(B, t_len, H))
    lr = LR_MAX * retain * rng.uniform(0.0, 1.0, size=(B, t_len, H))
    w = 0.3 * rng.normal(size=(B, H, D, dv))
    with jax.enable_x64(True):
        cur, outs = jnp.asarray(w), []
        for t in range(t_len):
            kt = jnp.asarray(k[:, t])
            grad = kt[..., :, None] * (EIN("bhd,bhdv->bhv", kt, cur) - vhat[:, t])[..., None, :]
            cur = dgd_write(cur, kt, grad, jnp.asarray(lr[:, t]), jnp.asarray(retain[:, t]))
            outs.append(EIN("bhd,bhdv->bhv", kt, cur))
        cur, outs = np.asarray(cur), np.stack(outs, 1)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    o, s = gated_delta_rule(f32(k), f32(k), f32(retain[..., None] * vhat / 2), f32(2 * lr / retain),
                            f32(np.log(retain)), initial_state=f32(w), impl="recurrent")
    assert rel_err(s, cur) <= TOL and rel_err(o, outs) <= TOL
    o, s = gated_delta_rule(f32(k), f32(k), f32(retain[..., None] * vhat / 2), f32(2 * lr / retain),
                            f32(np.log(retain)), initial_state=f32(w), chunk_size=4)
    assert rel_err(s, cur) <= TOL and rel_err(o, outs) <= TOL


def _fixed_generators(x, w0, lb, rb, f):
    """k, v, retain, lr of every token from the initial generator weights (chunk_other ≥ T), [B, T, H, ...]."""
    start = {n: tuple(jnp.broadcast_to(w, (x.shape[0],) + w.shape) for w in w0[n]) for n in w0}
    outs = [_generated(start, x[:, t], {"lr": lb, "retain": rb}, f) for t in range(x.shape[1])]
    return [jnp.stack(z, 1) for z in zip(*outs)]


def test_input_layer_is_gated_delta_rule():
    """With both chunks ≥ T every error is taken at the initial weights, and each memory's input layer
    is gated_delta_rule(a = retain, β = lr/retain, values −retain·δ) from W_in,0."""
    cfg = dict(cm=32, co=32)
    x, q, w0, lb, rb = make_inputs(8)
    _, state = sr_fast(x, q, weights0=w0, lr_bias=lb, retain_bias=rb, **op_kwargs(cfg))
    f, df = _act("gelu")
    deltas = {}
    with jax.enable_x64(True):
        x64, w64, lb64, rb64 = f64((x, w0, lb, rb))
        k, v, retain, lr = _fixed_generators(x64, w64, lb64, rb64, f)
        for n in ("k", "retain", "memory"):
            w_in, w_out = (jnp.broadcast_to(w, (B,) + w.shape) for w in w64[n])
            z = jnp.einsum("bthd,bhdf->bthf", k, w_in)
            pred = jnp.einsum("bthf,bhfo->btho", f(z), w_out)
            target = jnp.einsum("bthf,bhfo->btho", f(jnp.einsum("bthd,bhdf->bthf", v, w_in)), w_out)
            e = pred - target if n in SCALAR else pred + k - (v + target)
            deltas[n] = np.asarray(jnp.einsum("btho,bhfo->bthf", e, w_out) * df(z))
        k, retain, lr = (np.asarray(a) for a in (k, retain, lr))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    for n, delta in deltas.items():
        w_in = jnp.broadcast_to(w0[n][0], (B,) + w0[n][0].shape)
        _, s = gated_delta_rule(f32(k), f32(k), f32(-retain[..., None] * delta), f32(lr / retain),
                                f32(np.log(retain)), initial_state=w_in, chunk_size=8)
        assert rel_err(state[n][0], s) <= TOL, n


def test_memory_reduces_to_neural_memory():
    """chunk_other ≥ T, no self-targets, no DGD, read after write: the memory is neural_memory (residual,
    sgd, l2, mini-batch chunk_memory) on the generated k, v with lr and decay = 1 − retain."""
    cfg = dict(cm=4, co=32, st=False, dgd=False)
    x, q, w0, lb, rb = make_inputs(9)
    o, state = sr_fast(x, q, weights0=w0, lr_bias=lb, retain_bias=rb, **op_kwargs(cfg))
    f, _ = _act("gelu")
    with jax.enable_x64(True):
        k, v, retain, lr = (np.asarray(a) for a in _fixed_generators(*f64((x, w0, lb, rb)), f))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    o_nm, (theta, _) = neural_memory(q, f32(k), f32(v), lr=f32(lr), decay=f32(1 - retain), weights0=w0["memory"],
                                     residual=True, optimizer="sgd", objective="l2", minibatch=4)
    assert rel_err(o - q, o_nm - q) <= TOL
    assert rel_err(state["memory"][1], theta[1]) <= TOL


# ---------------------------------------------------------------------------------------------
# Causality, streaming, decoding

def test_causal():
    cfg = dict(cm=2, co=4)
    x, q, w0, lb, rb = make_inputs(10)
    def run(x, q):
        return sr_fast(x, q, weights0=w0, lr_bias=lb, retain_bias=rb, **op_kwargs(cfg))[0]

    o = run(x, q)
    cut = 10  # inside a chunk of both grids
    o2 = run(x.at[:, cut:].add(1.0), q.at[:, cut:].multiply(-1.0))
    np.testing.assert_array_equal(np.asarray(o[:, :cut]), np.asarray(o2[:, :cut]))
    assert float(jnp.abs(o[:, cut:] - o2[:, cut:]).max()) > 1e-3


@pytest.mark.parametrize("split, targets, retain_to", [(8, "chunk", "zero"), (7, "chunk", "zero"),
                                                      (7, "initial", "zero"), (7, "chunk", "initial")])
def test_stream_split_continues_exactly(split, targets, retain_to):
    """Split on a boundary of both grids (the weights dict resumes) and inside a chunk (the stream state)."""
    cfg = dict(cm=2, co=4, tg=targets, rt=retain_to)
    x, q, w0, lb, rb = make_inputs(11)
    kw = dict(lr_bias=lb, retain_bias=rb, **op_kwargs(cfg))
    o, state = sr_fast(x, q, weights0=w0, **kw)
    o1, st1 = sr_fast(x[:, :split], q[:, :split], weights0=w0, return_stream_state=split % 4 != 0, **kw)
    # the fixed initial weights of the targets or the retention
    more = dict(weights0=w0) if "initial" in (targets, retain_to) else {}
    o2, st2 = sr_fast(x[:, split:], q[:, split:], initial_state=st1, **more, **kw)
    tol = 1e-5 if retain_to == "zero" else 5e-5  # W − W_0 and back again rounds in float32
    assert rel_err(jnp.concatenate([o1, o2], 1) - q, o - q) <= tol
    for a, b in zip(jax.tree_util.tree_leaves(st2), jax.tree_util.tree_leaves(state)):
        assert rel_err(a, b) <= tol


@pytest.mark.parametrize("cfg", [dict(cm=2, co=4),
                                 pytest.param(dict(cm=4, co=2, read="before_write"), marks=pytest.mark.slow),
                                 pytest.param(dict(cm=2, co=4, read="chunk_start", aq=True), marks=pytest.mark.slow)],
                         ids=cfg_id)
def test_stream_with_static_positions_continues_exactly(cfg):
    """Pieces shorter than a period at positions known when tracing (the op computes only the chunks they
    touch, cut at both grids) continue the stream as the whole sequence does."""
    x, q, w0, lb, rb = make_inputs(13, t_len=11, adaptive_q=cfg.get("aq", False))
    kw = dict(lr_bias=lb, retain_bias=rb, **op_kwargs(cfg))
    o, state = sr_fast(x, q, weights0=w0, **kw)
    st = self_referential_init_state(w0, B)
    outs, pos = [], 0
    for size in (3, 1, 2, 3, 2):  # period 4: pieces start and end inside chunks of both grids
        def piece(x, q, weights, start, pos=pos % 4):
            init = SelfRefTitansState(weights, start, pos)
            return self_referential_titans(x, q, initial_state=init, return_stream_state=True, **kw)

        o_p, st = run_fast(piece, x[:, pos:pos + size], q[:, pos:pos + size], st.weights, st.start)
        outs.append(o_p)
        pos += size
    assert rel_err(jnp.concatenate(outs, 1) - q, o - q) <= 1e-5
    for a, b in zip(jax.tree_util.tree_leaves(st.weights), jax.tree_util.tree_leaves(state)):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("targets", ["chunk", pytest.param("initial", marks=pytest.mark.slow)])
def test_decode_after_chunked_prefill_equals_full_sequence(targets):
    cfg = dict(cm=2, co=4, tg=targets)
    x, q, w0, lb, rb = make_inputs(12, t_len=13)
    kw = dict(lr_bias=lb, retain_bias=rb, **op_kwargs(cfg))
    o, _ = sr_fast(x, q, weights0=w0, **kw)
    _, state = sr_fast(x[:, :5], q[:, :5], weights0=w0, return_stream_state=True, **kw)
    step = jax.jit(functools.partial(self_referential_titans_step, weights0=w0, **kw))
    outs = []
    for t in range(5, x.shape[1]):
        o_t, state = step(x[:, t], q[:, t], state=state)
        outs.append(o_t)
    assert rel_err(jnp.stack(outs, 1) - q[:, 5:], o[:, 5:] - q[:, 5:]) <= 1e-5


# ---------------------------------------------------------------------------------------------
# The write gate (`write_gate`, the layer's `memory.lr_gate`)

def make_gate(seed, t_len=GRAD_T):
    """[B, T, H] in [0, 1] with exact zeros and ones among the values."""
    g = np.random.default_rng(seed).uniform(-0.3, 1.3, size=(B, t_len, H))
    return jnp.asarray(np.clip(g, 0.0, 1.0), jnp.float32)


@pytest.mark.parametrize("cfg", [dict(cm=2, co=4), pytest.param(dict(cm=4, co=2, tg="initial", os="normalized",
                                                                     rt="initial", dgo=True), marks=pytest.mark.slow)],
                         ids=cfg_id)
def test_write_gate_chunked_and_recurrent_match_reference_values_and_gradients(cfg):
    args, r_o, r_w = _probe(cfg)
    gate = make_gate(5)

    def loss(impl):
        def fn(x, q, w0, lb, rb, g):
            o, st = self_referential_titans(x, q, weights0=w0, lr_bias=lb, retain_bias=rb, impl=impl, write_gate=g,
                                            **op_kwargs(cfg))
            return _objective(o, st, r_o, r_w), o
        return fn

    grads = {impl: run_fast(jax.value_and_grad(loss(impl), argnums=tuple(range(6)), has_aux=True), *args, gate)
             for impl in ("chunked", "recurrent")}
    with jax.enable_x64(True):
        def ref_loss(*a):
            o, st = reference(*a[:5], write_gate=a[5], **op_kwargs(cfg))
            return _objective(o, st, f64(r_o), f64(r_w)), o

        (_, o_ref), g_ref = jax.value_and_grad(ref_loss, argnums=tuple(range(6)), has_aux=True)(*f64(args + (gate,)))
        o_ref, g_ref = np.asarray(o_ref), jax.tree_util.tree_map(np.asarray, g_ref)
    for impl, ((_, o), g) in grads.items():
        assert rel_err(o, o_ref) <= TOL, impl
        assert_grads_close(g[:5], g_ref[:5])
        assert rel_err(g[5], g_ref[5]) <= TOL, f"{impl}: grad write_gate {rel_err(g[5], g_ref[5]):.2e}"


def test_a_closed_write_gate_leaves_every_memory_as_it_was():
    """Tokens written with strength 0 change no memory (retention included), however many follow, and the
    closed span is read from the state before it."""
    cfg = dict(cm=2, co=4, rt="initial", tg="initial")
    x, q, w0, lb, rb = make_inputs(14)
    kw = dict(weights0=w0, lr_bias=lb, retain_bias=rb, **op_kwargs(cfg))
    open_until = 8  # a boundary of both grids
    gate = jnp.ones((B, T, H), jnp.float32).at[:, open_until:].set(0.0)
    _, before = sr_fast(x[:, :open_until], q[:, :open_until], **kw)
    o, after = run_fast(lambda x, q, g: self_referential_titans(x, q, write_gate=g, **kw), x, q, gate)
    for a, b in zip(jax.tree_util.tree_leaves(after), jax.tree_util.tree_leaves(before)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    step = functools.partial(self_referential_titans_step, **kw)  # the read of a token that writes nothing
    o_read, _ = step(x[:, -1], q[:, -1], state=self_referential_init_state(before, B), write_gate_t=gate[:, -1])
    assert rel_err(o[:, -1] - q[:, -1], o_read - q[:, -1]) <= 1e-5


def test_write_gate_streams_and_decodes_as_the_full_sequence():
    cfg = dict(cm=2, co=4)
    x, q, w0, lb, rb = make_inputs(15, t_len=13)
    gate = make_gate(6, t_len=13)
    kw = dict(weights0=w0, lr_bias=lb, retain_bias=rb, **op_kwargs(cfg))

    def run(x, q, g, **more):
        return run_fast(lambda x, q, g: self_referential_titans(x, q, write_gate=g, **kw, **more), x, q, g)

    o, _ = run(x, q, gate)
    o1, state = run(x[:, :7], q[:, :7], gate[:, :7], return_stream_state=True)  # 7: inside a chunk of both grids
    o2, _ = run_fast(lambda x, q, g, s: self_referential_titans(x, q, write_gate=g, initial_state=s, **kw),
                     x[:, 7:10], q[:, 7:10], gate[:, 7:10], state)
    step = jax.jit(functools.partial(self_referential_titans_step, **kw))
    _, state = run(x[:, :10], q[:, :10], gate[:, :10], return_stream_state=True)
    outs = []
    for t in range(10, x.shape[1]):
        o_t, state = step(x[:, t], q[:, t], state=state, write_gate_t=gate[:, t])
        outs.append(o_t)
    got = jnp.concatenate([o1, o2, jnp.stack(outs, 1)], 1)
    assert rel_err(got - q, o - q) <= 1e-5


def test_a_write_gate_of_the_wrong_shape_names_it():
    x, q, w0, lb, rb = make_inputs(16)
    with pytest.raises(ValueError, match="write_gate must have shape"):
        self_referential_titans(x, q, weights0=w0, lr_bias=lb, retain_bias=rb, lr_max=LR_MAX,
                                write_gate=jnp.ones((B, T)))
