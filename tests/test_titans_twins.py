"""Independent slow twins of the Titans wirings (MAC eqs. 21-25, MAG eqs. 26-28, MAL eqs. 29-31).

Each twin runs token by token (MAC's retrieval segment by segment) from the equations, with plain
jnp, `jax.grad` of the memory's inner loss and a per-token memory update; it reads the layer's own
parameters out of the NNX module but calls none of its methods nor nlearn's ops. The layers must
give the same outputs for every selectable variant, on a length that divides no segment or window.
The memory here: an MLP of depth 2 (tanh GELU), l2 objective, momentum and forgetting gates,
gradients taken at the start of each mini-batch of b tokens (absolute positions), with the paper's step
or the bounded one (η/b, momentum as an EMA, each layer's step over 1 + ‖x‖² of its input).
"""

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import titans_mac
import titans_mag
import titans_mal
from nlearn.layers.titans import MACMixer, MAGMixer, MALMixer

B, T, D, H = 2, 11, 16, 2  # T divides neither the segments (4) nor the window (3)
K = D // H
EPS_L2 = 1e-6


# ----------------------------------------------------------------------------------------------
# Plain-jnp pieces


def arr(p):
    return None if p is None else jnp.asarray(p[...])


def dense(layer, x):
    y = x @ arr(layer.kernel)
    return y if layer.bias is None else y + arr(layer.bias)


def rms(norm, x, eps):
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * arr(norm.scale)


def l2n(x):
    return x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + EPS_L2)


def sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def silu(x):
    return x * sigmoid(x)


def gelu(x):
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def rope(x_BHK, pos, theta):
    """Rotate pairs (x_i, x_{i+K/2}) by pos * theta^(-i / (K/2))."""
    half = x_BHK.shape[-1] // 2
    ang = pos * theta ** (-jnp.arange(half) / half)
    x1, x2 = x_BHK[..., :half], x_BHK[..., half:]
    return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang), x2 * jnp.cos(ang) + x1 * jnp.sin(ang)], -1)


class Conv:
    """Causal depthwise conv, one token at a time: `y_t = sum_i w_i x_{t-K+1+i}`."""

    def __init__(self, conv, channels):
        self.w = None if conv is None else arr(conv.weight)  # [K, C], oldest tap first
        if self.w is not None:
            self.hist = jnp.zeros((B, self.w.shape[0], channels))

    def __call__(self, x_BC):
        if self.w is None:
            return x_BC
        self.hist = jnp.concatenate([self.hist[:, 1:], x_BC[:, None]], 1)
        return jnp.einsum("bkc,kc->bc", self.hist, self.w)


def heads(x_BW):
    return x_BW.reshape(B, H, -1)


def mlp(theta, x_BHd):
    w1, w2 = theta
    return jnp.einsum("bhf,bhfo->bho", gelu(jnp.einsum("bhd,bhdf->bhf", x_BHd, w1)), w2)


@partial(jax.jit, static_argnames=("step", "b"))  # (compiled once: eager autodiff per token is slow)
def write_read(theta, U, anchor, q, k, v, eta, mu, alpha, step="paper", b=1, batch_keys=None):
    """One token: the gradient of ½‖f(k) − v‖² at the mini-batch's start state, U_t = μ U − η g,
    θ_t = (1 − α) θ + U_t, then the read f(q; θ_t). Layer inputs at the start state: x_1 = k, x_2 = gelu(k W_1).
    "bounded": η (1 − μ) / b and layer i's gradient over 1 + ‖x_i‖²; "ema+overlap": η (1 − μ) and layer i's
    gradient over 1 + Σ_j |x_i · x_i(k_j)| over the mini-batch's keys so far (`batch_keys [b, B, H, K]`, this one
    included, zeros after it: a zero key has zero inputs); "+gain": that sum times the layer's gain, ‖δ_1‖² / ‖e‖²
    for the first layer (δ_1 = e W_2ᵀ ⊙ gelu'(k W_1), e the output's error), 1 for the last."""
    grads = jax.grad(lambda th: 0.5 * jnp.sum((mlp(th, k) - v) ** 2))(anchor)
    inputs = lambda kk: (kk, gelu(jnp.einsum("bhd,bhdf->bhf", kk, anchor[0])))  # noqa: E731
    if step == "bounded":
        eta = eta * (1.0 - mu) / b
        grads = tuple(g / (1.0 + jnp.sum(x * x, -1))[..., None, None] for g, x in zip(grads, inputs(k)))
    elif step in ("ema+overlap", "ema+overlap+gain"):
        eta = eta * (1.0 - mu)
        gains = (1.0, 1.0)
        if step.endswith("+gain"):
            e = mlp(anchor, k) - v
            z1 = jnp.einsum("bhd,bhdf->bhf", k, anchor[0])
            delta1 = jnp.einsum("bho,bhfo->bhf", e, anchor[1]) * jax.vmap(jax.vmap(jax.vmap(jax.grad(gelu))))(z1)
            gains = (jnp.sum(delta1 ** 2, -1) / jnp.sum(e ** 2, -1), 1.0)
        earlier = [inputs(batch_keys[j]) for j in range(b)]
        grads = tuple(g / (1.0 + gains[i] * sum(jnp.abs(jnp.sum(x * e_[i], -1)) for e_ in earlier))[..., None, None]
                      for i, (g, x) in enumerate(zip(grads, inputs(k))))
    else:
        assert step == "paper", step
    U = tuple(mu * u - eta * g for u, g in zip(U, grads))
    theta = tuple((1.0 - alpha) * w + u for w, u in zip(theta, U))
    return theta, U, mlp(theta, q)


class Memory:
    """The LMM mixer (q, k, v projections, convs, SiLU / L2 features, gates, per-token write then
    read, per-head RMSNorm, and with `output` its SiLU gate and output projection)."""

    def __init__(self, lmm, cfg):
        self.lmm, self.cfg = lmm, cfg
        self.convs = [Conv(lmm.convs[i] if len(lmm.convs) else None, H * K) for i in range(3)]
        self.theta = tuple(jnp.broadcast_to(arr(w), (B,) + w.shape) for w in lmm.weights0)
        self.U = tuple(jnp.zeros_like(w) for w in self.theta)
        self.anchor, self.batch_keys = self.theta, []
        self.t = 0

    def __call__(self, u_BD):
        lmm, mem = self.lmm, self.cfg.memory
        q, k, v = (heads(conv(dense(p, u_BD))) for conv, p in zip(self.convs, (lmm.q, lmm.k, lmm.v)))
        q, k, v = l2n(silu(q)), l2n(silu(k)), silu(v)
        eta = mem.max_lr * sigmoid(dense(lmm.lr_gate, u_BD))[..., None, None]  # [B, H, 1, 1]
        mu = sigmoid(dense(lmm.momentum_gate, u_BD))[..., None, None]
        alpha = sigmoid(dense(lmm.decay_gate, u_BD))[..., None, None]
        if self.t % mem.minibatch == 0:  # a mini-batch starts: its gradients are taken here
            self.anchor, self.batch_keys = self.theta, []
        self.batch_keys.append(k)
        padded = jnp.stack(self.batch_keys + [jnp.zeros_like(k)] * (mem.minibatch - len(self.batch_keys)))
        self.theta, self.U, read = write_read(self.theta, self.U, self.anchor, q, k, v, eta, mu, alpha,
                                              mem.inner_step, mem.minibatch, padded)
        self.t += 1
        o = rms(lmm.out_norm, read, self.cfg.norm_eps)  # [B, H, K]
        if lmm.o is None:
            return o
        return dense(lmm.o, o.reshape(B, -1) * silu(dense(lmm.gate, u_BD)))


class Attention:
    """Causal softmax attention over `[persistent ‖ tokens in the window]`, one query at a time;
    MAC adds the retrieved tokens and restarts the keys at each segment."""

    def __init__(self, attn, cfg, window):
        self.attn, self.cfg, self.window = attn, cfg, window
        self.convs = [Conv(attn.convs[i] if attn.convs is not None else None, H * K) for i in range(3)]
        self.keys, self.values = [], []
        p = arr(attn.persistent)  # [N_p, D]: keys and values without RoPE, for every query
        entries = lambda w: [jnp.broadcast_to(e, (B, H, K)) for e in (p @ arr(w.kernel)).reshape(-1, H, K)]  # noqa: E731
        self.pk, self.pv = ([], []) if p is None else (entries(attn.k), entries(attn.v))

    def qkv(self, x_BD, pos):
        q, k, v = (heads(conv(dense(p, x_BD))) for conv, p in zip(self.convs, (self.attn.q, self.attn.k, self.attn.v)))
        theta = self.cfg.rope_theta
        return rope(q, pos, theta), rope(k, pos, theta), v

    def attend(self, q, keys, values):
        ks, vs = jnp.stack(self.pk + keys, 1), jnp.stack(self.pv + values, 1)  # [B, S, H, K]
        s = jnp.einsum("bhk,bshk->bhs", q, ks) / math.sqrt(K)
        p = jnp.exp(s - s.max(-1, keepdims=True))
        return jnp.einsum("bhs,bshk->bhk", p / p.sum(-1, keepdims=True), vs)  # [B, H, K]

    def __call__(self, x_BD, pos):
        """Sliding-window step (MAG / MAL): the heads before the output projection."""
        q, k, v = self.qkv(x_BD, pos)
        self.keys, self.values = (self.keys + [k])[-self.window:], (self.values + [v])[-self.window:]
        return self.attend(q, self.keys, self.values)

    def project(self, a_BHK):
        return dense(self.attn.o, a_BHK.reshape(B, -1))


# ----------------------------------------------------------------------------------------------
# The three wirings


def mac_twin(mixer, cfg, x):
    """Eqs. 21-25 per segment: retrieve with the memory left by earlier segments, attend over
    [p ‖ retrieved ‖ segment], write u (y, x + y or x) token by token, read it with u, combine."""
    att, mem = Attention(mixer.attn, cfg, 0), Memory(mixer.lmm, cfg)
    outs = []
    for t in range(T):
        if t % cfg.segment_len == 0:  # a new segment: retrieval weights, empty attention keys
            theta_r, keys, values = mem.theta, [], []
        x_t = x[:, t]
        pos = t % cfg.segment_len if cfg.mac_positions == "segment" else t  # RoPE's position
        h = mlp(theta_r, l2n(silu(heads(dense(mixer.retrieve_q, x_t)))))
        r = rms(mixer.retrieved_norm, dense(mixer.retrieve_o, h.reshape(B, -1)), cfg.norm_eps)
        q, k, v = att.qkv(x_t, pos)
        keys += [rope(heads(dense(mixer.attn.k, r)), pos, cfg.rope_theta), k]
        values += [heads(dense(mixer.attn.v, r)), v]
        y = att.project(att.attend(q, keys, values))
        u = {"y": y, "x+y": x_t + y, "x": x_t}[cfg.mac_memory_input]
        m = mem(rms(mixer.lmm_norm, u, cfg.norm_eps))
        outs.append(y + m if cfg.mac_output == "add" else y * sigmoid(rms(mixer.gate_norm, m, cfg.norm_eps)))
    return jnp.stack(outs, 1)


def mag_twin(mixer, cfg, x):
    """Eqs. 26-28: sliding-window attention and the memory on x in parallel; gate or blend."""
    att, mem = Attention(mixer.attn, cfg, cfg.window), Memory(mixer.lmm, cfg)
    outs = []
    for t in range(T):
        a = rms(mixer.attn_norm, att(x[:, t], t), cfg.norm_eps)
        m = mem(x[:, t])
        if cfg.mag_output == "gate":
            mixed = a * sigmoid(m)
        else:
            g = heads(sigmoid(dense(mixer.gate, x[:, t])))
            mixed = g * a + (1.0 - g) * m
        outs.append(dense(mixer.o, mixed.reshape(B, -1)))
    return jnp.stack(outs, 1)


def mal_twin(mixer, cfg, x):
    """Eqs. 29-31: the memory, then sliding-window attention on its output (or on x + it, plus it)."""
    att, mem = Attention(mixer.attn, cfg, cfg.window), Memory(mixer.lmm, cfg)
    outs = []
    for t in range(T):
        u = mem(x[:, t])
        paper = cfg.mal_attn_input == "m"
        a = att.project(att(rms(mixer.attn_norm, u if paper else x[:, t] + u, cfg.norm_eps), t))
        outs.append(a if paper else u + a)
    return jnp.stack(outs, 1)


# ----------------------------------------------------------------------------------------------

FAMILIES = {"titans_mac": (titans_mac, MACMixer, mac_twin), "titans_mag": (titans_mag, MAGMixer, mag_twin),
            "titans_mal": (titans_mal, MALMixer, mal_twin)}


def small(family, **model):
    """Segments of 4 / a window of 3, 2 persistent tokens, mini-batches of 2, a large inner rate
    (max_lr 1: the writes move the reads well above float32 noise)."""
    config = FAMILIES[family][0].get_config("tiny")
    with config.unlocked():
        config.model.update(dict(d_model=D, num_layers=1, num_heads=H, num_persistent=2))
        config.model.update({"segment_len": 4} if family == "titans_mac" else {"window": 3})
        config.model.memory.update(dict(minibatch=2, chunk_size=4, max_lr=1.0))
        config.model.update(**model)
    return config.model


def perturbed(mixer, seed):
    """Every parameter moved by N(0, 0.1²) (init leaves gates at 1/2, norms at 1, convs near identity)."""
    state = nnx.state(mixer, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    nnx.update(mixer, jax.tree.unflatten(treedef, noisy))
    return mixer


# Every value of every key in the default suite (MAC: the paper's wiring, tiny's, x + y with mini-batches
# of 3, which do not divide the segments, and positions from each segment's start); MAC's other input x output
# pairs marked slow.
slow = pytest.mark.slow
VARIANTS = [
    ("titans_mac", dict(mac_memory_input="y", mac_output="gate")),
    ("titans_mac", dict(mac_memory_input="x", mac_output="add")),
    ("titans_mac", dict(mac_memory_input="x+y", mac_output="add", memory=dict(minibatch=3))),
    ("titans_mac", dict(mac_memory_input="x", mac_output="add", mac_positions="segment")),
    pytest.param("titans_mac", dict(mac_memory_input="y", mac_output="add"), marks=slow),
    pytest.param("titans_mac", dict(mac_memory_input="x+y", mac_output="gate"), marks=slow),
    pytest.param("titans_mac", dict(mac_memory_input="x", mac_output="gate"), marks=slow),
    ("titans_mag", dict(mag_output="gate")), ("titans_mag", dict(mag_output="blend")),
    ("titans_mal", dict(mal_attn_input="m")), ("titans_mal", dict(mal_attn_input="x+m")),
    ("titans_mag", dict(mag_output="gate", memory=dict(inner_step="paper"))),
]


@pytest.mark.parametrize("family,model", VARIANTS, ids=lambda v: v if isinstance(v, str) else
                         ",".join(f"{k}={v}" for k, v in v.items()))
def test_layer_equals_its_slow_twin(family, model):
    model = dict(model)
    memory = model.pop("memory", {})
    cfg = small(family, **model)
    with cfg.unlocked():
        cfg.memory.update(memory)
    _, cls, twin = FAMILIES[family]
    mixer = perturbed(cls(cfg, rngs=nnx.Rngs(0)), seed=1)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((B, T, D)), jnp.float32)
    graphdef, state = nnx.split(mixer)
    got = np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[0])(state, x))
    want = np.asarray(twin(mixer, cfg, x))
    assert np.abs(want).max() > 1e-2  # (not a trivially small output)
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=1e-4)
