"""Stream a memory over a long sequence with every gate saturated and record its fast weights' norms.

The worst case of a write rule: the largest learning rate, the momentum gate at its maximum, no forgetting,
and keys that point alike (mean cosine >= 0.5, as SiLU-then-L2 keys do). Shared by the bounded-memory tests;
run as a script it prints, per memory and step form, the largest Frobenius norm the fast weights reach:

    .venv/bin/python tests/memory/saturated_stream.py
"""

from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from nlearn.memory.neural_memory import neural_memory
from nlearn.memory.self_referential import memory_names, self_referential_titans

D, HIDDEN = 8, 32  # head dim and the depth-2 memory's hidden width (expansion 4)
MOMENTUM_MAX = 0.99  # the momentum gate at its maximum (a sigmoid gate that reached 4.6)
PIECES = 16  # the stream is read in this many pieces; a norm is taken after each


def aligned_keys(rng, t_len: int, d: int = D, spread: float = 0.8):
    """Unit keys around one shared direction, `[1, T, 1, d]`: mean pairwise cosine ~0.6 for spread 0.8."""
    u = rng.normal(size=d)
    k = u / np.linalg.norm(u) + spread * rng.normal(size=(t_len, d)) / np.sqrt(d)
    return (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32)[None, :, None, :]


def mean_cosine(k) -> float:
    k = np.asarray(k).reshape(-1, k.shape[-1])[:512]
    c = k @ k.T
    n = len(k)
    return float((c.sum() - n) / (n * (n - 1)))


def stream_inputs(seed: int = 0, t_len: int = 16384, d: int = D):
    """(q, k, v): aligned unit keys read back as queries, values SiLU of unit normals (the layer's v)."""
    rng = np.random.default_rng(seed)
    k = aligned_keys(rng, t_len, d)
    v = np.asarray(jax.nn.silu(rng.normal(size=k.shape).astype(np.float32)))
    return k, k, v


def titans_weights(depth: int, seed: int = 0, d: int = D, out_scale: float = 1.0):
    """Each layer ~ N(0, 1/fan-in) (the layer's init), the last at `out_scale` x that (a large output layer, as
    the outer loop can learn, multiplies the curvature of the layers before it by ~out_scale²)."""
    rng = np.random.default_rng(seed + 100)
    dims = [d] + [HIDDEN] * (depth - 1) + [d]
    return tuple(((out_scale if i == depth - 1 else 1.0) * rng.normal(size=(1, a, b)) / np.sqrt(a)).astype(np.float32)
                 for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])))


@functools.cache
def _titans_runner(depth: int, minibatch: int, inner_step: str, t_len: int):
    piece = t_len // PIECES

    def run(q, k, v, lr, mu, w0):
        theta = tuple(jnp.broadcast_to(w, (1,) + w.shape) for w in w0)
        state = (theta, tuple(jnp.zeros_like(w) for w in theta))

        def body(state, x):
            q_, k_, v_, lr_, mu_ = x
            _, state = neural_memory(q_, k_, v_, lr=lr_, momentum=mu_, initial_state=state, minibatch=minibatch,
                                     inner_step=inner_step)
            return state, jnp.sqrt(jnp.stack([jnp.sum(jnp.square(w)) for w in state[0]]))

        split = lambda x: jnp.moveaxis(x.reshape((1, PIECES, piece) + x.shape[2:]), 1, 0)  # noqa: E731
        _, norms = jax.lax.scan(body, state, tuple(split(x) for x in (q, k, v, lr, mu)))
        return norms  # [PIECES, depth]

    return jax.jit(run)


def titans_norms(depth: int, minibatch: int, inner_step: str, max_lr: float, *, t_len: int = 16384,
                 seed: int = 0, momentum: float = MOMENTUM_MAX, out_scale: float = 1.0):
    """Frobenius norm of each layer's fast weights after each of `PIECES` pieces, `[PIECES, depth]`
    (non-finite once they overflow), streaming with lr = max_lr and μ = `momentum` at every token."""
    q, k, v = stream_inputs(seed, t_len)
    gate = np.ones((1, t_len, 1), np.float32)
    run = _titans_runner(depth, minibatch, inner_step, t_len)
    return np.asarray(run(q, k, v, max_lr * gate, momentum * gate, titans_weights(depth, seed, out_scale=out_scale)))


SATURATED_BIAS = 10.0  # lr and retain biases: sigmoid(10) ~ 1, so lr_t ~ lr_max and retain_t ~ 1 (no forgetting)


def selfref_weights(seed: int = 0, d: int = D, hidden: int = D, out_scale: float = 3.0):
    """The layer's initial weights (W_in ~ N(0, 1/D), W_out ~ N(0, 0.02²)) with W_out at `out_scale` x its init."""
    rng = np.random.default_rng(seed + 200)
    return {name: ((rng.normal(size=(1, d, hidden)) / np.sqrt(d)).astype(np.float32),
                   (out_scale * 0.02 * rng.normal(size=(1, hidden, 1 if name in ("lr", "retain") else d)))
                   .astype(np.float32)) for name in memory_names()}


@functools.cache
def _selfref_runner(options: tuple, t_len: int):
    piece = t_len // PIECES
    opts = dict(options)

    def run(x, w0):
        bias = jnp.full((1,), SATURATED_BIAS)

        def body(weights, xp):
            _, weights = self_referential_titans(xp, xp, weights0=w0, initial_state=weights, lr_bias=bias,
                                                 retain_bias=bias, **opts)
            norms = jnp.stack([jnp.sqrt(jnp.sum(jnp.square(w))) for pair in weights.values() for w in pair])
            return weights, norms

        state0 = {n: tuple(jnp.broadcast_to(w, (1,) + w.shape) for w in pair) for n, pair in w0.items()}
        split = jnp.moveaxis(x.reshape((1, PIECES, piece) + x.shape[2:]), 1, 0)
        return jax.lax.scan(body, state0, split)[1]  # [PIECES, 2 x memories]

    return jax.jit(run)


def selfref_norms(*, t_len: int = 16384, seed: int = 0, **options):
    """Frobenius norms of every memory's W_in and W_out after each piece, `[PIECES, 2 x memories]`, streaming
    aligned inputs (x = q) with lr_t ~ lr_max and retain_t ~ 1; `options` go to `self_referential_titans`."""
    x = stream_inputs(seed, t_len)[1]
    return np.asarray(_selfref_runner(tuple(sorted(options.items())), t_len)(x, selfref_weights(seed)))


def summary(norms) -> str:
    n = np.asarray(norms)
    return "nan/inf" if not np.all(np.isfinite(n)) else f"{n.max():.3g}"


def main(argv) -> None:
    t_len = int(argv[1]) if len(argv) > 1 else 16384
    print(f"keys' mean cosine {mean_cosine(stream_inputs(0, 2048)[1][0, :, 0]):.2f}; {t_len} tokens, "
          f"momentum {MOMENTUM_MAX}, no forgetting; max Frobenius norm of the fast weights")
    print("| depth | b | inner_step | max_lr | max norm | s |")
    print("|---|---|---|---|---|---|")
    for depth, lr_paper in ((1, 0.04), (2, 0.01)):
        for b in (1, 16):
            for step, lr in (("paper", lr_paper), ("mean", lr_paper * 16), ("ema", lr_paper), ("normalized", lr_paper),
                             ("mean+ema", 1.0), ("mean+normalized", 1.0), ("bounded", 1.0), ("bounded", 0.5)):
                t0 = time.perf_counter()
                n = titans_norms(depth, b, step, lr, t_len=t_len)
                print(f"| {depth} | {b} | {step} | {lr} | {summary(n)} | {time.perf_counter() - t0:.1f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv)
