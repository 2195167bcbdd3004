"""The agent's layering, checked on the source: the composition root, its desks and the engine
edge form no import cycle (type-only imports count), the desks never reach up to the agent,
nobody reaches into another object's ``_private`` names, and no module grows past ~600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pdd_wire

PRODUCT = Path(pdd_wire.__file__).resolve().parent
AGENT_SIDE = ["agent.py", "admin.py", "inbound.py", "peers.py", "engine_handlers.py", "engine_server.py",
              "engine/client.py", "engine/events.py", "engine/hashes.py", *(f"desk/{p.name}"
                                                                            for p in (PRODUCT / "desk").glob("*.py"))]


def _module(path: Path) -> str:
    parts = list(path.relative_to(PRODUCT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in PRODUCT.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """The product modules ``path`` imports, type-only imports included."""
    package = _module(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            for a in node.names:
                out.add(f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target)
    return {m for m in out if m in MODULES}


def _reachable(start: str, graph: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_agent_side_is_in_no_import_cycle():
    graph = {m: _imports(p) - {m} for m, p in MODULES.items()}
    mine = [_module(PRODUCT / f) for f in AGENT_SIDE]
    assert len(mine) > 12
    assert {m: "imports itself back" for m in mine if m in _reachable(m, graph)} == {}


def test_the_desks_and_the_engine_edge_never_import_the_agent_or_its_root_parts():
    above = {"pdd_wire.agent", "pdd_wire.admin", "pdd_wire.inbound", "pdd_wire.engine_handlers"}
    for f in AGENT_SIDE:
        if f.startswith(("desk/", "engine/")) or f in ("peers.py", "engine_server.py", "admin.py"):
            assert not (_imports(PRODUCT / f) & above), f


def test_no_reach_into_another_objects_private_names():
    found = []
    for f in AGENT_SIDE:
        for node in ast.walk(ast.parse((PRODUCT / f).read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{f}:{node.lineno} .{node.attr}")
    assert found == []


def test_no_module_of_the_agent_side_is_a_god_module():
    sizes = {f: len((PRODUCT / f).read_text().splitlines()) for f in AGENT_SIDE}
    assert {f: n for f, n in sizes.items() if n > 600} == {}
