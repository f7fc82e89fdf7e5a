"""The memories' defaults stay bounded: 16K tokens with every gate saturated (largest learning rate, momentum
gate at its maximum, no forgetting, keys with mean cosine >= 0.5) keep the fast weights within a stated bound.

The bound: each layer's Frobenius norm stays below BOUND times its initial norm at every piece of the stream.
The paper's steps (`inner_step="paper"` with the old max_lr 0.04 / depth^2) fail every one of these: their
weights reach 3e7 (depth 1, one token at a time) or overflow (the others); see docs/paper_notes.md.
"""

from __future__ import annotations

import numpy as np
import pytest

from nlearn.memory_config import neural_memory_config
from saturated_stream import mean_cosine, stream_inputs, titans_norms, titans_weights

BOUND = 4.0


def test_stream_keys_are_aligned():
    assert mean_cosine(stream_inputs(0, 2048)[1][0, :, 0]) >= 0.5


@pytest.mark.parametrize("depth,minibatch", [(1, 1), (1, 16), (2, 1), (2, 16)])
def test_titans_default_stays_bounded(depth, minibatch):
    """The family default (`neural_memory_config`) with momentum, at its largest learning rate."""
    cfg = neural_memory_config(depth=depth, minibatch=minibatch)
    norms = titans_norms(depth, minibatch, cfg.inner_step, cfg.max_lr)
    init = np.array([np.linalg.norm(w) for w in titans_weights(depth)])
    assert np.all(np.isfinite(norms)), f"{cfg.inner_step} overflowed"
    assert np.all(norms <= BOUND * init), f"{cfg.inner_step}: max norm per layer {norms.max(0)}, init {init}"
