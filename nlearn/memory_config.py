"""Default `config.model.memory` sections of the memory families (one-line overridable)."""

from __future__ import annotations

import math

import ml_collections


def linear_memory(**overrides) -> ml_collections.ConfigDict:
    """Options shared by the matrix-memory mixers (linear attention, delta rules, TTT-Linear)."""
    c = ml_collections.ConfigDict()
    c.conv_size = 4  # short causal depthwise conv on q, k, v; 0 disables
    c.conv_init = "identity"  # or "uniform" (PyTorch/FLA default); see nlearn.layers.conv.ShortConv
    c.chunk_size = 64  # tokens per chunk of the chunked op
    c.normalize = False  # linear attention only: divide by q . sum(k)
    c.update(overrides)
    return c


def write_gate_options() -> dict:
    """The length options of a memory whose writes a learned gate scales (Titans, TTT; the delta rules have
    theirs as `beta_gate`): `lr_gate="hard_sigmoid"` lets a write close exactly, so `train.write_penalty`
    can teach it to leave the state alone over filler; `gate_conv=True` lets the gates read the last few tokens."""
    return dict(lr_gate="sigmoid", gate_conv=False)


# What a memory saved before the write-gate options existed trained with.
WRITE_GATE_MIGRATIONS = (("model.memory.lr_gate", "sigmoid"), ("model.memory.gate_conv", False))

DECAY_INIT = 1.0 / (1.0 + math.exp(4.0))  # sigmoid(-4): the forgetting gate's bias starts at -4


def neural_memory_config(**overrides) -> ml_collections.ConfigDict:
    """The inner learner of the Titans / TTT-MLP memories; each key is a one-line ablation."""
    c = linear_memory()
    del c.normalize
    c.optimizer = "momentum"  # inner optimizer: see nlearn.memory.inner_optimizers.INNER_OPTIMIZERS
    # The step's form: "ema+overlap+gain" (momentum as an EMA; each layer's step over 1 + the token's input
    # overlap with its mini-batch so far times the layer's downstream gain, so b aligned keys share one step,
    # orthogonal ones each take a full one and a large later layer cannot make an earlier one overshoot; see
    # nlearn.memory.neural_memory), "ema+overlap" (without the gain), "bounded" (averaged over the mini-batch:
    # a lone write is b times weaker) or "paper" (Titans' summed step, which diverges: docs/paper_notes.md).
    c.inner_step = "ema+overlap+gain"
    c.objective = "l2"  # inner objective: see nlearn.memory.objectives.OBJECTIVES
    c.minibatch = 16  # tokens whose gradients share the mini-batch start state (1 = fully online)
    c.depth = 2  # MLP layers of the memory (1 = matrix memory)
    c.expansion = 4  # hidden width of the memory MLP / head_dim
    c.residual = False  # f(x) = MLP(x) + x
    c.activation = "gelu"  # see nlearn.memory.neural_memory.ACTIVATIONS
    c.momentum = True  # learned momentum gate mu (optimizers with a momentum buffer)
    c.decay = True  # learned forgetting gate alpha
    # alpha at initialisation (the gate's bias is logit(decay_init)): keeps ~3% of a write 200 tokens on.
    c.decay_init = DECAY_INIT
    # eta = max_lr * sigmoid(x W_eta); with the bounded step, 1 / depth^2 keeps streamed aligned keys bounded
    # (docs/paper_notes.md); an explicit value always wins.
    depth = c.get_ref("depth").to_float()
    c.max_lr = 1.0 / (depth * depth)
    c.update(write_gate_options())
    c.update(overrides)
    return c


# The migration of a neural memory saved before `memory.inner_step` existed: it trained with the paper's step.
PAPER_STEP = ("model.memory.inner_step", "paper")


def validate_neural_memory(config) -> None:
    """Refuse unknown inner-learner choices with the list of valid ones (before anything runs)."""
    from nlearn.errors import UserError
    from nlearn.memory.inner_optimizers import INNER_OPTIMIZERS
    from nlearn.memory.neural_memory import ACTIVATIONS
    from nlearn.memory.objectives import OBJECTIVES

    mem = config.model.memory
    for key, valid in (("optimizer", INNER_OPTIMIZERS), ("objective", OBJECTIVES), ("activation", ACTIVATIONS)):
        if mem[key] not in valid:
            raise UserError(f"invalid config value model.memory.{key}={mem[key]!r}: valid choices: "
                            f"{', '.join(sorted(valid))}")
    validate_inner_step(mem)
    for key in ("minibatch", "depth", "expansion"):
        if mem[key] <= 0:
            raise UserError(f"invalid config value model.memory.{key}={mem[key]}: must be > 0")
    if mem.max_lr <= 0:
        raise UserError(f"invalid config value model.memory.max_lr={mem.max_lr}: must be > 0")
    decay_init = mem.decay_init
    if not 0.0 < decay_init < 1.0:
        raise UserError(f"invalid config value model.memory.decay_init={decay_init}: must be in (0, 1)")


def validate_inner_step(mem) -> None:
    """Refuse an unknown `memory.inner_step` of a neural memory (Titans, TTT-MLP) with the valid forms."""
    from nlearn.errors import UserError
    from nlearn.memory.neural_memory import step_parts

    try:
        step_parts(mem.inner_step)
    except ValueError as e:
        raise UserError(f"invalid config value model.memory.inner_step={mem.inner_step!r}: {e}") from None
