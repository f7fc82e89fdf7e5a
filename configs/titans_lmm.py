"""Titans LMM: the neural long-term memory alone as the token mixer.

Presets: tiny, 170m, 340m, 400m, 760m (Titans paper sizes). Ablate the inner learner with one
override, e.g. --config.model.memory.optimizer=sgd|momentum|dgd|dgd_momentum, .objective=dot, .minibatch=4,
.depth=3, .decay=False.
"""

from nlearn.memory_config import neural_memory_config
from nlearn.presets import family_config

PRESETS = {
    # `make train`'s default; SwiGLU width 448 matches the tiny Transformer++'s parameters (5.34M vs 5.31M).
    "tiny": dict(d_model=256, num_layers=4, num_heads=4, mlp_dim=448),
    "170m": dict(d_model=768, num_layers=14, num_heads=12, tie_embeddings=False),
    "340m": dict(d_model=1024, num_layers=20, num_heads=16, tie_embeddings=False),
    "400m": dict(d_model=1024, num_layers=24, num_heads=16, tie_embeddings=False),
    "760m": dict(d_model=1536, num_layers=22, num_heads=16, tie_embeddings=False),
}


# The memory trains ~3x slower than attention on CPU: 75 steps keep `make train` near 10 minutes on 2 cores.
TINY_TRAIN = dict(steps=75)


def get_config(preset: str = "tiny"):
    return family_config("titans_lmm", PRESETS, preset, memory=neural_memory_config(),
                         train=TINY_TRAIN if preset == "tiny" else None)
