"""Streaming through `decode` in chunks equals the full forward pass, and greedy decoding after it."""

import jax
import numpy as np
import pytest

from eval_helpers import small_config, split_model
from nlearn.eval.generate import generate
from nlearn.eval.streaming import Streamer
from nlearn.train.step import token_losses

FAMILIES = ["titans_lmm"] + [pytest.param(f, marks=pytest.mark.slow) for f in ("transformer", "deltanet")]


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_losses_match_the_full_forward(family):
    """A stream of 41 tokens in chunks of 16 (a tail of 8): the per-token losses of one forward pass."""
    config = small_config(family)
    graphdef, params = split_model(config)
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (2, 41), 0, 97), np.int32)
    full = token_losses(graphdef, params, tokens[:, :-1], tokens[:, 1:], jax.numpy.float32)
    streamed = Streamer(graphdef, params, chunk_size=16).losses(tokens)
    assert streamed.shape == (2, 40)
    np.testing.assert_allclose(streamed, np.asarray(full), atol=2e-4, rtol=2e-4)


def test_greedy_completion_matches_generate():
    config = small_config("transformer")
    graphdef, params = split_model(config)
    prompt = [int(t) for t in jax.random.randint(jax.random.key(2), (21,), 0, 97)]
    expected = generate(graphdef, params, prompt, max_new_tokens=6, temperature=0.0)
    streamer = Streamer(graphdef, params, chunk_size=8)  # one compiled chunk step serves every call
    assert streamer.complete(prompt, 6) == expected
    assert streamer.complete(prompt, 6, stop_ids=(expected[0],)) == []
    assert streamer.complete(prompt, 6, check_finite=True) == (expected, True)
    overflowed = jax.tree.map(lambda p: p * np.nan, params)  # what a memory whose state overflowed reads out
    assert Streamer(graphdef, overflowed, chunk_size=8).complete(prompt, 6, check_finite=True)[1] is False


def test_sliding_window_cache_stays_bounded():
    config = small_config("transformer", window=8)
    graphdef, params = split_model(config)
    streamer = Streamer(graphdef, params, chunk_size=8)
    cache = streamer.init_cache(1, 1000)
    _, cache = streamer.prefill(np.zeros((1, 40), np.int32), cache)
    assert cache[0]["k"].shape[1] == 8 and int(cache[0]["next"]) == 40


def test_hope_streams_in_whole_decode_spans_then_token_by_token():
    """Hope reads a CMS chunk per decode step only over whole mixer periods from a period's start
    (`decode_span`): streams come in pieces of that span, then single tokens, two compiled shapes in all."""
    graphdef, params = split_model(small_config("hope"))
    streamer = Streamer(graphdef, params, chunk_size=512)
    span = streamer.span
    assert span > 1
    assert [(s.start, s.stop) for s in streamer.chunks(2 * span + 3)] == [(0, span), (span, 2 * span)] + [
        (2 * span + i, 2 * span + i + 1) for i in range(3)]
