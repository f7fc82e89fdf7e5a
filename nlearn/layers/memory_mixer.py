"""Token mixers that call a memory op: the layers make q, k, v and gates, the ops do the math.

Shared wiring (DeltaNet / Titans style): q, k, v projections -> short causal depthwise conv ->
a family-specific featurization (elu+1, or SiLU + L2 norm) -> the op -> per-head RMSNorm ->
SiLU output gate -> output projection. Decoding feeds the op's state through the cache.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from nlearn.layers.conv import ShortConv, causal_conv_over_sequence
from nlearn.layers.core import Dense, RMSNorm, head_dim, param
from nlearn.memory.delta import delta_rule, delta_rule_step, gated_delta_rule, gated_delta_rule_step
from nlearn.memory.linear_attention import LinearAttentionState, linear_attention, linear_attention_step
from nlearn.memory.neural_memory import init_state as neural_memory_init_state
from nlearn.memory.neural_memory import neural_memory, neural_memory_step
from nlearn.memory import sequence_parallel as sp
from nlearn.memory.inner_optimizers import get_inner_optimizer
from nlearn.memory.objectives import get_objective, l2
from nlearn.memory.ttt import ttt_linear, ttt_linear_init_state, ttt_linear_step
from nlearn.memory.ttt_mlp import ttt_mlp, ttt_mlp_init_state, ttt_mlp_step


def l2_normalize(x, eps: float = 1e-6):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class MemoryMixer(nnx.Module):
    """Base class: projections, convs, output norm and gate.

    Subclasses define `initial_state(batch)` (the memory's state before any token) and
    `memory(q, k, v, gates, state) -> (o, state)` (the op over `[B, T, H, D]` inputs), and may
    override `featurize` and `gates`.
    """

    def __init__(self, cfg, *, output: bool = True, rngs: nnx.Rngs):
        mem = cfg.memory
        self.num_heads = cfg.num_heads
        self.head_dim = head_dim(cfg)
        width = self.num_heads * self.head_dim
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.q = Dense(cfg.d_model, width, axes=("embed", "heads"), std=cfg.init_std, rngs=rngs)
        self.k = Dense(cfg.d_model, width, axes=("embed", "heads"), std=cfg.init_std, rngs=rngs)
        self.v = Dense(cfg.d_model, width, axes=("embed", "heads"), std=cfg.init_std, rngs=rngs)
        conv_init = mem.conv_init
        self.convs = nnx.List([ShortConv(width, mem.conv_size, init=conv_init, rngs=rngs) for _ in range(3)]
                              if mem.conv_size else [])
        self.out_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps, axes=("kv",), overflow_safe=True, rngs=rngs)
        # output=False: no gate and output projection; the caller mixes `heads()` itself (Titans MAG).
        self.gate = Dense(cfg.d_model, width, axes=("embed", "heads"), std=cfg.init_std, rngs=rngs) if output else None
        self.o = Dense(width, cfg.d_model, axes=("heads", "embed"), std=out_std, rngs=rngs) if output else None
        self.chunk_size = mem.chunk_size
        self.gate_conv = nnx.data(None)  # a subclass's ShortConv over the gates' input `[B, T, d_model]`, if any

    # --- to override -----------------------------------------------------------------------
    def featurize(self, q, k, v):
        """`[B, T, H, D]` q, k, v after the convs -> what the op reads and writes."""
        return q, k, v

    def gates(self, x_BTD) -> tuple:
        """Per-token gates `[B, T, H]` passed to the op."""
        return ()

    def sequence_op(self):
        """The op over one device's shard of a split sequence, `(q, k, v, *gates, axis_name=) -> (o,
        state)` (`nlearn.memory.sequence_parallel`); memories without a state summary refuse."""
        raise ValueError(f"{type(self).__name__}: this memory is nonlinear and cannot split a sequence across "
                         "devices (no state summary to pass on); use mesh.sequence=1")

    # --- shared ----------------------------------------------------------------------------
    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        width = self.num_heads * self.head_dim
        convs = [conv.init_cache(batch, width, dtype) for conv in self.convs]
        if self.gate_conv is not None:  # last in the list, after q, k and v's
            convs.append(self.gate_conv.init_cache(batch, self.gate_conv.weight.shape[1], dtype))
        return {"convs": convs, "state": self.initial_state(batch)}

    def project(self, x_BTD, cache=None):
        """What the op reads and writes: `(q, k, v [B, T, H, D], gates, conv caches)`."""
        b, t, _ = x_BTD.shape
        qkv, conv_caches = [], []
        for i, proj in enumerate((self.q, self.k, self.v)):
            h = proj(x_BTD)
            if self.convs:
                h, c = self.convs[i](h, None if cache is None else cache["convs"][i])
                conv_caches.append(c)
            qkv.append(h.reshape(b, t, self.num_heads, self.head_dim))
        gate_in = x_BTD
        if self.gate_conv is not None:
            gate_in, c = self.gate_conv(x_BTD, None if cache is None else cache["convs"][len(self.convs)])
            conv_caches.append(c)
        return (*self.featurize(*qkv), self.gates(gate_in), conv_caches)

    def heads(self, x_BTD, cache=None):
        """The memory's read per head, RMS-normalised, `[B, T, H, D]`, and the new cache."""
        if cache is None and sp.context_axis_size() > 1:
            return self.out_norm(self._heads_over_sequence(x_BTD)), None
        q, k, v, gates, conv_caches = self.project(x_BTD, cache)
        state = None if cache is None else cache["state"]
        o, state = self.memory(q, k, v, gates, state)
        return self.out_norm(o), (None if cache is None else {"convs": conv_caches, "state": state})

    def _heads_over_sequence(self, x_BTD):
        """`heads` with the sequence split over the context mesh's `sequence` axis: projections and
        gates per token, then, per device, the convs (with their halo), the features and the op."""
        op = self.sequence_op()
        projected = tuple(proj(x_BTD) for proj in (self.q, self.k, self.v))
        weights = tuple(conv.weight[...].astype(x_BTD.dtype) for conv in self.convs)

        def shard(weights, projected, gates):
            if weights:
                projected = [causal_conv_over_sequence(h, w, sp.SEQUENCE_AXIS) for h, w in zip(projected, weights)]
            b, t = projected[0].shape[:2]
            q, k, v = self.featurize(*(h.reshape(b, t, self.num_heads, self.head_dim) for h in projected))
            return op(q, k, v, *gates, axis_name=sp.SEQUENCE_AXIS)[0]

        seq = P(None, sp.SEQUENCE_AXIS)
        gate_in = x_BTD
        if self.gate_conv is not None:
            gate_in = jax.shard_map(lambda w, x: causal_conv_over_sequence(x, w, sp.SEQUENCE_AXIS),
                                    in_specs=(P(), seq), out_specs=seq, axis_names={sp.SEQUENCE_AXIS})(
                self.gate_conv.weight[...].astype(x_BTD.dtype), x_BTD)
        return jax.shard_map(shard, in_specs=(P(), seq, seq), out_specs=seq, axis_names={sp.SEQUENCE_AXIS})(
            weights, projected, self.gates(gate_in))

    # --- diagnostics -----------------------------------------------------------------------
    def inner_objective(self):
        """The per-token loss `(pred [..., D], v [..., D]) -> [...]` the op's writes descend; None for a
        memory that is no learner (linear attention)."""
        return None

    def inner_losses(self, x_BTD, cache):
        """Inner loss of each token before and after its write, `(l_t(θ_{t-1}), l_t(θ_t))`, each `[B, T, H]`,
        continuing the stream in `cache` (left unchanged). Recomputed with the op itself, its math untouched:
        the op reads after writing, so reading with q = k gives f(k_t; θ_t) and with q_t = k_{t+1} gives
        f(k_{t+1}; θ_t); the first token's f(k_0; θ_{-1}) is a read-only step (all gates zero: no write).
        None when the memory is no learner."""
        objective = self.inner_objective()
        if objective is None:
            return None
        q, k, v, gates, _ = self.project(x_BTD, cache)
        state = cache["state"]
        after = self.memory(k, k, v, gates, state)[0]
        ahead = self.memory(jnp.concatenate([k[:, 1:], k[:, -1:]], 1), k, v, gates, state)[0]
        silent = tuple(None if g is None else jnp.zeros_like(g[:, :1]) for g in gates)
        first = self.memory(k[:, :1], k[:, :1], v[:, :1], silent, state)[0]
        before = jnp.concatenate([first, ahead[:, :-1]], 1)
        v32 = v.astype(jnp.float32)
        return objective(before.astype(jnp.float32), v32), objective(after.astype(jnp.float32), v32)

    def __call__(self, x_BTD, cache=None):
        b, t, _ = x_BTD.shape
        o, cache = self.heads(x_BTD, cache)
        o = o.reshape(b, t, -1) * jax.nn.silu(self.gate(x_BTD))
        return self.o(o.astype(x_BTD.dtype)), cache


class LinearAttentionMixer(MemoryMixer):
    """Katharopoulos et al.: elu+1 features, `S += k^T v`, optional normalizer."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.normalize = cfg.memory.normalize

    def featurize(self, q, k, v):
        return jax.nn.elu(q) + 1.0, jax.nn.elu(k) + 1.0, v

    def initial_state(self, batch):
        s = jnp.zeros((batch, self.num_heads, self.head_dim, self.head_dim), jnp.float32)
        if not self.normalize:
            return s
        return LinearAttentionState(s, jnp.zeros((batch, self.num_heads, self.head_dim), jnp.float32))

    def sequence_op(self):
        return partial(sp.linear_attention_shard, normalize=self.normalize, chunk_size=self.chunk_size)

    def memory(self, q, k, v, gates, state):
        if q.shape[1] == 1 and state is not None:
            o, state = linear_attention_step(q[:, 0], k[:, 0], v[:, 0], state, normalize=self.normalize)
            return o[:, None], state
        return linear_attention(q, k, v, normalize=self.normalize, initial_state=state,
                                    chunk_size=self.chunk_size)


class DeltaNetMixer(MemoryMixer):
    """DeltaNet (Schlag et al., Yang et al.): SiLU + L2-normalised q, k; `beta = sigmoid(x W_b)`.

    With `gated=True` it is Gated DeltaNet: `log a_t = -exp(A) * softplus(x W_a + dt_bias)`.
    `memory.qk_activation="identity"` drops the SiLU before the L2 norm: signed keys can be orthogonal,
    where SiLU's mostly positive ones all overlap; `"relu"` makes keys with exact zeros, so a key coordinate
    that no later key touches keeps what was written along it exactly (and an all-zero key writes nothing).
    `memory.beta_min` > 0 bounds every write's strength from below (`beta = beta_min + (1 - beta_min)
    sigmoid(x W_b)`): weak writes make the state converge over a repeated input so slowly that a short
    training window never shows its long-run value.
    `memory.beta_gate="hard_sigmoid"` makes the write gate `relu6(z + 3) / 6`, which reaches exactly 0 (and 1): a
    token written with beta 0 leaves the state as it was, so a learnt "skip" on the filler costs a stored
    association nothing however many filler tokens follow, where sigmoid's small betas still erase it slowly.
    `memory.gate_conv=True` feeds the gates (beta, and the decay when gated) a short causal conv of the input,
    as Mamba's dt reads its conv: a gate then sees the last few tokens, not one token alone, so it can write a
    `.` after a needle's digits and skip the same `.` after filler. It starts as the identity (the token gate).
    """

    QK_ACTIVATIONS = {"silu": jax.nn.silu, "identity": lambda x: x, "relu": jax.nn.relu}
    BETA_GATES = {"sigmoid": jax.nn.sigmoid, "hard_sigmoid": jax.nn.hard_sigmoid}
    # What `train.write_penalty` charges per token and head, from the gate's logit z (nlearn.train.write_penalty):
    # sigmoid's beta; hard_sigmoid's ramp unclipped at 1 (a gate stuck open still feels the cost) and shifted by
    # a unit, so a closed gate is pushed a unit past its edge and a small drift of its input does not reopen it.
    WRITE_COSTS = {"sigmoid": jax.nn.sigmoid, "hard_sigmoid": lambda z: jax.nn.relu(z + 4.0) / 6.0}
    record_writes = False  # set by train.write_penalty's step: `gates` then sows the mean write cost

    def __init__(self, cfg, *, gated: bool = False, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.beta = Dense(cfg.d_model, self.num_heads, axes=("embed", "heads"), std=cfg.init_std, rngs=rngs)
        self.gated = gated
        self.qk_activation = self.QK_ACTIVATIONS[cfg.memory.get("qk_activation", "silu")]
        self.beta_min = float(cfg.memory.get("beta_min", 0.0))
        self.beta_gate = self.BETA_GATES[cfg.memory.get("beta_gate", "sigmoid")]
        self.write_cost = self.WRITE_COSTS[cfg.memory.get("beta_gate", "sigmoid")]
        if gated:
            self.decay = Dense(cfg.d_model, self.num_heads, axes=("embed", "heads"), std=cfg.init_std, rngs=rngs)
            # Mamba-2 style init: A in [1, 16], softplus(dt_bias) in [1e-3, 0.1] (log-uniform).
            a = jax.random.uniform(rngs.params(), (self.num_heads,), minval=1.0, maxval=16.0)
            self.a_log = nnx.Param(jnp.log(a), out_sharding=("heads",), eager_sharding=False)
            dt = jnp.exp(jax.random.uniform(rngs.params(), (self.num_heads,),
                                            minval=math.log(1e-3), maxval=math.log(0.1)))
            self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)), out_sharding=("heads",), eager_sharding=False)
        if cfg.memory.get("gate_conv", False):  # created last: the other parameters draw as without it
            self.gate_conv = ShortConv(cfg.d_model, cfg.memory.conv_size or 4, init="identity", channel_axis="embed",
                                       rngs=rngs)

    def featurize(self, q, k, v):
        return l2_normalize(self.qk_activation(q)), l2_normalize(self.qk_activation(k)), jax.nn.silu(v)

    def gates(self, x_BTD):
        z = self.beta(x_BTD).astype(jnp.float32)
        if self.record_writes:
            self.sow(nnx.Intermediate, "sown_write_cost", jnp.mean(self.write_cost(z)))
        beta = self.beta_min + (1.0 - self.beta_min) * self.beta_gate(z)
        if not self.gated:
            return (beta,)
        dt = jax.nn.softplus(self.decay(x_BTD).astype(jnp.float32) + self.dt_bias[...])
        return beta, -jnp.exp(self.a_log[...]) * dt

    def initial_state(self, batch):
        return jnp.zeros((batch, self.num_heads, self.head_dim, self.head_dim), jnp.float32)

    def sequence_op(self):
        return partial(sp.gated_delta_rule_shard if self.gated else sp.delta_rule_shard, chunk_size=self.chunk_size)

    def inner_objective(self):
        return l2  # S_t = S_{t-1} - beta_t * grad of 1/2 |k_t S - v_t|^2 (after the decay, when gated)

    def memory(self, q, k, v, gates, state):
        step, full = ((gated_delta_rule_step, gated_delta_rule) if self.gated
                      else (delta_rule_step, delta_rule))
        if q.shape[1] == 1 and state is not None:
            o, state = step(q[:, 0], k[:, 0], v[:, 0], *(g[:, 0] for g in gates), state)
            return o[:, None], state
        return full(q, k, v, *gates, initial_state=state, chunk_size=self.chunk_size)


class NeuralMemoryMixer(MemoryMixer):
    """Titans long-term memory (LMM): an MLP memory trained while reading.

    q, k, v get SiLU and q, k an L2 norm (Titans §4.4); per-token, per-head gates are
    `eta = max_lr * sigmoid(x W_eta)`, `mu = sigmoid(x W_mu)` (momentum), `alpha = sigmoid(x W_alpha)`
    (forgetting); the memory's initial weights are parameters, meta-learned by the outer loop.
    All inner-learner choices come from `cfg.memory` (optimizer, objective, minibatch, depth, ...).
    """

    def __init__(self, cfg, *, output: bool = True, rngs: nnx.Rngs):
        super().__init__(cfg, output=output, rngs=rngs)
        mem = cfg.memory
        self.options = dict(residual=mem.residual, activation=mem.activation, objective=mem.objective,
                            optimizer=mem.optimizer, minibatch=mem.minibatch, inner_step=mem.inner_step)
        self.max_lr = mem.max_lr
        h, d = self.num_heads, self.head_dim
        dims = [d] + [mem.expansion * d] * (mem.depth - 1) + [d]
        # Small init for a residual memory (starts near identity); 1/sqrt(fan-in) otherwise.
        self.weights0 = nnx.List([
            param(rngs, (h, d_in, d_out), ("heads", None, None),
                  std=(0.02 if mem.residual else 1.0 / math.sqrt(d_in)))
            for d_in, d_out in zip(dims[:-1], dims[1:])])
        self.lr_gate = Dense(cfg.d_model, h, axes=("embed", "heads"), bias=True, std=cfg.init_std, rngs=rngs)
        # Optimizers without a momentum buffer (sgd, dgd: eq. 88) build no momentum gate, whatever
        # `memory.momentum` says.
        self.momentum_gate = (Dense(cfg.d_model, h, axes=("embed", "heads"), bias=True, std=cfg.init_std, rngs=rngs)
                              if mem.momentum and get_inner_optimizer(mem.optimizer).momentum else None)
        self.decay_gate = (Dense(cfg.d_model, h, axes=("embed", "heads"), bias=True, std=cfg.init_std, rngs=rngs)
                           if mem.decay else None)
        if self.decay_gate is not None:  # start with little forgetting: alpha = memory.decay_init
            alpha0 = mem.decay_init
            bias = math.log(alpha0) - math.log1p(-alpha0)
            self.decay_gate.bias[...] = jnp.full((h,), bias, self.decay_gate.bias.dtype)

    def featurize(self, q, k, v):
        return l2_normalize(jax.nn.silu(q)), l2_normalize(jax.nn.silu(k)), jax.nn.silu(v)

    def gates(self, x_BTD):
        sig = lambda dense: None if dense is None else jax.nn.sigmoid(dense(x_BTD).astype(jnp.float32))  # noqa: E731
        return self.max_lr * sig(self.lr_gate), sig(self.momentum_gate), sig(self.decay_gate)

    def _weights0(self):
        return tuple(w[...] for w in self.weights0)

    def inner_objective(self):
        return get_objective(self.options["objective"])

    def initial_state(self, batch):
        return neural_memory_init_state(self._weights0(), batch)

    def memory(self, q, k, v, gates, state):
        lr, momentum, decay = gates
        if state is None:  # training: a whole sequence from the learned initial weights
            return neural_memory(q, k, v, lr=lr, momentum=momentum, decay=decay,
                                 weights0=self._weights0(), **self.options)
        if q.shape[1] == 1:
            o, state = neural_memory_step(
                q[:, 0], k[:, 0], v[:, 0], lr=lr[:, 0], state=state, **self.options,
                momentum=None if momentum is None else momentum[:, 0],
                decay=None if decay is None else decay[:, 0])
            return o[:, None], state
        return neural_memory(q, k, v, lr=lr, momentum=momentum, decay=decay, initial_state=state,
                             return_stream_state=True, **self.options)


class TTTMixer(MemoryMixer):
    """Shared by the TTT mixers: the inner LayerNorm's affine and the per-token inner rate
    `eta = base_lr * sigmoid(x W_eta) / head_dim` (the TTT paper's choice)."""

    def _init_ttt(self, cfg, rngs: nnx.Rngs):
        """Create the shared parameters (after the subclass's initial weights, keeping RNG order)."""
        h, d = self.num_heads, self.head_dim
        self.minibatch, self.base_lr = cfg.memory.minibatch, cfg.memory.base_lr
        self.inner_step = cfg.memory.get("inner_step")  # TTT-MLP's (TTT-Linear has no such key)
        self.ln_scale = param(rngs, (h, d), ("heads", None), init="ones")
        self.ln_bias = param(rngs, (h, d), ("heads", None), init="zeros")
        self.lr_gate = Dense(cfg.d_model, h, axes=("embed", "heads"), bias=True, std=cfg.init_std, rngs=rngs)

    def gates(self, x_BTD):
        eta = jax.nn.sigmoid(self.lr_gate(x_BTD).astype(jnp.float32))
        return (self.base_lr * eta / self.head_dim,)

    def _ln(self):
        return dict(ln_scale=self.ln_scale[...], ln_bias=self.ln_bias[...], minibatch=self.minibatch)

    def inner_objective(self):
        return l2  # 1/2 |f(k) - v|^2, f = k + LN(inner model(k))


class TTTLinearMixer(TTTMixer):
    """TTT-Linear (Sun et al. 2024): inner model `f(x) = x + LN(x W + b)` trained by mini-batch GD.

    The learned `W0, b0` and the inner LayerNorm's affine are outer-loop parameters; the per-token
    inner rate is `eta = base_lr * sigmoid(x W_eta) / head_dim` (the TTT paper's choice).
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        h, d = self.num_heads, self.head_dim
        self.w0 = param(rngs, (h, d, d), ("heads", None, None), std=cfg.init_std)
        self.b0 = param(rngs, (h, d), ("heads", None), init="zeros")
        self._init_ttt(cfg, rngs)

    def initial_state(self, batch):
        return ttt_linear_init_state(self.w0[...], self.b0[...], batch)

    def memory(self, q, k, v, gates, state):
        (eta,) = gates
        ln = self._ln()
        if state is None:
            return ttt_linear(q, k, v, eta, W0=self.w0[...], b0=self.b0[...], **ln)
        if q.shape[1] == 1:
            o, state = ttt_linear_step(q[:, 0], k[:, 0], v[:, 0], eta[:, 0], state, **ln)
            return o[:, None], state
        return ttt_linear(q, k, v, eta, initial_state=state, **ln)


class TTTMLPMixer(TTTMixer):
    """TTT-MLP (Sun et al. 2024): inner model `f(x) = x + LN(gelu(x W1 + b1) W2 + b2)`, hidden width
    `expansion * head_dim`, trained by mini-batch GD.

    The learned initial weights (`W1_0, W2_0 ~ N(0, init_std)`, zero biases) and the inner
    LayerNorm's affine are outer-loop parameters; the per-token inner rate is
    `eta = base_lr * sigmoid(x W_eta) / head_dim` (base_lr 0.1 for TTT-MLP in the paper).
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        h, d = self.num_heads, self.head_dim
        mem = cfg.memory
        f = mem.expansion * d
        self.w1_0 = param(rngs, (h, d, f), ("heads", None, None), std=cfg.init_std)
        self.b1_0 = param(rngs, (h, f), ("heads", None), init="zeros")
        self.w2_0 = param(rngs, (h, f, d), ("heads", None, None), std=cfg.init_std)
        self.b2_0 = param(rngs, (h, d), ("heads", None), init="zeros")
        self._init_ttt(cfg, rngs)

    def _init_weights(self):
        return dict(W1_0=self.w1_0[...], b1_0=self.b1_0[...], W2_0=self.w2_0[...], b2_0=self.b2_0[...])

    def initial_state(self, batch):
        return ttt_mlp_init_state(*self._init_weights().values(), batch)

    def memory(self, q, k, v, gates, state):
        (eta,) = gates
        ln = self._ln()
        if state is None:
            return ttt_mlp(q, k, v, eta, **self._init_weights(), **ln, inner_step=self.inner_step)
        if q.shape[1] == 1:
            o, state = ttt_mlp_step(q[:, 0], k[:, 0], v[:, 0], eta[:, 0], state, **ln, inner_step=self.inner_step)
            return o[:, None], state
        return ttt_mlp(q, k, v, eta, initial_state=state, **ln, inner_step=self.inner_step)
