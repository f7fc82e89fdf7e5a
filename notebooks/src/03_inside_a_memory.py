# %% [markdown]
# # 03 · Inside a memory: gates, inner loss by position, and what a MAC segment retrieves
#
# We train a small Titans MAC (memory as a context) for a few dozen steps on MQAR (multi-query
# associative recall: key-value pairs at the start of a window, queries for them later), then look at
# its long-term memory while it reads one batch:
#
# * the per-token gates the layer computes: the inner learning rate η, the momentum μ, the forgetting α;
# * the memory's inner loss on each token's own pair just before and just after its write;
# * what the memory left by earlier segments still returns, which is what MAC retrieves for a segment.
#
# Everything is read off the memory op `nlearn.memory.neural_memory`, through a recording wrapper: the
# layers stay untouched, so this works for any family built on that op.

# %%
import importlib.util
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

from nlearn import data
from nlearn.eval.restore import restore_params
from nlearn.train import train_and_evaluate

ROOT = os.path.dirname(os.getcwd()) if os.path.basename(os.getcwd()) == "notebooks" else os.getcwd()
spec = importlib.util.spec_from_file_location("config_mqar", os.path.join(ROOT, "benchmarks", "configs", "mqar.py"))
mqar = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mqar)

# %% [markdown]
# ## Train briefly
#
# The MQAR preset for `titans_mac` (`benchmarks/configs/mqar.py:titans_mac`), shrunk: windows of 64 tokens with 4
# pairs, segments of 16 tokens (so a window spans 4 segments), one layer, 30 steps.

# %%
config = mqar.get_config("titans_mac")
config.model.update(d_model=32, num_layers=1, segment_len=16)
config.model.memory.minibatch = 8
config.data.mqar.update(num_pairs=4, curriculum="", eval_examples=32)
config.train.update(seq_len=64, batch_size=16, steps=30, warmup_steps=5, schedule="cosine", time_budget_s=0.0,
                    log_every=10, peak_gflops=100.0, final_eval=False)
config.checkpoint.update(every_steps=30, async_save=False)
config.logging.update(wandb_mode="disabled", progress=False)
workdir = tempfile.mkdtemp(prefix="nlearn_nb03_")
result = train_and_evaluate(config, workdir)
print({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()})

_, step, params = restore_params(config, workdir)
from nlearn.train.state import make_setup  # noqa: E402

model = nnx.merge(make_setup(config).graphdef, params)
batch = next(iter(data.make_eval_batches(config, process_index=0, process_count=1)))
tokens = jnp.asarray(batch["inputs"][:4])  # 4 windows of 64 tokens
print("restored step", int(step), "; batch", tokens.shape)

# %% [markdown]
# ## Record every call of the memory op
#
# The wrapper asks the op for its inner loss (`return_inner_loss=True`: the loss of token t's own
# pair at the state just before and just after its write) and hands the layer what it asked for.
# `jax.debug.callback` copies the values out, also from inside the layers' `lax.scan` over segments.

# %%
calls, options = [], {}
from nlearn.memory import neural_memory as original  # noqa: E402



def recording(q, k, v, *, lr, momentum=None, decay=None, initial_state=None, return_inner_loss=False, **kw):
    out = original(q, k, v, lr=lr, momentum=momentum, decay=decay, initial_state=initial_state,
                   return_inner_loss=True, **kw)
    theta_in = None if initial_state is None else initial_state[0]
    record = dict(q=q, k=k, v=v, lr=lr, momentum=momentum, decay=decay, loss=out[2], theta_in=theta_in,
                  theta_out=out[1][0])
    options.update(kw)  # static choices (activation, objective, ...): the same in every call
    jax.debug.callback(lambda r: calls.append(jax.tree_util.tree_map(np.asarray, r)), record, ordered=True)
    return out if return_inner_loss else out[:2]


patched = [m for name, m in sys.modules.items()
           if name.startswith("nlearn") and getattr(m, "neural_memory", None) is original]
for module in patched:
    module.neural_memory = recording
try:
    logits = model(tokens)
    jax.effects_barrier()
finally:
    for module in patched:
        module.neural_memory = original
n_layers, n_segments = config.model.num_layers, config.train.seq_len // config.model.segment_len
print(f"{len(calls)} calls recorded ({n_layers} layers x {n_segments} segments)")
assert len(calls) == n_layers * n_segments, [c["q"].shape for c in calls]


def layer_calls(layer):
    """The layer's calls in stream order, concatenated over segments along time."""
    return calls[layer * n_segments:(layer + 1) * n_segments]


def cat(layer, name):
    return np.concatenate([c[name] for c in layer_calls(layer)], axis=1)

# %% [markdown]
# ## The gates by position
#
# η = max_lr·σ(x W_η), μ = σ(x W_μ), α = σ(x W_α), per token and head (means over the 4 windows). The
# dotted lines are segment boundaries; the pairs sit in the first 8 tokens.

# %%
fig, axes = plt.subplots(n_layers, 3, figsize=(12, 2.6 * n_layers), squeeze=False)
for layer in range(n_layers):
    for ax, name in zip(axes[layer], ("lr", "momentum", "decay")):
        g = cat(layer, name)  # [B, T, H]
        for h in range(g.shape[-1]):
            ax.plot(g.mean(0)[:, h], label=f"head {h}")
        for s in range(1, n_segments):
            ax.axvline(s * config.model.segment_len - 0.5, color="gray", ls=":")
        ax.set_title(f"layer {layer}: {dict(lr='η', momentum='μ', decay='α')[name]}")
axes[0, 0].legend(fontsize=8)
plt.tight_layout()
plt.show()
for layer in range(n_layers):
    g = {name: cat(layer, name) for name in ("lr", "momentum", "decay")}
    assert all(np.all((x >= 0) & np.isfinite(x)) for x in g.values())
    assert np.all(g["decay"] < 1) and np.all(g["momentum"] < 1)
    medians = {name: float(np.median(x)) for name, x in g.items()}
    print(f"layer {layer}: median η {medians['lr']:.4f}, μ {medians['momentum']:.3f}, α {medians['decay']:.4f}")

# %% [markdown]
# ## The inner loss before and after each write
#
# `l_t = ½‖f(k_t) − v_t‖²` at the state before token t's write and after it. A write lowers the loss
# of its own pair (the gap is what the token taught the memory). Inside a mini-batch the write's
# gradient is taken at the mini-batch's start state, not at the state just before the token.

# %%
fig, axes = plt.subplots(1, n_layers, figsize=(6 * n_layers, 2.8), squeeze=False)
for layer, ax in enumerate(axes[0]):
    before, after = (cat(layer, "loss")[i].mean(axis=(0, 2)) for i in (0, 1))
    ax.plot(before, label="before the write")
    ax.plot(after, label="after")
    for s in range(1, n_segments):
        ax.axvline(s * config.model.segment_len - 0.5, color="gray", ls=":")
    ax.set_title(f"layer {layer}: inner loss by position")
    ax.set_xlabel("position")
axes[0, 0].legend(fontsize=8)
plt.tight_layout()
plt.show()
for layer in range(n_layers):
    before, after = cat(layer, "loss")
    print(f"layer {layer}: mean inner loss {before.mean():.4f} before, {after.mean():.4f} after the write")
    assert after.mean() < before.mean()

# %% [markdown]
# ## What a segment retrieves
#
# MAC reads the memory with the state the earlier segments left (its own segment's writes are not
# visible yet), and attends over those reads with the segment. Here we read the recorded states with the
# memory's keys of the first segment, where the pairs are, and measure how far the reads are from the
# values written: once right after the first segment, and then after each later segment, which writes
# its own tokens (and forgets at the rate α): does the first segment's content hold? A read is the op with
# a zero learning rate.


# %%
def read(theta, q, options):
    """f(q; θ) with the public op: a step with η = 0 writes nothing and reads θ."""
    zeros = tuple(np.zeros_like(w) for w in theta)
    o, _ = original(q, q, np.zeros_like(q), lr=np.zeros(q.shape[:3], np.float32), initial_state=(theta, zeros),
                    **dict(options, optimizer="sgd", minibatch=1))
    return np.asarray(o)


seg = config.model.segment_len
fig, axes = plt.subplots(1, n_layers, figsize=(6 * n_layers, 2.8), squeeze=False)
for layer, ax in enumerate(axes[0]):
    first = layer_calls(layer)[0]
    k0, v0 = first["k"], first["v"]  # the first segment's keys and values [B, C, H, D]
    errors = []
    for s, call in enumerate(layer_calls(layer)):
        recalled = read(call["theta_out"], k0, options)
        errors.append(0.5 * np.sum((recalled - v0) ** 2, -1).mean())
    # The state segment 1 retrieves from (left by segment 0) is the one segment 0's call returned.
    assert np.allclose(layer_calls(layer)[1]["theta_in"][0], first["theta_out"][0], atol=1e-5)
    ax.plot(np.arange(1, n_segments + 1), errors, marker="o")
    ax.set_xlabel("state after segment")
    ax.set_title(f"layer {layer}: recall error of segment 1's pairs")
    print(f"layer {layer}: recall error of the first segment's pairs after segments 1..{n_segments}:",
          np.round(errors, 4))
plt.tight_layout()
plt.show()
