"""Write `notebooks/*.ipynb` (outputs stripped) from their percent-format sources in `notebooks/src/`.

Edit the sources, then run `python notebooks/build.py`; `tests/test_notebooks.py` checks that the two agree
and executes every notebook.
"""

from __future__ import annotations

import glob
import os
import re
import sys

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))
_CELL = re.compile(r"^# %%( \[markdown\])?[^\n]*\n", re.M)


def cells(source: str) -> list:
    """Split a `# %%` / `# %% [markdown]` file into notebook cells."""
    marks = list(_CELL.finditer(source))
    out = []
    for i, m in enumerate(marks):
        body = source[m.end(): marks[i + 1].start() if i + 1 < len(marks) else len(source)].strip("\n")
        if m.group(1):
            out.append(nbformat.v4.new_markdown_cell("\n".join(line[2:] if line.startswith("# ") else line.lstrip("#")
                                                              for line in body.splitlines())))
        else:
            out.append(nbformat.v4.new_code_cell(body))
    return out


def notebook(path: str):
    with open(path, encoding="utf-8") as f:
        nb = nbformat.v4.new_notebook(cells=cells(f.read()))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):  # stable ids keep regenerated files byte-identical
        cell["id"] = f"cell-{i:02d}"
    return nb


def targets() -> dict[str, str]:
    """{source path: notebook path} for every source."""
    return {src: os.path.join(HERE, os.path.basename(src)[:-3] + ".ipynb")
            for src in sorted(glob.glob(os.path.join(HERE, "src", "*.py")))}


def render(src: str) -> str:
    return nbformat.writes(notebook(src)) + "\n"


def main() -> None:
    for src, dst in targets().items():
        with open(dst, "w", encoding="utf-8") as f:
            f.write(render(src))
        print(f"wrote {os.path.relpath(dst)}")


if __name__ == "__main__":
    sys.exit(main())
