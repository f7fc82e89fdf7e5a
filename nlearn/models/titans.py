"""Titans backbones: MAC (memory as a context), MAG (memory as a gate), MAL (memory as a layer).

The shared backbone (`nlearn.models.lm`) with a Titans mixer in every block; the mixers live in
`nlearn.layers.titans`. Config keys beyond the memory section: `model.num_persistent` (all three),
`model.segment_len` (MAC), `model.window` (MAG, MAL: the sliding window, > 0), `model.attn_conv_size`
(all three: short convs on the attention's q, k, v; 0 disables), `model.mac_output` (MAC: "gate" or
"add", how the attention output and the memory's read combine), `model.mac_memory_input` (MAC: "y",
"x+y" or "x", what the memory writes and is read with), `model.mac_positions` (MAC: "absolute" or
"segment", RoPE positions in the stream or from each segment's start), `model.mag_output` (MAG: "gate" or "blend"),
`model.mal_attn_input` (MAL: "m" or "x+m"). The paper's forms: docs/titans.md.
"""

from __future__ import annotations

from nlearn.errors import UserError
from nlearn.layers.core import head_dim as head_dim_of
from nlearn.layers.titans import (MAC_MEMORY_INPUTS, MAC_OUTPUTS, MAC_POSITIONS, MAG_OUTPUTS, MAL_ATTN_INPUTS,
                                  MACMixer, MAGMixer, MALMixer, mac_memory_input, mac_output, mac_positions,
                                  mag_output, mal_attn_input)
from nlearn.memory_config import PAPER_STEP, WRITE_GATE_MIGRATIONS, validate_neural_memory
from nlearn.models import flops
from nlearn.models.registry import register


def _fail(key: str, value, why: str):
    raise UserError(f"invalid config value model.{key}={value!r}: {why}")


def _int_at_least(model, key: str, low: int):
    if key not in model:
        _fail(key, None, "missing (start from a configs/titans_*.py file)")
    value = model[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        _fail(key, value, f"must be an integer >= {low}")


def _validate_common(config) -> None:
    validate_neural_memory(config)
    model = config.model
    head_dim = head_dim_of(model)
    if head_dim % 2:
        _fail("head_dim", head_dim, "RoPE needs an even head dimension")
    _int_at_least(model, "num_persistent", 0)
    if "attn_conv_size" in model:  # titans_lmm has no attention
        _int_at_least(model, "attn_conv_size", 0)


def _choice(key: str, value, valid) -> None:
    if value not in valid:
        _fail(key, value, f"valid choices: {', '.join(valid)}")


def validate_mac(config) -> None:
    _validate_common(config)
    _int_at_least(config.model, "segment_len", 1)
    _choice("mac_output", mac_output(config.model), MAC_OUTPUTS)
    _choice("mac_memory_input", mac_memory_input(config.model), MAC_MEMORY_INPUTS)
    _choice("mac_positions", mac_positions(config.model), MAC_POSITIONS)
    if config.model.window:
        _fail("window", config.model.window, "titans_mac attends within segments; set model.segment_len "
              "instead (model.window must be 0)")


def validate_windowed(config) -> None:
    _validate_common(config)
    _int_at_least(config.model, "window", 1)


def validate_mag(config) -> None:
    validate_windowed(config)
    _choice("mag_output", mag_output(config.model), MAG_OUTPUTS)


def validate_mal(config) -> None:
    validate_windowed(config)
    _choice("mal_attn_input", mal_attn_input(config.model), MAL_ATTN_INPUTS)


def _mixer(cls):
    return lambda cfg, layer_index, rngs: cls(cfg, rngs=rngs)


# Keys added after runs were saved, with the value such a run trained with.
_CONV = ("model.attn_conv_size", 0)
register("titans_mac", _mixer(MACMixer), validate_mac, flops=flops.mac, write_cost=True,
         migrations=(_CONV, PAPER_STEP, *WRITE_GATE_MIGRATIONS, ("model.mac_output", "gate"),
                     ("model.mac_memory_input", "x+y"), ("model.mac_positions", "absolute")))
register("titans_mag", _mixer(MAGMixer), validate_mag, flops=flops.windowed_titans, write_cost=True,
         migrations=(_CONV, PAPER_STEP, *WRITE_GATE_MIGRATIONS, ("model.mag_output", "blend")))
register("titans_mal", _mixer(MALMixer), validate_mal, flops=flops.windowed_titans, write_cost=True,
         migrations=(_CONV, PAPER_STEP, *WRITE_GATE_MIGRATIONS, ("model.mal_attn_input", "x+m")))
