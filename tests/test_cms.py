"""The Continuum Memory System's update math (nlearn.layers.cms): per-period weights and
boundary-only updates, against plain token-by-token and position-by-position references."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nlearn.layers.cms import CMSLevel, ContinuumMemory, accumulate_and_update, swiglu_with_delta


def _level(d=8, width=12, seed=0):
    return CMSLevel(d, width, eps=1e-6, std=0.3, out_std=0.3, rngs=nnx.Rngs(params=seed))


def test_tokens_inside_a_period_see_the_periods_weights():
    """Segmented forward (T divides by no period) == each token through W0 + Δ[t // period] alone."""
    level, b, t, period = _level(), 2, 11, 4
    n = -(-t // period)
    keys = jax.random.split(jax.random.key(1), 4)
    h = jax.random.normal(keys[0], (b, t, 8))
    delta = {name: 0.3 * jax.random.normal(k, (n, b) + w.shape)
             for k, (name, w) in zip(keys[1:], level.weights0().items())}
    y = level(h, delta, period)
    w0 = level.weights0()
    seg = jnp.arange(t) // period
    w_BT = {name: w0[name] + jnp.swapaxes(delta[name][seg], 0, 1) for name in w0}  # [B, T, ...] per token

    def one_token(w, h_D):
        return h_D + swiglu_with_delta(w, None, level.norm(h_D[None]))[0]

    ref = jax.vmap(jax.vmap(one_token))(w_BT, h)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_levels_change_only_at_their_boundaries():
    """Walk 12 chunks of 2 tokens with random gradients: level ℓ's Δ moves only when its period
    divides the tokens seen, by −lr times the sum of that period's gradients."""
    periods, lrs, c = (2, 4, 8), (0.5, 0.25, 0.125), 2
    shape = {"gate": (1, 3, 2)}
    delta = [{"gate": jnp.zeros(shape["gate"])} for _ in periods]
    gsum = [{"gate": jnp.zeros(shape["gate"])} for _ in periods]
    history = [[np.zeros(shape["gate"]) for _ in periods]]
    pending = [np.zeros(shape["gate"]) for _ in periods]
    for i in range(12):
        grads = [{"gate": jax.random.normal(jax.random.key(10 * i + j), shape["gate"])} for j in range(3)]
        pos = (i + 1) * c
        delta, gsum = accumulate_and_update(delta, gsum, grads, lrs=lrs, periods=periods, pos=jnp.int32(pos))
        for j, period in enumerate(periods):
            pending[j] = pending[j] + np.asarray(grads[j]["gate"])
            expected = history[-1][j]
            if pos % period == 0:
                expected, pending[j] = expected - lrs[j] * pending[j], np.zeros(shape["gate"])
            np.testing.assert_allclose(np.asarray(delta[j]["gate"]), expected, rtol=1e-6, atol=1e-6)
            moved = not np.array_equal(np.asarray(delta[j]["gate"]), history[-1][j])
            assert moved == (pos % period == 0), (j, pos)
        history.append([np.asarray(d["gate"]) for d in delta])


def test_chain_order_and_gradient_reaches_theta0():
    """fast_first applies the shortest period first; with Δ fixed the outer gradient reaches θ0."""
    cms = ContinuumMemory(8, periods=(8, 2), widths=(4, 6), lrs=(0.1, 0.2), order="fast_first", eps=1e-6,
                          std=0.3, out_std=0.3, rngs=nnx.Rngs(params=0))
    assert cms.periods == (2, 8) and cms.lrs == (0.2, 0.1)
    assert cms.levels[0].weights0()["gate"].shape == (8, 6)
    h = jax.random.normal(jax.random.key(0), (1, 5, 8))
    deltas = [jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), d) for d in cms.zero_delta(1)]
    graphdef, state = nnx.split(cms)
    grads = jax.grad(lambda s: jnp.sum(nnx.merge(graphdef, s)(h, deltas) ** 2))(state)
    assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(grads))
