"""self_referential_titans: chunked == recurrent == an independent float64 per-token reference written
from HOPE.md §1 (values and gradients), the identities HOPE.md pins, causality, streaming and decode."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nlearn.memory import (
    SelfRefTitansState,
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


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---------------------------------------------------------------------------------------------
# Independent float64 reference: HOPE.md §1 token by token, explicit outer products.

def _act(name):
    """(σ, σ'); gelu is the tanh approximation, written out; σ' by forward-mode autodiff of σ."""
    c = np.sqrt(2.0 / np.pi)
    f = {"gelu": lambda z: 0.5 * z * (1.0 + jnp.tanh(c * (z + 0.044715 * z**3))),
         "tanh": jnp.tanh, "identity": lambda z: z}[name]
    return f, lambda z: jax.jvp(f, (z,), (jnp.ones_like(z),))[1]


def reference(x, q, weights0, lr_bias, retain_bias, *, lr_max=LR_MAX, chunk_memory, chunk_other, activation="gelu",
              dgd=True, read="after_write", self_targets=True, adaptive_q=False):
    """o [B, T, H, D] and the final weights; call it under `jax.enable_x64(True)` with float64 inputs."""
    f, df = _act(activation)
    bsz, t_len = x.shape[:2]
    names = ("k", "v", "lr", "retain") + (("q",) if adaptive_q else ()) + ("memory",)
    bias = {"lr": lr_bias, "retain": retain_bias}
    ein = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)

    def mem(n, w, z):  # z [B, H, D]
        y = ein("bhf,bhfo->bho", f(ein("bhd,bhdf->bhf", z, w[0])), w[1])
        return y[..., 0] + bias[n] if n in SCALAR else z + y

    def unit(z):
        return z / jnp.sqrt(jnp.sum(z * z, -1, keepdims=True))

    weights = {n: tuple(jnp.broadcast_to(w, (bsz,) + w.shape) for w in weights0[n]) for n in names}
    start, outs = {}, []
    for t in range(t_len):
        for n in names:
            if t % (chunk_memory if n == "memory" else chunk_other) == 0:
                start[n] = weights[n]
        xt, qt = x[:, t], q[:, t]
        k = unit(mem("k", start["k"], xt))
        v = mem("v", start["v"], xt)
        retain = jax.nn.sigmoid(mem("retain", start["retain"], xt))[..., None, None]
        lr = lr_max * retain * jax.nn.sigmoid(mem("lr", start["lr"], xt))[..., None, None]
        if adaptive_q:
            qt = unit(mem("q", start["q"], qt))
        new = {}
        for n in names:
            w_in, w_out = start[n]
            z = ein("bhd,bhdf->bhf", k, w_in)
            target = mem(n, start[n], v) if (self_targets or n in SCALAR) else v
            e = mem(n, start[n], k) - target
            e = e[..., None] if n in SCALAR else e
            delta = ein("bho,bhfo->bhf", e, w_out) * df(z)
            g_in = k[..., :, None] * delta[..., None, :]
            g_out = f(z)[..., :, None] * e[..., None, :]
            cur_in, cur_out = weights[n]
            new_in = retain * cur_in - lr * g_in
            if dgd:
                new_in = new_in - lr * k[..., :, None] * ein("bhd,bhdf->bhf", k, cur_in)[..., None, :]
            new[n] = (new_in, retain * cur_out - lr * g_out)
        state = {"after_write": new, "before_write": weights, "chunk_start": start}[read]["memory"]
        outs.append(mem("memory", state, qt))
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
                activation=cfg.get("act", "gelu"), dgd=cfg.get("dgd", True), read=cfg.get("read", "after_write"),
                self_targets=cfg.get("st", True), adaptive_q=cfg.get("aq", False))


def ref_kwargs(cfg):
    kw = op_kwargs(cfg)
    return kw


# ---------------------------------------------------------------------------------------------
# Recurrent twin vs the reference

RECURRENT_CFGS = [
    dict(read="after_write"),
    dict(read="before_write", dgd=False, cm=4, co=2),
    dict(read="chunk_start", st=False, aq=True, act="tanh"),
]


@pytest.mark.parametrize("cfg", RECURRENT_CFGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_recurrent_matches_reference(cfg):
    x, q, w0, lb, rb = make_inputs(1, adaptive_q=cfg.get("aq", False))
    o, state = run_fast(lambda *a: self_referential_titans(*a[:2], weights0=a[2], lr_bias=a[3], retain_bias=a[4],
                                                           impl="recurrent", **op_kwargs(cfg)), x, q, w0, lb, rb)
    with jax.enable_x64(True):
        o_ref, w_ref = reference(*f64((x, q, w0, lb, rb)), **ref_kwargs(cfg))
        o_ref, w_ref = np.asarray(o_ref), jax.tree_util.tree_map(np.asarray, w_ref)
    assert np.all(np.isfinite(o_ref)) and np.abs(np.asarray(o) - np.asarray(q)).max() > 1e-3
    assert rel_err(o - q, o_ref - np.asarray(q)) <= TOL  # the memory's part of o (o = q + ...)
    for n in w_ref:
        for a, b in zip(state[n], w_ref[n]):
            assert rel_err(a, b) <= TOL, n


def test_step_equals_sequence_across_both_grids():
    cfg = dict(cm=2, co=4)
    x, q, w0, lb, rb = make_inputs(2, t_len=11)
    o, _ = self_referential_titans(x, q, weights0=w0, lr_bias=lb, retain_bias=rb, impl="recurrent", **op_kwargs(cfg))
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
])
def test_bad_arguments_name_the_culprit(kwargs, culprit):
    x, q, w0, lb, rb = make_inputs(0, t_len=4)
    kw = dict(lr_max=LR_MAX, weights0=w0, lr_bias=lb, retain_bias=rb) | kwargs
    with pytest.raises(ValueError, match=culprit):
        self_referential_titans(x, q, **kw)


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
