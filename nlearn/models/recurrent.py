"""Recurrent LMs: the shared backbone with a memory mixer in place of attention."""

from __future__ import annotations


from nlearn.layers.memory_mixer import (DeltaNetMixer, LinearAttentionMixer, NeuralMemoryMixer, TTTLinearMixer,
                                        TTTMLPMixer)
from nlearn.memory_config import validate_inner_step, validate_neural_memory
from nlearn.models import register


def _mixer(cls, **kwargs):
    return lambda cfg, layer_index, rngs: cls(cfg, rngs=rngs, **kwargs)


register("linear_attention", _mixer(LinearAttentionMixer))
register("deltanet", _mixer(DeltaNetMixer))
register("gated_deltanet", _mixer(DeltaNetMixer, gated=True))
register("titans_lmm", _mixer(NeuralMemoryMixer), validate_neural_memory)
register("ttt_linear", _mixer(TTTLinearMixer))
register("ttt_mlp", _mixer(TTTMLPMixer), lambda config: validate_inner_step(config.model.memory))
