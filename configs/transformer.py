"""Transformer++ baseline (RoPE, SwiGLU, RMSNorm). Presets: tiny, 125m, 340m, 760m.

  nlearn-train --config=configs/transformer.py:tiny --workdir=runs/tf --config.train.steps=100
"""

from nlearn.presets import family_config

PRESETS = {
    # Trains on 2 CPU cores in a few minutes (the `make train` comparison baseline).
    "tiny": dict(d_model=256, num_layers=4, num_heads=4),
    # Sizes of the Transformer++ baselines in the GLA / DeltaNet papers (32k vocabulary).
    "125m": dict(d_model=768, num_layers=12, num_heads=12, tie_embeddings=False),
    "340m": dict(d_model=1024, num_layers=24, num_heads=16, tie_embeddings=False),
    "760m": dict(d_model=1536, num_layers=24, num_heads=24, tie_embeddings=False),
}


def get_config(preset: str = "tiny"):
    return family_config("transformer", PRESETS, preset)
