"""The shaper itself (:class:`Shaper`): listens, relays each connection to the target through a
:class:`~pdd_tools.shaper.conn.ShapedConn`, and takes the settings and faults the tests set."""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import Self

import structlog

from .conn import ShapedConn
from .link import (
    QUEUE_LIMIT,
    CutRule,
    Direction,
    FlipRule,
    JitterDist,
    Link,
    check_address,
    directions,
    one_direction,
    reset,
)

log = structlog.get_logger("pdd_tools.shaper")

KEEP_CONNS = 1024  # connections (live or closed) kept in Shaper.connections
_CLOSE_WAIT_S = 5.0  # close(): how long to wait for the reset connections to be gone


@dataclass(frozen=True)
class ShaperStats:
    """A snapshot: connections accepted and still open, bytes forwarded each way, bytes queued."""

    connections: int
    active: int
    bytes_c2s: int
    bytes_s2c: int
    queued: int  # waiting in the delay queues of the live connections, both directions


class _Rejected(asyncio.Protocol):
    """Protocol for connections accepted while ``reject_new(True)`` or closing: reset at once."""

    def __init__(self, shaper: Shaper, lost: asyncio.Future[None]) -> None:
        self._shaper = shaper
        self._lost = lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._shaper.rejected += 1
        reset(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._lost.done():
            self._lost.set_result(None)


class Shaper:
    """Relays TCP from ``listen`` to ``target`` with delay, jitter and a rate limit per direction,
    and the faults of :mod:`pdd_tools.shaper`.

    ``delay_ms``, ``jitter_ms``, ``jitter_dist`` and ``rate_Bps`` set both directions; change
    them, per direction if need be, with :meth:`set_delay` and :meth:`set_rate`.  Use as
    ``async with Shaper(target=(host, port)) as sh:``; ``sh.address`` (``sh.port``) is where to
    connect.  ``sh.connections`` holds the latest ``keep_conns`` connections accepted, live or
    closed, oldest first (:class:`ShapedConn`: bytes each way, ``abort()``, ``wait_closed()``).
    """

    def __init__(
        self,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        target: tuple[str, int] = ("127.0.0.1", 0),
        *,
        delay_ms: float = 0.0,
        jitter_ms: float = 0.0,
        jitter_dist: JitterDist = "uniform",
        rate_Bps: float | None = None,
        queue_limit: int = QUEUE_LIMIT,
        keep_conns: int = KEEP_CONNS,
    ) -> None:
        self._listen = check_address(*listen, what="listen address", listen=True)
        if queue_limit < 1:
            raise ValueError("queue_limit must be >= 1 byte")
        self._link = Link(check_address(*target, what="target"), queue_limit)
        self.set_delay(delay_ms, jitter_ms, dist=jitter_dist)
        self.set_rate(rate_Bps)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._closing = False
        self._close_task: asyncio.Task[None] | None = None
        self._rejecting: set[asyncio.Future[None]] = set()
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._accepted = 0
        self._reject = False
        self.connections: collections.deque[ShapedConn] = collections.deque(maxlen=keep_conns)
        self.rejected = 0  # connections reset at once by reject_new(True)
        self.address: tuple[str, int] = self._listen

    @property
    def port(self) -> int:
        """The port listened on (the real one once started)."""
        return self.address[1]

    @property
    def flips_done(self) -> int:
        """Bytes flipped so far (:meth:`flip_byte_at`)."""
        return self._link.flips_done

    @property
    def cuts_done(self) -> int:
        """Connections cut so far (:meth:`cut_after`)."""
        return self._link.cuts_done

    # -- settings ---------------------------------------------------------

    def set_delay(
        self, ms: float, jitter_ms: float = 0.0, *, dist: JitterDist = "uniform", direction: Direction = "both"
    ) -> None:
        """One-way delay and jitter in ms for chunks read from now on (order is always kept)."""
        for d in directions(direction):
            self._link.dirs[d].set_delay(ms, jitter_ms, dist)

    def set_rate(self, Bps: float | None, *, direction: Direction = "both") -> None:
        """Rate limit in bytes/s for chunks read from now on; None (or 0) removes it."""
        for d in directions(direction):
            self._link.dirs[d].set_rate(Bps)

    # -- faults -----------------------------------------------------------

    def flip_byte_at(self, offset: int, *, direction: str = "c2s", min_conn_bytes: int = 0) -> None:
        """Once, xor 0xFF the byte at stream ``offset`` of the first eligible connection.

        Eligible: the connection carries (reads, both directions together) more than
        ``min_conn_bytes`` in total.  While a connection reaching ``offset`` has not yet done
        so, its stream in ``direction`` is held from the chunk holding ``offset`` on (reading
        goes on, up to ``queue_limit``) until it has -- then the byte is flipped and the stream
        let go -- or until it cannot: that stream ends, the queue fills, or the flip is spent on
        another connection; then the held bytes go on unflipped.  So with ``offset <
        min_conn_bytes`` a peer that waits for a reply before sending more stalls at ``offset``;
        use ``offset >= min_conn_bytes`` (never holds) for request/response traffic.  Several
        calls arm independent flips.
        """
        if offset < 0:
            raise ValueError("offset must be >= 0")
        self._link.flips.append(FlipRule(offset, one_direction(direction), min_conn_bytes))

    def cut_after(self, nbytes: int, *, direction: str = "c2s", count: int = 1) -> None:
        """Reset the next ``count`` connections whose ``direction`` stream passes ``nbytes``.

        Exactly the first ``nbytes`` bytes are forwarded (as with any RST, bytes still in flight
        may be lost), nothing after; then both sides are reset.  A connection already past
        ``nbytes`` when this is called does not count.
        """
        if nbytes < 0 or count < 1:
            raise ValueError("need nbytes >= 0 and count >= 1")
        self._link.cuts.append(CutRule(nbytes, one_direction(direction), count))

    def pause(self) -> None:
        """Stop forwarding: stop reading both sides; held data waits in kernel buffers."""
        self._set_paused(True)

    def resume(self) -> None:
        self._set_paused(False)

    def _set_paused(self, paused: bool) -> None:
        self._link.paused = paused
        for conn in list(self._link.live):
            conn.gate_changed()

    def abort_all(self) -> None:
        """Reset every live connection (link drop).  The listener stays up."""
        for conn in list(self._link.live):
            conn.abort()

    def reject_new(self, flag: bool) -> None:
        """While True, new connections are accepted and reset at once (link down)."""
        self._reject = bool(flag)

    # -- stats ------------------------------------------------------------

    @property
    def stats(self) -> ShaperStats:
        link = self._link
        queued = sum(conn.queued for conn in link.live)
        return ShaperStats(self._accepted, len(link.live), link.forwarded[0], link.forwarded[1], queued)

    async def wait_connections(self, n: int, timeout: float | None = 10) -> list[ShapedConn]:
        """Once at least ``n`` connections were accepted, the kept ones (TimeoutError otherwise)."""
        if self._accepted < n:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append((n, fut))
            await asyncio.wait_for(fut, timeout)
        return list(self.connections)

    # -- lifecycle --------------------------------------------------------

    def _accept(self) -> asyncio.Protocol:
        assert self._loop is not None
        if self._reject or self._closing:
            lost = self._loop.create_future()
            self._rejecting.add(lost)
            lost.add_done_callback(self._rejecting.discard)
            return _Rejected(self, lost)
        conn = ShapedConn(self._link, self._loop, self._accepted)
        self._accepted += 1
        self._link.live.add(conn)
        self.connections.append(conn)
        still = []
        for want, fut in self._waiters:
            if fut.done():
                continue
            if self._accepted >= want:
                fut.set_result(None)
            else:
                still.append((want, fut))
        self._waiters = still
        return conn.client_protocol()

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("shaper already started")
        self._loop = asyncio.get_running_loop()
        host, port = self._listen
        self._server = await self._loop.create_server(self._accept, host, port)
        self.address = self._server.sockets[0].getsockname()[:2]
        target = self._link.target
        log.info("shaper listening", listen=f"{self.address[0]}:{self.address[1]}", target=f"{target[0]}:{target[1]}")

    async def close(self) -> None:
        """Stop listening and reset every live connection (the link goes away).  Idempotent;
        concurrent calls all return once it is done."""
        if self._server is None:
            return
        if self._close_task is None:
            assert self._loop is not None
            self._close_task = self._loop.create_task(self._close(self._server))
        await asyncio.shield(self._close_task)

    async def _close(self, server: asyncio.AbstractServer) -> None:
        self._closing = True
        server.close()
        conns = list(self._link.live)
        for conn in conns:
            conn.abort()
        pending = [c.done for c in conns] + list(self._rejecting)
        if pending:
            await asyncio.wait(pending, timeout=_CLOSE_WAIT_S)
        await server.wait_closed()
        for _, fut in self._waiters:
            fut.cancel()
        self._waiters.clear()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
