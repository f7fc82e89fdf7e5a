"""Shared fixtures: a session cache directory and a tiny text corpus."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))

# The suite's programs are tiny, so compiling them is most of its time: unoptimised XLA code compiles ~1.2-1.5x
# faster, and every check and golden value holds under it. Set before jax is imported (here, and so in every CLI
# the tests start).
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()

# libtpu (nlearn-compile's TPU topologies) takes /tmp/libtpu_lockfile; pytest -n 2 loads it in two processes.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

CORPUS = textwrap.dedent("""\
    It is a truth universally acknowledged, that a single man in possession of a good fortune,
    must be in want of a wife. However little known the feelings or views of such a man may be on
    his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding
    families, that he is considered the rightful property of some one or other of their daughters.
    """)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One nlearn cache (datasets, tokenizers) for the whole session."""
    path = tmp_path_factory.mktemp("nlearn_cache")
    os.environ["NLEARN_CACHE"] = str(path)
    return str(path)


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory):
    """A glob of 24 small text documents (enough to hold out whole documents)."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(24):
        words = CORPUS.split()
        rotated = " ".join(words[i % len(words):] + words[: i % len(words)])
        (root / f"doc{i:02d}.txt").write_text((rotated + "\n") * 12)
    return str(root / "*.txt")
