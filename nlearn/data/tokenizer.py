"""sentencepiece BPE tokenizer: trained offline from lines of text, applied line by line.

Ids: pad = 0, eos = 1 (ends every document in the packed stream), bos = 2 (reserved, unused by
the pipeline), unk = 3, newline = 4 (the piece "\\n"), then 256 byte-fallback pieces and the
merges. Text is not normalized (identity rule, whitespace kept) and unknown characters fall
back to bytes, so `decode(encode(text)) == text` for any text. Lines are encoded separately
and joined with the newline id, which keeps encoding fast and line breaks exact.
"""

import hashlib
import io
import itertools
import os
from typing import Iterable, Iterator, Optional, Sequence, Union

from absl import logging
import numpy as np
import sentencepiece as spm

from nlearn.data import cache
from nlearn.errors import UserError

PAD_ID, EOS_ID, BOS_ID, UNK_ID, NEWLINE_ID = 0, 1, 2, 3, 4
NEWLINE = "\n"
# sentencepiece drops training sentences longer than max_sentence_length bytes; long lines
# (paragraphs) are cut at a space before this many characters.
_MAX_LINE_CHARS = 4000
# Character coverages tried in turn when the vocabulary cannot hold every required character.
_FALLBACK_COVERAGES = (0.999, 0.995, 0.99, 0.98, 0.95, 0.9, 0.8)
# Smallest useful vocabulary: 5 special pieces + 256 bytes + some merges.
MIN_VOCAB_SIZE = 300

TextOrFile = Union[str, bytes, os.PathLike]


def _as_text(item: TextOrFile) -> str:
    """A text item as str: PathLike items are files (read as UTF-8, bad bytes replaced)."""
    if isinstance(item, os.PathLike):
        try:
            with open(item, "rb") as f:
                return f.read().decode("utf-8", errors="replace").replace("\r\n", "\n")
        except OSError as e:
            raise UserError(f"cannot read tokenizer training file {os.fspath(item)}: "
                            f"{e.strerror}") from e
    if isinstance(item, bytes):
        return item.decode("utf-8", errors="replace")
    return item


def sentence_iterator(texts_or_files: Iterable[TextOrFile],
                      max_chars: Optional[int] = None) -> Iterator[str]:
    """Non-empty lines of each text, long lines cut at a space; stops after ~max_chars chars."""
    seen = 0
    for item in texts_or_files:
        for line in _as_text(item).split(NEWLINE):
            while len(line) > _MAX_LINE_CHARS:
                cut = line.rfind(" ", _MAX_LINE_CHARS // 2, _MAX_LINE_CHARS)
                cut = cut if cut > 0 else _MAX_LINE_CHARS
                yield line[:cut]
                seen += cut
                line = line[cut:]
            if line.strip():
                yield line
                seen += len(line)
        if max_chars and seen >= max_chars:
            return


def train_tokenizer(texts_or_files: Iterable[TextOrFile], model_prefix: str, vocab_size: int,
                    *, max_chars: Optional[int] = None, num_threads: Optional[int] = None,
                    character_coverage: float = 0.9995) -> str:
    """Train a BPE model on the texts (str/bytes) or files (os.PathLike); write
    `{model_prefix}.model` atomically and return its path. Always trains; callers cache.

    When the vocabulary is too small for every character the coverage asks for (small
    vocab_size on a varied text), the coverage is lowered step by step: the rarest characters
    are then written as bytes."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise UserError(f"data.vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    sentences = list(sentence_iterator(texts_or_files, max_chars))  # retries re-read them
    if not sentences:
        raise UserError("no text to train the tokenizer on")
    coverages = [character_coverage] + [c for c in _FALLBACK_COVERAGES if c < character_coverage]
    for coverage in coverages:
        proto = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences), model_writer=proto,
                vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
                pad_id=PAD_ID, eos_id=EOS_ID, bos_id=BOS_ID, unk_id=UNK_ID,
                user_defined_symbols=[NEWLINE], normalization_rule_name="identity",
                remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
                split_digits=True, character_coverage=coverage,
                max_sentence_length=4 * _MAX_LINE_CHARS + 16,
                num_threads=num_threads or min(16, os.cpu_count() or 1), minloglevel=2)
            break
        except RuntimeError as e:
            why = str(e).strip().splitlines()[-1]
            if "required_chars" in why and coverage != coverages[-1]:
                continue
            raise UserError(f"sentencepiece training failed (vocab_size={vocab_size}): "
                            f"{why}") from e
    if coverage != character_coverage:
        logging.info("tokenizer: character_coverage lowered to %s to fit vocab_size=%d",
                     coverage, vocab_size)
    path = f"{model_prefix}.model"
    cache.atomic_write_bytes(os.path.abspath(path), proto.getvalue())
    return path


class Tokenizer:
    """A loaded sentencepiece model with line-wise encode and exact decode. Picklable."""

    def __init__(self, model_proto: bytes, path: str = ""):
        self.path = path
        self._proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        # Our models have "\n" as a piece and are applied line by line; a foreign model without
        # one encodes each text in one call, and keeps its own special ids.
        self._linewise = self._sp.id_to_piece(self._sp.piece_to_id(NEWLINE)) == NEWLINE
        self.newline_id = self._sp.piece_to_id(NEWLINE) if self._linewise else -1
        self.pad_id, self.eos_id = self._sp.pad_id(), self._sp.eos_id()
        self.bos_id, self.unk_id = self._sp.bos_id(), self._sp.unk_id()
        if self.eos_id < 0:
            raise UserError(f"tokenizer model {path or '(in memory)'} has no eos id; the "
                            "pipeline ends every document with eos")
        self.fingerprint = hashlib.sha256(model_proto).hexdigest()[:12]

    def __getstate__(self):
        return {"model_proto": self._proto, "path": self.path}

    def __setstate__(self, state):
        self.__init__(state["model_proto"], state["path"])

    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    def encode(self, text: Union[str, bytes]) -> np.ndarray:
        """int32 ids of the text; lines are encoded separately and joined by the newline id."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        if not self._linewise:
            return np.asarray(self._sp.encode(text), dtype=np.int32)
        ids = self._sp.encode(text.split(NEWLINE))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32,
                           count=sum(map(len, ids)))
        line_ends = np.cumsum([len(x) for x in ids[:-1]], dtype=np.int64)
        return np.insert(flat, line_ends, np.int32(self.newline_id))

    def decode(self, ids: Union[Sequence[int], np.ndarray]) -> str:
        """Text of the ids; special ids (pad, eos, bos) decode to nothing."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if not self._linewise:
            return self._sp.decode(ids.tolist())
        parts = np.split(ids, np.flatnonzero(ids == self.newline_id))
        lines = [parts[0].tolist()] + [p[1:].tolist() for p in parts[1:]]
        return NEWLINE.join(self._sp.decode(lines))

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))


def load_tokenizer(path: str) -> Tokenizer:
    """Load a sentencepiece .model file; UserError if it is missing or not a model."""
    path = os.path.expanduser(path)
    try:
        with open(path, "rb") as f:
            proto = f.read()
    except OSError as e:
        raise UserError(f"cannot read tokenizer model {path}: {e.strerror}") from e
    try:
        return Tokenizer(proto, path)
    except RuntimeError as e:
        raise UserError(f"{path} is not a sentencepiece model") from e
