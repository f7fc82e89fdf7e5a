"""Transformer++: RoPE, SwiGLU, RMSNorm, causal (optionally sliding-window) attention."""

from __future__ import annotations

import math

from nlearn.errors import UserError
from nlearn.layers.attention import Attention
from nlearn.layers.core import head_dim
from nlearn.models.registry import register
from nlearn.models import flops


def make_attention(cfg, layer_index: int, rngs):
    return Attention(cfg.d_model, cfg.num_heads, head_dim(cfg), window=cfg.window,
                     rope_theta=cfg.rope_theta, std=cfg.init_std,
                     out_std=cfg.init_std / math.sqrt(2 * cfg.num_layers), rngs=rngs)


def validate(config) -> None:
    if head_dim(config.model) % 2:
        raise UserError(f"invalid config value model.head_dim={head_dim(config.model)}: "
                        "RoPE needs an even head dimension")


register("transformer", make_attention, validate, sequence_parallel=True,
         flops=flops.per_head(lambda cfg, t, d, be: 3.0 * flops.causal_attention(t, d, cfg.window)))
