"""A transport within one process, for tests: no sockets for KV, and connections found by name.

:class:`InprocDataPath` copies a chunk into the peer path's route on the next loop turn, as a
bulk connection's reader would (same claim/settle rules, same reports to the owner); one lane.
:class:`InprocListener` / :class:`InprocConnector` give control connections over a socket pair,
so the frame protocol above them is the real one.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Callable, Coroutine
from typing import Any

from ..errors import TransportError
from .base import BulkOwner, Connector, DataPath, Listener
from .tcp import KIND_CONTROL, preamble

INPROC_LANE = 0
_paths: dict[bytes, "InprocDataPath"] = {}
_listeners: dict[str, "InprocListener"] = {}
_ids = itertools.count(1)


class InprocDataPath(DataPath):
    kind = "inproc"

    def __init__(self, owner: BulkOwner, settings: Any = None) -> None:
        self.owner = owner
        self._address = f"inproc-{next(_ids)}".encode()
        self.remote: InprocDataPath | None = None
        self.sent = 0  # chunks handed over (for tests)
        _paths[self._address] = self

    @property
    def active(self) -> str:
        return "inproc"

    def address(self) -> bytes:
        return self._address

    def connected(self, remote: bytes, *, streams: int) -> None:
        self.remote = _paths.get(remote)
        if self.remote is None:
            raise TransportError(f"no in-process data path {remote!r}")
        self.owner.lane_up(INPROC_LANE)

    def send(self, lane: int, tid: int, k: int, views: list[memoryview], compression: Any = None) -> None:
        peer = self.remote
        if peer is None or lane != INPROC_LANE:
            self.owner.send_failed(tid, k, "inproc_down")
            return
        data = b"".join(views)  # the sender may reuse its memory once the chunk is acknowledged
        self.sent += 1
        asyncio.get_running_loop().call_soon(peer._land, tid, k, data)

    def _land(self, tid: int, k: int, data: bytes, held: bool = False) -> None:
        """What a bulk connection's reader does with a chunk (:mod:`.bulk`)."""
        route = self.owner.routes.get(tid)
        if route is None:
            if not held and self.owner.chunk_early(tid, lambda: self._land(tid, k, data, held=True)):
                return  # it outran its KV_BEGIN: landed once that is handled
            self.owner.chunk_arrived(tid, k, True, len(data), False)
            return
        if not route.fits(k, len(data)):
            self.owner.chunk_arrived(tid, k, False, len(data), False, True)
            return
        views = route.claim(k, len(data))
        if views is not None:
            at = 0
            for v in views:
                v[:] = data[at:at + len(v)]
                at += len(v)
            route.settle(k, True)
        self.owner.chunk_arrived(tid, k, True, len(data), views is not None)

    def stall(self) -> None:
        self.down()

    def down(self) -> None:
        if self.remote is not None:
            self.remote = None
            self.owner.lane_lost(INPROC_LANE)

    async def close(self) -> None:
        self.down()
        _paths.pop(self._address, None)


class InprocListener(Listener):
    """Accepts control connections addressed to ``name`` within this process."""

    def __init__(self, name: str, on_connection: Callable[[socket.socket], Coroutine[Any, Any, None]]) -> None:
        self.name = name
        self.on_connection = on_connection
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        if self.name in _listeners:
            raise TransportError(f"in-process address {self.name!r} is taken")
        _listeners[self.name] = self

    def _accept(self, sock: socket.socket) -> None:
        t = asyncio.create_task(self.on_connection(sock), name=f"inproc:{self.name}")
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        _listeners.pop(self.name, None)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class InprocConnector(Connector):
    """Control connections to the :class:`InprocListener` named ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def connect(self, protocol: Any, *, timeout: float) -> Any:
        listener = _listeners.get(self.name)
        if listener is None:
            raise TransportError(f"nothing listens at in-process address {self.name!r}")
        mine, theirs = socket.socketpair()
        mine.sendall(preamble(KIND_CONTROL))  # as over TCP: the listener's side reads it first
        mine.setblocking(False)
        theirs.setblocking(False)
        try:
            await asyncio.get_running_loop().create_connection(lambda: protocol, sock=mine)
        except OSError as exc:
            mine.close()
            theirs.close()
            raise TransportError(f"in-process connect to {self.name!r} failed: {exc}") from exc
        listener._accept(theirs)
        return protocol
