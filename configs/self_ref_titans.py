"""Self-referential Titans (Nested Learning §8, docs/self_referential.md §1): memories that generate their own keys,
values, learning rates, retention and targets, trained in context by DGD in chunks.

Presets: tiny, 340m, 760m, 1.3b. Every choice of docs/self_referential.md §1 is a one-line override, e.g.
--config.model.memory.read=before_write|chunk_start, .dgd=False, .dgd_output=True, .self_targets=False,
.adaptive_q=True, .chunk_memory=8, .chunk_other=32, .lr_max=0.25, .expansion=2, .activation=silu.

  nlearn-train --config=configs/self_ref_titans.py:tiny --workdir=runs/self_ref_titans
"""

from nlearn.models.self_referential import PRESETS, TINY_MEMORY, TINY_TRAIN, memory_config
from nlearn.presets import family_config


def get_config(preset: str = "tiny"):
    tiny = preset == "tiny"
    return family_config("self_ref_titans", PRESETS, preset, memory=memory_config(**(TINY_MEMORY if tiny else {})),
                         train=TINY_TRAIN if tiny else None)
