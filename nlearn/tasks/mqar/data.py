"""Multi-query associative recall (MQAR, Zoology): synthetic windows generated on the fly.

A window of seq_len + 1 tokens starts with num_pairs key-value pairs "k1 v1 k2 v2 ...", keys
drawn without replacement from [1, V//2), values from [V//2, V); the rest (the query region)
is 0 except for each key reappearing once, followed by its value. Only those values are
weighted prediction targets, so the loss measures recall and nothing else.

Query placement follows Zoology's `multiquery_ar`: the query region offers
S = (seq_len - 2 * num_pairs) // 2 two-token slots (slot s = region offsets 2s, 2s + 1); the
pairs take num_pairs distinct slots drawn without replacement with p(s) proportional to
(s + 1) ** (power_a - 1): successive sampling, each draw proportional to p over the slots not
yet taken, the distribution Zoology gets from `np.random.choice(S, num_pairs, replace=False,
p=p)`; here computed as an exponential race (Efraimidis-Spirakis: the num_pairs smallest
E_s / p_s, E_s ~ Exp(1), in increasing order), 10x faster than numpy's loop. Pair j goes to
the j-th drawn slot, so queries come in random order, mostly early in the region
(power_a = 0.01: p nearly 1/(s + 1)).

Two differences from Zoology: the answer value also sits in the token stream right after its
key (forced by the single stream this data layer turns into inputs/targets; Zoology's inputs
hold filler there; it is an input only after it has been predicted), and filler stays 0
(Zoology replaces non-query filler inputs by random tokens when random_non_queries=True).

Example i of a split is a pure function of (train.seed, split, i), so a corpus of any size
costs no storage, grain can shuffle it by index, and training iterators resume exactly.
"""

import collections.abc
import functools
import math
import operator
from typing import Mapping, Optional

import ml_collections
import numpy as np

from nlearn.data import cache

from nlearn.tasks import curriculum
from nlearn.data.corpus import Corpus
from nlearn.errors import UserError

_VERSION = 1  # Bump when the generated examples change (part of the corpus key).
_SEED_TAG = 0x6D716172  # "mqar": keeps these seed streams apart from other SeedSequence uses.
TRAIN_STREAM, EVAL_STREAM = 0, 1


def query_slots(seq_len: int, num_pairs: int, query_start: int = 0) -> int:
    """Number of two-token (key, value) slots in the query region, as in Zoology; the region
    starts right after the pairs, at position `query_start` when that is set (> 0)."""
    return (seq_len - (query_start or 2 * num_pairs)) // 2


@functools.lru_cache(maxsize=32)
def gap_probabilities(num_slots: int, power_a: float) -> np.ndarray:
    """p(slot s) proportional to (s + 1) ** (power_a - 1), s in [0, num_slots); read-only."""
    p = np.arange(1, num_slots + 1, dtype=np.float64) ** (power_a - 1.0)
    p /= p.sum()
    p.setflags(write=False)
    return p


def draw_slots(rng: np.random.Generator, p: np.ndarray, k: int) -> np.ndarray:
    """k distinct indices drawn by successive sampling proportional to p (each draw from the
    indices not yet drawn), in draw order; the exponential race gives that law exactly."""
    race = rng.standard_exponential(len(p)) / p
    first = np.argpartition(race, k - 1)[:k]
    return first[np.argsort(race[first], kind="stable")]


def check_args(seq_len: int, num_pairs: int, vocab_size: int, power_a: float,
               names: Optional[Mapping[str, str]] = None, query_start: int = 0) -> None:
    """UserError unless the arguments admit an MQAR window; `names` maps each argument to
    the config key the message should name."""
    n = {"seq_len": "seq_len", "num_pairs": "num_pairs", "vocab_size": "vocab_size",
         "power_a": "power_a", "query_start": "query_start", **(names or {})}
    if num_pairs < 1:
        raise UserError(f"{n['num_pairs']} must be at least 1, got {num_pairs}")
    if 4 * num_pairs > seq_len:
        raise UserError(f"{n['num_pairs']}={num_pairs} needs {n['seq_len']} >= 4 * "
                        f"{n['num_pairs']} = {4 * num_pairs} (the pairs, then one key-value "
                        f"slot per pair in the query region), got {n['seq_len']}={seq_len}")
    if num_pairs > vocab_size // 2 - 1:
        raise UserError(f"{n['num_pairs']}={num_pairs} exceeds the {max(vocab_size // 2 - 1, 0)} "
                        f"distinct keys [1, {n['vocab_size']}//2) of {n['vocab_size']}="
                        f"{vocab_size}")
    if not (math.isfinite(power_a) and power_a > 0):
        raise UserError(f"{n['power_a']} must be a positive number, got {power_a}")
    if query_start and not (2 * num_pairs <= query_start and query_slots(seq_len, num_pairs, query_start) >= num_pairs):
        raise UserError(f"{n['query_start']}={query_start} must be 0 (the pairs at the start) or "
                        f"between 2 * {n['num_pairs']} = {2 * num_pairs} and {n['seq_len']} - 2 * "
                        f"{n['num_pairs']} = {seq_len - 2 * num_pairs} (one query slot per pair)")


def mqar_example(rng: np.random.Generator, *, seq_len: int, num_pairs: int, vocab_size: int,
                 power_a: float = 0.01, random_filler: bool = False,
                 query_start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One MQAR window: (tokens int32 [seq_len + 1], weights float32 [seq_len + 1]).

    weights[t] = 1 exactly where tokens[t] is a queried value (tokens[t - 1] its key), so
    with inputs = tokens[:-1], targets = tokens[1:] and target weights = weights[1:] (what the
    pipeline's to_lm_batch does) the loss falls on the num_pairs answers only.

    random_filler: the query region's filler is drawn uniformly from [1, vocab_size) minus this
    window's keys instead of 0 (Zoology's random_non_queries, without its chance repeats of a
    key, which would make some answers ambiguous); drawn after everything else, so the pairs
    and slots are those of random_filler=False.

    query_start > 0: the pairs end and the queries start at that position, filler before the
    pairs; e.g. a segmented model (titans_mac) must then answer every query from the segment
    before, while the gaps stay as short as in Zoology's layout (query_start = 0: the pairs
    at the start); a curriculum stage, nlearn.tasks.curriculum."""
    check_args(seq_len, num_pairs, vocab_size, power_a, query_start=query_start)
    half = vocab_size // 2
    keys = rng.choice(half - 1, size=num_pairs, replace=False) + 1
    values = rng.choice(vocab_size - half, size=num_pairs, replace=False) + half
    region = query_start or 2 * num_pairs
    num_slots = query_slots(seq_len, num_pairs, query_start)
    slots = draw_slots(rng, gap_probabilities(num_slots, float(power_a)), num_pairs)
    tokens = np.zeros(seq_len + 1, np.int32)
    tokens[region - 2 * num_pairs:region:2] = keys
    tokens[region - 2 * num_pairs + 1:region:2] = values
    key_pos = region + 2 * slots
    tokens[key_pos] = keys
    tokens[key_pos + 1] = values
    weights = np.zeros(seq_len + 1, np.float32)
    weights[key_pos + 1] = 1.0
    if random_filler:
        filler = np.flatnonzero(tokens == 0)
        allowed = np.setdiff1d(np.arange(1, vocab_size, dtype=np.int32), keys)
        tokens[filler] = allowed[rng.integers(len(allowed), size=len(filler))]
    return tokens, weights



def example_index(index, num_examples: int, what: str = "example") -> int:
    """`index` as a non-negative int below `num_examples` (negative counts from the end), else IndexError."""
    i = operator.index(index)
    if i < 0:
        i += num_examples
    if not 0 <= i < num_examples:
        raise IndexError(f"{what} {index} out of range [0, {num_examples})")
    return i

class MqarExamples(collections.abc.Sequence):
    """Random-access (grain-compatible, picklable) sequence of `num_examples` MQAR records
    {"tokens", "weights"}; record i is generated from SeedSequence([tag, stream, seed, i])."""

    def __init__(self, num_examples: int, stream: int, seed: int, *, seq_len: int,
                 num_pairs: int, vocab_size: int, power_a: float, random_filler: bool = False,
                 query_start: int = 0):
        check_args(seq_len, num_pairs, vocab_size, power_a, query_start=query_start)
        self.num_examples, self.stream, self.seed = int(num_examples), int(stream), int(seed)
        self.kwargs = dict(seq_len=int(seq_len), num_pairs=int(num_pairs),
                           vocab_size=int(vocab_size), power_a=float(power_a))
        if random_filler:
            self.kwargs["random_filler"] = True
        if query_start:
            self.kwargs["query_start"] = int(query_start)

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index) -> dict[str, np.ndarray]:
        i = example_index(index, self.num_examples, "MQAR example")
        rng = np.random.default_rng([_SEED_TAG, self.stream, self.seed, i])
        tokens, weights = mqar_example(rng, **self.kwargs)
        return {"tokens": tokens, "weights": weights}

    def __repr__(self) -> str:
        return (f"MqarExamples(num_examples={self.num_examples}, stream={self.stream}, "
                f"seed={self.seed}, {self.kwargs})")


def mqar_source(config: ml_collections.ConfigDict) -> Corpus:
    """`data.source='mqar'`: an unpacked token corpus of generated MQAR windows of
    train.seq_len + 1 tokens over data.vocab_size ids (config.data.mqar sets the task)."""
    m = config.data.get("mqar")
    if m is None:
        raise UserError("data.source='mqar' needs a config.data.mqar section (see data_config())")
    seq_len, vocab = int(config.train.seq_len), int(config.data.vocab_size)
    num_pairs, power_a = int(m.num_pairs), float(m.power_a)
    query_start = int(m.query_start)
    check_args(seq_len, num_pairs, vocab, power_a, query_start=query_start,
               names={"seq_len": "train.seq_len", "num_pairs": "data.mqar.num_pairs",
                      "vocab_size": "data.vocab_size", "power_a": "data.mqar.power_a",
                      "query_start": "data.mqar.query_start"})
    counts = {}
    for split in ("train_examples", "eval_examples"):
        counts[split] = int(m[split])
        if counts[split] < 1:
            raise UserError(f"data.mqar.{split} must be at least 1, got {counts[split]}")
    seed = int(config.train.seed) % 2**64  # SeedSequence takes non-negative entropy only.
    task = dict(seq_len=seq_len, num_pairs=num_pairs, vocab_size=vocab, power_a=power_a)
    if m.random_filler:  # a key only when set: keeps earlier corpus keys
        task["random_filler"] = True
    if query_start:  # likewise
        task["query_start"] = query_start
    key = "mqar-" + cache.short_hash([_VERSION, task, counts, seed])
    return Corpus(
        key=key,
        train=MqarExamples(counts["train_examples"], TRAIN_STREAM, seed, **task),
        validation=MqarExamples(counts["eval_examples"], EVAL_STREAM, seed, **task),
        vocab_size=vocab,
        pack=False,
        stages=curriculum.training_stages(config),
        accuracy_key="mqar_accuracy",
        description=(f"mqar: {num_pairs} pairs, seq_len {seq_len}, vocab {vocab}, power_a "
                     f"{power_a}{', random filler' if task.get('random_filler') else ''}"
                     f"{f', queries from position {query_start}' if query_start else ''}; "
                     f"{counts['train_examples']} train / "
                     f"{counts['eval_examples']} eval examples (seed {seed})"),
    )

