"""MFU's FLOP count: every family has one, and two tiny presets equal a count by hand, matmul by matmul."""

import importlib

import pytest
from flax import nnx

from nlearn import models
from nlearn.train import flops

T = 256  # the tiny presets' seq_len


def _mm(*shapes):
    """FLOPs of matmuls given as (m, k, n)."""
    return sum(2 * m * k * n for m, k, n in shapes)


def _tiny(family):
    config = importlib.import_module(family).get_config("tiny")
    params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: models.build(config)), nnx.Param))
    return config, params


def _inverse_64():
    """`unit_lower_inverse` of a 64 × 64 block: per level of size s, 64 / s blocks of two (s/2)³ matmuls;
    its backward two 64³ matmuls."""
    fwd = sum(64 // s * _mm((s // 2,) * 3, (s // 2,) * 3) for s in (2, 4, 8, 16, 32, 64))
    return fwd + _mm((64, 64, 64), (64, 64, 64))


def test_deltanet_tiny_by_hand():
    config, params = _tiny("deltanet")
    d_model, heads, d, mlp, vocab, layers = 256, 4, 64, 640, 8192, 4
    dense = layers * (5 * d_model * d_model + d_model * heads + 3 * d_model * mlp) + vocab * d_model  # + tied head
    c = 64  # chunk_size; chunked_scan on CPU, per chunk and head:
    chunk = _mm((c, d, c), (c, d, c),  # K Kᵀ, Q Kᵀ
                (c, d, d), (c, c, d),  # βK S, T(βV − βK S)
                (c, d, d), (c, c, d),  # Q S, P u
                (d, c, d))  # Kᵀ u
    mixer = heads * (T // c) * (3 * chunk + _inverse_64())
    expected = 6 * dense + layers * mixer / T
    assert flops.flops_per_token(config.model, params, T, backend="cpu") == pytest.approx(expected, rel=1e-12)


def test_titans_mac_tiny_by_hand():
    config, params = _tiny("titans_mac")
    d_model, heads, d, mlp, vocab, layers = 256, 4, 64, 704, 8192, 4
    f, seg, n_p, b = 256, 64, 4, 16  # memory hidden width, segment, persistent tokens, mini-batch
    per_layer = (4 + 2 + 5) * d_model * d_model + 3 * d_model * heads + 3 * d_model * mlp  # attn, retrieve, lmm, gates
    dense = layers * per_layer + vocab * d_model
    per_segment_fwd = heads * _mm((seg, d, n_p + 2 * seg), (seg, n_p + 2 * seg, d))  # attention in a segment
    per_segment_fwd += seg * heads * _mm((1, d, f), (1, f, d))  # retrieval M*(q), each token
    per_segment_fwd += seg * _mm((1, d_model, heads * d), (1, d_model, heads * d))  # retrieved keys, values
    minibatch = _mm((2 * b, d, f), (b, d, f),  # [K; Q] W1, Q U1 (momentum)
                    (b, d, b), (b, b, f),  # dual read, layer 1: Q Kᵀ, (·) δ1
                    (d, b, 2 * f),  # W1 and U1 after the mini-batch
                    (b, f, d), (b, f, d), (b, d, f), (b, f, d),  # X2 W2 (keys), X̄2 W2, δ2 W2ᵀ, X̄2 U2
                    (b, f, b), (b, b, d),  # dual read, layer 2
                    (f, b, 2 * d),  # W2 and U2 after the mini-batch
                    (b, b, b), (b, b, b), (b, b, b),  # decay and momentum transfer matrices, their product
                    (b, d, b), (b, f, b))  # the "overlap" step's Gram matrices of the two layers' inputs
    lmm_per_segment = heads * (seg // b) * 3 * minibatch
    mixer = (T // seg) * (3 * per_segment_fwd + lmm_per_segment)
    expected = 6 * dense + layers * mixer / T
    assert flops.flops_per_token(config.model, params, T, backend="cpu") == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("family", sorted(models.FAMILIES))
def test_every_family_counts_its_mixer(family):
    """A new family must give its record a FLOPs count (else MFU would ignore its mixer)."""
    config = importlib.import_module(family).get_config("tiny")
    assert models.FAMILIES[family].flops is not None, f"{family}'s record (nlearn.models.Family) has no flops"
    assert flops.mixer_flops_per_token(config.model, T, backend="cpu") > 0


def test_window_bounds_attention_cost():
    config = importlib.import_module("transformer").get_config("tiny")
    full = flops.mixer_flops_per_token(config.model, 4096, backend="cpu")
    with config.unlocked():
        config.model.window = 128
    windowed = flops.mixer_flops_per_token(config.model, 4096, backend="cpu")
    assert windowed * 8 < full  # 256 keys per query instead of 4096
