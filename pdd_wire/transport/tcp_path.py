"""KV over bulk TCP connections: one lane per bulk connection, each on a bulk loop thread.

The dialer of the control connection dials the bulk connections too (and redials a lost one);
each presents the session token the listener gave in WELCOME. Chunks go out with
:func:`~.bulk.bulk_send` on the connection's own loop, so KV I/O never holds the session's loop.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from ..errors import ErrorCode, HandshakeError, TransportError
from ..log import limited
from ..wire import FrameType, encode, encode_body
from ..wire import messages as m
from .base import BulkOwner, DataPath
from .bulk import BulkHandler, bulk_send
from .bulk_loop import BulkLoop
from .tcp import KIND_BULK, FrameProtocol, dial


@dataclass(frozen=True)
class PathSettings:
    """What a data path needs to know about its peer and this agent (from the session)."""

    name: str  # the peer's key, for logs and thread names
    host: str  # the peer's WAN address
    port: int
    server_name: str  # the name its TLS certificate must carry
    site: str  # this agent's identity, presented on bulk connections
    node: str
    dialer: bool  # this agent dialed the control connection (and dials the bulk ones)
    connect_s: float
    handshake_s: float
    backoff_max_s: float
    ucx_chunk_bytes: int
    ssl_client: Callable[[], Any]  # the TLS client context, or None for plaintext
    bulk_loop: Callable[[int], BulkLoop]  # the bulk thread for stream n
    remote_token: Callable[[], int]  # the token the peer's WELCOME gave (dialer)
    on_streams: Callable[[int], None] = lambda n: None  # bulk connections up (a gauge)
    executor: Any = None  # where copies off the loop run (a concurrent.futures.Executor; None: the loop's default)
    log: Any = None
    ucx_tls: str = "^tcp"  # transfer.ucx_tls: the UCX transports ("": UCX's own choice, UCX_TLS included)
    credit_bytes: int = 256 << 20  # transfer.credit_bytes: bounds what UCX messages may wait unclaimed
    stall_s: float = 0.0  # timeouts.dead_after_s: a bulk connection that stalls this long ends (0: never)


class BulkLink:
    """The session loop's view of one bulk connection (which lives on ``loop``)."""

    def __init__(self, stream: int, loop: BulkLoop, conn: FrameProtocol) -> None:
        self.stream = stream
        self.loop = loop
        self.conn = conn


class TcpDataPath(DataPath):
    kind = "tcp"

    def __init__(self, owner: BulkOwner, settings: PathSettings) -> None:
        self.owner = owner
        self.settings = settings
        self.log = settings.log or structlog.get_logger("pdd_wire.transport").bind(peer=settings.name)
        self.links: dict[int, BulkLink] = {}
        self._stream_tasks: dict[int, asyncio.Task] = {}
        self._cancelled: set[asyncio.Task] = set()  # awaited by close()
        self._closing = False

    @property
    def active(self) -> str:
        return "tcp"

    def address(self) -> bytes:
        return b""

    def connected(self, remote: bytes, *, streams: int) -> None:
        if self.settings.dialer:
            for s in range(streams):
                self._start_stream(s)

    def send(self, lane: int, tid: int, k: int, views: list[memoryview], compression: Any = None) -> None:
        link = self.links.get(lane)
        if link is None:  # gone since the owner chose it; its loss is on the way
            self.owner.send_failed(tid, k, "connection_lost")
            return
        link.loop.call(bulk_send, link.conn, tid, k, views, compression)

    # -- bulk connections
    def adopt_bulk(self, stream: int, loop: BulkLoop, conn: FrameProtocol) -> None:
        """A bulk connection attached (called on the session's loop)."""
        if not self.owner.is_up or conn.closed:
            loop.call(conn.abort)
            return
        old = self.links.get(stream)
        if old is not None:
            self._link_down(old)
            old.loop.call(old.conn.abort)
        self.links[stream] = BulkLink(stream, loop, conn)
        self.settings.on_streams(len(self.links))
        self.owner.lane_up(stream)

    def bulk_lost(self, conn: FrameProtocol, stream: int, exc: BaseException | None) -> None:
        """A bulk connection ended (session loop)."""
        link = self.links.get(stream)
        if link is not None and link.conn is conn:
            self.log.info("bulk connection lost", stream=stream, error=str(exc) if exc else None)
            self._link_down(link)
            if self.settings.dialer and self.owner.is_up and not self._closing:
                self._start_stream(stream, delay=0.05)

    def _link_down(self, link: BulkLink) -> None:
        if self.links.get(link.stream) is link:
            del self.links[link.stream]
        self.settings.on_streams(len(self.links))
        self.owner.lane_lost(link.stream)

    def make_bulk_protocol(self, stream: int, main: asyncio.AbstractEventLoop) -> BulkHandler:
        """A bulk connection's frame handler for this session (created on its bulk loop)."""
        return BulkHandler(self.owner, stream, main, count_error=getattr(self.owner, "count_error", None),
                           stall_s=self.settings.stall_s)

    def _start_stream(self, stream: int, delay: float = 0.0) -> None:
        old = self._stream_tasks.get(stream)
        if old is not None and not old.done():
            return
        self._stream_tasks[stream] = asyncio.create_task(self._dial_stream(stream, delay),
                                                         name=f"{self.settings.name}:bulk{stream}")

    async def _dial_stream(self, stream: int, delay: float) -> None:
        st = self.settings
        backoff = max(delay, 0.05)
        bulk = st.bulk_loop(stream)
        main = asyncio.get_running_loop()
        if delay:
            await asyncio.sleep(delay)
        while self.owner.is_up and not self._closing:
            fut = bulk.submit(self._bulk_connect(stream, main))
            try:
                conn = await asyncio.wrap_future(fut)
                self.adopt_bulk(stream, bulk, conn)
                return
            except asyncio.CancelledError:
                fut.cancel()
                raise
            except HandshakeError as exc:  # the listener's ERROR answering BULK_HELLO
                if exc.code == ErrorCode.TOO_MANY_CONNECTIONS:  # proto/handshake.md §2: the longest backoff
                    limited(self, self.log.warning, "bulk connection refused: the peer has its "
                            "limits.max_peer_connections open", detail={"stream": stream, "error": str(exc)})
                    backoff = st.backoff_max_s
                else:
                    limited(self, self.log.info, "bulk connect failed", stream=stream, error=str(exc),
                            code=exc.code.name)
            except (TransportError, OSError, TimeoutError) as exc:
                self.log.info("bulk connect failed", stream=stream, error=str(exc))
            await asyncio.sleep(backoff * (0.5 + random.random() / 2))  # jittered: refused streams spread out
            backoff = min(backoff * 2, st.backoff_max_s)

    async def _bulk_connect(self, stream: int, main: asyncio.AbstractEventLoop) -> FrameProtocol:
        """Runs on the bulk loop: dial, present the session token, wait for BULK_WELCOME."""
        st = self.settings
        handler = self.make_bulk_protocol(stream, main)
        conn = handler.conn
        handler.welcomed = asyncio.get_running_loop().create_future()
        await dial(st.host, st.port, KIND_BULK, conn, ssl_ctx=st.ssl_client(), server_name=st.server_name,
                   timeout=st.connect_s)
        conn.send(encode(FrameType.BULK_HELLO, encode_body(
            m.BulkHello(session=st.remote_token(), stream=stream, site=st.site, node=st.node))))
        try:
            async with asyncio.timeout(st.handshake_s):
                await handler.welcomed
        except BaseException:
            conn.abort()
            raise
        return conn

    # -- teardown
    def stall(self) -> None:
        for link in list(self.links.values()):
            link.loop.call(link.conn.abort)

    def down(self) -> None:
        for t in self._stream_tasks.values():
            t.cancel()
            self._cancelled.add(t)
            t.add_done_callback(self._cancelled.discard)
        self._stream_tasks.clear()
        for link in list(self.links.values()):
            self._link_down(link)
            link.loop.call(link.conn.abort)

    async def close(self) -> None:
        self._closing = True
        self.down()
        await asyncio.gather(*self._cancelled, return_exceptions=True)

    def describe(self) -> dict[str, Any]:
        return {"data_path": self.active, "bulk_streams_up": len(self.links)}
