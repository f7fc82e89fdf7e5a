"""The notebooks run top to bottom (their cells assert the numbers they show) and match their sources."""

from __future__ import annotations

import importlib.util
import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")


def _build_module():
    spec = importlib.util.spec_from_file_location("nlearn_notebooks_build", os.path.join(NOTEBOOKS, "build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILD = _build_module()
NAMES = sorted(os.path.basename(dst) for dst in BUILD.targets().values())


def test_every_notebook_has_a_source_and_is_stripped():
    assert NAMES == ["01_memory_lab.ipynb", "02_train_evaluate_ablate.ipynb", "03_inside_a_memory.ipynb"]
    for src, dst in BUILD.targets().items():
        with open(dst, encoding="utf-8") as f:
            committed = f.read()
        assert committed == BUILD.render(src), f"{dst} is stale: run python notebooks/build.py"
        nb = nbformat.reads(committed, as_version=4)
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")


# The first notebook runs in the default suite; the other two (~70 s together) under the slow mark.
@pytest.mark.parametrize("name", NAMES[:1] + [pytest.param(n, marks=pytest.mark.slow) for n in NAMES[1:]])
def test_notebook_runs(name, cache_dir, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("NLEARN_CACHE", cache_dir)
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    NotebookClient(nb, timeout=1200, kernel_name="python3", resources={"metadata": {"path": NOTEBOOKS}}).execute()
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
