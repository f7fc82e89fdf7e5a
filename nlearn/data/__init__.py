"""Data layer: offline corpora (built-in, text files, tfds), sentencepiece, grain pipelines.

Typical use (config.data from `data_config()`, plus config.train.batch_size/seq_len/seed):

    it = make_train_iterator(config, process_index=jax.process_index(),
                             process_count=jax.process_count())
    batch = next(it)                  # {"inputs", "targets"}: int32 [B_local, T]
    state = it.get_state()            # store with the checkpoint; it.set_state(state) resumes
    for b in make_eval_batches(config): ...   # + "weights" float32, 0 on padding
"""

from nlearn.data.corpus import Corpus
from nlearn.data.defaults import data_config
from nlearn.data.pipeline import (
    describe,
    get_tokenizer,
    make_eval_batches,
    make_train_iterator,
    merge_states,
    tokenizer_path,
    unigram_perplexity,
    vocab_size,
)
from nlearn.data.sources import SOURCES, get_corpus, register_source
from nlearn.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    NEWLINE_ID,
    PAD_ID,
    UNK_ID,
    Tokenizer,
    load_tokenizer,
    sentence_iterator,
    train_tokenizer,
)

__all__ = [
    "BOS_ID", "EOS_ID", "NEWLINE_ID", "PAD_ID", "UNK_ID", "SOURCES", "Corpus", "Tokenizer",
    "data_config", "describe", "get_corpus", "get_tokenizer", "load_tokenizer",
    "make_eval_batches", "make_train_iterator", "merge_states", "register_source", "sentence_iterator",
    "tokenizer_path", "train_tokenizer", "unigram_perplexity", "vocab_size",
]
