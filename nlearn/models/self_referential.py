"""Family `self_ref_titans`: the shared backbone with the self-referential Titans mixer (docs/self_referential.md §1).

`memory_config()` is the default `model.memory` section (each key a one-line override) and
`validate()` refuses bad values in one line naming the key.
"""

from __future__ import annotations

import ml_collections

from nlearn.errors import UserError
from nlearn.layers.self_referential import SelfReferentialMixer
from nlearn.models.registry import register
from nlearn.models import flops


# Model sizes shared by `configs/self_ref_titans.py` and `configs/hope.py` (Hope splits the SwiGLU width over
# its CMS levels). tiny: SwiGLU width 512 and memories of hidden width head_dim give the tiny Transformer++'s
# parameter count; paper sizes: 32k vocabulary, untied head, memories of hidden width 4 * head_dim.
PRESETS = {
    "tiny": dict(d_model=256, num_layers=4, num_heads=4, mlp_dim=512),
    "340m": dict(d_model=1024, num_layers=20, num_heads=16, mlp_dim=2560, tie_embeddings=False),
    "760m": dict(d_model=1536, num_layers=20, num_heads=16, tie_embeddings=False),
    "1.3b": dict(d_model=2048, num_layers=20, num_heads=16, tie_embeddings=False),
}
TINY_MEMORY = dict(expansion=1)
TINY_TRAIN = dict(steps=75)  # like titans_lmm's tiny: fewer steps keep `make train` near its budget


def memory_config(**overrides) -> ml_collections.ConfigDict:
    """The self-referential memory's options (docs/self_referential.md §1; every *choice* there is a key here)."""
    c = ml_collections.ConfigDict()
    c.conv_size = 4  # short causal depthwise conv on the memory inputs x and the queries q; 0 disables
    c.conv_init = "identity"  # or "uniform"; see nlearn.layers.conv.ShortConv
    c.chunk_memory = 16  # tokens per update chunk of the `memory` (the one that is read)
    c.chunk_other = 64  # tokens per chunk of the generators k, v, lr, retain (one chunk size divides the other)
    c.read = "after_write"  # or "before_write" (eq. 86 literally), "chunk_start" (eq. 90 literally)
    # The layer reads o = M(q) = q + act(q W_in) W_out; False: act(q W_in) W_out alone (the skip q no longer
    # swamps what the memory recalls; benchmarks/configs/mqar.py)
    c.read_residual = True
    c.dgd = True  # delta-gradient descent on the memories' input layers (False: plain GD with retention)
    c.dgd_output = True  # DGD on the output layers too (key h); bounds a chunk's summed output steps
    c.self_targets = True  # targets v̂ = M(v) per memory (False: the "static values" ablation)
    c.targets = "initial"  # v̂ from the initial weights (a write cannot move its own target); "chunk": HOPE.md's
    c.retain_to = "zero"  # what retention pulls toward; "initial": the meta-learned initial weights, not zero
    c.inner_step = "normalized"  # bounded input and output steps; "plain": docs/self_referential.md's, which overflow
    c.adaptive_q = False  # generate the queries with a sixth memory instead of the static projection
    c.lr_max = 0.5  # lr_t = lr_max * retain_t * sigmoid(M_lr(x_t)); <= 1 keeps the DGD factor >= 0
    c.expansion = 4  # hidden width of every memory MLP / head_dim
    c.activation = "gelu"  # see nlearn.memory.neural_memory.ACTIVATIONS
    c.retain_init = 0.99  # retain_t at initialisation (the retain bias starts at its logit)
    c.lr_init = 0.1  # sigmoid of the lr bias at initialisation (lr_t starts near lr_max * lr_init)
    # A layer write gate scaling each token's step (a length mechanism, docs/long_context.md): "none", "sigmoid"
    # or "hard_sigmoid" (closes exactly; the gate train.write_penalty charges); gate_conv: it reads a short conv
    c.lr_gate = "none"
    c.gate_conv = False
    c.update(overrides)
    return c


def _fail(key: str, value, why: str):
    raise UserError(f"invalid config value model.memory.{key}={value!r}: {why}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate(config) -> None:
    """Refuse what the op or the layer cannot run, before anything is built."""
    from nlearn.memory.neural_memory import ACTIVATIONS
    from nlearn.memory.self_referential import INNER_STEPS, LR_MAX_BOUND, READS, RETAIN_TOS, TARGETS

    mem = config.model.memory
    for key, low in (("chunk_memory", 1), ("chunk_other", 1), ("expansion", 1), ("conv_size", 0)):
        if not _is_int(mem[key]) or mem[key] < low:
            _fail(key, mem[key], f"must be an integer >= {low}")
    if max(mem.chunk_memory, mem.chunk_other) % min(mem.chunk_memory, mem.chunk_other):
        _fail("chunk_other", mem.chunk_other, f"one of chunk_memory={mem.chunk_memory} and chunk_other must "
              "divide the other")
    if mem.read not in READS:
        _fail("read", mem.read, f"valid choices: {', '.join(READS)}")
    if mem.targets not in TARGETS:
        _fail("targets", mem.targets, f"valid choices: {', '.join(TARGETS)}")
    if mem.retain_to not in RETAIN_TOS:
        _fail("retain_to", mem.retain_to, f"valid choices: {', '.join(RETAIN_TOS)}")
    if mem.inner_step not in INNER_STEPS:
        _fail("inner_step", mem.inner_step, f"valid choices: {', '.join(INNER_STEPS)}")
    if mem.activation not in ACTIVATIONS:
        _fail("activation", mem.activation, f"valid choices: {', '.join(sorted(ACTIVATIONS))}")
    if config.train.get("write_penalty", 0.0) > 0 and mem.lr_gate == "none":
        _fail("lr_gate", mem.lr_gate, "train.write_penalty charges a write gate: set it to sigmoid or hard_sigmoid")
    if mem.gate_conv is True and mem.lr_gate == "none":
        _fail("gate_conv", mem.gate_conv, "the conv feeds the write gate: set model.memory.lr_gate too")
    for key in ("dgd", "dgd_output", "self_targets", "adaptive_q", "read_residual", "gate_conv"):
        if not isinstance(mem[key], bool):
            _fail(key, mem[key], "must be True or False")
    if not 0.0 < mem.lr_max <= LR_MAX_BOUND:
        _fail("lr_max", mem.lr_max, f"must be in (0, {LR_MAX_BOUND:g}] (above it DGD's factor retain - lr |k|^2 can "
              "turn negative)")
    for key in ("retain_init", "lr_init"):
        if not 0.0 < mem[key] < 1.0:
            _fail(key, mem[key], "must be in (0, 1)")


def _make_mixer(cfg, layer_index, rngs):
    return SelfReferentialMixer(cfg, rngs=rngs)


# Keys added after runs were saved (here and by `hope`), with the value such a run trained with.
MIGRATIONS = (("model.memory.dgd_output", False), ("model.memory.targets", "chunk"),
              ("model.memory.inner_step", "plain"), ("model.memory.read_residual", True),
              ("model.memory.retain_to", "zero"), ("model.memory.lr_gate", "none"), ("model.memory.gate_conv", False))
register("self_ref_titans", _make_mixer, validate, migrations=MIGRATIONS, write_cost=True, optional_write_gate=True,
         flops=flops.per_head(lambda cfg, t, d, be: flops.self_referential(t, d, cfg.memory)))
