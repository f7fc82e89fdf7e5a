"""`nlearn-eval --task=per_position`: mean next-token loss by token position over held-out documents longer
than the training window, fed through the model's decoding state chunk by chunk (constant memory for recurrent
families); for memory layers also their inner loss before and after each token's write, by position.

Documents start at their first token; positions are grouped in buckets (log-spaced by default), each with a 95%
confidence band over documents (normal approximation on the per-document bucket means).
"""

from __future__ import annotations

import math
import os
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nlearn import data
from nlearn.errors import UserError
from nlearn.train.step import cast_params

DEFAULT_LENGTH_FACTOR = 8  # default document length: this many training windows
DEFAULT_DOCUMENTS = 8
SPACINGS = ("log", "linear")
Z95 = 1.959964  # two-sided 95% normal quantile


# ----------------------------------------------------------------------------------------------
# Documents


def held_out_tokens(config, length: int, count: int, tokenizer=None) -> tuple[np.ndarray, list[str], str]:
    """`(tokens [N, length + 1] int32, names, source)`: the first `count` held-out documents with at least
    `length + 1` tokens (EOS included), each from its start (`source="documents"`); when fewer than `count`
    are that long, consecutive pieces of all held-out documents joined with EOS (`"concatenated documents"`)."""
    corpus = data.get_corpus(config)
    if corpus.vocab_size is not None:
        raise UserError(f"--task=per_position needs a text corpus; data.source={config.data.source!r} is tokens")
    tokenizer = tokenizer or data.get_tokenizer(config, corpus)
    docs = [np.append(tokenizer.encode(corpus.validation[i][corpus.text_key]), data.EOS_ID).astype(np.int32)
            for i in range(len(corpus.validation))]
    long = [i for i, d in enumerate(docs) if len(d) >= length + 1][:count]
    if len(long) == count:
        return np.stack([docs[i][:length + 1] for i in long]), [f"document {i}" for i in long], "documents"
    stream = np.concatenate(docs)
    pieces = min(count, len(stream) // (length + 1))
    if pieces < 1:
        raise UserError(f"the held-out documents hold {len(stream)} tokens, fewer than --lengths={length} + 1; "
                        "ask for a shorter length")
    rows = stream[:pieces * (length + 1)].reshape(pieces, length + 1)
    return rows, [f"held-out stream piece {i}" for i in range(pieces)], "concatenated documents"


# ----------------------------------------------------------------------------------------------
# Streaming with the inner-loss probe


def make_probe_step(graphdef, dtype=jnp.float32, inner: bool = True):
    """Jitted `(params, tokens [B, T], targets [B, T], cache) -> (losses [B, T], inner, cache)`: next-token
    cross-entropies and, with `inner`, `{layer: (before [B, T], after [B, T])}` (mean over heads) of every
    layer whose mixer has `inner_losses` (memory layers that learn)."""

    def step(params, tokens_BT, targets_BT, cache):
        model = nnx.merge(graphdef, cast_params(params, dtype))
        found = []

        def probe(block, x_BTD, layer_cache):
            fn = getattr(block.mixer, "inner_losses", None)
            found.append(None if fn is None else fn(block.mixer_norm(x_BTD), layer_cache))

        if inner and model.decode_probes:
            logits_BTV, cache = model.decode(tokens_BT, cache, probe=probe)
        else:  # no probe (Hope's decode scans the CMS token by token; its mixer has no inner loss either)
            logits_BTV, cache = model.decode(tokens_BT, cache)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT)
        per_layer = {i: (pair[0].mean(-1), pair[1].mean(-1)) for i, pair in enumerate(found) if pair is not None}
        return losses, per_layer, cache

    return jax.jit(step)  # no donation: a fresh cache may hold one buffer twice (θ and its mini-batch start)


_STEPS: dict = {}  # (id(graphdef), dtype, inner) -> (graphdef, step): the entry keeps the graphdef (and its id) alive


def probe_step(graphdef, dtype=jnp.float32, inner: bool = True):
    """`make_probe_step`, one per model definition, so repeated streams reuse its compilations."""
    key = (id(graphdef), jnp.dtype(dtype).name, inner)
    if key not in _STEPS:
        _STEPS[key] = (graphdef, make_probe_step(graphdef, dtype, inner))
    return _STEPS[key][1]


def stream_losses(graphdef, params, tokens_NL1, chunk_size: int, dtype=jnp.float32, inner: bool = True):
    """Stream `tokens [N, L + 1]` through the model in chunks: `(losses [N, L], {layer: (before, after) [N, L]})`."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    inputs, targets = tokens_NL1[:, :-1], tokens_NL1[:, 1:]
    n, length = inputs.shape
    step = probe_step(graphdef, dtype, inner)
    cache = nnx.merge(graphdef, params).init_cache(n, length, dtype)
    losses, per_layer = [], {}
    for start in range(0, length, chunk_size):
        s = slice(start, min(start + chunk_size, length))
        loss, layers, cache = step(params, jnp.asarray(inputs[:, s]), jnp.asarray(targets[:, s]), cache)
        losses.append(np.asarray(loss))
        for i, (before, after) in layers.items():
            per_layer.setdefault(i, ([], []))
            per_layer[i][0].append(np.asarray(before))
            per_layer[i][1].append(np.asarray(after))
    return (np.concatenate(losses, 1),
            {i: (np.concatenate(b, 1), np.concatenate(a, 1)) for i, (b, a) in per_layer.items()})


# ----------------------------------------------------------------------------------------------
# Buckets


def bucket_edges(length: int, num: int = 16, spacing: str = "log") -> np.ndarray:
    """Increasing integer edges `0 = e_0 < ... < e_K = length`: log-spaced (position 0 alone, then
    geometric) or linear."""
    if spacing not in SPACINGS:
        raise ValueError(f"spacing must be one of {SPACINGS}, got {spacing!r}")
    if length < 1 or num < 1:
        raise ValueError(f"length and num must be positive, got length={length}, num={num}")
    if spacing == "log":
        inner = np.geomspace(1, length, num) if length > 1 else np.array([1.0])
        edges = np.concatenate([[0], np.round(inner)])
    else:
        edges = np.round(np.linspace(0, length, num + 1))
    return np.unique(edges.astype(int))


def bucket_stats(values_NL: np.ndarray, edges: np.ndarray) -> list[dict]:
    """Per bucket `[start, end)`: mean over documents of each document's mean, and the 95% half-width."""
    out = []
    for start, end in zip(edges[:-1], edges[1:]):
        per_doc = values_NL[:, start:end].mean(axis=1)
        n = len(per_doc)
        half = Z95 * per_doc.std(ddof=1) / math.sqrt(n) if n > 1 else 0.0
        out.append({"start": int(start), "end": int(end), "mean": float(per_doc.mean()), "ci95": float(half)})
    return out


def _by_position(stats: list[dict], name: str) -> dict:
    return {str(s["start"]): {"end": s["end"], name: s["mean"], f"{name}_ci95": s["ci95"]} for s in stats}


def inner_by_position(per_layer: dict, edges: np.ndarray) -> dict:
    """`{"<start>": {"end", "before", "before_ci95", "after", "after_ci95"}}` of the layers' mean inner loss."""
    before = np.mean([b for b, _ in per_layer.values()], axis=0)
    after = np.mean([a for _, a in per_layer.values()], axis=0)
    out = _by_position(bucket_stats(before, edges), "before")
    for key, s in _by_position(bucket_stats(after, edges), "after").items():
        out[key].update(s)
    return out


def summarize(losses_NL: np.ndarray, per_layer: dict, edges: np.ndarray, window: int) -> dict:
    """The result's numbers: headline loss, within/beyond the training window, by position, inner losses."""
    loss = float(losses_NL.mean())
    result = {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(losses_NL.size),
              "within_window_loss": float(losses_NL[:, :window].mean())}
    if losses_NL.shape[1] > window:
        result["beyond_window_loss"] = float(losses_NL[:, window:].mean())
    result["by_position"] = _by_position(bucket_stats(losses_NL, edges), "loss")
    if per_layer:
        result["inner_loss"] = {
            "layers": sorted(per_layer),
            "mean_before": float(np.mean([b.mean() for b, _ in per_layer.values()])),
            "mean_after": float(np.mean([a.mean() for _, a in per_layer.values()])),
            "by_position": inner_by_position(per_layer, edges)}
    return result


# ----------------------------------------------------------------------------------------------
# Plot


def _curve(by_position: dict, name: str):
    starts = sorted(by_position, key=int)
    x = np.array([(int(s) + by_position[s]["end"] - 1) / 2 + 1 for s in starts])  # bucket middle, 1-based
    y = np.array([by_position[s][name] for s in starts])
    half = np.array([by_position[s][f"{name}_ci95"] for s in starts])
    return x, y, half


def plot_loss_by_position(results: dict, path: str, title: str = "Loss by position") -> str:
    """Loss-by-position curves with their 95% bands (one per label of `results`: label -> per_position
    result), the training window dashed; a second panel holds inner losses when any result has them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inner = {k: r["inner_loss"] for k, r in results.items() if "inner_loss" in r}
    fig, axes = plt.subplots(1, 2 if inner else 1, figsize=(9 if inner else 5, 3.4), squeeze=False)
    ax = axes[0, 0]
    for i, (label, r) in enumerate(results.items()):
        x, y, half = _curve(r["by_position"], "loss")
        ax.plot(x, y, color=f"C{i}", label=label, lw=1.4)
        ax.fill_between(x, y - half, y + half, color=f"C{i}", alpha=0.2, lw=0)
        if r.get("train_seq_len"):
            ax.axvline(r["train_seq_len"], color=f"C{i}", ls="--", lw=0.8)
    ax.set(xscale="log", xlabel="token position", ylabel="next-token loss (nats)", title=title)
    ax.legend(fontsize=7)
    if inner:
        ax2 = axes[0, 1]
        for i, (label, r) in enumerate(results.items()):
            if label not in inner:
                continue
            for name, style in (("before", "-"), ("after", ":")):
                x, y, half = _curve(inner[label]["by_position"], name)
                ax2.plot(x, y, color=f"C{i}", ls=style, lw=1.4, label=f"{label}, {name} write")
                ax2.fill_between(x, y - half, y + half, color=f"C{i}", alpha=0.15, lw=0)
        ax2.set(xscale="log", xlabel="token position", ylabel="inner loss (mean over layers, heads)",
                title="Memory's inner loss")
        ax2.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------
# The task


def _option(options: dict, key: str, default, cast):
    if key not in options:
        return default
    try:
        return cast(options[key])
    except ValueError as e:
        raise UserError(f"--option={key}={options[key]!r}: {e}") from e


def run(ctx) -> tuple[dict, list[dict]]:
    """The per_position task on a `TaskContext`: the result (written to eval/per_position.json by the CLI),
    one sample record per document, and eval/per_position.png."""
    window = int(ctx.config.train.seq_len)
    length = max(ctx.lengths) if ctx.lengths else DEFAULT_LENGTH_FACTOR * window
    count = ctx.samples or DEFAULT_DOCUMENTS
    spacing = _option(ctx.options, "buckets", "log", str)
    if spacing not in SPACINGS:
        raise UserError(f"--option=buckets={spacing!r}: choose one of {', '.join(SPACINGS)}")
    num = _option(ctx.options, "num_buckets", 16, int)
    if num < 1:
        raise UserError(f"--option=num_buckets={num}: must be positive")
    inner = _option(ctx.options, "inner", "true", str).lower() not in ("0", "false", "no")
    tokens, names, source = held_out_tokens(ctx.config, length, count, ctx.tokenizer)
    losses, per_layer = stream_losses(ctx.graphdef, ctx.params, tokens, ctx.stream_chunk, inner=inner)
    edges = bucket_edges(length, num, spacing)
    result = {"task": "per_position", "step": int(ctx.step), **summarize(losses, per_layer, edges, window),
              "length": length, "documents": len(names), "source": source, "train_seq_len": window,
              "buckets": spacing, "family": str(ctx.config.model.family)}
    if per_layer:
        result["inner_loss"]["definition"] = (
            "per token, the memory's own objective on (k_t, v_t) at its state before (theta_{t-1}) and after "
            "(theta_t) the token's write; mean over heads and memory layers")
    result["plot"] = os.path.join("eval", "per_position.png")  # relative to the workdir
    plot_loss_by_position({result["family"]: result}, os.path.join(ctx.workdir, result["plot"]),
                          f"{result['family']}, step {result['step']}")
    samples = [{"document": name, "first_tokens": tokens[i, :32].tolist(), "length": length,
                "loss": float(losses[i].mean()), "within_window_loss": float(losses[i, :window].mean()),
                **({"beyond_window_loss": float(losses[i, window:].mean())} if length > window else {})}
               for i, name in enumerate(names)]
    return result, samples

