"""MQAR source: example structure, query-slot law, determinism, split streams, pipeline batches,
exact resume, config errors."""

import pickle

import numpy as np
import pytest

from nlearn.data import data_config, get_corpus, make_eval_batches, make_train_iterator, vocab_size
from nlearn.tasks.mqar import data as mqar
from nlearn.errors import UserError

from data_helpers import check_example, take


@pytest.mark.parametrize("seq_len,num_pairs,vocab", [
    (64, 4, 128), (64, 16, 40), (33, 8, 32), (35, 8, 18), (512, 64, 8192), (8, 1, 4)])
def test_example_structure(seq_len, num_pairs, vocab):
    rng = np.random.default_rng(seq_len)
    for _ in range(50):
        tokens, weights = mqar.mqar_example(rng, seq_len=seq_len, num_pairs=num_pairs,
                                            vocab_size=vocab)
        check_example(tokens, weights, seq_len, num_pairs, vocab)


@pytest.mark.parametrize("seq_len,num_pairs,query_start", [(128, 4, 64), (64, 4, 8), (64, 4, 56), (33, 4, 25)])
def test_query_start_moves_every_query_past_it(seq_len, num_pairs, query_start):
    """data.mqar.query_start: the pairs end there and every query comes after, with the gaps of
    the layout without filler (the first slot is the likeliest)."""
    rng = np.random.default_rng(query_start)
    first_key = []
    for _ in range(200):
        tokens, weights = mqar.mqar_example(rng, seq_len=seq_len, num_pairs=num_pairs, vocab_size=128,
                                            query_start=query_start)
        check_example(tokens, weights, seq_len, num_pairs, 128, query_start=query_start)
        assert np.all(tokens[:query_start - 2 * num_pairs] == 0)
        first_key.append(np.flatnonzero(weights).min() - 1)
    assert min(first_key) == query_start


def test_query_slots_follow_successive_power_law_sampling():
    seq_len, n = 64, 6000
    p = mqar.gap_probabilities(mqar.query_slots(seq_len, 1), 0.01)
    assert np.all(np.diff(p) < 0) and p[0] / p[1] == pytest.approx(2 ** 0.99)
    # One pair: its slot has law p (p[0] ~ 0.25 for 31 slots, power_a = 0.01).
    rng = np.random.default_rng(1)
    first = np.array([np.flatnonzero(mqar.mqar_example(rng, seq_len=seq_len, num_pairs=1,
                                                       vocab_size=64)[1])[0] for _ in range(n)])
    slot = (first - 3) // 2
    freq = np.bincount(slot, minlength=len(p)) / n
    assert abs(freq[0] - p[0]) < 0.03 and abs(freq[:5].sum() - p[:5].sum()) < 0.03
    # Two draws without replacement: P(slot 0 taken) = p0 + sum_t p_t p0 / (1 - p_t).
    q = mqar.gap_probabilities(5, 0.5)
    drawn = np.array([mqar.draw_slots(rng, q, 2) for _ in range(n)])
    assert np.all(drawn[:, 0] != drawn[:, 1])
    exact = q[0] + sum(q[t] * q[0] / (1 - q[t]) for t in range(1, 5))
    assert abs(np.mean(drawn == 0) * 2 - exact) < 0.03
    # The first draw alone has law q (draw order is kept).
    assert abs(np.mean(drawn[:, 0] == 0) - q[0]) < 0.03


def test_source_is_deterministic_with_disjoint_streams(mqar_config):
    config = mqar_config()
    corpus = get_corpus(config)
    assert corpus.vocab_size == 128 and not corpus.pack and vocab_size(config) == 128
    assert len(corpus.train) == 1000 and len(corpus.validation) == 10
    again = get_corpus(config)
    assert again.key == corpus.key
    for i in (0, 7, 999, -1):
        for split in ("train", "validation"):
            if split == "validation" and i == 999:
                continue
            a, b = getattr(corpus, split)[i], getattr(again, split)[i]
            np.testing.assert_array_equal(a["tokens"], b["tokens"])
            np.testing.assert_array_equal(a["weights"], b["weights"])
    check_example(**corpus.train[5], seq_len=64, num_pairs=4, vocab=128)
    train = {corpus.train[i]["tokens"].tobytes() for i in range(200)}
    val = {corpus.validation[i]["tokens"].tobytes() for i in range(10)}
    assert len(train) == 200 and len(val) == 10 and not train & val
    # Another seed is another data set (and another cache key); grain workers get a pickle.
    other = get_corpus(mqar_config(seed=1))
    assert other.key != corpus.key
    assert not {other.train[i]["tokens"].tobytes() for i in range(200)} & train
    clone = pickle.loads(pickle.dumps(corpus.train))
    np.testing.assert_array_equal(clone[3]["tokens"], corpus.train[3]["tokens"])
    with pytest.raises(IndexError):
        corpus.train[1000]


def test_train_batches_weights_and_exact_resume(mqar_config):
    config = mqar_config()
    it = make_train_iterator(config)
    batches = take(it, 3)
    for b in batches:
        assert set(b) == {"inputs", "targets", "weights"}
        assert b["inputs"].shape == b["targets"].shape == b["weights"].shape == (4, 64)
        np.testing.assert_array_equal(b["weights"].sum(axis=1), 4.0)
        for row in range(4):
            tokens = np.append(b["inputs"][row], b["targets"][row][-1])
            weights = np.append(0.0, b["weights"][row]).astype(np.float32)
            check_example(tokens, weights, 64, 4, 128)
    state = it.get_state()
    expected = take(it, 4)
    resumed = make_train_iterator(config)
    resumed.set_state(state)
    got = take(resumed, 4)
    for x, y in zip(expected, got):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    # Same config, same stream from the start.
    first = next(make_train_iterator(config))
    np.testing.assert_array_equal(first["inputs"], batches[0]["inputs"])
    # Two processes each get half of every batch.
    half = next(make_train_iterator(config, process_index=1, process_count=2))
    assert half["inputs"].shape == (2, 64)


def test_eval_batches_cover_the_eval_stream(mqar_config):
    config = mqar_config()
    corpus = get_corpus(config)
    batches = make_eval_batches(config)
    assert len(batches) == 3  # 10 examples in batches of 4, the last 2 rows padding
    assert sum(b["weights"].sum() for b in batches) == 10 * 4
    np.testing.assert_array_equal(batches[-1]["weights"][2:], 0.0)
    rows = np.concatenate([b["inputs"] for b in batches])[:10]
    expected = np.stack([corpus.validation[i]["tokens"][:-1] for i in range(10)])
    np.testing.assert_array_equal(rows, expected)
    again = make_eval_batches(config)
    for x, y in zip(batches, again):
        np.testing.assert_array_equal(x["targets"], y["targets"])


def test_default_config_and_errors(mqar_config):
    m = data_config().mqar
    assert (m.num_pairs, m.power_a, m.train_examples, m.eval_examples) == (16, 0.01, 100_000, 1000)
    cases = [
        (dict(num_pairs=17), r"data\.mqar\.num_pairs=17 needs train\.seq_len >= 4"),
        (dict(num_pairs=0), r"data\.mqar\.num_pairs must be at least 1"),
        (dict(num_pairs=8, vocab=16), r"data\.mqar\.num_pairs=8 exceeds the 7 distinct keys.*"
                                      r"data\.vocab_size=16"),
        (dict(power_a=0.0), r"data\.mqar\.power_a must be a positive"),
        (dict(train_examples=0), r"data\.mqar\.train_examples must be at least 1"),
        (dict(eval_examples=0), r"data\.mqar\.eval_examples must be at least 1"),
    ]
    for kwargs, message in cases:
        with pytest.raises(UserError, match=message):
            get_corpus(mqar_config(**kwargs))
    with pytest.raises(UserError, match=r"data\.mqar\.num_pairs=17"):
        make_train_iterator(mqar_config(num_pairs=17))
    for start in (7, 57):  # inside the pairs; too few slots left for 4 queries
        with pytest.raises(UserError, match=rf"data\.mqar\.query_start={start} must be 0 .* = 8 and .* = 56"):
            get_corpus(mqar_config(query_start=start))
    assert "queries from position 56" in get_corpus(mqar_config(query_start=56)).description
    with pytest.raises(UserError, match=r"needs seq_len >= 4"):
        mqar.mqar_example(np.random.default_rng(0), seq_len=10, num_pairs=3, vocab_size=64)


def test_random_filler_keeps_the_task_and_never_repeats_a_key(mqar_config):
    """random_filler replaces only the 0 filler, by tokens that are not this window's keys."""
    for seed in range(20):
        plain, w0 = mqar.mqar_example(np.random.default_rng(seed), seq_len=64, num_pairs=4, vocab_size=32)
        noisy, w1 = mqar.mqar_example(np.random.default_rng(seed), seq_len=64, num_pairs=4, vocab_size=32,
                                      random_filler=True)
        np.testing.assert_array_equal(w0, w1)
        kept = plain != 0
        np.testing.assert_array_equal(noisy[kept], plain[kept])
        filler = noisy[~kept]
        assert filler.min() >= 1 and filler.max() < 32
        assert not np.isin(filler, plain[0:8:2]).any()
    config = mqar_config()
    config.data.mqar.random_filler = True
    corpus = get_corpus(config)
    assert corpus.key != get_corpus(mqar_config()).key
    assert (corpus.train[0]["tokens"] != 0).all()
