"""The family registry: each family module declares its `Family` with `register`; `nlearn.models` imports
them all (kept apart so a family module imports this, not the package that imports it)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from nlearn.models.lm import MixerFactory


@dataclasses.dataclass(frozen=True)
class Family:
    """Everything a model family is and can do, declared once where it registers."""

    make_mixer: MixerFactory
    validate: Optional[Callable] = None  # (config) -> None, raises UserError
    model: Optional[Callable] = None  # (model_cfg, make_mixer, rngs=) -> model; default LanguageModel
    # (model_cfg, seq_len, backend) -> training FLOPs of one layer's mixer over a sequence (nlearn.models.flops);
    # None: MFU counts the dense layers only
    flops: Optional[Callable] = None
    sequence_parallel: bool = False  # its mixers split a sequence over `mesh.sequence` devices
    write_cost: bool = False  # its memories sow a write cost that `train.write_penalty` can charge
    decode_write_cost: bool = True  # ... while decoding too (train.state_passing's forward decodes)
    optional_write_gate: bool = False  # its `memory.lr_gate` may be "none" (a layer without a write gate)
    # (model_cfg, n_params, seq_len, sequences per device) -> (passes, HBM bytes per device): sequential work of
    # a step that a compiled program's roofline does not see (nlearn.train.compile adds it; Hope's first pass)
    serial_traffic: Optional[Callable] = None
    # (key, value) pairs a config saved before the key existed gets (nlearn.config.migrate): the value such a
    # run trained with
    migrations: tuple = ()


FAMILIES: dict[str, Family] = {}


def register(name: str, make_mixer: MixerFactory, validate: Optional[Callable] = None,
             model: Optional[Callable] = None, **capabilities) -> None:
    """Register family `name`; `capabilities` are `Family`'s other fields."""
    FAMILIES[name] = Family(make_mixer, validate, model, **capabilities)
