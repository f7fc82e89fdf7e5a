"""`data.source=niah` / `babilong`: windows of seq_len + 1 tokens, loss on the answer and EOS only, each
window a pure function of its index."""

import numpy as np
import pytest

from nlearn import data
from nlearn.data import haystack


@pytest.mark.parametrize("source,extra", [("niah", {"niah.variants": "single_1,multikey_2", "niah.min_len": 384}),
                                          ("babilong", {"babilong.min_len": 128})])
def test_windows_weigh_only_the_answer(haystack_config, tokenizer, source, extra):
    config = haystack_config(source=source, seq_len=512, **extra)
    corpus = data.get_corpus(config)
    assert not corpus.pack and corpus.vocab_size == tokenizer.vocab_size
    for i in range(6):
        record = corpus.train[i]
        tokens, weights = record["tokens"], record["weights"]
        assert tokens.shape == weights.shape == (513,)
        answer = tokens[weights > 0]
        assert answer[-1] == tokenizer.eos_id and 1 < len(answer) < 40
        start = int(np.flatnonzero(weights)[0])
        assert np.all(weights[start:start + len(answer)] == 1) and np.all(tokens[start + len(answer):] == 0)
        reply = tokenizer.decode(answer[:-1]).strip()
        prompt = tokenizer.decode(tokens[:start])
        assert reply.rstrip(".") in prompt  # the answer was hidden in the prompt
    np.testing.assert_array_equal(corpus.train[3]["tokens"], corpus.train[3]["tokens"])
    assert not np.array_equal(corpus.train[3]["tokens"], corpus.validation[3]["tokens"])
    assert haystack.text_tokenizer(config).fingerprint == tokenizer.fingerprint


def test_training_batches_carry_the_weights(haystack_config):
    config = haystack_config(source="niah", seq_len=512, **{"niah.min_len": 384})
    batch = next(data.make_train_iterator(config))
    assert batch["inputs"].shape == batch["weights"].shape == (2, 512)
    assert 0 < batch["weights"].sum() < 60
