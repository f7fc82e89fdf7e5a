"""TTT-Linear (Sun et al. 2024): inner model x + LN(xW + b), mini-batch GD of 16 tokens.

Presets: tiny and the TTT paper's sizes 125m, 350m, 760m, 1.3b (Transformer backbone).
"""

from nlearn.memory_config import linear_memory, write_gate_options
from nlearn.presets import family_config

PRESETS = {
    # SwiGLU width 576 (the default is 704): within 5% of the tiny Transformer++'s parameters.
    "tiny": dict(d_model=256, num_layers=4, num_heads=4, mlp_dim=576),
    "125m": dict(d_model=768, num_layers=12, num_heads=12, tie_embeddings=False),
    "350m": dict(d_model=1024, num_layers=24, num_heads=16, tie_embeddings=False),
    "760m": dict(d_model=1536, num_layers=24, num_heads=16, tie_embeddings=False),
    "1.3b": dict(d_model=2048, num_layers=22, num_heads=32, tie_embeddings=False),
}


def get_config(preset: str = "tiny"):
    return family_config("ttt_linear", PRESETS, preset,
                         memory=linear_memory(minibatch=16, base_lr=1.0, **write_gate_options()))
