"""`TTTMixer`: what the TTT mixers share (the inner LayerNorm's affine, the per-token inner rate)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from nlearn.layers.core import Dense, param
from nlearn.layers.mixers.base import MemoryMixer
from nlearn.memory.objectives import l2


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
        self.write_gate_kind = cfg.memory.get("lr_gate", "sigmoid")  # the gate train.write_penalty charges
        self.init_gate_conv(cfg, rngs)

    def write_logits(self, x_BTD):
        return self.lr_gate(x_BTD)

    def gates(self, x_BTD):
        eta = self.write_gate(self.write_logits(x_BTD).astype(jnp.float32))
        return (self.base_lr * eta / self.head_dim,)

    def _ln(self):
        return dict(ln_scale=self.ln_scale[...], ln_bias=self.ln_bias[...], minibatch=self.minibatch)

    def inner_objective(self):
        return l2  # 1/2 |f(k) - v|^2, f = k + LN(inner model(k))
