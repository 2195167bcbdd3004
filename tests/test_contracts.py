"""The contracts CI holds (issue 10): ruff, mypy and import-linter pass as configured in
pyproject.toml, and three rules checked here on the source with ``ast``: no import cycle among
the product's modules (type-only and function-level imports count), no module over 600 lines,
and no reaching into another module's ``_private`` names outside the tests."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ROOT / "pdd_wire"
TOOLS = ROOT / "tools" / "pdd_tools"
BIN = Path(sys.executable).parent  # the venv's: scripts/test installs the tools with the test extra
MAX_LINES = 600


def _python_files(*roots: Path) -> list[Path]:
    return sorted(f for r in roots for f in r.rglob("*.py") if "__pycache__" not in f.parts)


def _rel(path: Path, root: Path = ROOT) -> str:
    return str(path.relative_to(root))


# ------------------------------------------------------------------------------ the three tools
@pytest.mark.parametrize("argv", [
    pytest.param(["ruff", "check", "--no-cache"], id="ruff"),
    pytest.param(["mypy"], id="mypy"),  # files and per-module strictness: [tool.mypy]
    pytest.param(["lint-imports", "--no-cache"], id="import-linter"),
])
def test_the_tool_passes(argv):
    out = subprocess.run([str(BIN / argv[0]), *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, f"{' '.join(argv)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"


# ------------------------------------------------------------------------------ import cycles
def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(files: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the same set it imports, however (type-only and inside functions
    included). ``from pkg import name`` is an import of ``pkg.name`` when that is a module, else
    of ``pkg`` (its ``__init__``)."""
    names = {_module_name(f, root): f for f in files}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join([*base, node.module] if node.module else base)
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in names else module for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in names and t != name)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph has ~100 nodes, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in components:  # a shortest way back to the first module, inside the component
        start, members = comp[0], set(comp)
        paths = {start: [start]}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w == start:
                        found = paths[v] + [start]
                        break
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if found:
                    break
            frontier = nxt
        cycles.append(found or comp)
    return cycles


def test_the_cycle_finder_finds_a_cycle_through_a_type_only_import(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "one.py").write_text("from . import two\n")
    (pkg / "two.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .one import X\n")
    assert _cycles(_import_graph(sorted(pkg.glob("*.py")), tmp_path)) == [["pkg.one", "pkg.two", "pkg.one"]]


def test_the_product_has_no_import_cycle():
    files = _python_files(PRODUCT)
    graph = _import_graph(files)
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100
    assert _cycles(graph) == []


def test_the_tools_have_no_import_cycle():
    graph = _import_graph(_python_files(TOOLS), TOOLS.parent)
    assert len(graph) > 20
    assert _cycles(graph) == []


# ------------------------------------------------------------------------------ module size
def test_no_module_is_over_600_lines():
    files = _python_files(PRODUCT, TOOLS)
    assert len(files) > 80
    sizes = {_rel(f): len(f.read_text().splitlines()) for f in files}
    assert {f: n for f, n in sizes.items() if n > MAX_LINES} == {}


# ------------------------------------------------------------------------------ private names
#: Private names of other libraries that are used on purpose, each with the reason.
FOREIGN_PRIVATE = {
    # os._exit is the public way to leave a forked or threaded process without cleanup.
    "_exit",
    # pdd_wire.loopwatch: sys._current_frames is the documented way to read another thread's
    # stack (faulthandler prints, it returns nothing).
    "_current_frames",
    # pdd_wire.compress: python-lz4 exports LZ4_decompress_safe only from its extension module,
    # lz4.block._block; ctypes loads it to decompress straight into registered memory.
    "_block",
    # pdd_wire.adapters.vllm_connector: vLLM's BlockPool has no public eviction hook; the connector
    # wraps its _maybe_evict_cached_block to tell the agent which prefix blocks vLLM dropped.
    "_maybe_evict_cached_block",
}


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _own_private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines itself: functions, classes, assigned names and
    attributes (``self._x = ...``, ``obj._x: T``). Reaching one of them on another object of the
    same module stays inside the module."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
    return {n for n in own if n.startswith("_") and not _is_dunder(n)}


def _private_reaches(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    own = _own_private_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [f"{_rel(path, root)}:{node.lineno}: from {'.' * node.level}{node.module or ''} import {a.name}"
                      for a in node.names if a.name.startswith("_") and not _is_dunder(a.name)]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not _is_dunder(node.attr):
            obj = node.value
            if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
                continue
            if isinstance(obj, ast.Call) and isinstance(obj.func, ast.Name) and obj.func.id == "super":
                continue
            if node.attr in own or node.attr in FOREIGN_PRIVATE:
                continue
            found.append(f"{_rel(path, root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_private_name_check_sees_both_forms(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from .other import _helper\nfrom .other import __version__\n"
                   "class A:\n    def f(self, b):\n        self._x = b._y\n        return super()._z, os._exit\n"
                   "def g(a: A):\n    return a._x\n")
    assert _private_reaches(src, tmp_path) == ["m.py:1: from .other import _helper", "m.py:5: b._y"]


def test_no_module_reaches_into_another_modules_private_names():
    files = _python_files(PRODUCT, TOOLS)
    assert [line for f in files for line in _private_reaches(f)] == []
