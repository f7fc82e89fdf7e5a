"""grain pipelines: packing, determinism, exact resume, sharding, evaluation, statistics."""

import math

import numpy as np
import pytest

from data_helpers import TOKEN_DOC_LENGTHS, doc_order, lane_streams
from nlearn.data import (SOURCES, Corpus, describe, get_tokenizer, make_eval_batches, make_train_iterator,
                         unigram_perplexity)
from nlearn.errors import UserError


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


@pytest.fixture(scope="module")
def builtin(make_config):
    return make_config(source="builtin", batch_size=4, seq_len=128)


def test_builtin_batches_are_packed_windows(builtin):
    batches = take(make_train_iterator(builtin), 3)
    for b in batches:
        assert set(b) == {"inputs", "targets"}
        assert b["inputs"].shape == b["targets"].shape == (4, 128)
        assert b["inputs"].dtype == b["targets"].dtype == np.int32
        np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    tokenizer = get_tokenizer(builtin)
    assert tokenizer.vocab_size == 512
    streams = lane_streams(batches)
    for stream in streams:
        assert stream.min() >= 1 and stream.max() < 512  # no padding inside the training stream
        assert len(tokenizer.decode(stream)) > 300
    # Rows come from different documents (each row reads its own shuffle of the corpus).
    assert len({tokenizer.decode(s[:40]) for s in streams}) == 4


def test_determinism_and_seed(builtin):
    a = take(make_train_iterator(builtin), 3)
    assert_same(a, take(make_train_iterator(builtin), 3))
    other = builtin.copy_and_resolve_references()
    other.train.seed = 1
    b = take(make_train_iterator(other), 3)
    assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b))


def test_resume_mid_run_builtin(builtin):
    it = make_train_iterator(builtin)
    take(it, 5)
    state = it.get_state()
    expected = take(it, 4)
    resumed = make_train_iterator(builtin)
    resumed.set_state(state)
    assert_same(expected, take(resumed, 4))


def test_epochs_reshuffle_and_resume_across_epochs(make_config, token_source):
    config = make_config(source=token_source, batch_size=4, seq_len=16)
    n_docs = len(TOKEN_DOC_LENGTHS)
    per_epoch = sum(TOKEN_DOC_LENGTHS) // 17  # windows of one row's stream per epoch
    batches = take(make_train_iterator(config), 3 * per_epoch)
    orders = [doc_order(s) for s in lane_streams(batches)]
    for order in orders:
        epoch1, epoch2 = order[:n_docs], order[n_docs:2 * n_docs]
        assert sorted(epoch1) == sorted(epoch2) == list(range(10, 10 + n_docs))
        assert epoch1 != epoch2
    assert len({tuple(o[:n_docs]) for o in orders}) == 4  # every row has its own order
    # Resume from a state taken late in epoch 1: identical batches through epochs 2 and 3.
    it = make_train_iterator(config)
    take(it, per_epoch - 1)
    state = it.get_state()
    expected = take(it, 2 * per_epoch)
    resumed = make_train_iterator(config)
    resumed.set_state(state)
    assert_same(expected, take(resumed, len(expected)))


def test_packed_stream_resumes_from_its_state_as_json(make_config, token_source, tmp_path):
    """The state is JSON, as orbax stores it (tuples come back as lists); a packed stream saved with no
    remainder pending must not skip a window on resume."""
    import json

    config = make_config(source=token_source, batch_size=8, seq_len=8)
    it = make_train_iterator(config)
    take(it, 1)
    state = it.get_state()
    assert [-1, -1] in [s["remainder_slices"]["tokens"] for s in json.loads(state)["rows"].values()]  # none pending
    expected = take(it, 3)
    for saved in (state, json.loads(state)):
        resumed = make_train_iterator(config)
        resumed.set_state(saved)
        assert_same(expected, take(resumed, 3))
    from nlearn.train.checkpoint import Checkpointer  # through orbax, as the trainer saves it

    it = make_train_iterator(config)
    take(it, 1)
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(1, {"x": np.zeros(1, np.float32)}, it, {})
    ckpt.close()
    resumed = make_train_iterator(config)
    Checkpointer(str(tmp_path)).restore({"x": np.zeros(1, np.float32)}, resumed)
    assert_same(expected, take(resumed, 3))


def test_any_source_can_train_in_stages(make_config, token_source):
    """`Corpus.stages` (what the MQAR curriculum uses): the first batches come from the stage configs'
    streams, then the source's own stream as without stages; resumable in every stage."""
    import dataclasses

    import ml_collections

    def staged(config):
        corpus = SOURCES[token_source](config)
        if config.train.seq_len == 8:  # the stage's own config: no stages of its own
            return corpus
        stage = ml_collections.ConfigDict(config.to_dict())
        stage.train.update(seq_len=8, batch_size=2 * config.train.batch_size)
        return dataclasses.replace(corpus, stages=((2, stage),))

    SOURCES["test_staged"] = staged
    try:
        config = make_config(source="test_staged", batch_size=4, seq_len=16)
        batches = take(make_train_iterator(config), 4)
        assert [b["inputs"].shape for b in batches] == [(8, 8), (8, 8), (4, 16), (4, 16)]
        plain = take(make_train_iterator(make_config(source=token_source, batch_size=4, seq_len=16)), 2)
        assert_same(plain, batches[2:])
        it = make_train_iterator(config)
        take(it, 1)
        resumed = make_train_iterator(config)
        resumed.set_state(it.get_state())
        assert_same(batches[1:], take(resumed, 3))
    finally:
        SOURCES.pop("test_staged")


def test_processes_read_the_rows_of_the_global_batch(make_config, token_source, builtin):
    """Process p reads rows [p * B/n, (p + 1) * B/n) of the 1-process batches; their states join into one
    (`merge_states`) that resumes any process count at the same global position."""
    from nlearn.data import merge_states

    config = make_config(source=token_source, batch_size=4, seq_len=16)
    whole = take(make_train_iterator(config), 5)
    halves = [make_train_iterator(config, process_index=p, process_count=2) for p in range(2)]
    parts = [take(it, 3) for it in halves]
    assert parts[0][0]["inputs"].shape == (2, 16)
    assert_same(whole[:3], [{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in zip(*parts)])
    state = merge_states([it.get_state() for it in halves])
    one = make_train_iterator(config)
    one.set_state(state)  # 2 processes -> 1
    assert_same(whole[3:], take(one, 2))
    quarter = make_train_iterator(config, process_index=3, process_count=4)  # -> 4 processes
    quarter.set_state(state)
    np.testing.assert_array_equal(take(quarter, 1)[0]["inputs"], whole[3]["inputs"][3:])
    with pytest.raises(UserError, match="disagree"):
        merge_states([b'{"count": 1}', b'{"count": 2}'])
    b = [next(make_train_iterator(builtin, process_index=p, process_count=2)) for p in range(2)]
    assert b[0]["inputs"].shape == (2, 128)
    assert not np.array_equal(b[0]["inputs"], b[1]["inputs"])
    with pytest.raises(UserError, match="not divisible"):
        make_train_iterator(builtin, process_index=0, process_count=3)


@pytest.fixture
def unparsed_flags():
    """absl flags unparsed for the test (as in a notebook), reset afterwards."""
    from absl import flags

    was_parsed = flags.FLAGS.is_parsed()
    flags.FLAGS.unparse_flags()
    yield flags.FLAGS
    flags.FLAGS.unparse_flags()
    if was_parsed:
        flags.FLAGS(["pytest"])


def test_multiprocess_prefetch_matches_in_process(make_config, token_source, unparsed_flags):
    config = make_config(source=token_source, batch_size=4, seq_len=16)
    expected = take(make_train_iterator(config), 8)
    config.data.num_workers = 1
    with pytest.raises(UserError, match="data.num_workers=1 runs grain worker processes"):
        make_train_iterator(config)  # grain's workers read absl flags: the caller parses them
    unparsed_flags(["pytest"])
    it = make_train_iterator(config)
    try:
        got = take(it, 4)
        state = it.get_state()
        got += take(it, 4)
        assert_same(expected, got)
    finally:
        it.close()
    it = make_train_iterator(config)
    try:
        it.set_state(state)
        assert_same(expected[4:], take(it, 4))
    finally:
        it.close()


def test_eval_batches(make_config, text_glob):
    config = make_config(source="text", path=text_glob, vocab_size=300, batch_size=4,
                         seq_len=32, eval_tokens=900)
    batches = make_eval_batches(config)
    assert_same(batches, make_eval_batches(config))  # deterministic
    assert len(batches) == math.ceil(math.ceil(900 / 32) / 4)  # 29 windows, 8 batches
    for b in batches:
        assert b["inputs"].shape == b["targets"].shape == b["weights"].shape == (4, 32)
        assert b["weights"].dtype == np.float32 and set(np.unique(b["weights"])) <= {0.0, 1.0}
        np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    assert sum(b["weights"].sum() for b in batches) == 900
    last = batches[-1]["weights"]
    assert last[0].sum() == 900 - 28 * 32 and last[0, :4].all()  # the cap cuts the 29th window
    assert last[1:].sum() == 0  # padding rows weigh nothing
    # eval_tokens=0: the whole validation split, every real token weighted once.
    config.data.eval_tokens = 0
    info = describe(config)
    full = make_eval_batches(config)
    assert sum(b["weights"].sum() for b in full) == info["validation_tokens"] - 1
    assert info["eval_tokens"] == info["validation_tokens"] - 1
    # Two processes split each global batch's rows; every process gets the same count.
    halves = [make_eval_batches(config, process_index=p, process_count=2) for p in range(2)]
    assert len(halves[0]) == len(halves[1]) == len(full)
    np.testing.assert_array_equal(np.concatenate([halves[0][0]["inputs"],
                                                  halves[1][0]["inputs"]]), full[0]["inputs"])


def test_describe_and_unigram_perplexity(make_config, text_glob):
    config = make_config(source="text", path=text_glob, vocab_size=300, batch_size=4,
                         seq_len=32)
    info = describe(config)
    assert info["train_docs"] + info["validation_docs"] == 16
    assert info["validation_docs"] >= 1 and info["train_tokens"] > info["validation_tokens"] > 0
    assert info["vocab_size"] == 300 and not info["approximate"]
    ppl = unigram_perplexity(config)
    assert math.isfinite(ppl) and 1.0 < ppl < 300
    assert unigram_perplexity(config) == ppl


def test_token_source_eval(make_config, token_source):
    config = make_config(source=token_source, batch_size=2, seq_len=8)
    batches = make_eval_batches(config)  # one validation window of 20 tokens, packed stream
    assert sum(b["weights"].sum() for b in batches) == 19
    assert math.isfinite(unigram_perplexity(config))


def windows_corpus(config):
    """An unpacked, weighted token source (like a synthetic recall task): each record is one
    window of seq_len + 1 = 9 tokens; only the last two targets count."""
    del config
    rng = np.random.default_rng(0)
    weights = np.zeros(9, np.float32)
    weights[-2:] = 1.0
    make = lambda n: [{"tokens": rng.integers(5, 30, 9).astype(np.int32), "weights": weights}
                      for _ in range(n)]
    return Corpus(key="test-windows", train=make(10), validation=make(5), vocab_size=32,
                  pack=False)


def test_unpacked_weighted_source(make_config):
    SOURCES["test_windows"] = windows_corpus
    try:
        config = make_config(source="test_windows", batch_size=2, seq_len=8)
        b = next(make_train_iterator(config))
        assert set(b) == {"inputs", "targets", "weights"}
        assert b["inputs"].shape == b["weights"].shape == (2, 8)
        np.testing.assert_array_equal(b["weights"][0], [0, 0, 0, 0, 0, 0, 1, 1])
        batches = make_eval_batches(config)
        assert len(batches) == 3 and sum(x["weights"].sum() for x in batches) == 10
        config.data.eval_tokens = 3  # cap counts weighted targets only
        assert sum(x["weights"].sum() for x in make_eval_batches(config)) == 3
        config.train.seq_len = 7
        with pytest.raises(UserError, match="expected train.seq_len"):
            next(make_train_iterator(config))
    finally:
        SOURCES.pop("test_windows")


def test_config_errors(make_config):
    with pytest.raises(UserError, match="positive"):
        make_train_iterator(make_config(source="builtin", seq_len=0))
