"""Transports: how frames and KV chunks move between agents.

:mod:`.base` is the seam (connector, data path); :func:`data_path` picks an implementation by
name (``peer.transport``): ``tcp`` (bulk TCP/TLS connections), ``ucx`` (UCX tagged messages,
same node or RDMA fabric), ``inproc`` (memory within one process, for tests). Implementations
are imported when first chosen, so ``import pdd_wire.transport`` loads neither uvloop nor ucxx.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from .base import BulkOwner, DataPath
    from .tcp_path import PathSettings

#: name -> "module:factory"; a factory is called as ``factory(owner, settings)``.
_DATA_PATHS: dict[str, str] = {
    "tcp": "pdd_wire.transport.tcp_path:TcpDataPath",
    "ucx": "pdd_wire.transport.ucx_path:open_path",
    "inproc": "pdd_wire.transport.inproc:InprocDataPath",
}


def register(kind: str, factory: str | Callable[..., "DataPath"]) -> None:
    """Add (or replace) a data path implementation under ``kind``."""
    _DATA_PATHS[kind] = factory  # type: ignore[assignment]


def kinds() -> list[str]:
    return sorted(_DATA_PATHS)


def data_path(kind: str, owner: "BulkOwner", settings: "PathSettings") -> "DataPath":
    """A new data path of ``kind`` for one peer session."""
    target = _DATA_PATHS.get(kind)
    if target is None:
        raise ConfigError("peers.transport", f"unknown transport {kind!r} (known: {', '.join(kinds())})")
    if isinstance(target, str):
        module, _, name = target.partition(":")
        target = getattr(importlib.import_module(module), name)
    return target(owner, settings)
