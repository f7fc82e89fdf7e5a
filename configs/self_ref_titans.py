"""Self-referential Titans (Nested Learning §8, HOPE.md §1): memories that generate their own keys,
values, learning rates, retention and targets, trained in context by DGD in chunks.

Presets: tiny, 340m, 760m, 1.3b. Every choice of HOPE.md §1 is a one-line override, e.g.
--config.model.memory.read=before_write|chunk_start, .dgd=False, .self_targets=False,
.adaptive_q=True, .chunk_memory=8, .chunk_other=32, .lr_max=0.25, .expansion=2, .activation=silu.

  nlearn-train --config=configs/self_ref_titans.py:tiny --workdir=runs/self_ref_titans
"""

from nlearn.models.self_referential import memory_config
from nlearn.presets import family_config

PRESETS = {
    # SwiGLU width 512 and memories of hidden width head_dim (expansion 1) give the tiny
    # Transformer++'s parameter count (5.25M against 5.31M) and a step CPU can afford.
    "tiny": dict(d_model=256, num_layers=4, num_heads=4, mlp_dim=512),
    # Paper sizes, 32k vocabulary, untied head; memories of hidden width 4 * head_dim.
    "340m": dict(d_model=1024, num_layers=20, num_heads=16, mlp_dim=2560, tie_embeddings=False),
    "760m": dict(d_model=1536, num_layers=20, num_heads=16, tie_embeddings=False),
    "1.3b": dict(d_model=2048, num_layers=20, num_heads=16, tie_embeddings=False),
}
TINY_MEMORY = dict(expansion=1)

# Like titans_lmm's tiny preset: fewer steps of the same tokens keep `make train` near its budget.
TINY_TRAIN = dict(steps=75)


def get_config(preset: str = "tiny"):
    tiny = preset == "tiny"
    return family_config("self_ref_titans", PRESETS, preset, memory=memory_config(**(TINY_MEMORY if tiny else {})),
                         train=TINY_TRAIN if tiny else None)
