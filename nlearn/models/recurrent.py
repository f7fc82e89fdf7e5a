"""Recurrent LMs: the shared backbone with a memory mixer in place of attention."""

from __future__ import annotations


from nlearn.layers.mixers import (DeltaNetMixer, LinearAttentionMixer, NeuralMemoryMixer, TTTLinearMixer,
                                        TTTMLPMixer)
from nlearn.memory_config import PAPER_STEP, WRITE_GATE_MIGRATIONS, validate_inner_step, validate_neural_memory
from nlearn.models.registry import register
from nlearn.models import flops


def _mixer(cls, **kwargs):
    return lambda cfg, layer_index, rngs: cls(cfg, rngs=rngs, **kwargs)


# Keys the delta rules gained after runs were saved, with the value such a run trained with.
DELTA_MIGRATIONS = (("model.memory.qk_activation", "silu"), ("model.memory.beta_min", 0.0),
                    ("model.memory.beta_gate", "sigmoid"), ("model.memory.gate_conv", False))
_delta_flops = flops.per_head(lambda cfg, t, d, backend: flops.delta_rule(t, d, cfg.memory.chunk_size, backend))

register("linear_attention", _mixer(LinearAttentionMixer), sequence_parallel=True,
         flops=flops.per_head(lambda cfg, t, d, be: 3.0 * flops.linear_attention(t, d, cfg.memory.chunk_size)))
register("deltanet", _mixer(DeltaNetMixer), flops=_delta_flops, sequence_parallel=True, write_cost=True,
         migrations=DELTA_MIGRATIONS)
register("gated_deltanet", _mixer(DeltaNetMixer, gated=True), flops=_delta_flops, sequence_parallel=True,
         write_cost=True, migrations=DELTA_MIGRATIONS)
register("titans_lmm", _mixer(NeuralMemoryMixer), validate_neural_memory, write_cost=True,
         migrations=(PAPER_STEP, *WRITE_GATE_MIGRATIONS),
         flops=flops.per_head(lambda cfg, t, d, be: flops.neural_memory(t, d, cfg.memory)))
register("ttt_linear", _mixer(TTTLinearMixer), write_cost=True, migrations=WRITE_GATE_MIGRATIONS,
         flops=flops.per_head(lambda cfg, t, d, be: 3.0 * flops.ttt_linear(t, d, cfg.memory.minibatch)))
register("ttt_mlp", _mixer(TTTMLPMixer), lambda config: validate_inner_step(config.model.memory),
         migrations=(PAPER_STEP, *WRITE_GATE_MIGRATIONS), write_cost=True,
         flops=flops.per_head(lambda cfg, t, d, be: 3.0 * flops.ttt_mlp(t, d, cfg.memory.expansion * d,
                                                                       cfg.memory.minibatch)))
