"""pdd-wire: the per-node transport daemon for cross-datacenter PD-disaggregated LLM serving.

The names below are loaded on first use (PEP 562), so that importing a light module such as
``pdd_wire.wire.frame`` does not pull in asyncio, sockets or the engine client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine.client import EngineClient, RegionHandle
    from .errors import ErrorCode, PddWireError
    from .memory import SharedMemory

from ._version import __version__

_LAZY = {
    "EngineClient": ".engine.client",
    "RegionHandle": ".engine.client",
    "SharedMemory": ".memory",
    "ErrorCode": ".errors",
    "PddWireError": ".errors",
}
__all__ = ["EngineClient", "RegionHandle", "SharedMemory", "ErrorCode", "PddWireError", "__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
