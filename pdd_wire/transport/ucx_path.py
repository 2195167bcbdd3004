"""KV as UCX tagged messages, for peers on the same node or RDMA fabric; bulk TCP otherwise.

One lane (:data:`UCX_LANE`): UCX stripes over its own transports. Delivery is acknowledged on
the control lane as over TCP (a completed UCX send does not mean the peer kept the bytes).
A peer that offers no UCX address gets the bulk TCP connections instead.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from ..errors import TransferError, TransportError
from ..memory import scatter
from . import ucx
from .base import BulkOwner, DataPath
from .route import Route
from .tcp_path import PathSettings, TcpDataPath

UCX_LANE = -1


def open_path(owner: BulkOwner, settings: PathSettings) -> DataPath:
    """The UCX path, or bulk TCP with a warning where UCX cannot be loaded here."""
    ok, why = ucx.available()
    log = settings.log or structlog.get_logger("pdd_wire.transport")
    if not ok:
        log.warning("transport = 'ucx' but UCX is unavailable; KV to this peer uses TCP", reason=why)
        return TcpDataPath(owner, settings)
    log.info("KV to this peer goes over UCX", ucx=why)
    return UcxDataPath(owner, settings)


class UcxDataPath(DataPath):
    kind = "ucx"

    def __init__(self, owner: BulkOwner, settings: PathSettings) -> None:
        self.owner = owner
        self.settings = settings
        self.tcp = TcpDataPath(owner, settings)
        self.log = self.tcp.log
        self.loop = ucx.acquire_loop()
        self.peer = ucx.UcxPeer(self.loop, name=settings.name)
        self.ready = False  # endpoint to the peer's worker made (this connection)
        self._remote = b""
        self._dir_out = ucx.DIR_DIALER if settings.dialer else ucx.DIR_ACCEPTOR
        self._dir_in = ucx.DIR_ACCEPTOR if settings.dialer else ucx.DIR_DIALER
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    @property
    def active(self) -> str:
        return "ucx" if self.ready else self.tcp.active

    @property
    def links(self):
        return self.tcp.links

    def address(self) -> bytes:
        return self.peer.local_address()

    def connected(self, remote: bytes, *, streams: int) -> None:
        if not remote:
            self.tcp.connected(remote, streams=streams)
        elif not self.ready:
            self._spawn(self._connect(remote))
        elif remote != self._remote:
            # The peer restarted with a new UCX worker; ours is bound to its old one. Start over
            # with a fresh worker (a new handshake carries its address).
            self._renew()

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro, name=f"{self.settings.name}:ucx")
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _connect(self, remote: bytes) -> None:
        try:
            await self.loop.run(self.peer.connect(remote))
        except (TransportError, RuntimeError) as exc:
            self.log.error("UCX endpoint failed; KV to this peer waits", error=str(exc))
            return
        self._remote = remote
        self.ready = True
        self.log.info("UCX endpoint up")
        self.owner.lane_up(UCX_LANE)

    def _renew(self) -> None:
        old, self.peer, self.ready = self.peer, ucx.UcxPeer(self.loop, name=self.settings.name), False
        old.close()
        self.owner.lane_lost(UCX_LANE)
        self.owner.reconnect("the peer's UCX worker changed")

    def chunk_bytes(self, default: int, *, window: int, peer_max_chunk: int) -> int:
        if not self.ready:
            return default
        # never above the credit window, or it could never be sent
        return max(default, min(self.settings.ucx_chunk_bytes, peer_max_chunk, window))

    # -- sending
    def send(self, lane: int, tid: int, k: int, views: list[memoryview], compression: Any = None) -> None:
        if lane != UCX_LANE:
            self.tcp.send(lane, tid, k, views, compression)
            return
        main = asyncio.get_running_loop()
        fut = self.loop.submit(self._send(tid, k, views))
        fut.add_done_callback(lambda f: main.call_soon_threadsafe(self._sent, tid, k, f))

    async def _send(self, tid: int, k: int, views) -> None:
        """On the UCX loop. A chunk whose blocks are not contiguous is gathered first (a copy)."""
        buf = views[0] if len(views) == 1 else b"".join(views)
        await self.peer.send(ucx.tag_for(self._dir_out, tid, k), buf)

    def _sent(self, tid: int, k: int, fut) -> None:
        if fut.cancelled() or fut.exception() is None:
            return
        self.log.warning("UCX send failed", transfer_id=tid, chunk=k, error=str(fut.exception()))
        self.owner.send_failed(tid, k, "ucx_error")

    # -- receiving
    def expect(self, tid: int, route: Route) -> None:
        if not self.ready:
            return
        main = asyncio.get_running_loop()
        for k in range(route.n_chunks):  # waiting receives cost nothing until their message comes
            self.loop.submit(self._recv(tid, route, k, main))

    async def _recv(self, tid: int, route: Route, k: int, main: asyncio.AbstractEventLoop) -> None:
        """On the UCX loop: receive chunk ``k`` straight into the posted blocks (staged only when
        they are not contiguous). No xxh3 here: UCX moves the bytes memory to memory (RDMA
        carries its own link CRC), and the checksum pass would cost as much as the copy."""
        n = route.chunk_len(k)
        if n is None:
            return
        views = route.claim(k, n)
        if views is None:
            return
        ok = False
        try:
            tag = ucx.tag_for(self._dir_in, tid, k)
            if len(views) == 1:
                await self.peer.recv(tag, views[0])
            else:
                staging = bytearray(n)
                await self.peer.recv(tag, staging)
                scatter(staging, views)
            ok = True
        except (TransferError, TransportError, asyncio.CancelledError):
            pass
        finally:
            route.settle(k, ok)
        if ok:
            main.call_soon_threadsafe(self.owner.chunk_arrived, tid, k, True, n, True)

    async def forget(self, tid: int) -> None:
        if self.loop.running:
            try:
                await self.loop.run(self.peer.cancel_transfer(self._dir_in, tid, drain_s=5.0))
            except TransportError:
                pass

    # -- the bulk TCP connections (peers without UCX)
    def adopt_bulk(self, stream, loop, conn) -> None:
        self.tcp.adopt_bulk(stream, loop, conn)

    def bulk_lost(self, conn, stream, exc) -> None:
        self.tcp.bulk_lost(conn, stream, exc)

    def make_bulk_protocol(self, stream, main):
        return self.tcp.make_bulk_protocol(stream, main)

    def stall(self) -> None:
        self.tcp.stall()

    def down(self) -> None:
        self.tcp.down()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.ready:
            self.ready = False
            self.owner.lane_lost(UCX_LANE)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.tcp.close()
        self.peer.close()
        try:
            async with asyncio.timeout(5):
                await self.loop.run(self.peer.wait_closed())
        except (TimeoutError, TransportError, RuntimeError):
            pass
        ucx.release_loop(self.loop)

    def describe(self) -> dict[str, Any]:
        return {"data_path": self.active, "bulk_streams_up": len(self.tcp.links), "ucx": dict(self.peer.stats)}
