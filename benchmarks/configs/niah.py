"""Needle in a haystack (RULER S-NIAH) for any family: `benchmarks/configs/niah.py:<family>`.

Trains on RULER prompts (filler haystack, one needle at a uniform depth, loss on the answer only), first 3000
steps on windows of 256 tokens (prompts of 192-256: the template and at most two filler lines, where the task
format is learnt), then on windows of 512 (prompts of 384-512: up to ~350 filler tokens to keep the needle
over); `nlearn-eval` then asks the same question at lengths the model never saw, with held-out keys:

  nlearn-train --config=benchmarks/configs/niah.py:titans_mac --workdir=runs/niah/titans_mac
  nlearn-eval --workdir=runs/niah/titans_mac --task=niah --variant=single_1,single_2 --lengths=512,2048,8192,16384

`--config.data.source=niah+babilong --config.data.niah.variants=single_1,single_2` trains one checkpoint on
S-NIAH-1, S-NIAH-2 (a needle in corpus text) and BABILong-style qa1/qa2 (TASK["qa_tasks"]) for
`nlearn-eval --task=babilong --variant=qa1,qa2` as well (docs/long_context.md).

Model as benchmarks/configs/mqar.py (2 layers, d_model=128, Titans memories linear) with a 1024-piece tokenizer on the
built-in corpus (digits are single pieces). TASK["variants"] takes any of nlearn.tasks.niah.data.VARIANTS.
"""

import importlib.util
import os

# RULER's single_1 prompt is ~158 tokens with this tokenizer, so windows start at 256 (prompts of 192-256).
TASK = dict(source="niah", variants="single_1", qa_tasks="qa1,qa2", seq_len=512, min_len=384,
            curriculum="256:3000", vocab_size=1024, eval_examples=64, loss_on="answer")
MODEL = dict(d_model=128, num_layers=2, num_heads=2, mlp_dim=128)
# titans_mac ~60 min on one core, ~32 on two (9.6k tok/s); <3000 steps at 256 miss the task; WSD: results/history.md
BUDGET = dict(batch_size=8, steps=4500, lr=3e-3, schedule="wsd", decay_fraction=1 / 3, min_lr_ratio=0.1,
              warmup_steps=20, weight_decay=0.0, cpu_opt_preset="fast_compile")
FAMILY_OVERRIDES: dict[str, dict] = {
    # Eight heads of 16 whose write gates can close exactly and read the last four tokens (results/history.md).
    "deltanet": {"memory.beta_gate": "hard_sigmoid", "memory.beta_min": 0.0, "memory.gate_conv": True, "num_heads": 8},
    # As mqar.py: a linear memory for speed, the family's default (bounded) step; MAC forgets less at first.
    "titans_lmm": {"memory.depth": 1},
    "titans_mac": {"memory.depth": 1, "memory.decay_init": 1e-3},
    "titans_mag": {"memory.depth": 1},
    "titans_mal": {"memory.depth": 1},
}
# Self-referential memories take mqar.py's memory settings: with the LM defaults recall is not learnt.
SELF_REFERENTIAL_FAMILIES = ("self_ref_titans", "hope")
# ...and keep their state over long filler: a charged write gate, retention toward the initial weights (history.md).
SELF_REFERENTIAL_OVERRIDES = {"memory.lr_gate": "hard_sigmoid", "memory.gate_conv": True, "memory.retain_to": "initial"}
# deltanet (measured with a cosine): a write cost from step 3000 closes its gates on the filler; then state passing.
TRAIN_OVERRIDES: dict[str, dict] = {
    "deltanet": dict(steps=BUDGET["steps"] + 2000, schedule="cosine", decay_steps=BUDGET["steps"], state_passing=0.9,
                     state_passing_from=BUDGET["steps"], write_penalty=0.2, write_penalty_from=3000),
    **{family: dict(write_penalty=0.2, write_penalty_from=3000) for family in SELF_REFERENTIAL_FAMILIES},
}


def _mqar_module():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mqar.py")
    spec = importlib.util.spec_from_file_location("nlearn_config_mqar_for_niah", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def get_config(family: str = "titans_lmm"):
    mqar = _mqar_module()
    config = mqar.family_base(family)
    with config.unlocked():
        config.data.source = TASK["source"]
        config.data.vocab_size = TASK["vocab_size"]
        config.data.niah.variants = TASK["variants"]
        config.data.babilong.tasks = TASK["qa_tasks"]
        config.data.niah.min_len = TASK["min_len"]
        config.data.niah.eval_examples = TASK["eval_examples"]
        config.data.niah.loss_on = TASK["loss_on"]
        config.data.niah.curriculum = TASK["curriculum"]
        config.data.eval_tokens = 0  # score every eval window
        config.model.update(MODEL)
        overrides = dict(FAMILY_OVERRIDES.get(family, {}))
        if family in SELF_REFERENTIAL_FAMILIES:
            overrides.update(mqar.FAMILY_OVERRIDES["self_ref_titans"], **SELF_REFERENTIAL_OVERRIDES)
        for key, value in overrides.items():
            mqar._set(config.model, key, value)
        config.train.update(seq_len=TASK["seq_len"], log_every=50, eval_every=0,
                            **{**BUDGET, **TRAIN_OVERRIDES.get(family, {})})
        config.checkpoint.every_steps = 200
        config.logging.plot = False
    return config
