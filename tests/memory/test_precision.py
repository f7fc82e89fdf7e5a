"""Matmul precision of the MLP memory ops (neural_memory, its decode step, mlp_apply, ttt_mlp).

They pass `precision` (default HIGHEST) to every matmul, so chunked == recurrent holds in float32 on
GPU/TPU too, whatever `jax.default_matmul_precision` says. On CPU that setting may change nothing,
so besides running the equivalences under it, every `dot_general` of the traced programs (forward
and gradient) is checked to carry HIGHEST: a matmul that forgets `precision=` fails here.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from nlearn.memory.neural_memory import init_state, mlp_apply, neural_memory, neural_memory_step
from nlearn.memory.ttt_mlp import ttt_mlp, ttt_mlp_init_state, ttt_mlp_step

B, T, H, D, F = 1, 11, 2, 4, 8
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    q, k = (f32(unit(rng.normal(size=(B, T, H, D)))) for _ in range(2))
    v = f32(rng.normal(size=(B, T, H, D)))
    lr, mu, alpha = (f32(rng.uniform(lo, hi, size=(B, T, H))) for lo, hi in ((0.05, 0.3), (0.2, 0.8), (0.0, 0.05)))
    w = (f32(rng.normal(size=(H, D + 1, F)) / 2), f32(rng.normal(size=(H, F + 1, D)) / 3))  # bias rows
    ttt = dict(W1_0=f32(0.3 * rng.normal(size=(H, D, F))), b1_0=f32(0.1 * rng.normal(size=(H, F))),
               W2_0=f32(0.3 * rng.normal(size=(H, F, D))), b2_0=f32(0.1 * rng.normal(size=(H, D))),
               ln_scale=f32(1.0 + 0.2 * rng.normal(size=(H, D))), ln_bias=f32(0.1 * rng.normal(size=(H, D))))
    return (q, k, v, lr, mu, alpha, w), ttt


# Every inner-model option at once: DGD with momentum and decay (every term of the dual form), biases,
# the output LayerNorm and the residual.
OPTIONS = dict(optimizer="dgd_momentum", bias=True, residual=True)


def _ln(seed=5):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(1.0 + 0.2 * rng.normal(size=(H, D)), jnp.float32),
            jnp.asarray(0.1 * rng.normal(size=(H, D)), jnp.float32))


def _memory(impl, minibatch):
    """A scalar of neural_memory's outputs and final weights, and the outputs."""

    def fn(q, k, v, lr, mu, alpha, w):
        o, (theta, _) = neural_memory(q, k, v, lr=lr, momentum=mu, decay=alpha, weights0=w, minibatch=minibatch,
                                      impl=impl, layer_norm=_ln(), **OPTIONS)
        return jnp.sum(jnp.sin(o)) + sum(jnp.sum(t) for t in theta), o
    return fn


def _ttt(impl, ttt):
    def fn(q, k, v, lr):
        o, st = ttt_mlp(q, k, v, lr, minibatch=4, impl=impl, remat_group=1, **ttt)
        return jnp.sum(jnp.sin(o)) + jnp.sum(st.weights.W1), o
    return fn


def _step(q, k, v, lr, mu, alpha, w):
    o, st = neural_memory_step(q[:, 0], k[:, 0], v[:, 0], lr=lr[:, 0], momentum=mu[:, 0], decay=alpha[:, 0],
                               state=init_state(w, B), minibatch=4, layer_norm=_ln(), **OPTIONS)
    return jnp.sum(o) + sum(jnp.sum(t) for t in st.theta), o


def _ttt_step(ttt):
    def fn(q, k, v, lr):
        st = ttt_mlp_init_state(ttt["W1_0"], ttt["b1_0"], ttt["W2_0"], ttt["b2_0"], B)
        o, st = ttt_mlp_step(q[:, 0], k[:, 0], v[:, 0], lr[:, 0], st, ln_scale=ttt["ln_scale"],
                             ln_bias=ttt["ln_bias"], minibatch=4)
        return jnp.sum(o) + jnp.sum(st.weights.W2), o
    return fn


def _read(q, k, v, lr, mu, alpha, w):
    theta = tuple(jnp.broadcast_to(x, (B,) + x.shape) for x in w)
    o = mlp_apply(theta, jnp.swapaxes(q, 1, 2), bias=True, residual=True, layer_norm=_ln())
    return jnp.sum(o), o


def _sub_jaxprs(value):
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def _dot_precisions(jaxpr):
    """The precision of every dot_general in `jaxpr` and the jaxprs nested in it (scan, remat, ...)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            p = eqn.params["precision"]
            yield p if isinstance(p, tuple) else (p, p)
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from _dot_precisions(sub)


PROGRAMS = {
    "chunked": (_memory("chunked", 4), 7),
    "chunked_b1": (_memory("chunked", 1), 7),
    "recurrent": (_memory("recurrent", 4), 7),
    "step": (_step, 7),
    "mlp_apply": (_read, 7),
    "ttt_mlp_dual": (None, 4),
    "ttt_mlp_recurrent": (None, 4),
    "ttt_mlp_step": (None, 4),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_every_matmul_is_highest(name):
    """Forward and gradient: every dot_general carries Precision.HIGHEST on both operands."""
    args, ttt = _inputs()
    fn, n_args = PROGRAMS[name]
    if name.startswith("ttt_mlp"):
        fn = _ttt_step(ttt) if name == "ttt_mlp_step" else _ttt(name.split("_")[-1], ttt)
    args = args[:n_args]
    grad = jax.grad(fn, argnums=tuple(range(n_args)), has_aux=True)
    found = []
    for program in (lambda *a: fn(*a)[1], grad):
        precisions = list(_dot_precisions(jax.make_jaxpr(program)(*args).jaxpr))
        assert precisions, "no matmul found"
        found += precisions
    bad = [p for p in found if p != (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)]
    assert not bad, f"{len(bad)} of {len(found)} matmuls not HIGHEST: {bad[:3]}"


def _run(fn, *args):
    return jax.jit(fn).lower(*args).compile(FAST_COMPILE)(*args)


def test_equivalences_hold_under_bfloat16_default_precision():
    """chunked == recurrent (neural_memory with every inner-model option, gradients) and dual ==
    recurrent (ttt_mlp) with the process-wide default at bfloat16: the ops pass HIGHEST themselves."""
    args, ttt = _inputs(seed=1)
    with jax.default_matmul_precision("bfloat16"):
        grads = {impl: _run(jax.grad(_memory(impl, 4), argnums=(0, 1, 3, 6), has_aux=True), *args)
                 for impl in ("chunked", "recurrent")}
        ttt_o = {impl: _run(functools.partial(lambda impl, *a: _ttt(impl, ttt)(*a)[1], impl), *args[:4])
                 for impl in ("dual", "recurrent")}
    for a, b in zip(jax.tree_util.tree_leaves(grads["chunked"]), jax.tree_util.tree_leaves(grads["recurrent"])):
        np.testing.assert_allclose(a, b, rtol=3e-4, atol=3e-5)
    np.testing.assert_allclose(ttt_o["dual"], ttt_o["recurrent"], rtol=3e-4, atol=3e-5)
