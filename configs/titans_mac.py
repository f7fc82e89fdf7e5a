"""Titans MAC (memory as a context): per segment of `model.segment_len` tokens, attention over
[persistent ‖ memory retrieval ‖ segment], then the memory learns from the attention output y and
gates it with its read of y (eqs. 21-25, the paper-size presets), or learns from the segment's tokens
x and adds its read to y (tiny, and the MQAR preset built on it). docs/titans.md compares the forms.

Presets: tiny, 170m, 340m, 400m, 760m (Titans paper sizes; 32k vocabulary, untied head).
  nlearn-train --config=configs/titans_mac.py:tiny --workdir=runs/mac
Ablate with one override: --config.model.segment_len=32, --config.model.num_persistent=0,
--config.model.mac_output=gate, --config.model.mac_memory_input=y, --config.model.mac_positions=segment,
--config.model.attn_conv_size=0, --config.model.memory.optimizer=sgd, .minibatch=4, .depth=1, .decay=False.
"""

from nlearn.memory_config import neural_memory_config
from nlearn.presets import family_config

# The paper's eqs. 24-25 (the keys are described in docs/titans.md).
PAPER_WIRING = dict(attn_conv_size=4, mac_output="gate", mac_memory_input="y", mac_positions="absolute")
# "add" with "x" recalls better at small scale (MQAR; docs/titans.md).
SMALL_WIRING = dict(attn_conv_size=4, mac_output="add", mac_memory_input="x", mac_positions="absolute")
TINY = dict(segment_len=64, num_persistent=4, **SMALL_WIRING)
PAPER = dict(segment_len=512, num_persistent=16, **PAPER_WIRING)

PRESETS = {
    "tiny": dict(d_model=256, num_layers=4, num_heads=4, **TINY),
    "170m": dict(d_model=768, num_layers=10, num_heads=12, tie_embeddings=False, **PAPER),
    "340m": dict(d_model=1024, num_layers=13, num_heads=16, tie_embeddings=False, **PAPER),
    "400m": dict(d_model=1024, num_layers=16, num_heads=16, tie_embeddings=False, **PAPER),
    "760m": dict(d_model=1536, num_layers=14, num_heads=16, tie_embeddings=False, **PAPER),
}


def get_config(preset: str = "tiny"):
    return family_config("titans_mac", PRESETS, preset, memory=neural_memory_config())
