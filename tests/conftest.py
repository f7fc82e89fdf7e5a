"""Shared fixtures: a session cache directory and a tiny text corpus."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))

# The suite's programs are tiny, so compiling them is most of its time: unoptimised XLA code compiles ~1.2-1.5x
# faster, and XLA:CPU's older fusion path another ~1.5-2.5x (a 2-layer deltanet train step: 3.8 s -> 1.5 s); every
# check and golden value holds under them. Set before jax is imported (here, and so in every CLI the tests start).
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                      "--xla_cpu_use_fusion_emitters=false")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()

# One XLA compilation cache for the whole run: the xdist workers and the CLIs the tests start inherit this process's
# environment, so a program compiled once (a tiny run's train step, resumed in another process) is read back after.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA_CACHE = tempfile.mkdtemp(prefix="nlearn-tests-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)

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
