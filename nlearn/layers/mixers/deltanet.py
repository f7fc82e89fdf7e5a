"""`DeltaNetMixer`: the (gated) delta rule (`nlearn.memory.delta`) as a token mixer."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from nlearn.layers.core import Dense
from nlearn.layers.mixers.base import MemoryMixer, l2_normalize
from nlearn.memory import sequence_parallel as sp
from nlearn.memory.delta import delta_rule, delta_rule_step, gated_delta_rule, gated_delta_rule_step
from nlearn.memory.objectives import l2


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

    def __init__(self, cfg, *, gated: bool = False, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.beta = Dense(cfg.d_model, self.num_heads, axes=("embed", "heads"), std=cfg.init_std, rngs=rngs)
        self.gated = gated
        self.qk_activation = self.QK_ACTIVATIONS[cfg.memory.get("qk_activation", "silu")]
        self.beta_min = float(cfg.memory.get("beta_min", 0.0))
        self.write_gate_kind = cfg.memory.get("beta_gate", "sigmoid")
        if gated:
            self.decay = Dense(cfg.d_model, self.num_heads, axes=("embed", "heads"), std=cfg.init_std, rngs=rngs)
            # Mamba-2 style init: A in [1, 16], softplus(dt_bias) in [1e-3, 0.1] (log-uniform).
            a = jax.random.uniform(rngs.params(), (self.num_heads,), minval=1.0, maxval=16.0)
            self.a_log = nnx.Param(jnp.log(a), out_sharding=("heads",), eager_sharding=False)
            dt = jnp.exp(jax.random.uniform(rngs.params(), (self.num_heads,),
                                            minval=math.log(1e-3), maxval=math.log(0.1)))
            self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)), out_sharding=("heads",), eager_sharding=False)
        self.init_gate_conv(cfg, rngs)

    def featurize(self, q, k, v):
        return l2_normalize(self.qk_activation(q)), l2_normalize(self.qk_activation(k)), jax.nn.silu(v)

    def write_logits(self, x_BTD):
        return self.beta(x_BTD)

    def gates(self, x_BTD):
        beta = self.beta_min + (1.0 - self.beta_min) * self.write_gate(self.write_logits(x_BTD).astype(jnp.float32))
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
