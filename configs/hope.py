"""Hope (Nested Learning §8.3, HOPE.md §2-3): self-referential Titans followed by a Continuum Memory
System, a chain of MLP levels that keep learning in context every `C_ℓ` tokens.

Presets: tiny, 340m, 760m, 1.3b. Overrides, each one line:
--config.model.cms.update=none (a static chain), --config.model.cms.periods='(16,64)'
--config.model.cms.lr='(1e-3,1e-3)' (one entry per level; widths=() splits the MLP width),
--config.model.hope.mixer=attention (Hope-Attention), and the self-referential memory's keys
(--config.model.memory.dgd=False, .self_targets=False, .adaptive_q=True, ...).

  nlearn-train --config=configs/hope.py:tiny --workdir=runs/hope
"""

from nlearn.models.hope import cms_config, hope_config
from nlearn.models.self_referential import memory_config
from nlearn.presets import family_config

# The self_ref_titans presets, their SwiGLU width split over the CMS levels.
PRESETS = {
    # SwiGLU width 512 in all and memories of hidden width head_dim (expansion 1): the tiny
    # Transformer++'s parameter count.
    "tiny": dict(d_model=256, num_layers=4, num_heads=4, mlp_dim=512),
    "340m": dict(d_model=1024, num_layers=20, num_heads=16, mlp_dim=2560, tie_embeddings=False),
    "760m": dict(d_model=1536, num_layers=20, num_heads=16, tie_embeddings=False),
    "1.3b": dict(d_model=2048, num_layers=20, num_heads=16, tie_embeddings=False),
}
TINY_MEMORY = dict(expansion=1)
# Every level updates inside a 256-token training window.
TINY_CMS = dict(periods=(16, 64, 128))
TINY_TRAIN = dict(steps=75)


def get_config(preset: str = "tiny"):
    tiny = preset == "tiny"
    config = family_config("hope", PRESETS, preset, memory=memory_config(**(TINY_MEMORY if tiny else {})),
                           train=TINY_TRAIN if tiny else None)
    with config.unlocked():
        config.model.cms = cms_config(**(TINY_CMS if tiny else {}))
        config.model.hope = hope_config()
    config.lock()
    return config
