# %% [markdown]
# # 02 · Train, resume, evaluate and ablate from Python
#
# `nlearn-train` is a thin wrapper around `nlearn.train.train_and_evaluate(config, workdir)`; this
# notebook calls that function directly. The shapes are tiny so that it runs in seconds on a laptop
# CPU: the numbers say that the machinery works, not how good the model is. For real runs use the
# presets (`configs/<family>.py:tiny`, `:170m`, ...) from the command line.

# %%
import importlib.util
import json
import os
import tempfile

import matplotlib.pyplot as plt

from nlearn.train import train_and_evaluate


def load_config(family: str, preset: str = "tiny"):
    """`configs/<family>.py:<preset>`, as `--config=configs/<family>.py:<preset>` loads it."""
    here = os.getcwd()
    root = os.path.dirname(here) if os.path.basename(here) == "notebooks" else here
    spec = importlib.util.spec_from_file_location(f"config_{family}", os.path.join(root, "configs", f"{family}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(preset)


def tiny(config, steps: int):
    """Shrink a preset to a seconds-long run on the built-in corpus (every key is a CLI override too)."""
    config.model.update(d_model=32, num_layers=1, num_heads=2, mlp_dim=64)
    if "memory" in config.model:  # a one-layer (matrix) memory compiles fastest
        config.model.memory.update(depth=1, minibatch=8)
    config.data.update(vocab_size=512, eval_tokens=2048, include_shakespeare=False)
    config.train.update(steps=steps, batch_size=4, seq_len=64, warmup_steps=4, log_every=2, peak_gflops=100.0)
    config.checkpoint.update(every_steps=10, async_save=False)
    config.logging.update(wandb_mode="disabled", plot=False, progress=False)
    return config


workdir = tempfile.mkdtemp(prefix="nlearn_nb02_")

# %% [markdown]
# ## Train
#
# The Titans LMM preset, 10 steps. The run directory gets `config.json` (the resolved config),
# `metrics.jsonl`, `eval.json` and `checkpoints/`.

# %%
config = tiny(load_config("titans_lmm"), steps=10)
run_dir = os.path.join(workdir, "lmm")
first = train_and_evaluate(config, run_dir)
print({k: round(v, 3) if isinstance(v, float) else v for k, v in first.items()})
print(sorted(os.listdir(run_dir)))
assert first["step"] == 10 and first["loss"] > 0

# %% [markdown]
# ## Resume
#
# Calling it again with more steps continues from the newest checkpoint (parameters, optimizer,
# step, RNG and the data position), exactly as rerunning the CLI command after a crash would.

# %%
config.train.steps = 20
second = train_and_evaluate(config, run_dir)
steps_logged = [json.loads(line)["step"] for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"loss"' in line]
print("second call ended at step", second["step"], "; logged steps:", steps_logged)
assert second["step"] == 20 and min(s for s in steps_logged if s > 10) > 10

# %% [markdown]
# ## Evaluate
#
# `nlearn-eval --workdir=... --step=N` restores a checkpoint with the run's saved config and scores the
# held-out tokens; these are the functions it calls. The step-10 checkpoint scores exactly what the
# first call reported when it ended there.

# %%
from nlearn import data  # noqa: E402
from nlearn.eval.perplexity import make_evaluator  # noqa: E402
from nlearn.eval.restore import load_run_config, restore_params  # noqa: E402

saved = load_run_config(run_dir)
setup, step, params = restore_params(saved, run_dir, step=10)
scores = make_evaluator(setup)(params, data.make_eval_batches(saved))
print(f"step {int(step)}: {scores}")
assert abs(scores["loss"] - first["loss"]) < 1e-4

# %% [markdown]
# ## Ablate the inner optimizer
#
# One override changes the memory's inner learner: here plain SGD instead of Titans' momentum. An
# unknown choice is refused with the list of valid ones.

# %%
ablated = tiny(load_config("titans_lmm"), steps=20)
ablated.model.memory.optimizer = "sgd"
sgd = train_and_evaluate(ablated, os.path.join(workdir, "lmm_sgd"))
print(f"validation loss: momentum {second['loss']:.3f}, sgd {sgd['loss']:.3f}")

from nlearn.errors import UserError  # noqa: E402

bad = tiny(load_config("titans_lmm"), steps=1)
bad.model.memory.optimizer = "adamq"
try:
    train_and_evaluate(bad, os.path.join(workdir, "bad"))
    raise AssertionError("an unknown inner optimizer should be refused")
except UserError as err:
    print("refused:", err)

# %% [markdown]
# ## Plot the losses

# %%
def losses(run):
    records = [json.loads(line) for line in open(os.path.join(workdir, run, "metrics.jsonl"))]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


for run, label in (("lmm", "momentum (default)"), ("lmm_sgd", "memory.optimizer=sgd")):
    steps, values = zip(*losses(run))
    plt.plot(steps, values, marker="o", label=label)
plt.xlabel("step")
plt.ylabel("training loss")
plt.legend()
plt.show()
