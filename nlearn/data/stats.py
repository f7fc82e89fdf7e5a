"""Token statistics of a corpus under a tokenizer, computed once and cached on disk.

Two entries, because their costs differ: the validation token stream (documents joined with
EOS, what evaluation windows are cut from; cheap, needed by every run) and the training
counts (token totals and unigram counts; a pass over the whole training split, needed only by
describe and unigram_perplexity).
"""

import json
import os
import shutil
import time
from typing import Any, Callable, Mapping

from absl import logging
import numpy as np

from nlearn.data import cache
from nlearn.data.corpus import Corpus

_VERSION = 1
Encode = Callable[[Mapping[str, Any]], np.ndarray]


def _folder(corpus: Corpus, what: str, tokenizer_key: str, cache_dir: str, params) -> str:
    key = f"{corpus.key}-{tokenizer_key}-{what}-{cache.short_hash([_VERSION, params], 8)}"
    return os.path.join(cache.cache_root(cache_dir), "stats", key)


def _cached(folder: str, compute: Callable[[], tuple[dict, dict]]) -> tuple[dict, dict]:
    """(meta, arrays) from `folder`, running `compute` and writing it atomically if missing."""
    meta_path = os.path.join(folder, "meta.json")
    if not os.path.exists(meta_path):
        with cache.file_lock(folder + ".lock"):
            if not os.path.exists(meta_path):
                t0 = time.time()
                meta, arrays = compute()
                tmp = f"{folder}.tmp{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
                for name, array in arrays.items():
                    np.save(os.path.join(tmp, f"{name}.npy"), array)
                with open(os.path.join(tmp, "meta.json"), "w") as f:
                    json.dump(meta, f)
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(tmp, folder)
                logging.info("token statistics %s in %.1f s: %s", os.path.basename(folder),
                             time.time() - t0, meta)
    with open(meta_path) as f:
        meta = json.load(f)
    arrays = {n[:-4]: np.load(os.path.join(folder, n)) for n in os.listdir(folder)
              if n.endswith(".npy")}
    return meta, arrays


def _extrapolate(count: int, read: int, total: int) -> int:
    return count if read >= total or read == 0 else int(round(count * total / read))


def validation_stream(corpus: Corpus, encode: Encode, tokenizer_key: str, cache_dir: str,
                      max_docs: int) -> tuple[dict, np.ndarray]:
    """({"validation_docs", "validation_tokens", "approximate"}, int32 stream of the first
    max_docs validation documents' ids, concatenated)."""

    def compute():
        n = min(len(corpus.validation), max_docs)
        pieces = [encode(corpus.validation[i]) for i in range(n)]
        stream = np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)
        meta = {"validation_docs": len(corpus.validation),
                "validation_tokens": _extrapolate(len(stream), n, len(corpus.validation)),
                "validation_approximate": n < len(corpus.validation)}
        return meta, {"stream": stream}

    meta, arrays = _cached(_folder(corpus, "val", tokenizer_key, cache_dir, max_docs), compute)
    return meta, arrays["stream"]


def train_counts(corpus: Corpus, encode: Encode, vocab_size: int, tokenizer_key: str,
                 cache_dir: str, max_docs: int) -> tuple[dict, np.ndarray]:
    """({"train_docs", "train_tokens", "approximate"}, int64 [vocab_size] occurrences of each
    id in the first max_docs training documents)."""

    def compute():
        n = min(len(corpus.train), max_docs)
        counts, total = np.zeros(vocab_size, np.int64), 0
        for i in range(n):
            ids = encode(corpus.train[i])
            total += len(ids)
            counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
        meta = {"train_docs": len(corpus.train),
                "train_tokens": _extrapolate(total, n, len(corpus.train)),
                "train_approximate": n < len(corpus.train)}
        return meta, {"counts": counts}

    folder = _folder(corpus, "train", tokenizer_key, cache_dir, [max_docs, vocab_size])
    meta, arrays = _cached(folder, compute)
    return meta, arrays["counts"]
