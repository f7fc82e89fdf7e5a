"""The self-referential Titans token mixer (Nested Learning §8; docs/self_referential.md §1): the layer around
`nlearn.memory.self_referential_titans`.

Projections to per-head memory inputs x and queries q -> short causal depthwise convs -> SiLU and
L2 norm -> the op (memories that generate their own keys, values, learning rates, retention and
targets; with `read_residual=False` its read minus the skip q) -> per-head RMSNorm -> SiLU output
gate -> output projection. The memories' initial weights and the lr / retain biases are parameters
the outer loop meta-learns; decoding carries the op's state (constant size) in the cache.

`memory.lr_gate` ("sigmoid" or "hard_sigmoid"; "none" by default) adds a layer write gate g_t = gate(x_t W_g + b)
that scales each token's whole step inside the op (a closed gate leaves every memory as it was), the gate that
`train.write_penalty` charges; `memory.gate_conv=True` lets it read a short causal conv of the input.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from nlearn.layers.conv import ShortConv, gate_conv
from nlearn.layers.core import Dense, RMSNorm, param
from nlearn.layers.mixers import l2_normalize
from nlearn.layers.mixers.base import WRITE_COSTS, WRITE_GATES
from nlearn.memory.self_referential import (SCALAR_MEMORIES, init_state, memory_names, self_referential_titans,
                                            self_referential_titans_step)


def logit(p: float) -> float:
    return math.log(p) - math.log1p(-p)


GATE_OPEN_BIAS = 3.0  # the write gate's bias at initialisation: open (hard_sigmoid 1, sigmoid 0.95)


class SelfReferentialMixer(nnx.Module):
    """`__call__(x [B, T, d_model], cache=None) -> (y [B, T, d_model], cache)`.

    The memories start small (docs/self_referential.md "Numerics": larger initial weights let self-generated targets
    blow the fast weights up within tens of tokens): `W_in ~ N(0, 1/D)`, `W_out ~ N(0, 0.02²)`, so
    every residual memory starts near the identity and lr / retain near `sigmoid(bias)`. The retain
    bias starts at `logit(memory.retain_init)` (near 1: little forgetting) and the lr bias at
    `logit(memory.lr_init)` (lr_t ≈ lr_max · lr_init at first). A write gate (`memory.lr_gate`) starts open.
    """

    record_writes = False  # set by train.write_penalty's step: the layer then sows its gate's mean write cost

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        mem = cfg.memory
        self.num_heads = h = cfg.num_heads
        self.head_dim = d = cfg.head_dim or cfg.d_model // cfg.num_heads
        width = h * d
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.x_proj = Dense(cfg.d_model, width, axes=("embed", "heads"), std=cfg.init_std, rngs=rngs)
        self.q_proj = Dense(cfg.d_model, width, axes=("embed", "heads"), std=cfg.init_std, rngs=rngs)
        self.convs = nnx.List([ShortConv(width, mem.conv_size, init=mem.conv_init, rngs=rngs) for _ in range(2)]
                              if mem.conv_size else [])
        hidden = mem.expansion * d
        names = memory_names(mem.adaptive_q)
        self.w_in = nnx.Dict({name: param(rngs, (h, d, hidden), ("heads", None, None), std=1.0 / math.sqrt(d))
                              for name in names})
        self.w_out = nnx.Dict({name: param(rngs, (h, hidden, 1 if name in SCALAR_MEMORIES else d),
                                           ("heads", None, None), std=0.02) for name in names})
        self.lr_bias = nnx.Param(jnp.full((h,), logit(mem.lr_init), jnp.float32), out_sharding=("heads",),
                                 eager_sharding=False)
        self.retain_bias = nnx.Param(jnp.full((h,), logit(mem.retain_init), jnp.float32), out_sharding=("heads",),
                                     eager_sharding=False)
        self.out_norm = RMSNorm(d, eps=cfg.norm_eps, axes=("kv",), overflow_safe=True, rngs=rngs)
        self.gate = Dense(cfg.d_model, width, axes=("embed", "heads"), std=cfg.init_std, rngs=rngs)
        self.o = Dense(width, cfg.d_model, axes=("heads", "embed"), std=out_std, rngs=rngs)
        self.options = dict(lr_max=mem.lr_max, chunk_memory=mem.chunk_memory, chunk_other=mem.chunk_other,
                            activation=mem.activation, dgd=mem.dgd, dgd_output=mem.dgd_output, read=mem.read,
                            self_targets=mem.self_targets, adaptive_q=mem.adaptive_q, targets=mem.targets,
                            inner_step=mem.inner_step, retain_to=mem.retain_to)
        self.read_residual = mem.read_residual
        # Last, so the other parameters draw as without them.
        kind = mem.get("lr_gate", "none")
        self.write_gate_kind = None if kind == "none" else kind
        self.lr_gate, self.gate_conv = nnx.data(None), nnx.data(None)
        if self.write_gate_kind is not None:
            self.lr_gate = Dense(cfg.d_model, h, axes=("embed", "heads"), bias=True, std=cfg.init_std, rngs=rngs)
            self.lr_gate.bias[...] = jnp.full((h,), GATE_OPEN_BIAS, jnp.float32)
            conv = gate_conv(cfg, rngs)
            if conv is not None:
                self.gate_conv = conv

    def weights0(self) -> dict:
        """`{memory: (W_in [H, D, Dh], W_out [H, Dh, D_out])}`, the op's initial weights."""
        return {name: (self.w_in[name][...], self.w_out[name][...]) for name in self.w_in}

    def _biases(self) -> dict:
        return dict(lr_bias=self.lr_bias[...], retain_bias=self.retain_bias[...])

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        """The conv windows and the op's state: the same size whatever the stream's length."""
        width = self.num_heads * self.head_dim
        convs = [conv.init_cache(batch, width, dtype) for conv in self.convs]
        if self.gate_conv is not None:  # last in the list, after x and q's
            convs.append(self.gate_conv.init_cache(batch, self.gate_conv.weight.shape[1], dtype))
        return {"convs": convs, "state": init_state(self.weights0(), batch)}

    def _inputs(self, x_BTD, cache):
        """Per-head memory inputs and queries `[B, T, H, D]` (float32) and the new conv caches."""
        b, t, _ = x_BTD.shape
        out, conv_caches = [], []
        for i, proj in enumerate((self.x_proj, self.q_proj)):
            z = proj(x_BTD)
            if self.convs:
                z, c = self.convs[i](z, None if cache is None else cache["convs"][i])
                conv_caches.append(c)
            z = z.reshape(b, t, self.num_heads, self.head_dim).astype(jnp.float32)
            out.append(l2_normalize(jax.nn.silu(z)))
        return out[0], out[1], conv_caches

    def _write_gate(self, x_BTD, cache, conv_caches):
        """The write gate `[B, T, H]` (None without `memory.lr_gate`); sows its cost while `record_writes`."""
        if self.write_gate_kind is None:
            return None
        gate_in = x_BTD
        if self.gate_conv is not None:
            gate_in, c = self.gate_conv(x_BTD, None if cache is None else cache["convs"][len(self.convs)])
            conv_caches.append(c)
        z = self.write_logits(gate_in)
        if self.record_writes:
            self.sow(nnx.Intermediate, "sown_write_cost", jnp.mean(WRITE_COSTS[self.write_gate_kind](z)))
        return WRITE_GATES[self.write_gate_kind](z)

    def write_logits(self, gate_in_BTD):
        """The write gate's logits `[B, T, H]` (float32) from its input (x, or its conv with `gate_conv`)."""
        return self.lr_gate(gate_in_BTD).astype(jnp.float32)

    def _memory(self, x, q, gate, state):
        if state is None:  # training: the whole window from the learned initial weights
            return self_referential_titans(x, q, weights0=self.weights0(), write_gate=gate, **self._biases(),
                                           **self.options)[0]
        if x.shape[1] == 1:  # decoding one token
            o, state = self_referential_titans_step(x[:, 0], q[:, 0], state=state, weights0=self.weights0(),
                                                    write_gate_t=None if gate is None else gate[:, 0],
                                                    **self._biases(), **self.options)
            return o[:, None], state
        # A prompt (or a stream resumed anywhere): the chunked form from the stream state.
        return self_referential_titans(x, q, weights0=self.weights0(), initial_state=state, return_stream_state=True,
                                       write_gate=gate, **self._biases(), **self.options)

    def __call__(self, x_BTD, cache=None):
        b, t, _ = x_BTD.shape
        x, q, conv_caches = self._inputs(x_BTD, cache)
        gate = self._write_gate(x_BTD, cache, conv_caches)
        if cache is None:
            o, new_cache = self._memory(x, q, gate, None), None
        else:
            o, state = self._memory(x, q, gate, cache["state"])
            new_cache = {"convs": conv_caches, "state": state}
        if not self.read_residual:  # the memory's learned part act(q W_in) W_out alone, without the skip q
            o = o - q
        o = self.out_norm(o).reshape(b, t, -1) * jax.nn.silu(self.gate(x_BTD).astype(jnp.float32))
        return self.o(o.astype(x_BTD.dtype)), new_cache
