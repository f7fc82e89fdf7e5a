"""Gated DeltaNet: the gated delta rule (decay + delta correction). Presets: tiny, 340m, 760m.

  nlearn-train --config=configs/gated_deltanet.py:tiny --workdir=runs/gated_deltanet
"""

from nlearn.memory_config import linear_memory
from nlearn.presets import family_config

PRESETS = {
    # SwiGLU width 640 (the default is 704): within 5% of the tiny Transformer++'s parameters.
    "tiny": dict(d_model=256, num_layers=4, num_heads=4, mlp_dim=640),
    # Gated DeltaNet paper sizes (Yang et al. 2025), 32k vocabulary, untied head.
    "340m": dict(d_model=1024, num_layers=24, num_heads=8, mlp_dim=2048, tie_embeddings=False),
    "760m": dict(d_model=1536, num_layers=24, num_heads=12, tie_embeddings=False),
}


def get_config(preset: str = "tiny"):
    return family_config("gated_deltanet", PRESETS, preset, memory=linear_memory(
        qk_activation="silu", beta_min=0.0, beta_gate="sigmoid", gate_conv=False))
