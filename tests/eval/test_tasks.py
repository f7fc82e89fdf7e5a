"""The babilong and mqar tasks in process, on untrained models: the result's shape and records."""

import pytest

from eval_helpers import small_config, split_model
from nlearn.tasks.haystack import text_tokenizer
from nlearn.tasks.babilong import score as babilong_task
from nlearn.eval.tasks import TaskContext
from nlearn.tasks.mqar import score as mqar_task
from nlearn.train.state import make_setup


@pytest.mark.slow
def test_babilong_task(haystack_config):
    config = haystack_config(source="babilong")
    graphdef, params = split_model(config)
    ctx = TaskContext(workdir="", config=config, setup=None, graphdef=graphdef, params=params, step=0,
                      tokenizer=text_tokenizer(config), lengths=(512,), samples=2, variant="qa1,qa3")
    result, records = babilong_task.run(ctx)
    assert list(result["by_variant"]) == ["qa1", "qa3"] and list(result["by_length"]) == ["512"]
    assert 0.0 <= result["accuracy"] <= 1.0 and "by_depth" not in result
    assert len(records) == 4 and all(r["targets"][0] in babilong_task.babilong.LOCATIONS for r in records)


@pytest.mark.slow  # ~6 s of compilation per length; tests/data covers the MQAR windows
def test_mqar_task_sweeps_lengths():
    config = small_config("deltanet", vocab=64)
    with config.unlocked():
        config.data.source = "mqar"
        config.data.mqar.num_pairs = 4
        config.train.update(seq_len=32, batch_size=8)
    setup = make_setup(config)
    params = setup.init_state()["params"]
    ctx = TaskContext(workdir="", config=config, setup=setup, graphdef=setup.graphdef, params=params, step=0,
                      lengths=(32, 64), samples=16)
    result, records = mqar_task.run(ctx)
    assert list(result["by_length"]) == ["32", "64"] and result["tokens"] == 16 * 4
    assert all(0.0 <= a <= 1.0 for a in result["by_length"].values())
    assert len(records) == 16 and len(records[0]["keys"]) == 4
