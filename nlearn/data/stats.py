"""Token statistics of a corpus under a tokenizer, computed once and cached on disk:
document and token counts per split, unigram counts of the training split, and the
validation token stream (documents joined with EOS) that evaluation windows are cut from."""

import dataclasses
import json
import os
import shutil
import time
from typing import Callable, Mapping, Any

from absl import logging
import numpy as np

from nlearn.data import cache
from nlearn.data.corpus import Corpus

_VERSION = 1


@dataclasses.dataclass(frozen=True)
class TokenStats:
    """Counts per split (extrapolated when only the first `max_docs` documents were read)."""

    train_docs: int
    train_tokens: int
    validation_docs: int
    validation_tokens: int
    approximate: bool
    train_counts: np.ndarray  # int64 [vocab_size]: occurrences of each id in the training tokens.
    validation_stream: np.ndarray  # int32 [n]: validation documents' tokens, concatenated.


def _scan(split, encode: Callable[[Mapping[str, Any]], np.ndarray], max_docs: int,
          vocab_size: int, keep_stream: bool):
    """(docs read, tokens read, counts [V], stream or None) over the first max_docs records."""
    n = min(len(split), max_docs)
    counts = np.zeros(vocab_size, np.int64)
    pieces, total = [], 0
    for i in range(n):
        ids = encode(split[i])
        total += len(ids)
        counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
        if keep_stream:
            pieces.append(ids)
    stream = np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)
    return n, total, counts, stream


def _extrapolate(count: int, read: int, total: int) -> int:
    return count if read >= total or read == 0 else int(round(count * total / read))


def token_stats(corpus: Corpus, encode: Callable[[Mapping[str, Any]], np.ndarray],
                vocab_size: int, tokenizer_key: str, cache_dir: str,
                max_docs: int) -> TokenStats:
    """Statistics of `corpus` with `encode` (record -> ids, EOS included), cached under
    cache_dir/stats keyed by the corpus, the tokenizer and max_docs."""
    key = f"{corpus.key}-{tokenizer_key}-{cache.short_hash([_VERSION, max_docs, vocab_size], 8)}"
    folder = os.path.join(cache.cache_root(cache_dir), "stats", key)
    meta_path = os.path.join(folder, "meta.json")
    if not os.path.exists(meta_path):
        with cache.file_lock(folder + ".lock"):
            if not os.path.exists(meta_path):
                _compute(corpus, encode, vocab_size, max_docs, folder)
    with open(meta_path) as f:
        meta = json.load(f)
    return TokenStats(train_counts=np.load(os.path.join(folder, "train_counts.npy")),
                      validation_stream=np.load(os.path.join(folder, "validation_tokens.npy")),
                      **meta)


def _compute(corpus, encode, vocab_size, max_docs, folder) -> None:
    """Tokenize both splits and write the statistics folder atomically."""
    t0 = time.time()
    n_tr, tok_tr, counts, _ = _scan(corpus.train, encode, max_docs, vocab_size, False)
    n_va, tok_va, _, stream = _scan(corpus.validation, encode, max_docs, vocab_size, True)
    meta = dict(train_docs=len(corpus.train), validation_docs=len(corpus.validation),
                train_tokens=_extrapolate(tok_tr, n_tr, len(corpus.train)),
                validation_tokens=_extrapolate(tok_va, n_va, len(corpus.validation)),
                approximate=n_tr < len(corpus.train) or n_va < len(corpus.validation))
    tmp = f"{folder}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    np.save(os.path.join(tmp, "train_counts.npy"), counts)
    np.save(os.path.join(tmp, "validation_tokens.npy"), stream)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    logging.info("token statistics of %s in %.1f s: %s", corpus.key, time.time() - t0, meta)
