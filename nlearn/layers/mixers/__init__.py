"""The memory mixers, one per file: the layers make q, k, v and gates, the ops in `nlearn.memory` do the math."""

from nlearn.layers.mixers.base import MemoryMixer, l2_normalize
from nlearn.layers.mixers.deltanet import DeltaNetMixer
from nlearn.layers.mixers.linear_attention import LinearAttentionMixer
from nlearn.layers.mixers.neural_memory import NeuralMemoryMixer
from nlearn.layers.mixers.ttt import TTTMixer
from nlearn.layers.mixers.ttt_linear import TTTLinearMixer
from nlearn.layers.mixers.ttt_mlp import TTTMLPMixer

__all__ = ["MemoryMixer", "l2_normalize", "DeltaNetMixer", "LinearAttentionMixer", "NeuralMemoryMixer", "TTTMixer",
           "TTTLinearMixer", "TTTMLPMixer"]
