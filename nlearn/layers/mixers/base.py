"""Token mixers that call a memory op: the layers make q, k, v and gates, the ops do the math.

Shared wiring (DeltaNet / Titans style): q, k, v projections -> short causal depthwise conv ->
a family-specific featurization (elu+1, or SiLU + L2 norm) -> the op -> per-head RMSNorm ->
SiLU output gate -> output projection. Decoding feeds the op's state through the cache.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from nlearn.layers.conv import ShortConv, causal_conv_over_sequence, gate_conv
from nlearn.layers.core import Dense, RMSNorm, head_dim
from nlearn.memory import sequence_parallel as sp


def l2_normalize(x, eps: float = 1e-6):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


# A write gate in [0, 1] from its logit z (`memory.beta_gate` of the delta rules, `memory.lr_gate` of the Titans
# and TTT memories): "hard_sigmoid" reaches exactly 0, and a token written with strength 0 leaves the state as it
# was however many such tokens follow, where sigmoid's small writes still wear it down.
WRITE_GATES = {"sigmoid": jax.nn.sigmoid, "hard_sigmoid": jax.nn.hard_sigmoid}
# What `train.write_penalty` charges per token and head (nlearn.train.write_penalty): sigmoid's value;
# hard_sigmoid's ramp unclipped at 1 (a gate stuck open still feels the cost) and shifted by a unit, so a
# closed gate is pushed a unit past its edge and a small drift of its input does not reopen it.
WRITE_COSTS = {"sigmoid": jax.nn.sigmoid, "hard_sigmoid": lambda z: jax.nn.relu(z + 4.0) / 6.0}


class MemoryMixer(nnx.Module):
    """Base class: projections, convs, output norm and gate.

    Subclasses define `initial_state(batch)` (the memory's state before any token) and
    `memory(q, k, v, gates, state) -> (o, state)` (the op over `[B, T, H, D]` inputs), and may
    override `featurize` and `gates`. A memory whose writes one gate scales sets `write_gate_kind` and
    defines `write_logits(gate_in_BTD) -> [B, T, H]`: `train.write_penalty` then charges the gate's mean cost
    (`write_cost`), and `memory.gate_conv` (`init_gate_conv`) lets its gates read the last few tokens.
    """

    write_gate_kind = None  # a key of WRITE_GATES for a memory with a write gate
    record_writes = False  # set by train.write_penalty's step: `project` then sows the mean write cost
    defer_writes = False  # the caller reports the cost itself (`heads` returns it in the cache: Titans MAC)

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
    def init_gate_conv(self, cfg, rngs: nnx.Rngs) -> None:
        """`memory.gate_conv=True`: the gates read `nlearn.layers.conv.gate_conv` of the input. Subclasses call it
        last in `__init__`, so the other parameters draw as without it."""
        conv = gate_conv(cfg, rngs)
        if conv is not None:
            self.gate_conv = conv

    def write_gate(self, z_BTH):
        """The write strength in [0, 1] from its logits."""
        return WRITE_GATES[self.write_gate_kind](z_BTH)

    def write_cost(self, gate_in_BTD):
        """The mean over tokens and heads of what `train.write_penalty` charges for the writes."""
        return jnp.mean(WRITE_COSTS[self.write_gate_kind](self.write_logits(gate_in_BTD).astype(jnp.float32)))

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        width = self.num_heads * self.head_dim
        convs = [conv.init_cache(batch, width, dtype) for conv in self.convs]
        if self.gate_conv is not None:  # last in the list, after q, k and v's
            convs.append(self.gate_conv.init_cache(batch, self.gate_conv.weight.shape[1], dtype))
        return {"convs": convs, "state": self.initial_state(batch)}

    def project(self, x_BTD, cache=None, with_cost: bool = False):
        """What the op reads and writes: `(q, k, v [B, T, H, D], gates, conv caches, write cost)`; the cost is
        None unless `record_writes`, then returned `with_cost` and sown otherwise."""
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
        out = (*self.featurize(*qkv), self.gates(gate_in), conv_caches)
        if not (self.record_writes and self.write_gate_kind is not None):
            return out + (None,)
        if with_cost:
            return out + (self.write_cost(gate_in),)
        self.sow(nnx.Intermediate, "sown_write_cost", self.write_cost(gate_in))
        return out + (None,)

    def heads(self, x_BTD, cache=None):
        """The memory's read per head, RMS-normalised, `[B, T, H, D]`, and the new cache (with the write
        cost under "write_cost" where the caller reports it: `defer_writes`)."""
        if cache is None and sp.context_axis_size() > 1:
            return self.out_norm(self._heads_over_sequence(x_BTD)), None
        q, k, v, gates, conv_caches, cost = self.project(x_BTD, cache, with_cost=self.defer_writes)
        state = None if cache is None else cache["state"]
        o, state = self.memory(q, k, v, gates, state)
        new = None if cache is None else {"convs": conv_caches, "state": state}
        if cost is not None and new is not None:
            new["write_cost"] = cost
        return self.out_norm(o), new

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
        if self.record_writes and self.write_gate_kind is not None:
            self.sow(nnx.Intermediate, "sown_write_cost", self.write_cost(gate_in))
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
        q, k, v, gates, _, _ = self.project(x_BTD, cache)
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
