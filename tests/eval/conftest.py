"""Fixtures for the evaluation tests: a small text haystack and its tokenizer, in the session cache."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def haystack_config(cache_dir, text_corpus):
    """`make(**data)` -> a transformer test config over the small text corpus (vocab 300); data.niah and
    data.babilong draw their haystack and tokenizer from it."""
    from eval_helpers import small_config

    def make(source="text", seq_len=512, **data):
        config = small_config("transformer", vocab=300)
        with config.unlocked():
            config.data.update({"source": source, "path": text_corpus, "cache_dir": cache_dir, "eval_tokens": 0})
            config.data.niah.haystack = "text"
            config.data.babilong.haystack = "text"
            for key, value in data.items():
                section, name = key.split(".")
                config.data[section][name] = value
            config.train.update(seq_len=seq_len, batch_size=2)
        return config

    return make


@pytest.fixture(scope="session")
def tokenizer(haystack_config):
    from nlearn.tasks.haystack import text_tokenizer

    return text_tokenizer(haystack_config())
