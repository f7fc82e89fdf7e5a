"""The worked examples of docs/extending.md run as written (each `## ` section's python blocks, in order,
in a fresh namespace, from the repository root); every relative link of README.md, docs/ and results/
resolves inside the repository; README.md stays a short guide."""

from __future__ import annotations

import glob
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


LINK = re.compile(r"!?\[[^\]]*\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")


def relative_links(text: str) -> list[str]:
    """The targets of a markdown text's links and images; code (fenced, indented by 4, in backticks), absolute
    URLs and in-page anchors left out."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    text = re.sub(r"^    .*$", "", text, flags=re.M)
    text = re.sub(r"`[^`]+`", "", text)
    return [t for t in LINK.findall(text) if not re.match(r"[a-zA-Z][a-zA-Z+.-]*:", t) and not t.startswith("#")]


def test_links_are_found_outside_code_only():
    text = "[a](docs/x.md) ![p](p.png) [w](https://x.org) [s](#top) `[c](no.md)`\n```\n[b](no.md)\n```\n    M[x](y)\n"
    assert relative_links(text) == ["docs/x.md", "p.png"]


def test_every_relative_link_resolves_inside_the_repository():
    pages = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))),
             *sorted(glob.glob(os.path.join(ROOT, "results", "*.md")))]
    assert len(pages) > 10
    broken = []
    for page in pages:
        with open(page, encoding="utf-8") as f:
            for target in relative_links(f.read()):
                path = os.path.realpath(os.path.join(os.path.dirname(page), target.split("#")[0]))
                if not path.startswith(os.path.realpath(ROOT) + os.sep) or not os.path.exists(path):
                    broken.append(f"{os.path.relpath(page, ROOT)}: {target}")
    assert not broken, broken


def test_readme_is_a_short_guide_that_starts_with_the_two_commands():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= 250, len(lines)
    block = lines[lines.index("```bash") + 1:]
    assert block[0].startswith("make train") and block[1].startswith("make test"), block[:2]
