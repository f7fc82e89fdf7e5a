"""A local tfds dataset of documents ({id, text}, train/validation) in array_record format.

It is built once per exact set of files into `cache_dir/tfds` (the builder config name is a
hash of the files' paths, sizes and mtimes and of the split) and read back with
`tfds.data_source`, which needs no TensorFlow.
"""

import contextlib
import dataclasses
import io
import os
import time
from typing import Iterator, Sequence

from absl import logging
import tensorflow_datasets as tfds
from tensorflow_datasets.core import utils as tfds_utils

from nlearn.data import cache
from nlearn.data.corpus import Corpus, DocFile, files_fingerprint, read_document, validation_ids
from nlearn.errors import UserError

DATASET_NAME = "nlearn_corpus"
_VERSION = "1.0.0"


@dataclasses.dataclass
class DocumentsConfig(tfds.core.BuilderConfig):
    """Which files make the dataset and which of them (by doc id) are held out."""

    files: tuple = ()
    val_ids: frozenset = frozenset()


class NlearnCorpus(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """One example per document file: {'id': its name, 'text': its UTF-8 text}."""

    VERSION = tfds.core.Version(_VERSION)

    @tfds_utils.classproperty
    @classmethod
    def code_path(cls):
        """No code directory: no checksums or metadata files to look up (tfds would otherwise
        probe the package with importlib_resources, which may not be installed)."""
        return None

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bad_utf8_files: list[str] = []

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Text documents, one per file, split by whole documents.",
            features=tfds.features.FeaturesDict(
                {"id": tfds.features.Text(), "text": tfds.features.Text()}),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Everything is local.
        return {"train": self._generate_examples(held_out=False),
                "validation": self._generate_examples(held_out=True)}

    def _generate_examples(self, held_out: bool) -> Iterator[tuple[str, dict]]:
        for f in self.builder_config.files:
            if (f.doc_id in self.builder_config.val_ids) != held_out:
                continue
            text, bad = read_document(f.path, f.start, f.end)
            if bad:
                self.bad_utf8_files.append(f.path)
            yield f.doc_id, {"id": f.doc_id, "text": text}


@contextlib.contextmanager
def _quiet_tfds() -> Iterator[None]:
    """Silence tfds' progress bars, its stdout banners ('Downloading and preparing dataset')
    and chatty logs ('custom data configuration', 'Load dataset info') around our calls;
    stdout stays clean for the CLIs' results."""
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)
    tfds.disable_progress_bar()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.set_verbosity(verbosity)
        tfds.enable_progress_bar()


def _build(config: DocumentsConfig, data_dir: str) -> None:
    """Write the array_record files of both splits; warn once about files with bad UTF-8."""
    t0 = time.time()
    with _quiet_tfds():
        builder = NlearnCorpus(config=config, data_dir=data_dir, file_format="array_record")
        builder.download_and_prepare(
            download_dir=os.path.join(data_dir, "downloads"),
            download_config=tfds.download.DownloadConfig(num_shards=1))
    if builder.bad_utf8_files:
        shown = ", ".join(builder.bad_utf8_files[:5])
        more = f" and {len(builder.bad_utf8_files) - 5} more" if len(builder.bad_utf8_files) > 5 else ""
        logging.warning("invalid UTF-8 bytes replaced by U+FFFD in %s%s", shown, more)
    logging.info("built dataset %s/%s (%d documents) in %.1f s", DATASET_NAME, config.name,
                 len(config.files), time.time() - t0)


def prepared_corpus(kind: str, files: Sequence[DocFile], cache_dir: str, val_fraction: float,
                    description: str = "") -> Corpus:
    """Corpus over `files` (one document each), building its tfds dataset on first use."""
    val_ids = validation_ids([f.doc_id for f in files], val_fraction)
    name = f"{kind}-{cache.short_hash([_VERSION, files_fingerprint(files), val_fraction])}"
    data_dir = os.path.join(cache.cache_root(cache_dir), "tfds")
    info = os.path.join(data_dir, DATASET_NAME, name, _VERSION, "dataset_info.json")
    if not os.path.exists(info):
        with cache.file_lock(os.path.join(data_dir, f".{name}.lock")):
            if not os.path.exists(info):
                _build(DocumentsConfig(name=name, files=tuple(files), val_ids=frozenset(val_ids)),
                       data_dir)
    with _quiet_tfds():
        sources = tfds.data_source(f"{DATASET_NAME}/{name}", data_dir=data_dir, download=False)
    return Corpus(key=name, train=sources["train"], validation=sources["validation"],
                  text_key="text", description=description or f"{kind}: {len(files)} files")


def tfds_corpus(name: str, data_dir: str, text_key: str, train_split: str,
                eval_split: str) -> Corpus:
    """Corpus over a prepared tfds dataset in array_record format (never downloads)."""
    if not name:
        raise UserError("data.source='tfds' needs data.name, a prepared tfds dataset name")
    data_dir = os.path.abspath(os.path.expanduser(data_dir)) if data_dir else None
    where = data_dir or "the default tfds data_dir"
    try:
        with _quiet_tfds():
            train, validation = tfds.data_source(
                name, split=[train_split, eval_split], data_dir=data_dir, download=False)
    except Exception as e:  # tfds raises several types for missing datasets, configs or splits.
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot read tfds dataset {name!r} ({train_split}, {eval_split}) "
                        f"in {where}: {first}") from e
    for split, src in ((train_split, train), (eval_split, validation)):
        if len(src) == 0:
            raise UserError(f"tfds dataset {name!r} split {split!r} is empty")
    if text_key not in train[0]:
        raise UserError(f"tfds dataset {name!r} has no feature {text_key!r} (data.text_key); "
                        f"it has {sorted(train[0])}")
    info = train.dataset_info
    key = "tfds-{}-{}".format(
        "".join(c if c.isalnum() else "_" for c in info.name),
        cache.short_hash([name, data_dir, str(info.version), info.config_name, train_split,
                          eval_split, len(train), len(validation), text_key]))
    return Corpus(key=key, train=train, validation=validation, text_key=text_key,
                  description=f"tfds {name} in {where}")
