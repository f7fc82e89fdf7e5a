"""Pure functional memory ops (no Flax, no configs)."""

from nlearn.memory.delta import delta_rule, delta_rule_step, gated_delta_rule, gated_delta_rule_step, unit_lower_inverse
from nlearn.memory.linear_attention import LinearAttentionState, linear_attention, linear_attention_step
from nlearn.memory.ttt import TTTState, ttt_linear, ttt_linear_init_state, ttt_linear_step
from nlearn.memory.ttt_mlp import TTTMLPState, TTTMLPWeights, ttt_mlp, ttt_mlp_init_state, ttt_mlp_step
from nlearn.memory.neural_memory import NeuralMemoryState, neural_memory, neural_memory_init_state, neural_memory_step
from nlearn.memory.self_referential import (
    SelfRefTitansState,
    self_referential_init_state,
    self_referential_titans,
    self_referential_titans_step,
)
