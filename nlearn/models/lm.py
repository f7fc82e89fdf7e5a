"""The language-model backbone every family shares: embed -> blocks -> norm -> head.

A block is pre-norm residual `x + mixer(norm(x))` then `x + mlp(norm(x))`; families differ only
in the mixer (attention, a memory op, a Titans wiring), chosen through the registry.
"""

from __future__ import annotations

import math
from typing import Callable

import jax.numpy as jnp
from flax import nnx

from nlearn.layers.core import Dense, Embed, RMSNorm, SwiGLU, swiglu_width


class Block(nnx.Module):
    """Pre-norm residual block around one token mixer and a SwiGLU MLP."""

    def __init__(self, cfg, mixer: nnx.Module, *, rngs: nnx.Rngs):
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.mixer_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.mixer = mixer
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.mlp = SwiGLU(cfg.d_model, swiglu_width(cfg.d_model, cfg.mlp_dim), std=std,
                          out_std=out_std, rngs=rngs)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        return self.mixer.init_cache(batch, max_len, dtype)

    def __call__(self, x_BTD, cache=None):
        y, cache = self.mixer(self.mixer_norm(x_BTD), cache)
        x_BTD = x_BTD + y
        return x_BTD + self.mlp(self.mlp_norm(x_BTD)), cache


MixerFactory = Callable[..., nnx.Module]  # (model_cfg, layer_index, rngs) -> mixer module


class LanguageModel(nnx.Module):
    """Maps int tokens `[B, T]` to float32 logits `[B, T, V]`; `decode` carries a cache."""

    def __init__(self, cfg, make_mixer: MixerFactory, *, rngs: nnx.Rngs):
        self.remat = cfg.remat
        self.embed = Embed(cfg.vocab_size, cfg.d_model, std=cfg.init_std, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, make_mixer(cfg, i, rngs), rngs=rngs)
                                for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.head = None if cfg.tie_embeddings else Dense(
            cfg.d_model, cfg.vocab_size, axes=("embed", "vocab"), std=cfg.init_std, rngs=rngs)

    def _logits(self, x_BTD):
        x_BTD = self.final_norm(x_BTD)
        logits = self.embed.attend(x_BTD) if self.head is None else self.head(x_BTD)
        return logits.astype(jnp.float32)

    def __call__(self, tokens_BT):
        x = self.embed(tokens_BT, self.embed.table[...].dtype)
        for block in self.blocks:
            if self.remat:
                x = nnx.remat(lambda blk, h: blk(h)[0])(block, x)
            else:
                x = block(x)[0]
        return self._logits(x)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        """Per-layer decoding state: KV ring buffers for attention, memory states for the rest."""
        return [block.init_cache(batch, max_len, dtype) for block in self.blocks]

    def decode(self, tokens_BT, cache, probe=None):
        """Feed `tokens [B, T]` (a prompt, or one new token) after what `cache` holds. `probe(block,
        x_BTD, layer_cache)`, if given, sees every block's input before the block runs (diagnostics)."""
        x = self.embed(tokens_BT, self.embed.table[...].dtype)
        new_cache = []
        for block, layer_cache in zip(self.blocks, cache):
            if probe is not None:
                probe(block, x, layer_cache)
            x, layer_cache = block(x, layer_cache)
            new_cache.append(layer_cache)
        return self._logits(x), new_cache
