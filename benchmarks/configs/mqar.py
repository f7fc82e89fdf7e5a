"""MQAR (multi-query associative recall, Zoology) for any family: `benchmarks/configs/mqar.py:<family>`.

One common task and budget for every family: T=256 tokens holding 16 key-value pairs then their
queries, loss only on the answers, 2 layers, d_model=128, trained for BUDGET["steps"] steps, the
first CURRICULUM steps on shorter windows with fewer pairs (Zoology-style; evaluation is always on
the task itself). FAMILY_OVERRIDES and FAMILY_TRAINING hold the few per-family departures, each
with its reason; `make mqar` prints them above its table.
`make mqar` (benchmarks/mqar.py) also stops a run at TIME_LIMIT_S of wall time (the trainer saves a
checkpoint on SIGTERM, which is then scored), so every family trains for at most 10 minutes.

  nlearn-train --config=benchmarks/configs/mqar.py:deltanet --workdir=runs/mqar-deltanet
  nlearn-eval --workdir=runs/mqar-deltanet      # reports mqar_accuracy

The vocabulary is 512 (keys from [1, 256), values from [256, 512)) rather than Zoology's 8192:
recall is as hard, but the output layer costs 16x less. Family sizes come from
`configs/<family>.py:tiny`; the dimensions below override them. No weight decay (the task has
no noise to regularise against) and a short warmup: MQAR is learnt after a loss plateau at
ln(256), and the steps spent on the plateau are what the budget has to cover.
TASK["random_filler"] (or --config.data.mqar.random_filler=True) fills the query region with
random non-key tokens instead of 0, as Zoology's random_non_queries does; the presets keep 0.
"""

import importlib.util
import os

TASK = dict(seq_len=256, num_pairs=16, vocab_size=512, eval_examples=1000, random_filler=False)
MODEL = dict(d_model=128, num_layers=2, num_heads=2, mlp_dim=128)  # SwiGLU width 128: a ~1.4x cheaper step
# With the curriculum recall is learnt by step ~400; the cosine then polishes the last percent (results/history.md).
BUDGET = dict(batch_size=16, steps=1300, lr=3e-3, schedule="cosine", min_lr_ratio=0.1, warmup_steps=20,
              weight_decay=0.0, cpu_opt_preset="fast_compile")
CURRICULUM = "64x4:300"  # 64-token windows with 4 pairs first: the plateau ends in ~300 steps, not 400-1100
TIME_LIMIT_S = 600  # wall-time cap per family in `make mqar` (start-up and compilation included, scoring not)
FAMILY_OVERRIDES: dict[str, dict] = {
    # A linear memory: 11x cheaper on CPU than the default depth 2 (the family's default step and max_lr).
    "titans_lmm": {"memory.depth": 1},
    "titans_mac": {"memory.depth": 1, "memory.decay_init": 1e-3},  # forgets less at first
    # Strong writes and a read without its skip, which recall needs (results/history.md, self-referential Titans).
    "self_ref_titans": {"memory.lr_max": 1.0, "memory.lr_init": 0.9, "memory.retain_init": 0.999,
                        "memory.read_residual": False},
}
# Hope runs its own (self-referential) mixer, with the same recall settings.
FAMILY_OVERRIDES["hope"] = dict(FAMILY_OVERRIDES["self_ref_titans"])
# Titans: a 128-token stage between (MAC: two segments, the 64-token stage is one), 1600 steps, WSD decayed in its cap.
TITANS_TRAINING = {"data.mqar.curriculum": "64x4:150,128x8:300", "train.steps": 1600, "train.schedule": "wsd",
                   "train.decay_fraction": 0.5, "train.time_budget_s": 2370.0}
FAMILY_TRAINING: dict[str, dict] = {
    "titans_lmm": dict(TITANS_TRAINING),
    "titans_mac": dict(TITANS_TRAINING),
    # Its seeds need 1000 steps (median 97.0%); at ~2.5x titans_lmm's step that takes its own cap, below.
    "self_ref_titans": {"train.steps": 1000, "train.schedule": "wsd", "train.decay_fraction": 0.5,
                        "train.time_budget_s": 1770.0},
}
FAMILY_TRAINING["hope"] = {**FAMILY_TRAINING["self_ref_titans"], "train.time_budget_s": 3570.0}  # two-pass step
# Where a preset needs more than TIME_LIMIT_S (Titans' 1600 steps: ~8 min on 2 idle cores, 20-34 on one shared).
FAMILY_TIME_LIMIT_S: dict[str, float] = {"titans_lmm": 2400.0, "titans_mac": 2400.0, "self_ref_titans": 1800.0,
                                         "hope": 3600.0}


def _set(node, key: str, value) -> None:
    """Set an existing dotted key (a typo must not add a new one)."""
    *path, name = key.split(".")
    for part in path:
        node = node[part]
    if name not in node:
        raise KeyError(f"benchmarks/configs/mqar.py override {key!r}: no such config key")
    node[name] = value


FAMILY_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


def family_base(family: str):
    """`configs/<family>.py:tiny`, loaded by path (configs/ is not a package)."""
    path = os.path.join(FAMILY_DIR, f"{family}.py")
    if not os.path.exists(path):
        from nlearn.errors import UserError

        families = sorted(f[:-3] for f in os.listdir(FAMILY_DIR) if f.endswith(".py"))
        raise UserError(f"unknown family {family!r} for benchmarks/configs/mqar.py; valid: {', '.join(families)}")
    spec = importlib.util.spec_from_file_location(f"nlearn_config_{family}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("tiny")


def get_config(family: str = "deltanet"):
    config = family_base(family)
    with config.unlocked():
        config.data.source = "mqar"
        config.data.vocab_size = TASK["vocab_size"]
        config.data.mqar.num_pairs = TASK["num_pairs"]
        config.data.mqar.eval_examples = TASK["eval_examples"]
        config.data.mqar.random_filler = TASK["random_filler"]
        config.data.mqar.curriculum = CURRICULUM
        config.data.eval_tokens = 0  # score every eval example
        config.model.update(MODEL)
        for key, value in FAMILY_OVERRIDES.get(family, {}).items():
            _set(config.model, key, value)
        config.train.update(seq_len=TASK["seq_len"], log_every=50, eval_every=0, **BUDGET)
        for key, value in FAMILY_TRAINING.get(family, {}).items():
            _set(config, key, value)
        config.checkpoint.every_steps = 250
        config.logging.plot = False
    return config
