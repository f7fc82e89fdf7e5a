"""Helpers shared by the data tests (a module, not conftest, so tests can import it by name)."""

import os

import ml_collections
import numpy as np

from nlearn.data import Corpus, data_config
from nlearn.tasks.mqar import data as mqar
from nlearn.data.pipeline import to_lm_batch

WORDS = ("the of and to in a that is for be it by with as on this not which we our have are "
         "congress nation people states government year law public war peace power great "
         "citizens country upon must shall time new made world act duty union right free "
         "lord king love night hath thou thee doth speak heart sweet death fair honour").split()


def config(cache_dir: str, batch_size: int = 4, seq_len: int = 64, seed: int = 0, **data):
    """A full config (data + train sections) with a small vocabulary and the given cache."""
    c = ml_collections.ConfigDict()
    c.data = data_config()
    c.data.cache_dir = cache_dir
    c.data.vocab_size = 512
    c.data.update(data)
    c.train = ml_collections.ConfigDict({"batch_size": batch_size, "seq_len": seq_len,
                                         "seed": seed})
    return c


def write_docs(folder: str, n_docs: int, seed: int = 0) -> list[str]:
    """n_docs pseudo-random English-ish documents (20-60 lines); returns their texts."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    texts = []
    for i in range(n_docs):
        lines = [" ".join(rng.choice(WORDS, size=rng.integers(3, 15))).capitalize() + "."
                 for _ in range(rng.integers(20, 60))]
        text = "\n".join(lines) + "\n"
        with open(os.path.join(folder, f"doc{i:02d}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
        texts.append(text)
    return texts


TOKEN_DOC_LENGTHS = [3 + (i * 7) % 40 for i in range(12)]
TOKEN_EOS = 1


def token_corpus(config) -> Corpus:
    """12 training documents, document i = copies of id 10 + i ending in TOKEN_EOS, so the
    document order of a packed stream can be read off its tokens."""
    del config
    train = [{"tokens": np.array([10 + i] * (n - 1) + [TOKEN_EOS], np.int32)}
             for i, n in enumerate(TOKEN_DOC_LENGTHS)]
    validation = [{"tokens": np.arange(20, dtype=np.int32) % 7 + 5}]
    return Corpus(key="test-tokens", train=train, validation=validation, vocab_size=64)


def lane_streams(batches) -> list[np.ndarray]:
    """Per batch row, the packed token stream behind consecutive batches (row i of each batch
    is the next window of row i's stream)."""
    rows = batches[0]["inputs"].shape[0]
    return [np.concatenate([np.concatenate([b["inputs"][i], b["targets"][i][-1:]])
                            for b in batches]) for i in range(rows)]


def doc_order(stream: np.ndarray) -> list[int]:
    """Document ids of a token-corpus stream, in order (documents end with TOKEN_EOS)."""
    ends = np.flatnonzero(stream == TOKEN_EOS)
    return [int(seg[0]) for seg in np.split(stream, ends + 1) if len(seg) and seg[0] != TOKEN_EOS]


def take(it, n):
    return [next(it) for _ in range(n)]


def check_example(tokens, weights, seq_len, num_pairs, vocab, query_start=0):
    """Every structural property of one window (see nlearn/tasks/mqar/data.py)."""
    assert tokens.shape == weights.shape == (seq_len + 1,)
    assert tokens.dtype == np.int32 and weights.dtype == np.float32
    p2, half = 2 * num_pairs, vocab // 2
    skip = (query_start or p2) - p2  # filler before the pairs
    assert np.all(tokens[:skip] == 0)
    tokens, weights = tokens[skip:], weights[skip:]  # now as with the pairs first
    seq_len -= skip
    keys, values = tokens[0:p2:2], tokens[1:p2:2]
    assert len(set(keys)) == len(set(values)) == num_pairs
    assert keys.min() >= 1 and keys.max() < half
    assert values.min() >= half and values.max() < vocab
    answer = dict(zip(keys.tolist(), values.tolist()))
    region = tokens[p2:]
    occupied = np.flatnonzero(region)
    key_off = occupied[0::2]
    assert len(occupied) == p2 and np.all(key_off % 2 == 0)  # whole (key, value) slots
    np.testing.assert_array_equal(occupied[1::2], key_off + 1)
    assert sorted(region[key_off].tolist()) == sorted(keys.tolist())  # each key queried once
    assert all(answer[k] == v for k, v in zip(region[key_off], region[key_off + 1]))
    assert key_off.max() // 2 < mqar.query_slots(seq_len, num_pairs)
    expected = np.zeros(seq_len + 1, np.float32)
    expected[p2 + key_off + 1] = 1.0
    np.testing.assert_array_equal(weights, expected)
    # Through the pipeline's shift: weighted targets are exactly the answers to queried keys.
    b = to_lm_batch({"tokens": tokens[None], "weights": weights[None]})
    hot = b["weights"][0] > 0
    assert hot.sum() == num_pairs
    assert np.all(np.flatnonzero(hot) >= p2)  # never in the context pairs
    assert [answer[k] for k in b["inputs"][0][hot]] == b["targets"][0][hot].tolist()
