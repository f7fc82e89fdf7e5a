"""The memory mixers' former home, kept so that older imports work: they live in `nlearn.layers.mixers`."""

from nlearn.layers.mixers import (DeltaNetMixer, LinearAttentionMixer, MemoryMixer, NeuralMemoryMixer,  # noqa: F401
                                  TTTLinearMixer, TTTMixer, TTTMLPMixer, l2_normalize)
