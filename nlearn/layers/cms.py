"""The Continuum Memory System (docs/self_referential.md §2): a chain of pre-norm residual SwiGLU levels whose
weights `θ_ℓ = θ_ℓ,0 + Δ_ℓ` keep learning in context, level ℓ every `C_ℓ` tokens.

`θ_ℓ,0` are parameters (the outer optimizer learns them); `Δ_ℓ` is per-sequence state that the
model (`nlearn.models.hope`) carries. The update math is pure functions over plain pytrees:
a level's `Δ` is `{"gate", "up", "down"}` with the kernels' shapes and a leading batch axis (and,
in the parallel pass, a leading segment axis: one `Δ` per period of the level).

A chunk's gradient w.r.t. a kernel used on every token is a sum of outer products, `Σ_t x_t ⊗ δ_t` of the
kernel's inputs and the loss's gradients at its outputs, so the first pass hands the parallel pass these
per-token factors (`{"z", "a", "gate", "up", "down"}`: `[B, T, D]`, `[B, T, F]` and the gradients at the
three outputs) instead of one weight-sized `Δ` per chunk; the parallel pass rebuilds each period's `Δ` from
them inside the (rematerialised) layer, so no layer's `Δ` stack outlives its own forward or backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nlearn.layers.core import RMSNorm, SwiGLU

UPDATES = ("ntp", "none")  # "ntp": Δ learns by the next-token loss; "none": a static chain
ORDERS = ("fast_first", "slow_first")  # the order the levels apply in, by period
KERNELS = ("gate", "up", "down")


def swiglu_with_delta(w0: dict, delta: dict | None, z, probe: dict | None = None, with_hidden: bool = False):
    """`(silu(z Wg) * z Wu) Wd` with `W = W0 + Δ`. `z [..., T, D]`; `w0` kernels `[D, F]` /
    `[F, D]`; `delta` kernels with the leading dims of `z` before T (`[..., D, F]`), or None. `probe[kernel]`
    is added to that kernel's output (its gradient is the loss's there); `with_hidden` also returns the down
    kernel's input `a`."""

    def mm(a, name):
        y = a @ w0[name].astype(a.dtype)
        if delta is not None:
            y = y + jnp.einsum("...td,...df->...tf", a, delta[name].astype(a.dtype))
        return y if probe is None else y + probe[name].astype(y.dtype)

    hidden = jax.nn.silu(mm(z, "gate")) * mm(z, "up")
    out = mm(hidden, "down")
    return (out, hidden) if with_hidden else out


def segment_apply(fn, z_BTD, delta_NB, period: int):
    """Apply `fn(z [B, N, P, D], delta [B, N, ...]) -> [B, N, P, D']` with segment n of `period`
    tokens using `delta_NB[n]` (leaves `[N, B, ...]`); T is padded up to N * period and cut back."""
    b, t, d = z_BTD.shape
    n = delta_NB[KERNELS[0]].shape[0]
    if n * period < t:
        raise ValueError(f"delta has {n} segments of {period} tokens, fewer than the {t} tokens of z")
    z = jnp.pad(z_BTD, ((0, 0), (0, n * period - t), (0, 0))).reshape(b, n, period, d)
    y = fn(z, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), delta_NB))
    return y.reshape(b, n * period, -1)[:, :t]


def factor_grads(factors: dict) -> dict:
    """The weight gradients `{"gate", "up", "down"}` of per-token factors (leaves `[..., T, ·]`): `Σ_t x_t ⊗ δ_t`
    with x the kernel's input (`z` for gate and up, `a` for down) and δ the gradient at its output."""
    def outer(x, g):
        return jnp.einsum("...td,...tf->...df", x.astype(jnp.float32), g.astype(jnp.float32))

    return {"gate": outer(factors["z"], factors["gate"]), "up": outer(factors["z"], factors["up"]),
            "down": outer(factors["a"], factors["down"])}


def deltas_from_factors(factors: dict, *, period: int, n_segments: int, lr, decay: float, dtype):
    """One `Δ` per period (leaves `[n_segments, B, ...]`, in `dtype`) of a level that starts at 0 and takes
    `Δ ← (1 − decay) Δ − lr Σ∇` at every period's end, its gradients given as per-token factors
    (`factor_grads`; leaves `[B, T', ·]`, tokens past T' contributing nothing). A scan over the periods: the
    weight-sized running `Δ` (float32) is the only per-sequence copy it keeps besides the stack it returns."""
    t = factors["z"].shape[1]
    pad = n_segments * period - t
    if pad < 0:
        raise ValueError(f"{t} tokens of factors need more than {n_segments} periods of {period}")
    by_period = jax.tree.map(
        lambda x: jnp.moveaxis(jnp.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(
            x.shape[0], n_segments, period, x.shape[-1]), 1, 0), factors)  # [N, B, P, ·]

    def step(delta, f):
        new = factor_grads(f)
        return jax.tree.map(lambda d, g: (1.0 - decay) * d - _per_row(lr, g) * g, delta, new), jax.tree.map(
            lambda d: d.astype(dtype), delta)

    b, d_model, width = factors["z"].shape[0], factors["z"].shape[-1], factors["a"].shape[-1]
    zero = {"gate": jnp.zeros((b, d_model, width), jnp.float32), "up": jnp.zeros((b, d_model, width), jnp.float32),
            "down": jnp.zeros((b, width, d_model), jnp.float32)}
    return jax.lax.scan(step, zero, by_period)[1]


def _per_row(lr, x):
    """`lr` (a number, or one per stacked layer `[L]`) shaped to broadcast against `x` (`[L, B, ...]`)."""
    lr = jnp.asarray(lr, jnp.float32)
    return lr.reshape(lr.shape + (1,) * (x.ndim - lr.ndim))


def accumulate_and_update(delta: list, gsum: list, grads: list, *, lrs, periods, pos, decays=None):
    """One chunk's gradients in: `gsum += grads`; every level whose period divides `pos` (the
    number of tokens seen, a chunk boundary) takes `Δ ← (1 − decay) Δ − lr Σ∇` and restarts its sum.
    The decay is a retention toward the level's meta-learned θ_ℓ,0 (Δ = θ_ℓ − θ_ℓ,0): with it a gradient
    that never lets up (norm G) holds ‖Δ‖ below lr·G / decay, where without it Δ grows by lr·G each
    update. `delta`, `gsum`, `grads`: lists over levels of `{kernel: [B, ...]}`; `lrs` one per level (each a
    number, or `[L]` for stacked layers); `decays` one per level (None: 0). Returns `(delta, gsum)`."""
    new_delta, new_gsum = [], []
    decays = (0.0,) * len(lrs) if decays is None else decays
    for d, s, g, lr, period, decay in zip(delta, gsum, grads, lrs, periods, decays):
        s = jax.tree.map(jnp.add, s, g)
        boundary = (pos % period) == 0
        keep = 1.0 - decay
        new_delta.append(jax.tree.map(lambda x, y: jnp.where(boundary, keep * x - _per_row(lr, y) * y, x), d, s))
        new_gsum.append(jax.tree.map(lambda y: jnp.where(boundary, jnp.zeros_like(y), y), s))
    return new_delta, new_gsum


class CMSLevel(nnx.Module):
    """One level: `h + SwiGLU_{θ0 + Δ}(RMSNorm(h))`."""

    def __init__(self, d_model: int, width: int, *, eps: float, std: float, out_std: float, rngs: nnx.Rngs):
        self.norm = RMSNorm(d_model, eps=eps, rngs=rngs)
        self.mlp = SwiGLU(d_model, width, std=std, out_std=out_std, rngs=rngs)

    def weights0(self) -> dict:
        return {name: getattr(self.mlp, name).kernel[...] for name in KERNELS}

    def zero_delta(self, batch: int) -> dict:
        return {name: jnp.zeros((batch,) + w.shape, jnp.float32) for name, w in self.weights0().items()}

    def zero_probes(self, batch: int, tokens: int) -> dict:
        """Zeros added to the three kernels' outputs (`probed`), whose gradients are the factors' δ."""
        w = self.weights0()
        return {name: jnp.zeros((batch, tokens, w[name].shape[1]), jnp.float32) for name in KERNELS}

    def __call__(self, h_BTD, delta=None, period: int | None = None):
        """`delta`: None (static), `{kernel: [B, ...]}` for all T tokens, or `{kernel: [N, B, ...]}`
        with one Δ per `period` tokens."""
        z = self.norm(h_BTD)
        w0 = self.weights0()
        if delta is None or period is None:
            y = swiglu_with_delta(w0, delta, z)
        else:
            y = segment_apply(lambda zz, dd: swiglu_with_delta(w0, dd, zz), z, delta, period)
        return h_BTD + y

    def probed(self, h_BTD, delta, probe: dict):
        """The level with `delta` (`[B, ...]`) and `probe[kernel]` added to each kernel's output; also the
        kernels' inputs `{"z", "a"}` (the gradient w.r.t. `probe` completes the factors)."""
        z = self.norm(h_BTD)
        y, a = swiglu_with_delta(self.weights0(), delta, z, probe, with_hidden=True)
        return h_BTD + y, {"z": z, "a": a}


class ContinuumMemory(nnx.Module):
    """K levels applied in `order` (fast_first: increasing period); `periods[i]`, `widths[i]`,
    `lrs[i]`, `decays[i]` describe the level applied i-th (`decays`: one number for every level, or one per
    level; the retention toward θ_ℓ,0 of `accumulate_and_update`). With `learn_lr` each level's rate is
    learned by the outer loop (as `log_lr`, starting at `lrs`); `rates()` gives the rates in use."""

    def __init__(self, d_model: int, *, periods, widths, lrs, order: str = "fast_first", eps: float,
                 std: float, out_std: float, rngs: nnx.Rngs, decays=0.0, learn_lr: bool = False):
        idx = sorted(range(len(periods)), key=lambda i: periods[i], reverse=order == "slow_first")
        self.periods = tuple(int(periods[i]) for i in idx)
        self.lrs = tuple(float(lrs[i]) for i in idx)
        decays = (decays,) if isinstance(decays, (int, float)) else tuple(decays)
        decays = decays * len(periods) if len(decays) == 1 else decays
        self.decays = tuple(float(decays[i]) for i in idx)
        self.levels = nnx.List([CMSLevel(d_model, int(widths[i]), eps=eps, std=std, out_std=out_std, rngs=rngs)
                                for i in idx])
        self.log_lr = nnx.Param(jnp.log(jnp.asarray(self.lrs, jnp.float32))) if learn_lr else nnx.data(None)

    def rates(self) -> tuple:
        """Each level's rate: the fixed `lrs`, or the learned ones (`[L]` each when the layers are stacked)."""
        if self.log_lr is None:
            return self.lrs
        lr = jnp.exp(self.log_lr[...])
        return tuple(lr[..., i] for i in range(len(self.lrs)))

    def zero_delta(self, batch: int) -> list:
        return [level.zero_delta(batch) for level in self.levels]

    def __call__(self, h_BTD, deltas=None, segmented: bool = False):
        """`deltas`: None, or a list over levels (segmented: leaves `[N_ℓ, B, ...]`, one per period)."""
        for i, level in enumerate(self.levels):
            d = None if deltas is None else deltas[i]
            h_BTD = level(h_BTD, d, self.periods[i] if segmented else None)
        return h_BTD

    def zero_probes(self, batch: int, tokens: int) -> list:
        return [level.zero_probes(batch, tokens) for level in self.levels]

    def probed(self, h_BTD, deltas: list, probes: list):
        """Every level `probed`: the output and, per level, the kernels' inputs `{"z", "a"}`."""
        records = []
        for level, d, p in zip(self.levels, deltas, probes):
            h_BTD, record = level.probed(h_BTD, d, p)
            records.append(record)
        return h_BTD, records

    def from_factors(self, h_BTD, factors: list):
        """The parallel pass: each level with one `Δ` per period rebuilt from the first pass's per-token
        factors (a list over levels, leaves `[B, T', ·]`)."""
        for level, f, period, lr, decay in zip(self.levels, factors, self.periods, self.rates(), self.decays):
            n = -(-h_BTD.shape[1] // period)
            delta = deltas_from_factors(f, period=period, n_segments=n, lr=lr, decay=decay, dtype=h_BTD.dtype)
            h_BTD = level(h_BTD, delta, period)
        return h_BTD
