"""Data layer: offline corpora (built-in, text files, tfds), sentencepiece, grain pipelines.

Typical use (config.data from `data_config()`, plus config.train.batch_size/seq_len/seed):

    it = make_train_iterator(config, process_index=jax.process_index(),
                             process_count=jax.process_count())
    batch = next(it)                  # {"inputs", "targets"}: int32 [B_local, T]
    state = it.get_state()            # store with the checkpoint; it.set_state(state) resumes
    for b in make_eval_batches(config): ...   # + "weights" float32, 0 on padding

The names below load on first use: reading a config (`data_config`) must not pull in grain, tfds and
orbax (~5 s), so a bad command line is refused at once.
"""

import importlib

_HOMES = {
    "nlearn.data.corpus": ("Corpus",),
    "nlearn.data.defaults": ("data_config",),
    "nlearn.data.pipeline": ("describe", "get_tokenizer", "make_eval_batches", "make_train_iterator",
                             "merge_states", "tokenizer_path", "unigram_perplexity", "vocab_size"),
    "nlearn.data.sources": ("SOURCES", "get_corpus", "register_source"),
    "nlearn.data.tokenizer": ("BOS_ID", "EOS_ID", "NEWLINE_ID", "PAD_ID", "UNK_ID", "Tokenizer",
                              "load_tokenizer", "sentence_iterator", "train_tokenizer"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = sorted(_HOME_OF)


def __getattr__(name: str):
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'nlearn.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
