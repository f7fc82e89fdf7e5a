"""The repository's layout, read from the source with `ast` (nothing is imported but the family configs):
no import cycle among nlearn's modules, no nlearn module reaching into benchmarks/, the data layer naming
the synthetic tasks instead of importing them, and configs/ holding only family files with terse comments.

What counts as an import of module M by module A: an `import nlearn.x.y` or `from nlearn.x import y`
statement in A (absolute, or relative and resolved against A's package), where M is `nlearn.x.y` when that
is a module or package of nlearn, else `nlearn.x` (y is then a name defined in it). A module-level import
is one outside any function body (a class body or a try/if block at the top still counts); the implicit
import of a package's parents is not counted, since Python runs a package's `__init__` before its modules.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import os
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_files() -> dict[str, str]:
    """{"nlearn.data.sources": path, "nlearn.data": path of its __init__.py, ...}."""
    found = {}
    for directory, _, files in os.walk(os.path.join(ROOT, "nlearn")):
        for name in files:
            if not name.endswith(".py"):
                continue
            parts = os.path.relpath(os.path.join(directory, name), ROOT)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = os.path.join(directory, name)
    return found


MODULES = module_files()


def imported_names(module: str, tree: ast.AST) -> list[tuple[str, bool]]:
    """(dotted name, at module level) for every import statement in `tree`; relative ones resolved."""
    package = module if MODULES[module].endswith("__init__.py") else module.rpartition(".")[0]
    out = []

    def visit(node, top):
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((alias.name, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                out.extend((f"{base}.{alias.name}" if alias.name != "*" else base, top) for alias in child.names)
            visit(child, inner)

    visit(tree, True)
    return out


def resolve(name: str) -> str | None:
    """The nlearn module that importing `name` loads: the longest prefix that is one of MODULES."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return None


def import_graph() -> dict[str, dict[str, bool]]:
    """{module: {imported nlearn module: at module level (True wins over a function-level import)}}."""
    graph: dict[str, dict[str, bool]] = {}
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        edges = graph.setdefault(module, {})
        for name, top in imported_names(module, tree):
            target = resolve(name) if name.split(".")[0] == "nlearn" else None
            if target and target != module:
                edges[target] = edges.get(target, False) or top
    return graph


GRAPH = import_graph()


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `edges` as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_walk_sees_module_and_function_level_imports():
    assert GRAPH["nlearn.data.sources"]["nlearn.data.corpus"] is True  # `from nlearn.data import corpus as ...`
    assert GRAPH["nlearn.tasks.haystack"]["nlearn.data.pipeline"] is False  # inside text_tokenizer()
    assert GRAPH["nlearn.cli.eval"]["nlearn.tasks.haystack"] is False
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_no_import_cycle_among_nlearn_modules():
    module_level = {m: {t for t, top in edges.items() if top} for m, edges in GRAPH.items()}
    cycle = find_cycle(module_level)
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def test_the_data_layer_names_the_tasks_instead_of_importing_them():
    """nlearn.tasks builds on nlearn.data (corpora, tokenizer, pipeline); the source registry reaches the
    tasks' builders by "module:function" strings, so no import of either kind goes back."""
    back = sorted(f"{m} -> {t}" for m, edges in GRAPH.items() if m.startswith("nlearn.data")
                  for t in edges if t.startswith("nlearn.tasks"))
    assert not back, back
    from nlearn.data.sources import SOURCES

    for name in ("mqar", "niah", "babilong"):
        module, _, fn = SOURCES[name].entry.partition(":")
        assert module == f"nlearn.tasks.{name}.data" and module in MODULES and fn == f"{name}_source"


def test_nothing_under_nlearn_imports_from_benchmarks():
    benchmark_modules = {"benchmarks"} | {f[:-3] for f in os.listdir(os.path.join(ROOT, "benchmarks"))
                                          if f.endswith(".py")}
    offenders = []
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for name, _ in imported_names(module, tree):
            if name.split(".")[0] in benchmark_modules:
                offenders.append(f"{module} imports {name}")
        for node in ast.walk(tree):  # importlib / spec_from_file_location with a literal path or name
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    node.value.startswith("benchmarks/") or node.value.startswith("benchmarks.")):
                offenders.append(f"{module} names {node.value!r}")
    assert "timing" in benchmark_modules and "results_md" in benchmark_modules  # the walk sees the folder
    assert not offenders, offenders


def comment_blocks(path: str) -> list[tuple[int, int]]:
    """(first line, number of lines) of each run of consecutive comment-only lines in a Python file."""
    with open(path, encoding="utf-8") as f:
        tokens = list(tokenize.generate_tokens(io.StringIO(f.read()).readline))
    lines = sorted({t.start[0] for t in tokens if t.type == tokenize.COMMENT and t.line.lstrip().startswith("#")})
    blocks: list[list[int]] = []
    for line in lines:
        if blocks and blocks[-1][0] + blocks[-1][1] == line:
            blocks[-1][1] += 1
        else:
            blocks.append([line, 1])
    return [tuple(b) for b in blocks]


FAMILY_FILES = sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".py"))


def test_comment_blocks_are_counted(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("x = 1  # trailing\n# one\ny = 2\n# two\n# lines\nz = 3\n")
    assert comment_blocks(str(path)) == [(2, 1), (4, 2)]


@pytest.mark.parametrize("name", FAMILY_FILES)
def test_configs_holds_family_files_with_one_line_comments(name):
    """Each configs/ file is a family (its get_config() builds that family at every preset) and each of its
    values carries at most one line of comment; the why beyond a line goes to docs/."""
    path = os.path.join(ROOT, "configs", name)
    spec = importlib.util.spec_from_file_location(f"nlearn_layout_config_{name[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert set(module.PRESETS) and "tiny" in module.PRESETS
    for preset in module.PRESETS:
        assert module.get_config(preset).model.family == name[:-3], (name, preset)
    long = [f"line {start}: {count} lines" for start, count in comment_blocks(path) if count > 1]
    assert not long, f"configs/{name}: comment blocks over one line: {long}"


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(os.path.join(ROOT, "benchmarks", "configs"))
                                        if f.endswith(".py")))
def test_task_presets_comment_each_value_in_one_line(name):
    """benchmarks/configs/ (the MQAR and NIAH presets) as quiet as configs/: the measurements are in results/."""
    path = os.path.join(ROOT, "benchmarks", "configs", name)
    long = [f"line {start}: {count} lines" for start, count in comment_blocks(path) if count > 1]
    assert not long, f"benchmarks/configs/{name}: comment blocks over one line: {long}"
