"""The inner learner's config defaults: max_lr follows the memory depth unless set."""

import pytest

from nlearn.memory_config import neural_memory_config


@pytest.mark.parametrize("depth, expected", [(1, 0.04), (2, 0.01), (3, 0.04 / 9)])
def test_max_lr_follows_depth(depth, expected):
    config = neural_memory_config()
    config.depth = depth  # as a --config.model.memory.depth override does
    assert config.max_lr == pytest.approx(expected)
    assert neural_memory_config(depth=depth).max_lr == pytest.approx(expected)


def test_explicit_max_lr_wins():
    config = neural_memory_config()
    config.max_lr = 0.2
    config.depth = 3
    assert config.max_lr == 0.2
    assert neural_memory_config(max_lr=0.05, depth=3).max_lr == 0.05
