"""Two layering rules, checked on the source: the product never imports the tools, and the wire
layer imports light (no asyncio, no engine client, through pdd_wire/__init__.py or otherwise)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pdd_wire

PRODUCT = Path(pdd_wire.__file__).resolve().parent


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports, type-only imports included."""
    package = ".".join(path.relative_to(PRODUCT.parent).parent.parts)  # what "." means there
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[:len(base) - node.level + 1] if node.level else []
            names.add(".".join([*base, node.module] if node.module else base))
    return names


def test_the_product_never_imports_the_tools():
    files = sorted(PRODUCT.rglob("*.py"))
    assert len(files) > 20
    offenders = {str(f.relative_to(PRODUCT)): sorted(n for n in _imported_modules(f) if n.split(".")[0] == "pdd_tools")
                 for f in files}
    assert {f: n for f, n in offenders.items() if n} == {}


def test_importing_the_wire_frame_pulls_in_no_asyncio_and_no_engine_client():
    code = ("import sys, pdd_wire.wire.frame\n"
            "print(sorted(m for m in sys.modules if m == 'asyncio' or m.startswith(('asyncio.', 'uvloop', "
            "'pdd_wire.engine', 'pdd_wire.memory', 'pdd_wire.transport', 'pdd_wire.session'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_the_lazy_names_of_pdd_wire_resolve():
    from pdd_wire import EngineClient, ErrorCode, PddWireError, RegionHandle, SharedMemory

    assert EngineClient.__module__ == "pdd_wire.engine.client" and RegionHandle.__module__ == "pdd_wire.engine.client"
    assert SharedMemory.__module__ == "pdd_wire.memory"
    assert issubclass(PddWireError, Exception) and ErrorCode.__module__ == "pdd_wire.errors"
    assert set(pdd_wire.__all__) <= set(dir(pdd_wire))
