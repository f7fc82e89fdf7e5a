"""`data.source=niah` / `babilong`: windows of seq_len + 1 tokens, loss on the answer and EOS only, each
window a pure function of its index."""

import numpy as np
import pytest

from nlearn import data
from nlearn.tasks import haystack
from nlearn.errors import UserError


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


@pytest.mark.parametrize("loss_on", ["question", "all"])
def test_loss_on_the_question_or_every_token(haystack_config, tokenizer, loss_on):
    config = haystack_config(source="niah", seq_len=512, **{"niah.min_len": 384, "niah.loss_on": loss_on})
    corpus = data.get_corpus(config)
    tokens, weights = corpus.train[2]["tokens"], corpus.train[2]["weights"]
    used = int(np.flatnonzero(tokens == tokenizer.eos_id)[-1]) + 1
    hot = np.flatnonzero(weights)
    assert hot[-1] == used - 1 and np.all(weights[hot[0]:used] == 1)
    if loss_on == "all":
        assert hot[0] == 1
    else:  # from the question's first token, after the haystack's last newline
        assert tokens[hot[0] - 1] == tokenizer.newline_id and tokenizer.newline_id not in tokens[hot[0]:used]
        assert tokenizer.decode(tokens[hot[0]:used]).startswith("What is the special magic number for")
    held_out = corpus.validation[2]["weights"]
    assert 0 < held_out.sum() < 20  # scored on the answer and EOS only
    config.data.niah.loss_on = "everything"
    with pytest.raises(UserError, match="data.niah.loss_on='everything'"):
        data.get_corpus(config)


def test_length_curriculum_trains_short_windows_first(haystack_config):
    """data.niah.curriculum="512:2": two batches of 512-token windows (twice the rows, prompts of at most 512
    tokens), then the task's 1024-token windows; a stage length that does not divide seq_len is refused."""
    config = haystack_config(source="niah", seq_len=1024, **{"niah.min_len": 768, "niah.curriculum": "512:2"})
    it = data.make_train_iterator(config)
    batches = [next(it) for _ in range(3)]
    assert [b["inputs"].shape for b in batches] == [(4, 512), (4, 512), (2, 1024)]
    assert all(0 < b["weights"].sum() < 120 for b in batches)
    config.data.niah.curriculum = "384:5"
    with pytest.raises(UserError, match="data.niah.curriculum: stage length 384 must divide"):
        data.get_corpus(config)
    config.data.niah.curriculum = "512"
    with pytest.raises(UserError, match="cannot read stage '512'"):
        data.get_corpus(config)


def test_a_mixture_draws_windows_from_each_task(haystack_config, tokenizer):
    """data.source="niah+babilong": windows of both tasks, in the niah section's lengths and curriculum; the
    single-task corpora keep their examples; an unknown or repeated part is refused naming data.source."""
    config = haystack_config(source="niah+babilong", seq_len=1024, **{"niah.min_len": 768, "niah.curriculum": "512:1",
                                                                     "babilong.tasks": "qa1"})
    corpus = data.get_corpus(config)
    prompts = [tokenizer.decode(corpus.train[i]["tokens"]) for i in range(24)]
    kinds = {("Question:" in p, "special magic" in p) for p in prompts}
    assert kinds == {(True, False), (False, True)}
    assert corpus.accuracy_key == "niah_babilong_accuracy" and corpus.stages[0][1].data.source == "niah+babilong"
    assert next(data.make_train_iterator(config))["inputs"].shape == (4, 512)
    assert haystack.text_tokenizer(config).fingerprint == tokenizer.fingerprint
    single = data.get_corpus(haystack_config(source="niah", seq_len=512, **{"niah.min_len": 384}))
    assert single.key.startswith("niah-") and single.key != corpus.key
    for bad in ("niah+niah", "niah+mqar"):
        with pytest.raises(UserError, match="data.source"):
            data.get_corpus(haystack_config(source=bad))
