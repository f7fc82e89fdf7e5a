"""Fixtures for the data tests: one temporary nlearn cache per session (so the built-in corpus
and its tokenizer are built at most once), small configs, a small text corpus, and a token
source registered through SOURCES."""

import pytest

import data_helpers
from nlearn.data import SOURCES


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("nlearn_data_cache"))


@pytest.fixture(scope="session")
def make_config(data_cache):
    """make_config(batch_size=4, seq_len=64, seed=0, **data_overrides) -> full config."""
    return lambda **kw: data_helpers.config(data_cache, **kw)


@pytest.fixture(scope="session")
def text_glob(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("text_corpus")
    data_helpers.write_docs(str(folder), 16)
    return str(folder / "*.txt")


@pytest.fixture(scope="session")
def token_source():
    """Registers source 'test_tokens' (data_helpers.token_corpus); returns its name."""
    SOURCES["test_tokens"] = data_helpers.token_corpus
    yield "test_tokens"
    SOURCES.pop("test_tokens", None)


@pytest.fixture
def mqar_config(make_config):
    """mqar_config(num_pairs=4, seq_len=64, vocab=128, **mqar_overrides) -> config."""

    def build(num_pairs=4, seq_len=64, vocab=128, batch_size=4, seed=0, **overrides):
        config = make_config(source="mqar", batch_size=batch_size, seq_len=seq_len, seed=seed,
                             vocab_size=vocab)
        config.data.mqar.num_pairs = num_pairs
        config.data.mqar.train_examples = 1000
        config.data.mqar.eval_examples = 10
        for k, v in overrides.items():
            config.data.mqar[k] = v
        return config

    return build
