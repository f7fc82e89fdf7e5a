"""Loss by position (`nlearn.eval.tasks.per_position`) and the memory layers' inner-loss probe.

The probe (`inner_losses`) is checked against direct token-by-token computations: the neural memory op's
own `return_inner_loss`, and the delta rule's and TTT-Linear's one-token steps, from a mid-stream state.
"""

import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nlearn.eval.tasks import per_position as pp
from nlearn.layers.mixers import DeltaNetMixer, LinearAttentionMixer, NeuralMemoryMixer, TTTLinearMixer
from nlearn.memory import ttt
from nlearn.memory.delta import gated_delta_rule_step
from nlearn.memory.neural_memory import neural_memory
from nlearn.memory.objectives import l2
from run_helpers import load_family_config

B, T0, T, D, H = 2, 3, 7, 16, 2  # T0 tokens already in the stream, then T more (odd: no mini-batch divides)


def small(family, **memory):
    cfg = load_family_config(family).model
    with cfg.unlocked():
        cfg.update(dict(d_model=D, num_layers=1, num_heads=H))
        cfg.memory.update(memory)
    return cfg


def perturbed(mixer, seed=1):
    """Every parameter moved by N(0, 0.1²), so gates and inner rates differ per token and head."""
    state = nnx.state(mixer, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    nnx.update(mixer, jax.tree.unflatten(treedef, [x + 0.1 * jax.random.normal(k, x.shape, x.dtype)
                                                   for x, k in zip(leaves, keys)]))
    return mixer


def mid_stream(mixer):
    """`(x [B, T, D], cache after T0 earlier tokens, the probe's (before, after) [B, T, H])`, jitted."""
    x = jnp.asarray(np.random.default_rng(2).standard_normal((B, T0 + T, D)), jnp.float32)
    graphdef, state = nnx.split(mixer)

    @jax.jit
    def probe(state, x):
        m = nnx.merge(graphdef, state)
        _, cache = m(x[:, :T0], m.init_cache(B, T0 + T))
        return cache, m.inner_losses(x[:, T0:], cache)

    cache, losses = probe(state, x)
    return x[:, T0:], cache, losses


@pytest.mark.slow
def test_neural_memory_probe_equals_the_ops_inner_loss():
    mixer = perturbed(NeuralMemoryMixer(small("titans_lmm", minibatch=2, max_lr=1.0), rngs=nnx.Rngs(0)))
    x, cache, (before, after) = mid_stream(mixer)
    q, k, v, (lr, mom, dec), _, _ = mixer.project(x, cache)
    _, _, (want_before, want_after) = neural_memory(
        q, k, v, lr=lr, momentum=mom, decay=dec, initial_state=cache["state"], impl="recurrent",
        return_inner_loss=True, **mixer.options)
    assert float(jnp.abs(want_before - want_after).max()) > 1e-3  # the writes move the loss
    np.testing.assert_allclose(before, want_before, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(after, want_after, rtol=1e-4, atol=1e-5)


def test_delta_probe_equals_a_token_by_token_loop():
    cfg = small("gated_deltanet")
    with cfg.unlocked():
        cfg.memory.chunk_size = 4
    mixer = perturbed(DeltaNetMixer(cfg, gated=True, rngs=nnx.Rngs(0)))
    x, cache, (before, after) = mid_stream(mixer)
    q, k, v, (beta, log_a), _, _ = mixer.project(x, cache)
    s, want_b, want_a = cache["state"], [], []
    for t in range(T):
        want_b.append(l2(jnp.einsum("bhk,bhkv->bhv", k[:, t], s), v[:, t]))
        _, s = gated_delta_rule_step(q[:, t], k[:, t], v[:, t], beta[:, t], log_a[:, t], s)
        want_a.append(l2(jnp.einsum("bhk,bhkv->bhv", k[:, t], s), v[:, t]))
    np.testing.assert_allclose(before, jnp.stack(want_b, 1), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(after, jnp.stack(want_a, 1), rtol=1e-4, atol=1e-6)
    assert float((before - after).mean()) > 0  # a delta write lowers the loss of its own pair


@pytest.mark.slow
def test_ttt_linear_probe_equals_a_token_by_token_loop():
    mixer = perturbed(TTTLinearMixer(small("ttt_linear", minibatch=2, base_lr=10.0), rngs=nnx.Rngs(0)))
    x, cache, (before, after) = mid_stream(mixer)
    q, k, v, (eta,), _, _ = mixer.project(x, cache)
    scale, bias = mixer.ln_scale[...], mixer.ln_bias[...]

    def loss(state, t):  # 1/2 |k + LN(k W + b) - v|^2 at the state's current weights
        z = jnp.einsum("bhd,bhde->bhe", k[:, t], state.W) + state.b
        return l2(ttt._read(k[:, t], z, scale, bias), v[:, t])

    st, want_b, want_a = cache["state"], [], []
    for t in range(T):
        want_b.append(loss(st, t))
        _, st = ttt.ttt_linear_step(q[:, t], k[:, t], v[:, t], eta[:, t], st, ln_scale=scale, ln_bias=bias,
                                    minibatch=2)
        want_a.append(loss(st, t))
    assert float(jnp.abs(jnp.stack(want_b) - jnp.stack(want_a)).max()) > 1e-4
    np.testing.assert_allclose(before, jnp.stack(want_b, 1), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(after, jnp.stack(want_a, 1), rtol=1e-4, atol=1e-6)


def test_linear_attention_has_no_inner_loss():
    mixer = LinearAttentionMixer(small("linear_attention"), rngs=nnx.Rngs(0))
    assert mid_stream(mixer)[2] is None


def test_bucket_edges_and_confidence_band():
    assert pp.bucket_edges(100, 5, "log").tolist() == [0, 1, 3, 10, 32, 100]
    assert pp.bucket_edges(10, 5, "linear").tolist() == [0, 2, 4, 6, 8, 10]
    with pytest.raises(ValueError, match="spacing"):
        pp.bucket_edges(10, 5, "cubic")
    values = np.array([[1.0, 3.0, 0.0, 0.0], [3.0, 5.0, 2.0, 2.0]])  # per-doc means of [0, 2): 2 and 4
    first, second = pp.bucket_stats(values, np.array([0, 2, 4]))
    assert (first["start"], first["end"], first["mean"]) == (0, 2, 3.0)
    assert first["ci95"] == pytest.approx(pp.Z95 * np.sqrt(2.0) / np.sqrt(2))  # sd of (2, 4) is sqrt(2)
    assert second["mean"] == 1.0 and second["ci95"] == pytest.approx(pp.Z95 * np.sqrt(2.0) / np.sqrt(2))


@pytest.fixture(scope="module")
def lmm_model(cache_dir, text_corpus):
    from nlearn.models import build

    config = load_family_config("titans_lmm")
    with config.unlocked():
        config.data.update({"source": "text", "path": text_corpus, "cache_dir": cache_dir, "vocab_size": 300})
        config.model.update(dict(d_model=32, num_layers=1, num_heads=2, vocab_size=300))
        config.model.memory.update(dict(minibatch=2, chunk_size=4))
        config.train.update(dict(seq_len=16, batch_size=2))
    graphdef, params = nnx.split(build(config), nnx.Param)
    return config, graphdef, params


@pytest.mark.slow
def test_streaming_in_chunks_equals_one_pass(lmm_model):
    config, graphdef, params = lmm_model
    tokens = np.random.default_rng(0).integers(3, 300, (3, 28)).astype(np.int32)  # 27 inputs: 16 + 11
    whole, inner_whole = pp.stream_losses(graphdef, params, tokens, chunk_size=27)
    pieces, inner_pieces = pp.stream_losses(graphdef, params, tokens, chunk_size=16)
    assert sorted(inner_whole) == [0] and inner_whole[0][0].shape == (3, 27)
    np.testing.assert_allclose(pieces, whole, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(inner_pieces[0][0], inner_whole[0][0], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(inner_pieces[0][1], inner_whole[0][1], rtol=1e-4, atol=1e-6)


def test_task_writes_result_samples_and_plot(lmm_model, tmp_path):
    config, graphdef, params = lmm_model
    ctx = types.SimpleNamespace(workdir=str(tmp_path), config=config, graphdef=graphdef, params=params, step=0,
                                tokenizer=None, lengths=(32,), samples=3, options={"num_buckets": "4"},
                                stream_chunk=16)
    result, samples = pp.run(ctx)
    assert result["task"] == "per_position" and result["length"] == 32 and result["documents"] == 3
    assert result["source"] in ("documents", "concatenated documents")
    assert np.isfinite(result["loss"]) and result["perplexity"] == pytest.approx(np.exp(result["loss"]))
    buckets = result["by_position"]
    assert sorted(map(int, buckets)) == [0, 1, 3, 10] and buckets["10"]["end"] == 32
    inner = result["inner_loss"]
    assert inner["layers"] == [0] and set(inner["by_position"]["0"]) >= {"before", "after", "after_ci95"}
    assert len(samples) == 3 and "beyond_window_loss" in samples[0]
    assert os.path.getsize(os.path.join(tmp_path, result["plot"])) > 1000
    json.dumps(result)  # the CLI writes it as JSON


def test_hope_streams_without_a_probe(cache_dir, text_corpus):
    """Hope's decode (the CMS learning token by token) takes no probe: its losses stream all the same (their
    equality with the full forward is tests/test_hope.py's decode test); its mixer reports no inner loss."""
    from nlearn.models import build

    config = load_family_config("hope")
    with config.unlocked():
        config.model.update(dict(d_model=32, num_layers=1, num_heads=2, vocab_size=300))
        config.model.cms.update(dict(periods=(4,), lr=(1e-2,), decay=(0.01,)))
    graphdef, params = nnx.split(build(config), nnx.Param)
    tokens = np.random.default_rng(0).integers(3, 300, (2, 13)).astype(np.int32)  # 12 inputs: 6 + 6, CMS every 4
    losses, inner = pp.stream_losses(graphdef, params, tokens, chunk_size=6)
    assert inner == {} and losses.shape == (2, 12) and np.all(np.isfinite(losses))
