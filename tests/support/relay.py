"""User-space TCP relay for fault injection in tests (there is no netem here).

A :class:`Relay` listens on ``listen_host:listen_port`` (an ephemeral port by
default) and, for each accepted client, opens a connection to
``target_host:target_port`` and copies bytes both ways.  Faults can be set at
any time and apply to the live connections and to later ones:

* :meth:`Relay.flip_byte_at` -- corrupt one byte (xor 0xFF) at a stream offset;
* :meth:`Relay.cut_after` -- reset a connection once a stream passes an offset;
* :meth:`Relay.set_delay` -- one-way added latency for every chunk, in order;
* :meth:`Relay.pause` / :meth:`Relay.resume` -- stop / restart forwarding;
* :meth:`Relay.abort_all` -- reset every live connection (link drop);
* :meth:`Relay.reject_new` -- reset new connections as soon as they arrive.

"c2s" is the client (whoever connected to the relay) to server (the target)
direction, "s2c" the other one.  Stream offsets are per connection and per
direction, counted from 0.

Pure asyncio protocols, so it runs on the default loop and on uvloop and
keeps up with well over 1 GB/s on loopback.  Memory is bounded: a side stops
reading while the transport it feeds is paused for writing (pause_writing /
resume_writing), while the relay is paused, and while more than
``queue_limit`` bytes wait in a delay queue.  EOF is forwarded as a half-close
(``write_eof``); a reset on one side is forwarded as a reset on the other.
"Reset" always means a real RST: SO_LINGER is set to (on, 0) before
``transport.abort()``, since ``abort()`` alone only drops the user-space
buffer and closes the socket, which sends a FIN.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import struct
import time
from typing import Any

from pdd_tools.shaper import _End  # the socket protocol of a two-sided relayed connection

__all__ = ["Relay", "RelayedConn"]

_DIRECTIONS = {"c2s": 0, "s2c": 1}
_EOF = object()  # queue marker: the source half-closed after the queued data
_LINGER_RST = struct.pack("ii", 1, 0)
_MIN_TIMER = 0.001  # uvloop rounds timers to whole milliseconds


def _direction(direction: str) -> int:
    try:
        return _DIRECTIONS[direction]
    except KeyError:
        raise ValueError(f"direction must be 'c2s' or 's2c', not {direction!r}") from None


def _reset(transport: asyncio.BaseTransport) -> None:
    """Close ``transport`` with an RST, dropping whatever it still buffers."""
    _set_linger_rst(transport)
    transport.abort()


def _set_linger_rst(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    except OSError:
        pass


def _set_nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass


class _FlipRule:
    __slots__ = ("offset", "direction", "min_conn_bytes")

    def __init__(self, offset: int, direction: int, min_conn_bytes: int) -> None:
        self.offset = offset
        self.direction = direction
        self.min_conn_bytes = min_conn_bytes


class _CutRule:
    __slots__ = ("nbytes", "direction", "remaining")

    def __init__(self, nbytes: int, direction: int, remaining: int) -> None:
        self.nbytes = nbytes
        self.direction = direction
        self.remaining = remaining


class _Rejected(asyncio.Protocol):
    """Protocol for connections accepted while ``reject_new(True)``: reset at once."""

    def __init__(self, relay: Relay) -> None:
        self._relay = relay
        self._lost = relay._loop.create_future()
        relay._rejecting.add(self._lost)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._relay.rejected += 1
        _reset(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._lost.done():
            self._lost.set_result(None)
        self._relay._rejecting.discard(self._lost)


class RelayedConn:
    """One client connection and its connection to the target.

    Direction index 0 is c2s (read from side 0, written to side 1), 1 is s2c.
    """

    def __init__(self, relay: Relay, index: int) -> None:
        self._relay = relay
        self.index = index
        self._loop = relay._loop
        self._transports: list[asyncio.Transport | None] = [None, None]
        self._lost = [False, False]
        self._reading = [True, True]  # what we last asked of each transport
        self._wpaused = [False, False]  # side's transport paused us for writing
        self._src_eof = [False, False]  # side sent EOF
        self._eof_fwd = [False, False]  # EOF forwarded in direction
        self._qhigh = [False, False]  # delay queue over its limit
        self._fwd = [0, 0]  # bytes forwarded per direction
        self._rcvd = [0, 0]  # bytes read from each side
        self._hold: list[_FlipRule | None] = [None, None]  # direction held for a flip
        self._skip: set[_FlipRule] = set()  # flip rules this connection is ineligible for
        self._queues: list[collections.deque[tuple[float, Any]]] = [
            collections.deque(),
            collections.deque(),
        ]
        self._qbytes = [0, 0]
        self._timers: list[asyncio.TimerHandle | None] = [None, None]
        self._timer_due = [0.0, 0.0]
        self._established = False
        self._dead = False  # torn down (or tearing down): forward nothing more
        self._connect_task: asyncio.Task[Any] | None = None
        self._done = self._loop.create_future()
        self.closed = False
        self.error: BaseException | None = None  # why the target connect failed
        self.peername: Any = None

    # -- public ---------------------------------------------------------

    @property
    def bytes_c2s(self) -> int:
        """Bytes forwarded client -> server so far."""
        return self._fwd[0]

    @property
    def bytes_s2c(self) -> int:
        """Bytes forwarded server -> client so far."""
        return self._fwd[1]

    def abort(self) -> None:
        """Reset both sides of this connection now."""
        self._teardown(rst=True)

    async def wait_closed(self, timeout: float | None = 10) -> None:
        """Return once both sides are closed (raises TimeoutError on timeout)."""
        await asyncio.wait_for(asyncio.shield(self._done), timeout)

    def __repr__(self) -> str:
        return (
            f"<RelayedConn #{self.index} c2s={self._fwd[0]} s2c={self._fwd[1]}"
            f" closed={self.closed}>"
        )

    # -- setup ----------------------------------------------------------

    def _start_connect(self) -> None:
        relay = self._relay
        self._connect_task = self._loop.create_task(self._connect(relay._target_host, relay._target_port))
        self._connect_task.add_done_callback(self._connect_done)

    async def _connect(self, host: str, port: int) -> None:
        await self._loop.create_connection(lambda: _End(self, 1), host, port)

    def _connect_done(self, task: asyncio.Task[Any]) -> None:
        self._connect_task = None
        if not task.cancelled() and task.exception() is not None:
            self.error = task.exception()
            self._teardown(rst=True)
        self._check_done()

    def _on_made(self, side: int, transport: asyncio.Transport) -> None:
        self._transports[side] = transport
        _set_nodelay(transport)
        if self._dead:
            _reset(transport)
            return
        if side == 0:
            self.peername = transport.get_extra_info("peername")
            # Read nothing from the client until the target is connected.
            self._reading[0] = False
            transport.pause_reading()
            self._start_connect()
            return
        self._established = True
        self._update_reading(0)
        self._update_reading(1)

    # -- data path ------------------------------------------------------

    def _on_data(self, side: int, data: bytes) -> None:
        if self._dead:
            return
        self._rcvd[side] += len(data)
        relay = self._relay
        if (
            self._queues[side]
            or relay._delay
            or relay._paused
            or self._wpaused[1 - side]
            or not self._deliver(side, data)
        ):
            self._enqueue(side, data, len(data))
        if self._hold[1 - side] is not None:
            # That direction waits for this connection to carry more bytes.
            self._flush(1 - side)

    def _on_eof(self, side: int) -> None:
        if self._dead or self._src_eof[side]:
            return
        self._src_eof[side] = True
        self._reading[side] = False
        self._enqueue(side, _EOF, 0)

    def _enqueue(self, d: int, item: Any, size: int) -> None:
        self._queues[d].append((time.monotonic() + self._relay._delay, item))
        if size:
            self._qbytes[d] += size
            if self._qbytes[d] > self._relay._queue_limit and not self._qhigh[d]:
                self._qhigh[d] = True
                self._update_reading(d)
        self._flush(d)

    def _flush(self, d: int) -> None:
        """Forward what is due in direction ``d``, as far as the gates allow."""
        queue = self._queues[d]
        relay = self._relay
        now = None
        while queue and not self._dead and not relay._paused and not self._wpaused[1 - d]:
            due, item = queue[0]
            if now is None or due > now:
                now = time.monotonic()
                if due > now:
                    self._arm_timer(d, due, now)
                    break
            if item is _EOF:
                queue.popleft()
                self._forward_eof(d)
            elif self._deliver(d, item):
                queue.popleft()
                self._qbytes[d] -= len(item)
            else:
                break  # held for a flip: stays at the head
        if self._qhigh[d] and self._qbytes[d] <= self._relay._queue_limit // 2:
            self._qhigh[d] = False
        self._update_reading(d)

    def _arm_timer(self, d: int, due: float, now: float) -> None:
        timer = self._timers[d]
        if timer is not None:
            if self._timer_due[d] == due:
                return
            timer.cancel()
        self._timer_due[d] = due
        self._timers[d] = self._loop.call_later(max(due - now, _MIN_TIMER), self._on_timer, d)

    def _on_timer(self, d: int) -> None:
        self._timers[d] = None
        self._flush(d)

    def _deliver(self, d: int, data: bytes) -> bool:
        """Write ``data`` on, faults applied; False: held back for a flip, nothing done."""
        relay = self._relay
        cut = False
        if relay._flips or relay._cuts:
            if relay._flips and self._must_hold(d, len(data)):
                return False
            data, cut = self._apply_faults(d, data)
        self._fwd[d] += len(data)
        if data:
            self._transports[1 - d].write(data)  # type: ignore[union-attr]
        if cut:
            relay.cuts_done += 1
            self._teardown(rst=True)
        return True

    def _cut_point(self, d: int, start: int, end: int) -> _CutRule | None:
        """The earliest armed cut that this chunk ``[start, end)`` triggers."""
        found = None
        for rule in self._relay._cuts:
            if rule.direction == d and start <= rule.nbytes < end:
                if found is None or rule.nbytes < found.nbytes:
                    found = rule
        return found

    def _flip_eligible(self, rule: _FlipRule) -> bool:
        return rule not in self._skip and self._rcvd[0] + self._rcvd[1] > rule.min_conn_bytes

    def _must_hold(self, d: int, size: int) -> bool:
        """Whether the chunk of ``size`` bytes next in direction ``d`` must wait.

        It waits when it carries the offset of an armed flip but this
        connection has not yet carried more than that flip's min_conn_bytes;
        it stops waiting once it has, or once it cannot: the stream ended or
        the queue is full (the connection is then ineligible for that flip).
        """
        self._hold[d] = None
        start = self._fwd[d]
        end = start + size
        cut = self._cut_point(d, start, end)
        if cut is not None:
            end = cut.nbytes
        for rule in self._relay._flips:
            if rule.direction != d or not start <= rule.offset < end or self._flip_eligible(rule):
                continue
            if rule in self._skip:
                continue
            if self._src_eof[d] or self._qhigh[d]:
                self._skip.add(rule)
                continue
            self._hold[d] = rule
            return True
        return False

    def _apply_faults(self, d: int, data: bytes) -> tuple[bytes, bool]:
        relay = self._relay
        start = self._fwd[d]
        end = start + len(data)
        cut = self._cut_point(d, start, end)
        if cut is not None:
            cut.remaining -= 1
            if cut.remaining <= 0:
                relay._cuts.remove(cut)
            data = data[: cut.nbytes - start]
            end = cut.nbytes
        for rule in list(relay._flips):
            if rule.direction != d or not start <= rule.offset < end:
                continue
            if not self._flip_eligible(rule):
                continue
            buf = bytearray(data)
            buf[rule.offset - start] ^= 0xFF
            data = bytes(buf)
            relay._spend_flip(rule)
        return data, cut is not None

    def _forward_eof(self, d: int) -> None:
        self._eof_fwd[d] = True
        dest = self._transports[1 - d]
        assert dest is not None
        if dest.can_write_eof():
            dest.write_eof()
        else:
            dest.close()
        if self._eof_fwd[0] and self._eof_fwd[1]:
            # Both halves closed cleanly: close both (flushing what is buffered).
            self._dead = True
            self._cancel_timers()
            for t in self._transports:
                if t is not None:
                    t.close()

    # -- flow control ---------------------------------------------------

    def _update_reading(self, d: int) -> None:
        """Start or stop reading from side ``d`` (the source of direction d)."""
        t = self._transports[d]
        if t is None or self._lost[d] or self._src_eof[d] or self._dead:
            return
        want = (
            self._established
            and not self._relay._paused
            and not self._wpaused[1 - d]
            and not self._qhigh[d]
        )
        if want != self._reading[d]:
            self._reading[d] = want
            if want:
                t.resume_reading()
            else:
                t.pause_reading()

    # The names pdd_tools.shaper's socket protocol (_End) calls.
    def on_made(self, side: int, transport: asyncio.Transport) -> None:
        self._on_made(side, transport)

    def on_data(self, side: int, data: bytes) -> None:
        self._on_data(side, data)

    def on_eof(self, side: int) -> None:
        self._on_eof(side)

    def set_write_paused(self, side: int, paused: bool) -> None:
        (self._on_pause_writing if paused else self._on_resume_writing)(side)

    def on_lost(self, side: int, exc: Exception | None) -> None:
        self._on_lost(side, exc)

    def _on_pause_writing(self, side: int) -> None:
        self._wpaused[side] = True
        self._update_reading(1 - side)

    def _on_resume_writing(self, side: int) -> None:
        self._wpaused[side] = False
        self._flush(1 - side)

    def _on_resume_all(self) -> None:
        self._flush(0)
        self._flush(1)

    # -- teardown -------------------------------------------------------

    def _cancel_timers(self) -> None:
        for d in (0, 1):
            timer = self._timers[d]
            if timer is not None:
                timer.cancel()
                self._timers[d] = None

    def _teardown(self, *, rst: bool) -> None:
        """Stop forwarding and close both sides (RST when ``rst``)."""
        if not self._dead:
            self._dead = True
            self._cancel_timers()
            for q in self._queues:
                q.clear()
            self._qbytes = [0, 0]
        if self._connect_task is not None:
            self._connect_task.cancel()
        for side, t in enumerate(self._transports):
            if t is not None and not self._lost[side]:
                if rst:
                    _reset(t)
                elif not t.is_closing():
                    t.close()
        self._check_done()

    def _on_lost(self, side: int, exc: Exception | None) -> None:
        self._lost[side] = True
        if not self._dead:
            # The peer went away on its own: pass a reset on as a reset, a
            # clean close as a clean close.
            self._teardown(rst=exc is not None)
        else:
            self._check_done()

    def _check_done(self) -> None:
        if self._done.done() or self._connect_task is not None:
            return
        for side, t in enumerate(self._transports):
            if t is not None and not self._lost[side]:
                return
        if self._transports[0] is None:
            return
        self.closed = True
        self._done.set_result(None)


class Relay:
    """A TCP relay from ``listen_host:port`` to ``target_host:target_port``."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        queue_limit: int = 8 << 20,
    ) -> None:
        self._target_host = target_host
        self._target_port = target_port
        self._listen_host = listen_host
        self._listen_port = listen_port
        self._queue_limit = queue_limit
        self._loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._server: asyncio.AbstractServer | None = None
        self._closing = False
        self._close_task: asyncio.Future[None] | None = None
        self._delay = 0.0
        self._paused = False
        self._reject = False
        self._flips: list[_FlipRule] = []
        self._cuts: list[_CutRule] = []
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._rejecting: set[asyncio.Future[None]] = set()
        self.port = 0
        self.connections: list[RelayedConn] = []
        self.flips_done = 0
        self.cuts_done = 0
        self.rejected = 0  # connections reset at once by reject_new(True)

    # -- lifecycle ------------------------------------------------------

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("relay already started")
        self._loop = asyncio.get_running_loop()
        self._server = await self._loop.create_server(
            self._make_protocol, self._listen_host, self._listen_port
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and reset every relayed connection.  Idempotent."""
        if self._server is None:
            return
        if self._close_task is None:
            self._close_task = self._loop.create_task(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        self._closing = True
        assert self._server is not None
        self._server.close()
        self.abort_all()
        for conn in self.connections:
            await conn._done
        while self._rejecting:
            await next(iter(self._rejecting))
        await self._server.wait_closed()
        for _, fut in self._waiters:
            if not fut.done():
                fut.cancel()
        self._waiters.clear()

    async def __aenter__(self) -> Relay:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _make_protocol(self) -> asyncio.Protocol:
        if self._reject or self._closing:
            return _Rejected(self)
        conn = RelayedConn(self, len(self.connections))
        self.connections.append(conn)
        n = len(self.connections)
        still = []
        for want, fut in self._waiters:
            if fut.done():
                continue
            if n >= want:
                fut.set_result(None)
            else:
                still.append((want, fut))
        self._waiters = still
        return _End(conn, 0)

    async def wait_connections(self, n: int, timeout: float | None = 10) -> list[RelayedConn]:
        """Return once at least ``n`` connections were accepted (TimeoutError otherwise)."""
        if len(self.connections) < n:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append((n, fut))
            await asyncio.wait_for(fut, timeout)
        return list(self.connections)

    # -- faults ---------------------------------------------------------

    def _spend_flip(self, rule: _FlipRule) -> None:
        self._flips.remove(rule)
        self.flips_done += 1
        for conn in self.connections:
            for d in (0, 1):
                if conn._hold[d] is rule:
                    # Spent elsewhere: let the held stream go, unflipped.
                    conn._loop.call_soon(conn._flush, d)

    def flip_byte_at(self, offset: int, *, direction: str = "c2s", min_conn_bytes: int = 0) -> None:
        """Once, xor 0xFF the byte at stream ``offset`` of the first eligible connection.

        Eligible: the connection carries (reads, both directions together)
        more than ``min_conn_bytes`` in total.  While a connection reaching
        ``offset`` has not yet done so, its stream in ``direction`` is held
        from the chunk holding ``offset`` on (reading goes on, up to
        ``queue_limit``) until it has -- then the byte is flipped and the
        stream let go -- or until it cannot: that stream ends, the queue
        fills, or the flip is spent on another connection; then the held
        bytes go on unflipped.  So with ``offset < min_conn_bytes`` a peer
        that waits for a reply before sending more stalls at ``offset``; use
        ``offset >= min_conn_bytes`` (never holds) for request/response
        traffic.  Several calls arm independent flips.
        """
        if offset < 0:
            raise ValueError("offset must be >= 0")
        self._flips.append(_FlipRule(offset, _direction(direction), min_conn_bytes))

    def cut_after(self, nbytes: int, *, direction: str = "c2s", count: int = 1) -> None:
        """Reset the next ``count`` connections whose ``direction`` stream passes ``nbytes``.

        Exactly the first ``nbytes`` bytes are forwarded (as with any RST,
        bytes still in flight may be lost), nothing after; then both sides
        are reset.  A connection already past ``nbytes`` when this is called
        does not count.
        """
        if nbytes < 0 or count < 1:
            raise ValueError("need nbytes >= 0 and count >= 1")
        self._cuts.append(_CutRule(nbytes, _direction(direction), count))

    def set_delay(self, seconds: float) -> None:
        """Hold every chunk ``seconds`` before forwarding it (both directions); 0 disables.

        Order is preserved.  Each delay queue holds at most ``queue_limit``
        bytes (then the relay stops reading), so throughput under delay is
        capped at about queue_limit / seconds.
        """
        if seconds < 0:
            raise ValueError("delay must be >= 0")
        self._delay = float(seconds)

    def pause(self) -> None:
        """Stop forwarding: stop reading both sides; held data waits in kernel buffers."""
        self._paused = True
        for conn in self.connections:
            conn._update_reading(0)
            conn._update_reading(1)

    def resume(self) -> None:
        self._paused = False
        for conn in self.connections:
            conn._on_resume_all()

    def abort_all(self) -> None:
        """Reset every live relayed connection (link drop).  The listener stays up."""
        for conn in self.connections:
            if not conn.closed:
                conn._teardown(rst=True)

    def reject_new(self, flag: bool) -> None:
        """While True, new connections are accepted and reset at once (link down)."""
        self._reject = bool(flag)
