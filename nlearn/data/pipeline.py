"""grain pipelines: a checkpointable, infinite training stream of packed token windows, and
finite, deterministic evaluation batches.

Training: for each batch row, documents of this process's shard -> shuffle (new order every
epoch, seeded by config.train.seed and the row) -> tokenize (+EOS) -> concatenate and cut into
windows of seq_len + 1 tokens; rows zipped into batches {"inputs": [B_local, T], "targets":
[B_local, T]} (int32). Evaluation: the validation documents joined with EOS, cut into
consecutive windows, zero-weighted padding.
"""

import atexit
import functools
import json
import math
import os
import weakref
from typing import Any, Mapping, Optional

from absl import flags
import grain
import grain.experimental
import ml_collections
import numpy as np

from nlearn.data import cache
from nlearn.data import sources
from nlearn.data import stats as stats_lib
from nlearn.data.corpus import Corpus
from nlearn.data.staged import StagedIterator
from nlearn.data.tokenizer import Tokenizer, load_tokenizer, train_tokenizer
from nlearn.errors import UserError

_TOKENIZER_VERSION = 1
Batch = dict[str, np.ndarray]


# ----------------------------------------------------------------------------- tokenizer


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, mtime_ns: int) -> Tokenizer:
    del mtime_ns  # Part of the cache key only: a rewritten file is reloaded.
    return load_tokenizer(path)


def _load(path: str) -> Tokenizer:
    path = os.path.expanduser(path)
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError as e:
        raise UserError(f"cannot read tokenizer model {path}: {e.strerror}") from e
    return _load_cached(path, mtime)


def tokenizer_path(config: ml_collections.ConfigDict, corpus: Optional[Corpus] = None) -> str:
    """Where the tokenizer lives: config.data.tokenizer, or the cache entry for this corpus
    and vocab_size (which may not exist yet)."""
    d = config.data
    if d.tokenizer:
        return os.path.expanduser(d.tokenizer)
    corpus = corpus or sources.get_corpus(config)
    key = cache.short_hash([_TOKENIZER_VERSION, corpus.key, d.vocab_size, d.tokenizer_max_chars])
    return os.path.join(cache.cache_root(d.cache_dir), "tokenizers",
                        f"{corpus.key}-v{d.vocab_size}-{key}.model")


def get_tokenizer(config: ml_collections.ConfigDict,
                  corpus: Optional[Corpus] = None) -> Optional[Tokenizer]:
    """The tokenizer of config.data.tokenizer, or the one trained on the training split (once,
    then cached). None for corpora that are already tokenized."""
    corpus = corpus or sources.get_corpus(config)
    if corpus.vocab_size is not None:
        return None
    path = tokenizer_path(config, corpus)
    if not config.data.tokenizer and not os.path.exists(path):
        with cache.file_lock(path + ".lock"):
            if not os.path.exists(path):
                texts = (record[corpus.text_key] for record in corpus.train)
                train_tokenizer(texts, path[: -len(".model")], config.data.vocab_size,
                                max_chars=config.data.tokenizer_max_chars)
    return _load(path)


def vocab_size(config: ml_collections.ConfigDict) -> int:
    """Number of token ids the model must embed (the tokenizer's, or the token corpus')."""
    corpus = sources.get_corpus(config)
    if corpus.vocab_size is not None:
        return corpus.vocab_size
    return get_tokenizer(config, corpus).vocab_size


# ----------------------------------------------------------------------------- transforms


class EncodeDocument:
    """record -> {"tokens": int32 [n + 1]}: the document's ids followed by EOS."""

    def __init__(self, tokenizer: Tokenizer, text_key: str):
        self.tokenizer, self.text_key = tokenizer, text_key

    def __call__(self, record: Mapping[str, Any]) -> dict[str, np.ndarray]:
        ids = self.tokenizer.encode(record[self.text_key])
        return {"tokens": np.append(ids, np.int32(self.tokenizer.eos_id))}


class TokenRecord:
    """record of a token corpus -> {"tokens": int32 [n]} (+ "weights": float32 [n] when the
    record has them and the corpus is unpacked; packed streams weigh every target)."""

    def __init__(self, keep_weights: bool):
        self.keep_weights = keep_weights

    def __call__(self, record: Mapping[str, Any]) -> dict[str, np.ndarray]:
        out = {"tokens": np.asarray(record["tokens"], np.int32)}
        if self.keep_weights and "weights" in record:
            out["weights"] = np.asarray(record["weights"], np.float32)
        return out


class CheckWindow:
    """Unpacked records must be windows of exactly seq_len + 1 tokens."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, element: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if len(element["tokens"]) != self.length:
            raise UserError(f"unpacked source record has {len(element['tokens'])} tokens, "
                            f"expected train.seq_len + 1 = {self.length}")
        return element


def to_lm_batch(batch: Mapping[str, np.ndarray]) -> Batch:
    """{"tokens": [B, T+1] (, "weights")} -> next-token inputs/targets (and target weights)."""
    tokens = batch["tokens"]
    out = {"inputs": np.ascontiguousarray(tokens[:, :-1], np.int32),
           "targets": np.ascontiguousarray(tokens[:, 1:], np.int32)}
    if "weights" in batch:
        out["weights"] = np.ascontiguousarray(batch["weights"][:, 1:], np.float32)
    return out


def _encoder(corpus: Corpus, tokenizer: Optional[Tokenizer]):
    return (TokenRecord(keep_weights=not corpus.pack) if corpus.vocab_size is not None
            else EncodeDocument(tokenizer, corpus.text_key))


# ----------------------------------------------------------------------------- training


def _shape(config: ml_collections.ConfigDict, process_count: int) -> tuple[int, int]:
    """(B_local, T) from config.train, checked."""
    batch, seq_len = int(config.train.batch_size), int(config.train.seq_len)
    if seq_len < 1 or batch < 1:
        raise UserError(f"train.batch_size and train.seq_len must be positive, got "
                        f"{batch} and {seq_len}")
    if batch % process_count:
        raise UserError(f"train.batch_size={batch} is not divisible by the {process_count} "
                        "processes")
    return batch // process_count, seq_len


def lane_seed(seed: int, lane: int) -> int:
    """Shuffle seed of one batch row's document stream, derived from the run's seed."""
    return int(np.random.SeedSequence([seed, lane]).generate_state(1)[0])


def _lane(source, seed: int, encode, corpus: Corpus, seq_len: int) -> grain.IterDataset:
    """One row's infinite stream of windows: documents reshuffled every epoch, tokenized,
    packed (or checked, for unpacked corpora)."""
    ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat(None).map(encode)
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    if corpus.pack:
        return grain.experimental.ConcatThenSplitIterDataset(
            it, length_struct={"tokens": seq_len + 1})
    return it.map(CheckWindow(seq_len + 1))


def stack_rows(rows) -> dict[str, np.ndarray]:
    """A tuple of per-row elements -> one batch element with a leading row axis."""
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def _close_at_exit(ref: "weakref.ref") -> None:
    """Stop an iterator's worker processes before interpreter teardown (grain otherwise
    prints tracebacks from their finalizers at exit)."""
    iterator = ref()
    if iterator is not None:
        try:
            iterator.close()
        except Exception:  # Best effort at exit; nothing useful to report.
            pass


def make_train_iterator(config: ml_collections.ConfigDict, *, process_index: int = 0,
                        process_count: int = 1) -> grain.DatasetIterator:
    """Infinite, checkpointable (get_state/set_state) iterator of this process's training
    batches {"inputs", "targets"}: int32 [batch_size // process_count, seq_len] (+ "weights"
    float32 [B_local, T] for unpacked token sources whose records carry weights).

    Row i of every batch continues row i of the previous batch: each row ("lane") reads its
    own shuffle of the training documents (seed from train.seed, the data offset and the row's
    index in the global batch; a new order every epoch), so a batch mixes B_local documents rather
    than slicing one long document, and a recurrent model may carry its state from one batch to
    the next (with num_workers <= 1; more workers interleave their batches). Process p reads the
    global rows [p * B_local, (p + 1) * B_local): the global batches, and the state saved per row,
    do not depend on the process count. A corpus with training stages (`Corpus.stages`) first
    hands out their batches."""
    if not 0 <= process_index < process_count:
        raise UserError(f"process_index {process_index} not in [0, {process_count})")
    corpus = sources.get_corpus(config)
    if not corpus.stages:
        return _stream(config, corpus, process_index, process_count)
    configs = [stage for _, stage in corpus.stages]
    return StagedIterator([steps for steps, _ in corpus.stages], lambda i: (
        _stream(configs[i], sources.get_corpus(configs[i]), process_index, process_count)
        if i < len(configs) else _stream(config, corpus, process_index, process_count)))


def _stream(config: ml_collections.ConfigDict, corpus: Corpus, process_index: int,
            process_count: int) -> grain.DatasetIterator:
    """The training iterator of one corpus (no stages): lanes of windows zipped into batches."""
    d = config.data
    b_local, seq_len = _shape(config, process_count)
    encode = _encoder(corpus, get_tokenizer(config, corpus))
    seed = int(config.train.seed) + int(d.shuffle_seed_offset)
    rows = range(process_index * b_local, (process_index + 1) * b_local)  # of the global batch
    lanes = [_lane(corpus.train, lane_seed(seed, i), encode, corpus, seq_len) for i in rows]
    it = grain.experimental.ZipIterDataset(lanes).map(stack_rows).map(to_lm_batch)
    if int(d.num_workers) > 0:
        if not flags.FLAGS.is_parsed():  # grain <= 0.2.18 reads absl flags in mp_prefetch (google/grain#1355)
            raise UserError(f"data.num_workers={d.num_workers} runs grain worker processes, which need absl "
                            "flags parsed: run under absl.app.run (the nlearn-* commands do) or call "
                            "absl.flags.FLAGS(sys.argv[:1]) first")
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=int(d.num_workers)))
        iterator = JsonStateIterator(iter(it), process=(process_index, process_count))
        atexit.register(_close_at_exit, weakref.ref(iterator))
        return iterator
    # In-process: no background thread (grain 0.2's ThreadPrefetch leaks threads and prints
    # errors when an unclosed iterator is collected); tokenizing costs ~2-3 us per token.
    return JsonStateIterator(iter(it), process=(process_index, process_count), rows=rows)


def _tuple_slices(state):
    """`state` with every `remainder_slices` pair a tuple again (JSON turns tuples into lists)."""
    if isinstance(state, dict):
        return {k: ({n: tuple(v) for n, v in s.items()} if k == "remainder_slices" else _tuple_slices(s))
                for k, s in state.items()}
    if isinstance(state, list):
        return [_tuple_slices(s) for s in state]
    return state


class JsonStateIterator:
    """A grain iterator whose state is JSON bytes (what grain's orbax handler stores), restored exactly.

    With `rows` (the global batch rows its zipped lanes read) the state is keyed by row,
    `{"rows": {"i": lane state}}`, so the states of all processes join into one (`merge_states`)
    that any process count resumes from; otherwise (worker processes) it is this process's own.
    grain 0.2.18's packing tests `remainder_slices` against the tuple (-1, -1); the lists JSON gives
    back read as a remainder, and a resumed packed stream would skip a window whenever the state was
    saved with none pending. `set_state` also takes the state as a dict."""

    def __init__(self, iterator, *, process: tuple[int, int] = (0, 1), rows: Optional[range] = None):
        self._it, self.process, self.rows = iterator, process, rows

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._it)

    def get_state(self) -> bytes:
        state = self._it.get_state()
        if self.rows is not None:
            state = {"rows": {str(r): s for r, s in zip(self.rows, state["parents"])}}
        else:
            state = {"processes": {str(self.process[0]): state}, "process_count": self.process[1]}
        return json.dumps(state).encode()

    def set_state(self, state) -> None:
        state = json.loads(state) if isinstance(state, (bytes, str)) else state
        if "rows" in state:
            missing = [r for r in self.rows or () if str(r) not in state["rows"]]
            if self.rows is None or missing:
                which = missing if self.rows is not None else "read by worker processes"
                raise UserError(f"the data checkpoint has no position for batch rows {which}: resume with "
                                "the train.batch_size and data.num_workers it was saved with")
            state = {"parents": [state["rows"][str(r)] for r in self.rows]}
        elif "processes" in state:
            index, count = self.process
            if state["process_count"] != count:
                raise UserError(f"the data checkpoint was written by {state['process_count']} processes with "
                                f"data.num_workers > 0; resume with {state['process_count']} processes or "
                                "data.num_workers=0 (whose position does not depend on the process count)")
            state = state["processes"][str(index)]
        self._it.set_state(_tuple_slices(state))

    def start_prefetch(self) -> None:
        getattr(self._it, "start_prefetch", lambda: None)()

    def close(self) -> None:
        getattr(self._it, "close", lambda: None)()


def merge_states(states: list[bytes]) -> bytes:
    """The iterator states of all processes (process order) as one global state: JSON objects
    joined key by key (each process contributes its own rows or process entry; shared entries,
    e.g. a training stage's batch count, must agree)."""
    def join(a, b, where):
        if isinstance(a, dict) and isinstance(b, dict):
            return {**a, **b, **{k: join(a[k], b[k], f"{where}.{k}") for k in a.keys() & b.keys()}}
        if a != b:
            raise UserError(f"the processes' data iterators disagree at {where or 'the top'} ({a!r} vs {b!r})")
        return a

    merged = json.loads(states[0])
    for state in states[1:]:
        merged = join(merged, json.loads(state), "")
    return json.dumps(merged).encode()


# ----------------------------------------------------------------------------- evaluation


class _Context:
    """What evaluation and statistics need: the corpus, its tokenizer (None for token
    corpora), the vocabulary size, and a record -> ids (EOS included) function."""

    def __init__(self, config: ml_collections.ConfigDict):
        self.config = config
        self.corpus = sources.get_corpus(config)
        self.tokenizer = get_tokenizer(config, self.corpus)
        self.vocab = (self.corpus.vocab_size if self.tokenizer is None
                      else self.tokenizer.vocab_size)
        self.tok_key = "tokens" if self.tokenizer is None else f"sp{self.tokenizer.fingerprint}"
        encoder = _encoder(self.corpus, self.tokenizer)
        self.encode = lambda record: encoder(record)["tokens"]

    def validation_stream(self):
        d = self.config.data
        return stats_lib.validation_stream(self.corpus, self.encode, self.tok_key, d.cache_dir,
                                           int(d.stats_max_docs))

    def train_counts(self):
        d = self.config.data
        return stats_lib.train_counts(self.corpus, self.encode, self.vocab, self.tok_key,
                                      d.cache_dir, int(d.stats_max_docs))


def _windows_from_stream(stream: np.ndarray, seq_len: int, n_eval: int, pad_id: int):
    """Consecutive windows covering the first n_eval targets of the stream:
    (inputs [N, T], targets [N, T], weights [N, T]) with pad_id / weight 0 past the end."""
    n_win = math.ceil(n_eval / seq_len)
    padded = np.full(n_win * seq_len + 1, pad_id, np.int32)
    take = min(len(stream), len(padded))
    padded[:take] = stream[:take]
    inputs = padded[:-1].reshape(n_win, seq_len)
    targets = padded[1:].reshape(n_win, seq_len)
    weights = (np.arange(n_win * seq_len) < n_eval).astype(np.float32).reshape(n_win, seq_len)
    return inputs, targets, weights


def _eval_rows(config: ml_collections.ConfigDict):
    """All evaluation rows (inputs, targets, weights), each [N, T], before batching."""
    ctx = _Context(config)
    corpus, tokenizer = ctx.corpus, ctx.tokenizer
    seq_len = int(config.train.seq_len)
    cap = int(config.data.eval_tokens)
    if corpus.pack:
        _, stream = ctx.validation_stream()
        available = max(len(stream) - 1, 0)
        n_eval = min(available, cap) if cap > 0 else available
        return _windows_from_stream(stream, seq_len, n_eval, pad_id=0)
    # Unpacked records: one window each, read until `cap` weighted targets are covered.
    encode, check = _encoder(corpus, tokenizer), CheckWindow(seq_len + 1)
    rows, counted = [], 0
    for i in range(len(corpus.validation)):
        row = to_lm_batch({k: v[None] for k, v in check(encode(corpus.validation[i])).items()})
        row.setdefault("weights", np.ones((1, seq_len), np.float32))
        rows.append(row)
        counted += int((row["weights"] > 0).sum())
        if 0 < cap <= counted:
            break
    if not rows:
        raise UserError(f"source {config.data.source!r} has no validation records")
    inputs, targets, weights = (np.concatenate([r[k] for r in rows])
                                for k in ("inputs", "targets", "weights"))
    if cap > 0:  # Zero the weights past the cap, counting only weighted targets.
        weights = np.where(np.cumsum(weights > 0).reshape(weights.shape) <= cap, weights, 0.0)
    return inputs, targets, weights.astype(np.float32)


def make_eval_batches(config: ml_collections.ConfigDict, *, process_index: int = 0,
                      process_count: int = 1) -> list[Batch]:
    """Finite, deterministic validation batches {"inputs", "targets": int32 [B_local, T],
    "weights": float32 [B_local, T] (1 = real target, 0 = padding)} covering up to
    data.eval_tokens targets. Every process gets the same number of batches (its rows)."""
    b_local, seq_len = _shape(config, process_count)
    batch = b_local * process_count
    inputs, targets, weights = _eval_rows(config)
    n_batches = max(1, math.ceil(len(inputs) / batch))
    pad_rows = n_batches * batch - len(inputs)

    def pad(x):
        return np.concatenate([x, np.zeros((pad_rows, seq_len), x.dtype)])

    inputs, targets, weights = pad(inputs), pad(targets), pad(weights)
    lo = process_index * b_local
    out = []
    for i in range(n_batches):
        rows = slice(i * batch + lo, i * batch + lo + b_local)
        out.append({"inputs": inputs[rows], "targets": targets[rows], "weights": weights[rows]})
    return out


# ----------------------------------------------------------------------------- reporting


def describe(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """Sizes for logging: documents and tokens per split, evaluated tokens, vocabulary.
    The first call per corpus and tokenizer tokenizes the training split (then cached)."""
    ctx = _Context(config)
    val_meta, _ = ctx.validation_stream()
    train_meta, _ = ctx.train_counts()
    n_eval = int(sum(b["weights"].sum() for b in make_eval_batches(config)))
    return {
        "source": config.data.source,
        "corpus": ctx.corpus.key,
        "description": ctx.corpus.description,
        "tokenizer": ctx.tokenizer.path if ctx.tokenizer is not None else "",
        "vocab_size": ctx.vocab,
        "train_docs": train_meta["train_docs"],
        "train_tokens": train_meta["train_tokens"],
        "validation_docs": val_meta["validation_docs"],
        "validation_tokens": val_meta["validation_tokens"],
        "eval_tokens": n_eval,
        "approximate": train_meta["train_approximate"] or val_meta["validation_approximate"],
    }


def unigram_perplexity(config: ml_collections.ConfigDict) -> float:
    """Perplexity on the evaluated validation targets of an add-one-smoothed unigram model
    fit on the training tokens: the score an LM must beat to have learned anything."""
    _, counts = _Context(config).train_counts()
    counts = counts.astype(np.float64)
    log_p = np.log(counts + 1.0) - np.log(counts.sum() + len(counts))
    nll, n = 0.0, 0.0
    for b in make_eval_batches(config):
        nll -= float((b["weights"] * log_p[b["targets"]]).sum())
        n += float(b["weights"].sum())
    if n == 0:
        raise UserError("no validation tokens to evaluate (data.eval_tokens or the split is empty)")
    return float(np.exp(nll / n))
