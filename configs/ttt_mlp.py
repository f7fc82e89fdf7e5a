"""TTT-MLP (Sun et al. 2024): inner model x + LN(gelu(x W1 + b1) W2 + b2), hidden 4 x head_dim,
mini-batch GD of 16 tokens, inner rate base_lr 0.1 (the paper's choice for TTT-MLP).

Presets: tiny and the TTT paper's sizes 125m, 350m, 760m, 1.3b (Transformer backbone). The inner
MLP adds 8·head_dim² weights per head, so 125m, 350m and 760m have one or two layers fewer than
TTT-Linear's presets to stay near their named size (138M, 379M, 800M, 1.36B parameters).
"""

from nlearn.memory_config import linear_memory, write_gate_options
from nlearn.presets import family_config

PRESETS = {
    # SwiGLU width 448 (the default is 704): within 5% of the tiny Transformer++'s parameters.
    "tiny": dict(d_model=256, num_layers=4, num_heads=4, mlp_dim=448),
    "125m": dict(d_model=768, num_layers=11, num_heads=12, tie_embeddings=False),
    "350m": dict(d_model=1024, num_layers=22, num_heads=16, tie_embeddings=False),
    "760m": dict(d_model=1536, num_layers=22, num_heads=16, tie_embeddings=False),
    "1.3b": dict(d_model=2048, num_layers=22, num_heads=32, tie_embeddings=False),
}


def get_config(preset: str = "tiny"):
    return family_config("ttt_mlp", PRESETS, preset,
                         memory=linear_memory(minibatch=16, base_lr=0.1, expansion=4, inner_step="paper",
                                              **write_gate_options()))
