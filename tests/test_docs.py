"""The worked examples of docs/extending.md run as written: each `## ` section's python blocks, in order,
in a fresh namespace, from the repository root."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "extending.md")


def sections() -> dict[str, str]:
    """{section title: the code of its python blocks}."""
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    out = {}
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        code = "\n".join(re.findall(r"^```python\n(.*?)^```", body, flags=re.M | re.S))
        if code:
            out[title.strip()] = code
    return out


SECTIONS = sections()


def test_every_registry_has_an_example():
    assert list(SECTIONS) == ["An inner optimizer", "An objective", "A data source", "A family"]


@pytest.fixture
def registries():
    """Put every registry back as it was, so the examples' entries do not leak into later tests."""
    from nlearn import models
    from nlearn.data import SOURCES
    from nlearn.memory.inner_optimizers import INNER_OPTIMIZERS
    from nlearn.memory.objectives import OBJECTIVES

    saved = [(registry, dict(registry)) for registry in (models.FAMILIES, SOURCES, INNER_OPTIMIZERS, OBJECTIVES)]
    yield saved
    for registry, entries in saved:
        registry.clear()
        registry.update(entries)


@pytest.mark.parametrize("title", list(SECTIONS))
def test_example_runs(title, cache_dir, monkeypatch, registries):
    monkeypatch.chdir(ROOT)
    namespace = {"__name__": f"docs_example_{title.replace(' ', '_')}"}
    exec(compile(SECTIONS[title], f"docs/extending.md: {title}", "exec"), namespace)
    assert any(set(registry) - set(entries) for registry, entries in registries), "the example registered nothing"
