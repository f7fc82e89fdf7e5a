"""The config schema shared by every model family, and its validation.

Family files under `configs/` start from `base_config()`, set the model section and a preset, and
return a locked `ml_collections.ConfigDict`: an override of an unknown key fails at parse time, and
`validate()` refuses invalid values before anything runs.
"""

from __future__ import annotations

import json
import os

import ml_collections

from nlearn.errors import UserError
from nlearn.memory_config import DECAY_INIT

DTYPES = ("float32", "bfloat16")
WANDB_MODES = ("auto", "offline", "online", "disabled")

# Logical parameter/activation axis -> mesh axis (or axes). One table, in the config.
DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("kv", None),
    ("conv", None),
    ("layers", None),  # the stacked blocks of model.scan_layers=True
)


def base_config() -> ml_collections.ConfigDict:
    """Defaults for every section; model families override `model` and presets."""
    from nlearn.data.defaults import data_config  # local: keeps `import nlearn.config` light

    c = ml_collections.ConfigDict()
    c.data = data_config()

    c.model = ml_collections.ConfigDict()
    c.model.family = "transformer"
    c.model.vocab_size = c.data.get_ref("vocab_size")
    c.model.d_model = 256
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.head_dim = 0  # 0: d_model // num_heads
    c.model.mlp_dim = 0  # 0: SwiGLU width ~8/3 d_model rounded up to a multiple of 64
    c.model.window = 0  # sliding-window size for attention; 0: full causal attention
    c.model.rope_theta = 10000.0
    c.model.norm_eps = 1e-6
    c.model.tie_embeddings = True
    c.model.init_std = 0.02
    c.model.dtype = "float32"  # compute dtype; parameters stay float32
    c.model.remat = False  # rematerialise each block in the backward pass
    c.model.remat_policy = "full"  # what remat keeps: "full" (nothing) or a name in nlearn.models.lm.REMAT_POLICIES
    c.model.scan_layers = False  # blocks stacked on a `layers` axis and run by one scan (compile time flat in depth)

    c.train = ml_collections.ConfigDict()
    c.train.steps = 1000
    c.train.batch_size = 16  # global, in sequences
    c.train.seq_len = 256
    c.train.seed = 0
    c.train.lr = 3e-3
    c.train.min_lr_ratio = 0.1  # the schedule decays to lr * min_lr_ratio
    c.train.schedule = "cosine"  # after warmup: "cosine", or "wsd" (constant, then linear decay)
    c.train.decay_fraction = 0.2  # "wsd": the last fraction of the steps that decays
    c.train.decay_steps = 0  # "cosine": the step where it reaches its floor and stays (0: train.steps)
    c.train.warmup_steps = 100
    c.train.weight_decay = 0.1
    c.train.b1 = 0.9
    c.train.b2 = 0.95
    c.train.eps = 1e-8
    c.train.grad_clip = 1.0  # global-norm clip; 0 disables
    c.train.grad_accum = 1  # micro-batches per optimizer step
    c.train.log_every = 10
    c.train.eval_every = 0  # 0: evaluate only at the end
    c.train.final_eval = True  # evaluate at the end; False leaves scoring to `nlearn-eval --workdir`
    # Recurrent families: probability that a batch row starts from the state its previous window ended in
    # (nlearn.train.state_passing; trains on the states long inputs reach). 0: every window starts fresh.
    c.train.state_passing = 0.0
    c.train.state_passing_from = 0  # the first step that passes states (post-training: a model learns first)
    # Delta-rule families: weight of an L1 cost on the memories' write strengths (nlearn.train.write_penalty;
    # the model learns to leave its state alone where a write does not lower the loss). 0: none.
    c.train.write_penalty = 0.0
    c.train.write_penalty_from = 0  # the first step that charges it (a model learns its task first)
    c.train.peak_gflops = 0.0  # for MFU; 0: measure this machine's f32 matmul rate at start
    # Run options. XLA:CPU optimisation preset (nlearn.train.cpu_preset) of the train/eval steps
    # ("default", "fast_compile", "fast_runtime"); ignored off the CPU.
    c.train.cpu_opt_preset = "default"
    # Wall-time budget in seconds (0: none). With the "wsd" schedule the run times its steps early on
    # and lowers its total to what fits, so it ends fully decayed in time.
    c.train.time_budget_s = 0.0

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 100
    c.checkpoint.keep = 3
    c.checkpoint.async_save = True

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # -1: all devices not used by the other axes
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    c.mesh.sequence = 1  # devices that split each sequence's tokens (sequence parallelism)
    c.mesh.rules = json.dumps(DEFAULT_RULES)  # JSON so a CLI override stays one string

    # Several processes (nlearn.train.distributed); unset values come from the environment as JAX detects
    # them (JAX_COORDINATOR_ADDRESS, SLURM, Cloud TPU, ...). One process: nothing to set.
    c.distributed = ml_collections.ConfigDict()
    c.distributed.coordinator = ""  # HOST:PORT of process 0
    c.distributed.num_processes = 0  # 0: from the environment
    c.distributed.process_id = -1  # -1: from the environment
    c.distributed.timeout_s = 60  # a peer silent this long is declared lost (every process exits); 0: no check

    c.logging = ml_collections.ConfigDict()
    c.logging.wandb_mode = "auto"  # auto: online with WANDB_API_KEY, else offline
    c.logging.wandb_project = "nlearn"
    c.logging.progress = True
    c.logging.plot = True
    # Evaluations also report the memories' largest fast-weight norm over the first eval sequences (one more
    # compiled program: the model's decode path), so a memory that blows up shows before its loss turns nan.
    c.logging.fast_weights = False

    c.eval = ml_collections.ConfigDict()
    c.eval.max_batches = 0  # 0: all of data.eval_tokens
    return c


# Keys added after runs were saved, each with the value such a run trained with (not always today's
# default) and, where only some configs have the key, which (config -> bool). A family's own keys are in its
# record (`nlearn.models.Family.migrations`).
MIGRATIONS = (
    ("train.schedule", "cosine", None),
    ("train.decay_fraction", 0.2, None),
    ("train.decay_steps", 0, None),
    ("train.final_eval", True, None),
    ("train.state_passing", 0.0, None),
    ("train.state_passing_from", 0, None),
    ("train.write_penalty", 0.0, None),
    ("train.write_penalty_from", 0, None),
    ("train.cpu_opt_preset", "default", None),
    ("train.time_budget_s", 0.0, None),
    ("model.remat_policy", "full", None),
    ("model.scan_layers", False, None),
    ("logging.fast_weights", False, None),
    ("model.cms.decay", (0.0,), lambda c: c.model.family == "hope"),  # Hope's CMS before its retention
    ("data.mqar.query_start", 0, None),
    ("data.mqar.random_filler", False, None),
    ("data.mqar.curriculum", "", None),
    ("model.memory.conv_init", "identity", None),
    ("model.memory.decay_init", DECAY_INIT, lambda c: "decay" in c.model.memory),  # the neural memories
    ("mesh.sequence", 1, None),
    ("data.niah.loss_on", "answer", None),  # skipped where a config has no data.niah section
    ("data.niah.curriculum", "", None),
    ("data.babilong.curriculum", "", None),
)


def migrate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Add the keys a config saved by an older nlearn lacks (MIGRATIONS), in place, so that it loads,
    resumes and evaluates as the run it describes; returns it. Today's `configs/` have every key."""
    from nlearn import models  # the families' own keys

    family = models.FAMILIES.get(config.model.get("family"))
    for key, value, applies in MIGRATIONS + tuple((k, v, None) for k, v in (family.migrations if family else ())):
        *path, name = key.split(".")
        node = config
        for part in path:
            node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
        if node is None or name in node or (applies is not None and not applies(config)):
            continue
        with node.unlocked():
            node[name] = value
    return config


def _fail(key: str, value, why: str):
    raise UserError(f"invalid config value {key}={value!r}: {why}")


def validate(config: ml_collections.ConfigDict) -> None:
    """Refuse invalid values with one line naming the key; call before anything runs."""
    from nlearn import models  # registry of families
    from nlearn.data.sources import describe_sources, known_source
    from nlearn.train import distributed, write_penalty
    from nlearn.train.cpu_preset import CPU_OPT_PRESETS
    from nlearn.train.optim import SCHEDULES

    positive = [
        "train.steps", "train.batch_size", "train.seq_len", "train.grad_accum", "train.log_every",
        "checkpoint.every_steps", "checkpoint.keep", "model.d_model", "model.num_layers",
        "model.num_heads", "model.vocab_size",
    ]
    for key in positive:
        section, name = key.split(".")
        value = config[section][name]
        if value <= 0:
            _fail(key, value, "must be > 0")
    if config.train.lr <= 0:
        _fail("train.lr", config.train.lr, "must be > 0")
    for key in ("train.eval_every", "model.window", "model.head_dim", "model.mlp_dim"):
        section, name = key.split(".")
        if config[section][name] < 0:
            _fail(key, config[section][name], "must be >= 0")
    if not 0 <= config.train.min_lr_ratio <= 1:
        _fail("train.min_lr_ratio", config.train.min_lr_ratio, "must be in [0, 1]")
    if config.train.schedule not in SCHEDULES:
        _fail("train.schedule", config.train.schedule, f"valid: {', '.join(SCHEDULES)}")
    if not 0 <= config.train.decay_steps <= config.train.steps:
        _fail("train.decay_steps", config.train.decay_steps, f"must be in [0, train.steps={config.train.steps}]")
    if config.train.decay_steps and config.train.schedule != "cosine":
        _fail("train.decay_steps", config.train.decay_steps, "is for train.schedule=cosine (wsd: train.decay_fraction)")
    if not 0 < config.train.decay_fraction <= 1:
        _fail("train.decay_fraction", config.train.decay_fraction, "must be in (0, 1]")
    budget = config.train.time_budget_s
    if budget < 0:
        _fail("train.time_budget_s", budget, "must be >= 0 (0: no budget)")
    if budget and config.train.schedule != "wsd":
        _fail("train.time_budget_s", budget, "needs train.schedule=wsd (a cosine's lr at every step depends "
              "on the total, so the total cannot be chosen mid-run)")
    if config.train.cpu_opt_preset not in CPU_OPT_PRESETS:
        _fail("train.cpu_opt_preset", config.train.cpu_opt_preset, f"valid: {', '.join(CPU_OPT_PRESETS)}")
    if config.model.family not in models.FAMILIES:
        _fail("model.family", config.model.family, f"valid families: {', '.join(sorted(models.FAMILIES))}")
    if config.model.dtype not in DTYPES:
        _fail("model.dtype", config.model.dtype, f"valid: {', '.join(DTYPES)}")
    if config.model.head_dim == 0 and config.model.d_model % config.model.num_heads:
        _fail("model.num_heads", config.model.num_heads, f"must divide model.d_model={config.model.d_model}")
    if not known_source(config.data.source):
        _fail("data.source", config.data.source, f"valid sources: {describe_sources()}")
    if config.logging.wandb_mode not in WANDB_MODES:
        _fail("logging.wandb_mode", config.logging.wandb_mode, f"valid: {', '.join(WANDB_MODES)}")
    for axis in ("data", "fsdp", "tensor"):
        value = config.mesh[axis]
        if value == 0 or value < -1:
            _fail(f"mesh.{axis}", value, "must be a positive size or -1")
    if sum(config.mesh[a] == -1 for a in ("data", "fsdp", "tensor")) > 1:
        _fail("mesh", "", "at most one of mesh.data/fsdp/tensor may be -1")
    _validate_sequence(config)
    if config.train.batch_size % config.train.grad_accum:
        _fail("train.grad_accum", config.train.grad_accum,
              f"must divide train.batch_size={config.train.batch_size}")
    try:
        rules = json.loads(config.mesh.rules)
        dict(rules)
    except (ValueError, TypeError) as e:
        _fail("mesh.rules", config.mesh.rules, f"must be a JSON list of [logical, mesh_axis] pairs ({e})")
    distributed.validate(config)
    models.validate_config(config)
    _validate_state_passing(config)
    write_penalty.validate(config)


def _validate_state_passing(config) -> None:
    p = config.train.state_passing
    if not 0 <= p < 1:
        _fail("train.state_passing", p, "must be in [0, 1) (the probability a row continues its previous state)")
    if config.train.state_passing_from < 0:
        _fail("train.state_passing_from", config.train.state_passing_from, "must be >= 0 (a step)")
    if p and config.train.grad_accum != 1:
        _fail("train.state_passing", p, "needs train.grad_accum=1 (each row carries one state)")
    if p:
        from nlearn.train import state_passing
        state_passing.batch_axes(config)  # a UserError for a family without a fixed-size state


def _validate_sequence(config) -> None:
    sequence = config.mesh.get("sequence", 1)
    if not isinstance(sequence, int) or sequence < 1:
        _fail("mesh.sequence", sequence, "must be a positive size (-1 is for mesh.data/fsdp/tensor)")
    if sequence == 1:
        return
    from nlearn import models

    if not models.FAMILIES[config.model.family].sequence_parallel:  # attention (all-gathered K/V), the affine
        able = sorted(name for name, family in models.FAMILIES.items() if family.sequence_parallel)  # memories
        _fail("mesh.sequence", sequence, f"family {config.model.family} cannot split a sequence across devices "
              f"(its memory is nonlinear: no state summary to pass on); families that can: {', '.join(able)}")
    if config.train.seq_len % sequence:
        _fail("mesh.sequence", sequence, f"must divide train.seq_len={config.train.seq_len}")


def save_config(config: ml_collections.ConfigDict, workdir: str) -> str:
    """Write the resolved config to `workdir/config.json` (and a readable .txt twin)."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "config.json")
    with open(path, "w") as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    with open(os.path.join(workdir, "config.txt"), "w") as f:
        f.write(str(config))
    return path
