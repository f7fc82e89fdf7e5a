"""Small helpers for the on-disk cache: stable short hashes, cross-process locks, atomic writes."""

import contextlib
import fcntl
import hashlib
import json
import os
from typing import Any, Iterator

from nlearn.errors import UserError


def short_hash(obj: Any, n: int = 12) -> str:
    """Hex digest of a JSON-serializable object, stable across runs and machines."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:n]


def cache_root(cache_dir: str) -> str:
    """Expanded, absolute cache directory, created if missing (UserError if it cannot be)."""
    root = os.path.abspath(os.path.expanduser(cache_dir))
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create data cache_dir {cache_dir!r}: {e.strerror}") from e
    return root


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
    """Exclusive advisory lock so concurrent processes build a cache entry only once."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write `data` to `path` through a temporary file so readers never see a partial file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
