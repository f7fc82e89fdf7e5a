"""Needle in a haystack (RULER S-NIAH) for any family: `configs/niah.py:<family>`.

Trains on RULER prompts of 192-256 tokens (data.source='niah': filler haystack, one needle at a uniform
depth, loss on the answer only) so the model learns the task format; `nlearn-eval --task=niah` then asks
the same question at lengths the model never saw:

  nlearn-train --config=configs/niah.py:titans_lmm --workdir=runs/niah-titans_lmm
  nlearn-eval --workdir=runs/niah-titans_lmm --task=niah --lengths=256,1024,4096,8192

Model as configs/mqar.py (2 layers, d_model=128, Titans memories linear) with a 1024-piece tokenizer on the
built-in corpus (digits are single pieces), so a step costs about an MQAR step; BUDGET fits 10 minutes on 2
idle cores for titans_lmm at MQAR's ~10k tokens/s. TASK["variants"] takes any of nlearn.data.niah.VARIANTS
(e.g. "single_1,single_2,multikey_2" for a mixture).
"""

import importlib.util
import os

TASK = dict(seq_len=256, min_len=192, variants="single_1", vocab_size=1024, eval_examples=64)
MODEL = dict(d_model=128, num_layers=2, num_heads=2, mlp_dim=128)
BUDGET = dict(batch_size=16, steps=1200, lr=3e-3, schedule="cosine", min_lr_ratio=0.1, warmup_steps=20,
              weight_decay=0.0, cpu_opt_preset="fast_compile")
# As configs/mqar.py: linear Titans memories (a deep one costs ~11x more per token on CPU) with a stronger
# inner learning rate, so a needle written once is still recalled thousands of tokens on.
FAMILY_OVERRIDES: dict[str, dict] = {
    "titans_lmm": {"memory.depth": 1, "memory.max_lr": 0.2},
    "titans_mac": {"memory.depth": 1, "memory.max_lr": 0.2, "memory.decay_init": 1e-3},
    "titans_mag": {"memory.depth": 1, "memory.max_lr": 0.2},
    "titans_mal": {"memory.depth": 1, "memory.max_lr": 0.2},
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
        config.data.source = "niah"
        config.data.vocab_size = TASK["vocab_size"]
        config.data.niah.variants = TASK["variants"]
        config.data.niah.min_len = TASK["min_len"]
        config.data.niah.eval_examples = TASK["eval_examples"]
        config.data.eval_tokens = 0  # score every eval window
        config.model.update(MODEL)
        for key, value in FAMILY_OVERRIDES.get(family, {}).items():
            mqar._set(config.model, key, value)
        config.train.update(seq_len=TASK["seq_len"], log_every=50, eval_every=0, **BUDGET)
        config.checkpoint.every_steps = 200
        config.logging.plot = False
    return config
