"""Model registry: `build(config)` turns a config into an NNX language model.

A family registers a mixer factory (and optionally a config validator and a default memory
section); every family shares the backbone in `nlearn.models.lm`.
"""

from __future__ import annotations

from typing import Optional

from flax import nnx

from nlearn.models.lm import LanguageModel
from nlearn.models.registry import FAMILIES, Family, register  # noqa: F401  (re-exported)


def validate_config(config) -> None:
    from nlearn.errors import UserError
    from nlearn.layers.conv import ShortConv

    memory = config.model.get("memory")
    if memory is not None and memory.conv_init not in ShortConv.INITS:
        raise UserError(f"invalid config value model.memory.conv_init={memory.conv_init!r}: valid choices: "
                        f"{', '.join(ShortConv.INITS)}")
    family = FAMILIES[config.model.family]
    if memory is not None:  # the memories' gate choices (a family's memory has some of these keys or none)
        from nlearn.layers.mixers import DeltaNetMixer
        from nlearn.layers.mixers.base import WRITE_GATES
        lr_gates = (("none",) if family.optional_write_gate else ()) + tuple(WRITE_GATES)
        for key, choices in (("qk_activation", DeltaNetMixer.QK_ACTIVATIONS), ("beta_gate", WRITE_GATES),
                             ("lr_gate", lr_gates)):
            if key in memory and memory[key] not in choices:
                raise UserError(f"invalid config value model.memory.{key}={memory[key]!r}: valid "
                                f"choices: {', '.join(choices)}")
    if memory is not None and "beta_min" in memory and not 0.0 <= memory.beta_min < 1.0:
        raise UserError(f"invalid config value model.memory.beta_min={memory.beta_min}: must be in [0, 1)")
    _validate_layers(config)
    if family.validate is not None:
        family.validate(config)


def _validate_layers(config) -> None:
    """`model.remat_policy` (with `model.remat`): one line naming the key."""
    from nlearn.errors import UserError
    from nlearn.models.lm import REMAT_POLICIES

    model = config.model  # model.scan_layers is a bool: ml_collections refuses anything else
    if model.remat_policy not in REMAT_POLICIES:
        raise UserError(f"invalid config value model.remat_policy={model.remat_policy!r}: valid choices: "
                        f"{', '.join(REMAT_POLICIES)}")
    if model.remat_policy != "full" and not model.remat:
        raise UserError(f"invalid config value model.remat_policy={model.remat_policy!r}: applies to "
                        "rematerialised blocks; set model.remat=True too")


def build(config, rngs: Optional[nnx.Rngs] = None) -> LanguageModel:
    """The model named by `config.model.family`, with float32 parameters (seeded by train.seed)."""
    family = FAMILIES[config.model.family]
    rngs = rngs if rngs is not None else nnx.Rngs(params=config.train.seed)
    with nnx.use_eager_sharding(False):  # placement happens in the trainer, by the rules table
        return (family.model or LanguageModel)(config.model, family.make_mixer, rngs=rngs)


def count_params(config) -> int:
    """Parameter count without allocating (abstract evaluation)."""
    import math

    import jax

    model = nnx.eval_shape(lambda: build(config))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return sum(math.prod(x.shape) for x in leaves)


from nlearn.models import transformer  # noqa: E402,F401  (registers the families)
from nlearn.models import recurrent  # noqa: E402,F401
from nlearn.models import titans  # noqa: E402,F401
from nlearn.models import self_referential  # noqa: E402,F401
from nlearn.models import hope  # noqa: E402,F401
