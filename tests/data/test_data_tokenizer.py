"""sentencepiece training, special ids, exact round trips, caching by the pipeline."""

import os
import pathlib
import pickle

import numpy as np
import pytest

from nlearn.data import tokenizer as tok_lib
from nlearn.data import get_tokenizer, vocab_size
from nlearn.errors import UserError

from data_helpers import write_docs


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    texts = write_docs(str(folder / "docs"), 8, seed=1)
    files = [pathlib.Path(folder / "docs" / f) for f in sorted(os.listdir(folder / "docs"))]
    path = tok_lib.train_tokenizer(files[:4] + texts[4:], str(folder / "spm"), 400)
    return tok_lib.load_tokenizer(path)


def test_special_ids_and_size(small_tokenizer):
    t = small_tokenizer
    assert t.vocab_size == 400
    assert (t.pad_id, t.eos_id, t.bos_id, t.unk_id, t.newline_id) == (0, 1, 2, 3, 4)
    assert t.id_to_piece(4) == "\n"


@pytest.mark.parametrize("text", [
    "The king shall speak.\nThe nation is great.\n",
    "  indented line\n\n\nafter blank lines  \ttab",
    "unseen: ünïcödé — 漢字 🙂 \x00 control",
    "",
    "\n",
])
def test_round_trip_exact(small_tokenizer, text):
    ids = small_tokenizer.encode(text)
    assert ids.dtype == np.int32
    assert small_tokenizer.decode(ids) == text
    assert small_tokenizer.decode(ids.tolist()) == text


def test_encode_is_line_wise_and_bytes_ok(small_tokenizer):
    t = small_tokenizer
    a, b = t.encode("the war"), t.encode("of peace")
    joined = t.encode("the war\nof peace")
    np.testing.assert_array_equal(joined, np.concatenate([a, [t.newline_id], b]))
    np.testing.assert_array_equal(t.encode("the war".encode()), a)
    assert t.decode([t.eos_id, *a, t.pad_id]) == "the war"


def test_pickle(small_tokenizer):
    clone = pickle.loads(pickle.dumps(small_tokenizer))
    np.testing.assert_array_equal(clone.encode("love and death"),
                                  small_tokenizer.encode("love and death"))


def test_sentence_iterator_cuts_long_lines():
    long = " ".join(["word"] * 3000)  # 14999 characters on one line
    pieces = list(tok_lib.sentence_iterator(["a\n\n  \n" + long + "\nb"]))
    assert pieces[0] == "a" and pieces[-1] == "b"
    assert all(len(p) <= 4000 for p in pieces)
    assert "".join(pieces[1:-1]) == long


def test_errors(tmp_path):
    with pytest.raises(UserError, match="vocab_size"):
        tok_lib.train_tokenizer(["some text"], str(tmp_path / "x"), 100)
    with pytest.raises(UserError, match="too high|vocab_size=5000"):
        tok_lib.train_tokenizer(["a tiny text"] * 3, str(tmp_path / "x"), 5000)
    with pytest.raises(UserError, match="missing.model"):
        tok_lib.load_tokenizer(str(tmp_path / "missing.model"))
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(UserError, match="junk.model"):
        tok_lib.load_tokenizer(str(tmp_path / "junk.model"))


def test_pipeline_tokenizer_cached_and_configurable(make_config, text_glob, small_tokenizer):
    config = make_config(source="text", path=text_glob, vocab_size=350)
    first = get_tokenizer(config)
    mtime = os.stat(first.path).st_mtime_ns
    again = get_tokenizer(config)
    assert again.path == first.path and os.stat(again.path).st_mtime_ns == mtime
    assert vocab_size(config) == 350 == first.vocab_size
    # An explicit model wins over vocab_size; a missing one is a UserError naming it.
    config.data.tokenizer = small_tokenizer.path
    assert vocab_size(config) == 400
    config.data.tokenizer = "/nonexistent/spm.model"
    with pytest.raises(UserError, match="/nonexistent/spm.model"):
        get_tokenizer(config)
