"""`NeuralMemoryMixer`: the Titans long-term memory (`nlearn.memory.neural_memory`) as a token mixer."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from nlearn.layers.core import Dense, param
from nlearn.layers.mixers.base import MemoryMixer, l2_normalize
from nlearn.memory.inner_optimizers import get_inner_optimizer
from nlearn.memory.neural_memory import init_state as neural_memory_init_state
from nlearn.memory.neural_memory import neural_memory, neural_memory_step
from nlearn.memory.objectives import get_objective


class NeuralMemoryMixer(MemoryMixer):
    """Titans long-term memory (LMM): an MLP memory trained while reading.

    q, k, v get SiLU and q, k an L2 norm (Titans §4.4); per-token, per-head gates are
    `eta = max_lr * sigmoid(x W_eta)` (`memory.lr_gate="hard_sigmoid"`: a ramp that closes exactly, the write
    gate `train.write_penalty` charges), `mu = sigmoid(x W_mu)` (momentum), `alpha = sigmoid(x W_alpha)`
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
        self.write_gate_kind = mem.get("lr_gate", "sigmoid")
        self.init_gate_conv(cfg, rngs)

    def featurize(self, q, k, v):
        return l2_normalize(jax.nn.silu(q)), l2_normalize(jax.nn.silu(k)), jax.nn.silu(v)

    def write_logits(self, x_BTD):
        return self.lr_gate(x_BTD)

    def gates(self, x_BTD):
        sig = lambda dense: None if dense is None else jax.nn.sigmoid(dense(x_BTD).astype(jnp.float32))  # noqa: E731
        lr = self.max_lr * self.write_gate(self.write_logits(x_BTD).astype(jnp.float32))
        return lr, sig(self.momentum_gate), sig(self.decay_gate)

    def _weights0(self):
        return tuple(w[...] for w in self.weights0)

    def inner_objective(self):
        return get_objective(self.options["objective"])

    def initial_state(self, batch):
        return neural_memory_init_state(self._weights0(), batch, minibatch=self.options["minibatch"],
                                        inner_step=self.options["inner_step"])

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
