"""Default `config.model.memory` sections of the memory families (one-line overridable)."""

from __future__ import annotations

import ml_collections


def linear_memory(**overrides) -> ml_collections.ConfigDict:
    """Options shared by the matrix-memory mixers (linear attention, delta rules, TTT-Linear)."""
    c = ml_collections.ConfigDict()
    c.conv_size = 4  # short causal depthwise conv on q, k, v; 0 disables
    c.chunk_size = 64  # tokens per chunk of the chunked op
    c.normalize = False  # linear attention only: divide by q . sum(k)
    c.update(overrides)
    return c
