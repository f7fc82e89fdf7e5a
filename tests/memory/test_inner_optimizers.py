"""Inner optimizer and objective registries: the update formulas, name lookup, plugging in new ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nlearn.memory.inner_optimizers import (
    INNER_OPTIMIZERS,
    InnerOptimizer,
    get_inner_optimizer,
    linear_optimizer,
)
from nlearn.memory.neural_memory import neural_memory
from nlearn.memory.objectives import OBJECTIVES, get_objective, output_grad


def _nm(q, k, v, lr, w, **kw):
    """neural_memory compiled at LLVM -O0 (these tiny programs compile ~3x faster, same float math)."""
    fn = lambda q, k, v, lr, w: neural_memory(q, k, v, lr=lr, weights0=w, **kw)
    fast = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    return jax.jit(fn).lower(q, k, v, lr, w).compile(fast)(q, k, v, lr, w)


def _gate(x):
    return jnp.full((1, 1, 1, 1), x, jnp.float32)


def test_registries_and_unknown_names():
    assert {"momentum", "sgd", "dgd", "dgd_momentum"} <= set(INNER_OPTIMIZERS)
    assert {"l2", "dot", "huber"} <= set(OBJECTIVES)
    with pytest.raises(ValueError, match=r"\['dgd', 'dgd_momentum', 'momentum', 'sgd'\]"):
        get_inner_optimizer("adamw")
    with pytest.raises(ValueError, match=r"\['dot', 'huber', 'l2'\]"):
        get_objective("cosine")
    custom = linear_optimizer("mine", momentum=True, precondition=False)
    assert get_inner_optimizer(custom) is custom
    assert get_objective(OBJECTIVES["dot"]) is OBJECTIVES["dot"]


def test_momentum_step_is_the_seed_example():
    """W = 2, U = 0.2, g = −0.4, μ = 0.5, η = 0.1, α = 0.1: U = 0.14, W = 0.9·2 + 0.14 = 1.94."""
    step = INNER_OPTIMIZERS["momentum"].step
    (w,), (u,) = step((_gate(2.0),), (_gate(0.2),), (_gate(-0.4),), (jnp.ones((1, 1, 1)),),
                      _gate(0.1), _gate(0.5), _gate(0.9))
    np.testing.assert_allclose(float(u.ravel()[0]), 0.14, atol=1e-7)
    np.testing.assert_allclose(float(w.ravel()[0]), 1.94, atol=1e-7)


def test_sgd_step_leaves_momentum_alone():
    step = INNER_OPTIMIZERS["sgd"].step
    (w,), (u,) = step((_gate(2.0),), (_gate(0.2),), (_gate(-0.4),), (jnp.ones((1, 1, 1)),),
                      _gate(0.1), _gate(0.0), _gate(0.9))
    np.testing.assert_allclose(float(w.ravel()[0]), 0.9 * 2.0 + 0.04, atol=1e-7)
    np.testing.assert_allclose(float(u.ravel()[0]), 0.2, atol=0)


# The update rules written out independently (float64 NumPy, one layer of a [d_in, d_out] memory):
# name -> (W', U') from W, U, gradient g, layer input x and the gates η, μ, a = 1 − α.
def _np_momentum(w, u, g, x, eta, mu, a):
    u = mu * u - eta * g
    return a * w + u, u


def _np_sgd(w, u, g, x, eta, mu, a):
    return a * w - eta * g, u


def _np_dgd(w, u, g, x, eta, mu, a):  # Nested Learning eq. 88 for row vectors: no momentum buffer
    return (a * np.eye(len(x)) - eta * np.outer(x, x)) @ w - eta * g, u


def _np_dgd_momentum(w, u, g, x, eta, mu, a):
    u = mu * u - eta * g
    return (a * np.eye(len(x)) - eta * np.outer(x, x)) @ w + u, u


NP_STEPS = {"momentum": _np_momentum, "sgd": _np_sgd, "dgd": _np_dgd, "dgd_momentum": _np_dgd_momentum}
FLAGS = {"momentum": (True, False), "sgd": (False, False), "dgd": (False, True), "dgd_momentum": (True, True)}


def _check_step(step, np_step):
    """Two layers, two heads, per-head gates: the jax step against the float64 formula."""
    rng = np.random.default_rng(0)
    shapes = ((1, 2, 3, 5), (1, 2, 5, 2))
    w, u, g = ([rng.normal(size=s) for s in shapes] for _ in range(3))
    x = [rng.normal(size=s[:-1]) for s in shapes]
    eta, mu, a = (rng.uniform(lo, hi, size=(1, 2, 1, 1)) for lo, hi in ((0.1, 0.4), (0.3, 0.9), (0.8, 1.0)))
    f32 = lambda xs: tuple(jnp.asarray(z, jnp.float32) for z in xs)  # noqa: E731
    w_new, u_new = step(f32(w), f32(u), f32(g), f32(x), *f32((eta, mu, a)))
    for i in range(2):
        for h in range(2):
            gates = (eta[0, h, 0, 0], mu[0, h, 0, 0], a[0, h, 0, 0])
            w_ref, u_ref = np_step(w[i][0, h], u[i][0, h], g[i][0, h], x[i][0, h], *gates)
            np.testing.assert_allclose(w_new[i][0, h], w_ref, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(u_new[i][0, h], u_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(NP_STEPS))
def test_registry_steps_match_the_written_out_formulas(name):
    """Each registered optimizer's step and flags against its formula; dgd (eq. 88) has no momentum."""
    opt = INNER_OPTIMIZERS[name]
    assert set(INNER_OPTIMIZERS) == set(NP_STEPS)
    assert (opt.momentum, opt.precondition) == FLAGS[name]
    _check_step(opt.step, NP_STEPS[name])


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_linear_optimizer_flags_give_the_formulas(name):
    """`linear_optimizer`'s two flags build each of the four update rules."""
    momentum, precondition = FLAGS[name]
    _check_step(linear_optimizer("mine", momentum=momentum, precondition=precondition).step, NP_STEPS[name])


def test_objective_gradients():
    pred = jnp.asarray([[0.0, 2.5, -3.0]])
    target = jnp.asarray([[0.5, 0.0, 0.0]])
    np.testing.assert_allclose(output_grad(OBJECTIVES["l2"], pred, target), pred - target)
    np.testing.assert_allclose(output_grad(OBJECTIVES["dot"], pred, target), -target)
    np.testing.assert_allclose(output_grad(OBJECTIVES["huber"], pred, target), [[-0.5, 1.0, -1.0]])


def _inputs(t_len=9, seed=0):
    rng = np.random.default_rng(seed)
    b, h, d = 1, 2, 4
    k = rng.normal(size=(b, t_len, h, d))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q, v = rng.normal(size=(2, b, t_len, h, d))
    lr = rng.uniform(0.05, 0.3, size=(b, t_len, h))
    w = (rng.normal(size=(h, d, 8)) / 2, rng.normal(size=(h, 8, d)) / 3)
    cast = lambda x: jnp.asarray(x, jnp.float32)
    return cast(q), cast(k), cast(v), cast(lr), tuple(cast(x) for x in w)


def test_plug_in_a_recurrent_only_optimizer():
    """A new optimizer is one step function; without a chunked form it runs token by token."""

    def sign_step(theta, U, grads, inputs, eta, mu, a):
        return tuple(a * w - eta * jnp.sign(g) for w, g in zip(theta, grads)), U

    sign_sgd = InnerOptimizer("sign_sgd", sign_step, momentum=False, chunkable=False)
    q, k, v, lr, w = _inputs()
    o_rec, _ = _nm(q, k, v, lr, w, optimizer=sign_sgd, impl="recurrent")
    o_fast, _ = _nm(q, k, v, lr, w, optimizer=sign_sgd, minibatch=1)
    np.testing.assert_allclose(o_fast, o_rec, rtol=0, atol=1e-5)
    o_mb, _ = _nm(q, k, v, lr, w, optimizer=sign_sgd, minibatch=4, impl="recurrent")
    assert np.max(np.abs(np.asarray(o_mb) - np.asarray(o_rec))) > 1e-4  # the schedule matters
    with pytest.raises(ValueError, match="no chunked form"):
        _nm(q, k, v, lr, w, optimizer=sign_sgd, minibatch=4)


def test_plug_in_an_objective_callable():
    q, k, v, lr, w = _inputs(seed=1)

    def half_squared(pred, target):
        return 0.5 * jnp.sum((pred - target) ** 2, axis=-1)

    o_fn, _ = _nm(q, k, v, lr, w, objective=half_squared, minibatch=4)
    o_l2, _ = _nm(q, k, v, lr, w, objective="l2", minibatch=4)
    np.testing.assert_allclose(o_fn, o_l2, rtol=0, atol=1e-6)
