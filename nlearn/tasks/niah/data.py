"""RULER's needle-in-a-haystack tasks (Hsieh et al. 2024, NVIDIA/RULER `niah`), as text, and their
training source `data.source='niah'`.

Templates, needle and filler are RULER's (tests pin them); the variants are its niah_single_1-3,
multikey_1-3, multivalue and multiquery. As RULER, a prompt's length counts `REPLY_TOKENS` reserved for the
reply, needles go before one of the haystack's units (never after the last), and evaluation keys are
adjective-noun pairs from wonderwords' lists; training keys come from the short lists below, whose words the
evaluation leaves out, so no evaluation key was seen in training. Departures, each for a reason: needles go at
the depths the caller asks (evenly spaced in the evaluation, for per-depth results; RULER samples them), the
others of a multi-needle prompt evenly spread after the first; the essay haystack is held-out built-in corpus
text (RULER: Paul Graham essays) cut into sentences at '.', '!' and '?' (RULER: nltk).
"""

from __future__ import annotations

import dataclasses
import functools
import uuid

import ml_collections
import numpy as np

from nlearn.data.corpus import Corpus
from nlearn.errors import UserError
from nlearn.tasks import haystack

# RULER scripts/data/synthetic/constants.py ('niah') and niah.py, verbatim.
TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
            "{type_needle_v} for {query} mentioned in the provided text?")
ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
REPEAT_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@dataclasses.dataclass(frozen=True)
class Variant:
    """One RULER niah configuration (scripts/synthetic.yaml)."""

    haystack: str  # "repeat" (filler), "essay" (corpus text), "needle" (distractor needles)
    type_needle_k: str = "words"
    type_needle_v: str = "numbers"
    num_needle_k: int = 1
    num_needle_v: int = 1
    num_needle_q: int = 1


VARIANTS = {
    "single_1": Variant("repeat"),
    "single_2": Variant("essay"),
    "single_3": Variant("essay", type_needle_v="uuids"),
    "multikey_1": Variant("essay", num_needle_k=4),
    "multikey_2": Variant("needle"),
    "multikey_3": Variant("needle", type_needle_k="uuids", type_needle_v="uuids"),
    "multivalue": Variant("essay", num_needle_v=4),
    "multiquery": Variant("essay", num_needle_q=4),
}

ADJECTIVES = (
    "ablaze", "agile", "amber", "ancient", "bitter", "bold", "brave", "brisk", "calm", "clever", "crimson",
    "curious", "damp", "eager", "early", "elegant", "faint", "fierce", "fragile", "gentle", "gilded", "glossy",
    "grumpy", "hollow", "humble", "icy", "jolly", "lively", "lofty", "lucky", "mellow", "misty", "modest",
    "noisy", "odd", "pale", "proud", "quiet", "rapid", "rustic", "shiny", "silent", "sleepy", "smooth",
    "spicy", "stormy", "sturdy", "sunny", "tender", "tidy", "vivid", "wary", "witty", "young", "zealous",
)
NOUNS = (
    "anchor", "apple", "badger", "basket", "beacon", "bicycle", "blanket", "bridge", "candle", "canyon",
    "castle", "cherry", "cloud", "comet", "compass", "cottage", "crystal", "dolphin", "drum", "falcon",
    "feather", "fountain", "garden", "glacier", "harbor", "helmet", "island", "jacket", "kettle", "ladder",
    "lantern", "meadow", "mirror", "mountain", "needle", "orchard", "otter", "parrot", "pebble", "pillow",
    "pyramid", "quarry", "river", "saddle", "shadow", "spindle", "teapot", "thistle", "tunnel", "violin",
    "walnut", "willow", "window", "wizard", "zebra",
)


REPLY_TOKENS = 128  # RULER's tokens_to_generate: an evaluation prompt's length counts them for the reply


@functools.cache
def heldout_words() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(adjectives, nouns) of wonderwords' lists, as RULER draws its keys, less every word of the training lists
    and any word with a character outside a-z (no training key can be drawn from them)."""
    from importlib import resources

    def keep(name, taken):
        words = (resources.files("wonderwords") / "assets" / name).read_text(encoding="utf-8").splitlines()
        return tuple(sorted({w for w in words if w.isascii() and w.isalpha() and w.islower()} - set(taken)))

    return keep("adjectivelist.txt", ADJECTIVES), keep("nounlist.txt", NOUNS)


def random_value(rng: np.random.Generator, kind: str, heldout: bool = False) -> str:
    """RULER's needle keys and values: 7-digit numbers, adjective-noun words (from the held-out lists when
    `heldout`), or uuid4s."""
    if kind == "numbers":
        return str(int(rng.integers(10**6, 10**7)))
    if kind == "words":
        adjectives, nouns = heldout_words() if heldout else (ADJECTIVES, NOUNS)
        return f"{adjectives[rng.integers(len(adjectives))]}-{nouns[rng.integers(len(nouns))]}"
    if kind == "uuids":
        return str(uuid.UUID(int=int.from_bytes(rng.bytes(16), "big"), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


@dataclasses.dataclass
class Needles:
    """What one prompt hides and asks: keys, their values, the queried keys, and the answers in order."""

    keys: list[str]
    values: list[list[str]]
    queries: list[str]
    answers: list[str]


def draw_needles(rng: np.random.Generator, v: Variant, heldout: bool = False) -> Needles:
    """Distinct keys (and values), `num_needle_q` of the keys queried; keys from the held-out lists when
    `heldout`."""
    keys, values, seen = [], [], set()
    while len(keys) < max(v.num_needle_k, v.num_needle_q):
        key = random_value(rng, v.type_needle_k, heldout)
        if key not in seen:
            seen.add(key)
            keys.append(key)
    for _ in keys:
        row = []
        while len(row) < v.num_needle_v:
            value = random_value(rng, v.type_needle_v)
            if value not in seen:
                seen.add(value)
                row.append(value)
        values.append(row)
    picked = sorted(rng.choice(len(keys), v.num_needle_q, replace=False).tolist())
    return Needles(keys, values, [keys[i] for i in picked], [a for i in picked for a in values[i]])


def prompt_template(v: Variant) -> tuple[str, str]:
    """(template + answer prefix, the value noun) with RULER's singular rewrite for one queried value."""
    template, noun = TEMPLATE + ANSWER_PREFIX, v.type_needle_v
    if v.num_needle_q * v.num_needle_v == 1:
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template = template.replace(old, new)
        noun = noun[:-1]
    return template, noun


def query_text(queries: list[str]) -> str:
    return ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]


def needle_sentences(v: Variant, needles: Needles) -> list[str]:
    """The needle sentences, those of the queried keys first (the first goes at the prompt's depth)."""
    order = needles.queries + [k for k in needles.keys if k not in needles.queries]
    return [NEEDLE.format(type_needle_v=v.type_needle_v, key=k, value=value)
            for k in order for value in needles.values[needles.keys.index(k)]]


def needle_depths(depth: float, count: int) -> list[float]:
    """The first needle at `depth`, the others evenly spread after it (wrapping around)."""
    return [(depth + i / count) % 1.0 if i else depth for i in range(count)]


def insert_at_depths(units: list[str], sentences: list[str], depths: list[float]) -> list[str]:
    """`units` with each sentence inserted before unit min(floor(depth * len(units)), len(units) - 1), so a
    needle always has haystack after it (RULER never puts one after the last unit); stable for ties."""
    slots = [min(int(d * len(units)), max(len(units) - 1, 0)) for d in depths]
    out, order = list(units), sorted(range(len(sentences)), key=lambda i: (slots[i], i), reverse=True)
    for i in order:
        out.insert(slots[i], sentences[i])
    return out


def make_context(v: Variant, needles: Needles, n: int, depth: float, *, words=(), offset: int = 0,
                 distractors=()) -> str:
    """The haystack of size n (filler sentences, essay words, or distractor needles) with the needles in."""
    sentences = needle_sentences(v, needles)
    depths = needle_depths(depth, len(sentences))
    if v.haystack == "repeat":
        return "\n".join(insert_at_depths([REPEAT_FILLER] * n, sentences, depths))
    if v.haystack == "needle":
        units = [NEEDLE.format(type_needle_v=v.type_needle_v, key=k, value=val) for k, val in distractors[:n]]
        return "\n".join(insert_at_depths(units, sentences, depths))
    if v.haystack == "essay":
        take = [words[(offset + i) % len(words)] for i in range(n)]
        units = haystack.split_sentences(" ".join(take))
        return " ".join(insert_at_depths(units, sentences, depths))
    raise ValueError(f"unknown haystack {v.haystack!r}")


def render_prompt(v: Variant, needles: Needles, context: str) -> str:
    template, noun = prompt_template(v)
    return template.format(type_needle_v=noun, context=context, query=query_text(needles.queries))


def answer_text(answers: list[str]) -> str:
    """The reply the training windows teach after the answer prefix (the values, then a period)."""
    return ", ".join(answers) + "."


def distractor_needles(rng: np.random.Generator, v: Variant, count: int, needles: Needles,
                       heldout: bool = False) -> list[tuple[str, str]]:
    """`count` (key, value) pairs for the 'needle' haystack, none reusing a real key."""
    taken, out = set(needles.keys), []
    while len(out) < count:
        key = random_value(rng, v.type_needle_k, heldout)
        if key not in taken:
            out.append((key, random_value(rng, v.type_needle_v)))
    return out


def niah_example(rng: np.random.Generator, v: Variant, tokenizer, length: int, depth: float, words=(), *,
                 evaluation: bool = False) -> dict:
    """One prompt and its answer: {"prompt", "prompt_ids", "answers", "queries", "answer_ids", "depth",
    "haystack_size"}. For `evaluation`, RULER's: the prompt takes `length - REPLY_TOKENS` tokens and its keys
    come from the held-out lists; for training, the prompt, its answer and EOS fill a window of `length`."""
    needles = draw_needles(rng, v, heldout=evaluation)
    answer_ids = tokenizer.encode(answer_text(needles.answers))
    budget = length - REPLY_TOKENS if evaluation else length - len(answer_ids) - 1
    if budget <= 0:
        raise UserError(f"a niah prompt of {length} tokens leaves no room for a haystack (evaluation lengths count "
                        f"{REPLY_TOKENS} reply tokens, as RULER's): ask for a longer length")
    offset = int(rng.integers(len(words))) if v.haystack == "essay" else 0
    distractors = (distractor_needles(rng, v, budget // 8 + 1, needles, heldout=evaluation)
                   if v.haystack == "needle" else ())

    def build(n):
        return render_prompt(v, needles, make_context(v, needles, n, depth, words=words, offset=offset,
                                                      distractors=distractors))

    hint = {"repeat": 8, "needle": 8, "essay": 256}[v.haystack]
    n, ids = haystack.fit_to_budget(build, tokenizer, budget, hint)
    return {"prompt": build(n), "prompt_ids": ids, "answers": needles.answers, "queries": needles.queries,
            "answer_ids": answer_ids,
            "depth": depth, "haystack_size": n}


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's niah score: the fraction of references found in the prediction (case-insensitive)."""
    pred = prediction.lower()
    return sum(ref.lower() in pred for ref in references) / len(references)


def char_matches(prediction: str, answer: str) -> list[bool]:
    """Whether each character of `answer` is where it belongs in the reply (leading spaces stripped, case
    ignored): the diagnostic behind `by_length_char`, e.g. which of a value's seven digits a model loses."""
    pred = prediction.lstrip().lower()
    return [i < len(pred) and pred[i] == c for i, c in enumerate(answer.lower())]


def parse_variants(spec: str, key: str = "data.niah.variants") -> list[str]:
    return haystack.parse_names(spec, VARIANTS, key)


SEED_TAG = 0x6E696168  # "niah"


def qa_task(config: ml_collections.ConfigDict) -> haystack.QATask:
    """RULER prompts of the variants in data.niah.variants, the needle at a uniform depth."""
    variants = tuple(VARIANTS[name] for name in parse_variants(config.data.niah.variants))

    def make(rng, v, tokenizer, length, words):
        return niah_example(rng, v, tokenizer, length, float(rng.random()), words)

    return haystack.QATask("niah", SEED_TAG, variants, make, any(v.haystack == "essay" for v in variants),
                           f"niah: RULER {config.data.niah.variants} prompts")


def niah_source(config: ml_collections.ConfigDict) -> Corpus:
    """`data.source='niah'`: windows of train.seq_len + 1 tokens, each a RULER prompt of a random length in
    [data.niah.min_len, seq_len] (variant from data.niah.variants, needle at a uniform depth), its answer and
    EOS; the loss falls on the answer and EOS only."""
    return haystack.qa_source(config, [qa_task(config)])
