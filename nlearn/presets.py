"""Preset selection shared by the family config files under `configs/`."""

from __future__ import annotations

import ml_collections

from nlearn.errors import UserError

# `tiny` presets fit `make train` (setup + training + eval) in 15 minutes on 2 CPU cores.
TINY_TRAIN = dict(steps=150, warmup_steps=15)
TINY_EVAL_TOKENS = 65536

# Paper-scale presets train with the paper's tokenizer size and context.
PAPER_SCALE = dict(vocab_size=32000, seq_len=2048, batch_size=256, lr=3e-4, warmup_steps=1000,
                   steps=50000)
# ... and run on accelerators: bf16 compute (float32 master weights), rematerialised blocks (activations per chip
# near the transformer's, results/pod_fit.md), one scan over the blocks (compile time flat in depth: a 340m step
# compiles for a TPU slice in minutes, not tens of minutes). Each is a one-line override back.
PAPER_MODEL = dict(dtype="bfloat16", remat=True, scan_layers=True)


def apply_preset(config: ml_collections.ConfigDict, presets: dict, preset: str,
                 train: dict | None = None) -> ml_collections.ConfigDict:
    """Apply `presets[preset]` to `config.model` (paper sizes also get paper-scale training and the
    accelerator settings of PAPER_MODEL)."""
    if preset not in presets:
        raise UserError(f"unknown preset {preset!r}; valid presets: {', '.join(presets)}")
    for key, value in presets[preset].items():
        config.model[key] = value
    if preset == "tiny":
        config.train.update(TINY_TRAIN)
        config.data.eval_tokens = TINY_EVAL_TOKENS
    else:
        config.data.vocab_size = PAPER_SCALE["vocab_size"]
        config.model.update({k: v for k, v in PAPER_MODEL.items() if k not in presets[preset]})
        for key in ("seq_len", "batch_size", "lr", "warmup_steps", "steps"):
            config.train[key] = PAPER_SCALE[key]
    for key, value in (train or {}).items():
        config.train[key] = value
    config.lock()
    return config


def family_config(family: str, presets: dict, preset: str, *, memory=None,
                  train: dict | None = None) -> ml_collections.ConfigDict:
    """The locked config of `family` at `preset`: base config, memory section, preset values."""
    from nlearn.config import base_config

    config = base_config()
    config.model.family = family
    if memory is not None:
        config.model.memory = memory
    return apply_preset(config, presets, preset, train)
