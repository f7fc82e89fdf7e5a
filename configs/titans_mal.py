"""Titans MAL (memory as a layer): the neural memory, then sliding-window attention over
[persistent ‖ memory output] (eq. 31, paper-size presets), or on x + memory output with a residual
around the memory (tiny). docs/titans.md compares the forms.

Presets: tiny, 170m, 340m, 400m, 760m (Titans paper sizes; 32k vocabulary, untied head).
  nlearn-train --config=configs/titans_mal.py:tiny --workdir=runs/mal
Ablate with one override: --config.model.mal_attn_input=m, --config.model.window=32, --config.model.num_persistent=0,
--config.model.attn_conv_size=0, --config.model.memory.optimizer=sgd, .minibatch=4, .depth=1, .decay=False.
"""

from nlearn.memory_config import neural_memory_config
from nlearn.presets import family_config

# window and num_persistent are not given in the paper; tiny keeps "x+m", as tuned (docs/titans.md).
TINY = dict(window=64, num_persistent=4, attn_conv_size=4, mal_attn_input="x+m")
PAPER = dict(window=512, num_persistent=16, attn_conv_size=4, mal_attn_input="m")

PRESETS = {
    "tiny": dict(d_model=256, num_layers=4, num_heads=4, **TINY),
    "170m": dict(d_model=768, num_layers=12, num_heads=12, tie_embeddings=False, **PAPER),
    "340m": dict(d_model=1024, num_layers=15, num_heads=16, tie_embeddings=False, **PAPER),
    "400m": dict(d_model=1024, num_layers=18, num_heads=16, tie_embeddings=False, **PAPER),
    "760m": dict(d_model=1536, num_layers=16, num_heads=16, tie_embeddings=False, **PAPER),
}


def get_config(preset: str = "tiny"):
    return family_config("titans_mal", PRESETS, preset, memory=neural_memory_config())
