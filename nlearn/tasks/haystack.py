"""What the long-context tasks share: the text they hide facts in, the tokenizer, fitting a prompt to a
token budget, and training corpora of generated question-answer windows (`data.source='niah'` /
`'babilong'`, or a mixture such as `'niah+babilong'`, each window drawn from one of them).

The haystack text comes from a base text source (`data.<task>.haystack`, default the built-in corpus):
its training documents for training windows, its held-out documents for evaluation. The tokenizer is
the base source's, so a run trained on a synthetic task still reads and writes text.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import importlib
import re
from typing import Callable, Optional, Sequence

import ml_collections
import numpy as np

from nlearn.data import cache, sources
from nlearn.data.corpus import Corpus
from nlearn.tasks.curriculum import resized_windows
from nlearn.tasks.mqar.data import example_index
from nlearn.data.tokenizer import PAD_ID, Tokenizer
from nlearn.errors import UserError

TEXT_TASK_SOURCES = sources.QA_TASK_SOURCES  # data sources whose text base gives the tokenizer


class PromptTooLong(UserError):
    """A prompt's fixed parts (template, needles, facts) alone exceed the tokens asked for."""


def parse_names(spec: str, choices, key: str) -> list[str]:
    """A comma list of names from `choices` ("all": every one); UserError naming `key` and the choices."""
    names = [s.strip() for s in str(spec).split(",") if s.strip()]
    if names == ["all"]:
        return list(choices)
    if not names or any(n not in choices for n in names):
        raise UserError(f"{key}={spec!r}: choose from all, {', '.join(choices)}")
    return names


def base_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`config` with data.source set to the text source a synthetic task (a mixture's first) draws its
    haystack from."""
    task = str(config.data.source).split("+")[0]
    if task not in TEXT_TASK_SOURCES:
        return config
    section = config.data.get(task)
    base = str(section.haystack) if section is not None and "haystack" in section else "builtin"
    if base in TEXT_TASK_SOURCES:
        raise UserError(f"data.{task}.haystack must name a text source, got {base!r}")
    config = config.copy_and_resolve_references()
    with config.unlocked():
        config.data.source = base
    return config


def text_tokenizer(config: ml_collections.ConfigDict) -> Optional[Tokenizer]:
    """The tokenizer that turns task text into this run's token ids (None for token-only runs: MQAR)."""
    from nlearn.data.pipeline import get_tokenizer

    return get_tokenizer(base_config(config))


@functools.lru_cache(maxsize=8)
def _words(texts: tuple) -> tuple:
    return tuple(re.sub(r"\s+", " ", " ".join(texts)).split(" "))


def haystack_words(config: ml_collections.ConfigDict, split: str, max_docs: int = 400) -> tuple[str, ...]:
    """The base source's `split` ("train" or "validation") documents as one whitespace-normalised list of
    words (RULER's essay haystack: words, later cut into sentences)."""
    corpus = sources.get_corpus(base_config(config))
    records = corpus.train if split == "train" else corpus.validation
    texts = []
    for i in range(min(len(records), max_docs)):
        text = records[i][corpus.text_key]
        texts.append(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)
    words = _words(tuple(texts))
    if len(words) < 100:
        raise UserError(f"the haystack source {corpus.description!r} has too little {split} text")
    return words


def split_sentences(text: str) -> list[str]:
    """Sentences at '.', '!' or '?' followed by whitespace (a stand-in for nltk's sent_tokenize)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def fit_to_budget(build: Callable[[int], str], tokenizer: Tokenizer, budget: int,
                  hint: int = 64) -> tuple[int, np.ndarray]:
    """About the largest haystack size n (and its token ids) with `len(encode(build(n))) <= budget`.

    Token counts grow about linearly in n: secant steps from a probe's slope, keeping the largest n that
    fits and the smallest that does not, until the fit is within one unit's tokens."""
    def count(n):
        ids = tokenizer.encode(build(n))
        return len(ids), ids

    base, lo_ids = count(0)
    if base > budget:
        raise PromptTooLong(f"a prompt without any haystack already has {base} tokens, more than the {budget} "
                            "asked (ask for longer prompts)")
    probe = max(1, hint)
    slope = max((count(probe)[0] - base) / probe, 1e-3)
    lo, hi, n = 0, None, max(0, int((budget - base) / slope))
    for _ in range(16):
        tokens, ids = count(n)
        if tokens <= budget:
            lo, lo_ids = n, ids
            if tokens > budget - slope:
                break
        else:
            hi = n
        guess = n + int(np.floor((budget - tokens) / slope))
        guess = max(lo + 1, guess if hi is None else min(guess, hi - 1))
        if hi is not None and guess >= hi or guess == n:
            break
        n = guess
    return lo, lo_ids


LOSS_ON = ("answer", "question", "all")  # data.<task>.loss_on: which tokens of a window the loss falls on


class QAExamples(collections.abc.Sequence):
    """Random-access (grain-compatible) training windows {"tokens", "weights"} of `length` + 1 tokens:
    a prompt, its answer and EOS, then padding; weights 1 on the answer and EOS (`loss_on="answer"`), also
    on the prompt's last line, the question ("question"), or on every token ("all").

    Example i is `make(rng_i) -> (prompt ids, answer ids)` with rng_i from SeedSequence([tag, stream, seed,
    i]); `make` must fit `length` + 1 tokens."""

    def __init__(self, num_examples: int, stream: int, seed: int, tag: int, length: int, make, eos_id: int,
                 loss_on: str = "answer", newline_id: int = -1):
        self.num_examples, self.stream, self.seed, self.tag = int(num_examples), int(stream), int(seed), int(tag)
        self.length, self.make, self.eos_id = int(length), make, int(eos_id)
        self.loss_on, self.newline_id = loss_on, int(newline_id)

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index) -> dict[str, np.ndarray]:
        i = example_index(index, self.num_examples)
        rng = np.random.default_rng([self.tag, self.stream, self.seed, i])
        prompt, answer = self.make(rng)
        return qa_window(prompt, answer, self.eos_id, self.length + 1, loss_from(prompt, self.loss_on,
                                                                                 self.newline_id))


def loss_from(prompt: Sequence[int], loss_on: str, newline_id: int) -> int:
    """The first token the loss falls on: the answer's, the one after the prompt's last newline (the question
    and answer prefix), or the second token (every prediction)."""
    if loss_on == "all":
        return 1
    if loss_on == "question":
        lines = np.flatnonzero(np.asarray(prompt) == newline_id)
        return int(lines[-1]) + 1 if len(lines) else 1
    return len(prompt)


def qa_window(prompt: Sequence[int], answer: Sequence[int], eos_id: int, size: int,
              start: int | None = None) -> dict[str, np.ndarray]:
    """{"tokens", "weights"} of `size`: prompt, answer, EOS, PAD...; weights from `start` (default: the
    answer's first token) through EOS."""
    used = len(prompt) + len(answer) + 1
    if used > size:
        raise ValueError(f"a {used}-token example does not fit a {size}-token window")
    tokens = np.full(size, PAD_ID, np.int32)
    tokens[:used] = np.concatenate([prompt, answer, [eos_id]]).astype(np.int32)
    weights = np.zeros(size, np.float32)
    weights[len(prompt) if start is None else start:used] = 1.0
    return {"tokens": tokens, "weights": weights}


def random_length(rng: np.random.Generator, min_len: int, seq_len: int, make):
    """`make(length)` at a length drawn from [min_len, seq_len + 1]; at seq_len + 1 (the whole window) when
    the drawn one cannot hold the prompt's fixed parts."""
    try:
        return make(int(rng.integers(min_len, seq_len + 2)))
    except PromptTooLong:
        return make(seq_len + 1)


_LENGTH_STAGE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def length_stages(config: ml_collections.ConfigDict, name: str) -> tuple:
    """`data.<name>.curriculum = "256:3000"`: the first 3000 steps train on windows of 256 tokens (prompt
    lengths from min_len scaled by 256 / seq_len, the tokens per step kept: batch_size * seq_len / 256 rows),
    then on the task's own windows; stages run in order ("256:2000,384:500" needs 384 to divide seq_len too). Short
    windows hold little filler, so the model learns the task format there in a fraction of the steps, and the
    long windows then teach it to keep the facts over a haystack. `((steps, stage config), ...)`."""
    section, key = config.data[name], f"data.{name}.curriculum"
    seq_len, stages = int(config.train.seq_len), []
    for part in [p for p in str(section.get("curriculum", "")).split(",") if p.strip()]:
        m = _LENGTH_STAGE.match(part)
        if not m:
            raise UserError(f"{key}: cannot read stage {part.strip()!r}; expected 'LEN:STEPS' stages separated "
                            f"by commas, e.g. '256:3000'")
        length, steps = int(m.group(1)), int(m.group(2))
        if length < 1 or seq_len % length:
            raise UserError(f"{key}: stage length {length} must divide train.seq_len={seq_len} (each stage keeps "
                            f"the tokens per step)")
        stage = resized_windows(config, length)
        stage.data[name].update(min_len=max(1, int(section.min_len) * length // seq_len), curriculum="")
        stages.append((steps, stage))
    return tuple(stages)


@dataclasses.dataclass(frozen=True)
class QATask:
    """A question-answer task's training examples: `make_example(rng, kind, tokenizer, length, words)` -> a dict
    with "prompt_ids" and "answer_ids", for a kind drawn from `kinds`; `words` is haystack text when
    `needs_words`."""

    name: str  # its data.source and config.data section
    tag: int  # seeds its examples' random streams
    kinds: tuple
    make_example: Callable
    needs_words: bool
    description: str


def qa_task(config: ml_collections.ConfigDict, name: str) -> QATask:
    """The QATask of task source `name` (nlearn.tasks.<name>.data.qa_task)."""
    return importlib.import_module(f"nlearn.tasks.{name}.data").qa_task(config)


def mixed_qa_source(config: ml_collections.ConfigDict) -> Corpus:
    """`data.source='niah+babilong'`: each window one task's example, kinds drawn uniformly over all tasks'
    kinds; window lengths, counts, loss and curriculum come from the first task's section."""
    return qa_source(config, [qa_task(config, name) for name in str(config.data.source).split("+")])


def qa_source(config: ml_collections.ConfigDict, tasks: Sequence[QATask]) -> Corpus:
    """The unpacked token corpus of `tasks` (one, or a mixture): windows of train.seq_len + 1 tokens, each
    `make_example(rng, kind, tokenizer, length, words)` of a kind drawn from all tasks' kinds and a length
    drawn from [data.<name>.min_len, seq_len + 1] (name: the first task's), then EOS and padding."""
    name = tasks[0].name
    section = config.data.get(name)
    if section is None:
        raise UserError(f"data.source={config.data.source!r} needs a config.data.{name} section (see data_config())")
    seq_len, min_len = int(config.train.seq_len), int(section.min_len)
    if not 0 < min_len <= seq_len:
        raise UserError(f"data.{name}.min_len={min_len} must be in [1, train.seq_len={seq_len}]")
    counts = {}
    for split in ("train_examples", "eval_examples"):
        counts[split] = int(section[split])
        if counts[split] < 1:
            raise UserError(f"data.{name}.{split} must be at least 1, got {counts[split]}")
    loss_on = str(section.get("loss_on", "answer"))
    if loss_on not in LOSS_ON:
        raise UserError(f"data.{name}.loss_on={loss_on!r}: choose from {', '.join(LOSS_ON)}")
    stages = length_stages(config, name)
    tokenizer = text_tokenizer(config)
    kinds = [(task, kind) for task in tasks for kind in task.kinds]

    def make_for_split(split):
        words = haystack_words(config, split) if any(t.needs_words for t in tasks) else ()

        def make(rng):
            (task, kind), seed = kinds[int(rng.integers(len(kinds)))], rng.integers(2**63)
            ex = random_length(rng, min_len, seq_len, lambda length: task.make_example(
                np.random.default_rng(seed), kind, tokenizer, length, words))
            return ex["prompt_ids"], ex["answer_ids"]

        return make

    seed = int(config.train.seed) % 2**64
    tag = functools.reduce(lambda a, b: a ^ b, (t.tag for t in tasks))
    sections = [config.data.get(t.name, ml_collections.ConfigDict()).to_dict() for t in tasks]
    key = "-".join(t.name for t in tasks) + "-" + cache.short_hash(
        [sections[0] if len(tasks) == 1 else sections, counts, seed, seq_len, tokenizer.fingerprint])
    description = "; ".join(t.description for t in tasks)
    return Corpus(
        key=key,
        train=QAExamples(counts["train_examples"], 0, seed, tag, seq_len, make_for_split("train"), tokenizer.eos_id,
                         loss_on, tokenizer.newline_id),
        # scored on the answer whatever the training loss covers: the eval accuracy stays the task's
        validation=QAExamples(counts["eval_examples"], 1, seed, tag, seq_len, make_for_split("validation"),
                              tokenizer.eos_id),
        vocab_size=tokenizer.vocab_size,
        pack=False,
        stages=stages,
        accuracy_key="_".join(t.name for t in tasks) + "_accuracy",
        description=f"{description}; {counts['train_examples']} train / {counts['eval_examples']} eval windows "
                    f"of {seq_len} tokens (seed {seed})",
    )
