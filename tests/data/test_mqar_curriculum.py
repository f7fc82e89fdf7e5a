"""MQAR curriculum (data.mqar.curriculum): stage shapes and tasks, exact resume in every stage,
through an orbax checkpoint too, and one-line errors for malformed stages."""

import numpy as np
import pytest

from nlearn.data import make_train_iterator
from nlearn.tasks.curriculum import Stage, parse_curriculum
from nlearn.data.staged import StagedIterator
from nlearn.errors import UserError
from nlearn.train.checkpoint import Checkpointer

from data_helpers import check_example, take


def example_rows(batch):
    """(tokens [T + 1], weights [T + 1]) of each row, undoing the pipeline's shift."""
    for inputs, targets, weights in zip(batch["inputs"], batch["targets"], batch["weights"]):
        yield np.append(inputs, targets[-1]), np.append(0.0, weights).astype(np.float32)


def test_stages_then_the_task_at_equal_tokens_per_step(mqar_config):
    config = mqar_config(curriculum="16x2:2, 32x4@16:1")  # task: 64 tokens, 4 pairs, batch 4
    batches = take(make_train_iterator(config), 5)
    expected = [(16, 16, 2, 0), (16, 16, 2, 0), (8, 32, 4, 16), (4, 64, 4, 0), (4, 64, 4, 0)]
    for b, (rows, length, pairs, start) in zip(batches, expected):
        assert b["inputs"].shape == (rows, length) and b["inputs"].size == 4 * 64
        np.testing.assert_array_equal(b["weights"].sum(axis=1), pairs)
        for tokens, weights in example_rows(b):
            check_example(tokens, weights, length, pairs, 128, query_start=start)
    # After the stages, the task's own stream, exactly as without a curriculum.
    plain = take(make_train_iterator(mqar_config()), 1)[0]
    np.testing.assert_array_equal(batches[3]["inputs"], plain["inputs"])


@pytest.mark.parametrize("consumed", [0, 1, 2, 3, 5])
def test_resume_continues_in_the_right_stage(mqar_config, consumed):
    config = mqar_config(curriculum="16x2:2,32x4:1")
    it = make_train_iterator(config)
    take(it, consumed)
    state = it.get_state()
    expected = take(it, 3)
    resumed = make_train_iterator(config)
    resumed.set_state(state)
    for x, y in zip(expected, take(resumed, 3)):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def test_resume_through_an_orbax_checkpoint(mqar_config, tmp_path):
    config = mqar_config(curriculum="16x2:3")
    it = make_train_iterator(config)
    take(it, 2)
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    state = {"x": np.zeros(2, np.float32)}
    ckpt.save(2, state, it, {"note": "test"})
    ckpt.close()
    expected = take(it, 3)  # crosses into the task stage
    resumed = make_train_iterator(config)
    Checkpointer(str(tmp_path)).restore(state, resumed)
    for x, y in zip(expected, take(resumed, 3)):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])


def test_changed_curriculum_is_refused_on_resume(mqar_config):
    it = make_train_iterator(mqar_config(curriculum="16x2:1"))
    take(it, 1)
    state = it.get_state()  # in the task stage
    other = make_train_iterator(mqar_config(curriculum="16x2:5"))
    with pytest.raises(UserError, match=r"curriculum \(e.g. data.mqar.curriculum\) changed"):
        other.set_state(state)


def test_parse_and_errors():
    assert parse_curriculum("", 256) == []
    assert parse_curriculum(" 64x4:300 ,128x8:50", 256) == [Stage(64, 4, 300), Stage(128, 8, 50)]
    assert parse_curriculum("128x4@64:150,64x4 @ 8:2", 256) == [Stage(128, 4, 150, 64), Stage(64, 4, 2, 8)]
    for spec, message in [("64:300", "cannot read stage '64:300'"),
                          ("64x4", "cannot read stage"),
                          ("48x4:10", "stage length 48 must divide train.seq_len=256"),
                          ("64x4:0", "stage .64x4:0. needs at least 1 step"),
                          ("64x4@7:10", r"stage .64x4@7:10. needs 2 \* pairs <= query start"),
                          ("64x4@57:10", r"stage .64x4@57:10. needs 2 \* pairs <= query start")]:
        with pytest.raises(UserError, match=f"data.mqar.curriculum: {message}"):
            parse_curriculum(spec, 256)
    assert StagedIterator([2, 3], None).ends == [2, 5]


def test_bad_stage_is_named_before_any_batch(mqar_config):
    with pytest.raises(UserError, match=r"data\.mqar\.curriculum: stage '16x5:2' needs 1 <= pairs"):
        make_train_iterator(mqar_config(curriculum="16x5:2"))
