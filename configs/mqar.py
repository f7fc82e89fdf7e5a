"""MQAR (multi-query associative recall, Zoology) for any family: `configs/mqar.py:<family>`.

One common task and budget for every family: T=256 tokens holding 16 key-value pairs then their
queries, loss only on the answers, 2 layers, d_model=128, trained for a fixed number of steps.

  nlearn-train --config=configs/mqar.py:deltanet --workdir=runs/mqar-deltanet
  nlearn-eval --workdir=runs/mqar-deltanet      # reports mqar_accuracy

The vocabulary is 512 (keys from [1, 256), values from [256, 512)) rather than Zoology's 8192:
recall is as hard, but the output layer costs 16x less, which keeps each run within 10 CPU minutes.
"""

import importlib.util
import os


def family_base(family: str):
    """`configs/<family>.py:tiny`, loaded by path (configs/ is not a package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{family}.py")
    if not os.path.exists(path):
        from nlearn.errors import UserError

        families = sorted(f[:-3] for f in os.listdir(os.path.dirname(path))
                          if f.endswith(".py") and f != "mqar.py")
        raise UserError(f"unknown family {family!r} for configs/mqar.py; valid: {', '.join(families)}")
    spec = importlib.util.spec_from_file_location(f"nlearn_config_{family}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("tiny")


def get_config(family: str = "deltanet"):
    config = family_base(family)
    with config.unlocked():
        config.data.source = "mqar"
        config.data.vocab_size = 512
        config.data.mqar.num_pairs = 16
        config.data.eval_tokens = 0  # score every eval example
        config.data.mqar.eval_examples = 1000
        config.model.update(d_model=128, num_layers=2, num_heads=2)
        config.train.update(seq_len=256, batch_size=32, steps=1500, lr=3e-3, warmup_steps=100,
                            weight_decay=0.1, log_every=50, eval_every=500)
        config.checkpoint.every_steps = 500
        config.logging.plot = False
    return config
