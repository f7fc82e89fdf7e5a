"""Keep generated tables in README.md current: replace the text between two marker comments."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def replace_section(name: str, body: str, path: str | None = None) -> str:
    """Replace what lies between `<!-- name:start -->` and `<!-- name:end -->` in README.md."""
    path = path or os.path.join(ROOT, "README.md")
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = open(path).read()
    if start not in text or end not in text:
        raise ValueError(f"{path} has no {start} ... {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w") as f:
        f.write(f"{head}{start}\n{body.rstrip()}\n{end}{tail}")
    return path
