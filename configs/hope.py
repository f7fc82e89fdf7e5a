"""Hope (Nested Learning §8.3, docs/self_referential.md §2-3): self-referential Titans followed by a Continuum Memory
System, a chain of MLP levels that keep learning in context every `C_ℓ` tokens.

Presets: tiny, 340m, 760m, 1.3b. Overrides, each one line:
--config.model.cms.update=none (a static chain), --config.model.cms.periods='(16,64)'
--config.model.cms.lr='(1e-3,1e-3)' (one entry per level; widths=() splits the MLP width),
--config.model.hope.mixer=attention (Hope-Attention), and the self-referential memory's keys
(--config.model.memory.dgd=False, .self_targets=False, .adaptive_q=True, ...).

  nlearn-train --config=configs/hope.py:tiny --workdir=runs/hope
"""

from nlearn.models.hope import cms_config, hope_config
from nlearn.models.self_referential import PRESETS, TINY_MEMORY, TINY_TRAIN, memory_config
from nlearn.presets import family_config

TINY_CMS = dict(periods=(16, 64, 128))  # every level updates inside a 256-token training window


def get_config(preset: str = "tiny"):
    tiny = preset == "tiny"
    config = family_config("hope", PRESETS, preset, memory=memory_config(**(TINY_MEMORY if tiny else {})),
                           train=TINY_TRAIN if tiny else None)
    with config.unlocked():
        config.model.cms = cms_config(**(TINY_CMS if tiny else {}))
        config.model.hope = hope_config()
    config.lock()
    return config
