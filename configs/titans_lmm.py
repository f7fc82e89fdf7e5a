"""Titans LMM: the neural long-term memory alone as the token mixer.

Presets: tiny, 170m, 340m, 400m, 760m (Titans paper sizes). Ablate the inner learner with one
override, e.g. --config.model.memory.optimizer=sgd|momentum|dgd, .objective=dot, .minibatch=4,
.depth=3, .decay=False.
"""

from nlearn.memory_config import neural_memory_config
from nlearn.presets import family_config

PRESETS = {
    "tiny": dict(d_model=256, num_layers=4, num_heads=4),
    "170m": dict(d_model=768, num_layers=14, num_heads=12, tie_embeddings=False),
    "340m": dict(d_model=1024, num_layers=20, num_heads=16, tie_embeddings=False),
    "400m": dict(d_model=1024, num_layers=24, num_heads=16, tie_embeddings=False),
    "760m": dict(d_model=1536, num_layers=22, num_heads=16, tie_embeddings=False),
}


def get_config(preset: str = "tiny"):
    return family_config("titans_lmm", PRESETS, preset, memory=neural_memory_config())
