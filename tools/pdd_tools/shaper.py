"""A user-space TCP relay for an emulated WAN and for fault injection: one-way delay, jitter and a
rate limit per direction, and the faults the tests inject (a flipped byte, a cut, a pause, a
link drop, refused connections).

Why: the demo and the fault-injection suite want two "datacenters" 20 ms apart on one machine,
and this kernel has no ``netem`` qdisc (``tbf`` and ``htb`` exist, see :mod:`pdd_tools.netns`,
but neither delays packets nor corrupts them).  So the WAN's latency and its faults are added
here, above TCP: a :class:`Shaper` listens on ``listen`` and, for every accepted connection,
connects to ``target`` and copies bytes both ways.  "c2s" is the direction from whoever
connected to the shaper to the target, "s2c" the other one; stream offsets are counted per
connection and per direction from 0.

Each chunk read from one side gets a due time and is written to the other side no earlier:

* rate (optional, bytes/s): a token bucket, run as a virtual clock (GCRA): the chunk's last
  byte "leaves the bottleneck" at ``tx = max(tx_prev, now - burst/rate) + size/rate``, so after
  an idle spell up to ``burst`` bytes (5 ms of the rate, at least 16 KiB) pass at once and the
  long-run rate never exceeds ``rate``.  Chunks are cut to at most ``quantum`` bytes (1 ms of
  the rate, within 4-64 KiB) first, so the receiver sees a smooth stream, not 256 KiB lumps;
* delay and jitter: then ``due = max(tx, now) + delay + j``, where ``j`` is uniform in
  ``[-jitter, +jitter]`` or normal with sigma ``jitter``, never below ``-delay``;
* order: ``due = max(due, due of the previous chunk)``, so bytes are never reordered within a
  connection; with jitter, the mean added delay is therefore a little above ``delay``.

Faults, set at any time, apply to the live connections and to later ones:

* :meth:`Shaper.flip_byte_at`: corrupt one byte (xor 0xFF) at a stream offset, once;
* :meth:`Shaper.cut_after`: reset a connection once a stream passes an offset;
* :meth:`Shaper.pause` / :meth:`Shaper.resume`: stop / restart forwarding;
* :meth:`Shaper.abort_all`: reset every live connection (link drop);
* :meth:`Shaper.reject_new`: reset new connections as soon as they arrive (link down).

Memory is bounded: a side stops being read while more than ``queue_limit`` bytes wait in its
delay queue (reading resumes below half of it), while the transport it feeds is paused for
writing (``pause_writing`` / ``resume_writing``) and while the shaper is paused.  Throughput
under delay is thus capped at about ``queue_limit / delay`` (8 MiB / 20 ms = 400 MiB/s by
default); kernel socket buffers add to what is in flight.  EOF is forwarded, in order and
delayed like data, as a half-close; a reset on one side is passed on at once as a reset on the
other.  "Reset" always means a real RST: SO_LINGER is set to (on, 0) before
``transport.abort()``, since ``abort()`` alone closes the socket with a FIN.

Settings can be changed at any time (:meth:`Shaper.set_delay`, :meth:`Shaper.set_rate`) and
apply to the chunks read from then on, on live connections too.  Only loopback and private
addresses (127/8, 10/8, 172.16/12, 192.168/16, ::1) may be listened on or targeted: this is a
test tool and must never relay to, or be reachable from, the outside.  Pure asyncio protocols:
it runs on the default loop and on uvloop.

CLI: ``python -m pdd_tools.shaper --listen HOST:PORT --target HOST:PORT --delay-ms 20
--jitter-ms 2 [--rate-mbit N]`` runs until SIGTERM or SIGINT, then exits 0; a bad argument
exits 2 naming it; a listen address that cannot be bound exits 1.  Once listening it prints
``shaper listening on HOST:PORT -> HOST:PORT`` on stdout (the real port when PORT was 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ipaddress
import math
import random
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any, Literal, Self

import structlog

__all__ = ["QUEUE_LIMIT", "ShapedConn", "Shaper", "ShaperStats", "check_address", "main"]

log = structlog.get_logger("pdd_tools.shaper")

Direction = Literal["c2s", "s2c", "both"]
JitterDist = Literal["uniform", "normal"]

QUEUE_LIMIT = 8 << 20  # default bound of one direction's delay queue, bytes
KEEP_CONNS = 1024  # connections (live or closed) kept in Shaper.connections

_ALLOWED_NETS = tuple(
    ipaddress.ip_network(n)
    for n in ("127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "::1/128")
)
_DIRECTIONS = {"c2s": (0,), "s2c": (1,), "both": (0, 1)}
_EOF = object()  # queue marker: the source half-closed after the data queued before it
_LINGER_RST = struct.pack("ii", 1, 0)
_MIN_TIMER = 0.001  # uvloop rounds timers to whole milliseconds; a release is re-checked anyway
_BURST_S = 0.005  # token bucket depth: 5 ms of the rate ...
_MIN_BURST = 16 << 10  # ... but at least 16 KiB, so that one read is not always split up
_QUANTUM_S = 0.001  # rate-limited chunks are cut to ~1 ms of the rate ...
_QUANTUM_RANGE = (4 << 10, 64 << 10)  # ... within 4-64 KiB
_CLOSE_WAIT_S = 5.0  # close(): how long to wait for the reset connections to be gone


def check_address(host: str, port: int, *, what: str = "address", listen: bool = False) -> tuple[str, int]:
    """``(ip, port)`` for a numeric loopback/private ``host`` (or ``localhost``); ValueError otherwise.

    Names other than ``localhost`` are refused rather than resolved: a DNS answer could point
    anywhere, and a test tool has no business waiting on DNS.
    """
    literal = "127.0.0.1" if host == "localhost" else host.strip("[]")
    try:
        ip = ipaddress.ip_address(literal)
    except ValueError:
        raise ValueError(f"{what} {host!r} is not a numeric IP address (or localhost)") from None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if not any(ip in net for net in _ALLOWED_NETS):
        raise ValueError(
            f"{what} {host} is not a loopback or private address "
            "(allowed: 127/8, 10/8, 172.16/12, 192.168/16, ::1)"
        )
    lowest = 0 if listen else 1
    if not lowest <= port <= 65535:
        raise ValueError(f"{what} port {port} is out of range ({lowest}-65535)")
    return str(ip), port


def _reset(transport: asyncio.BaseTransport) -> None:
    """Close ``transport`` with a real RST (SO_LINGER 0), not the FIN that abort() alone sends."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
        except (OSError, ValueError):  # ValueError: uvloop, the socket is already closed
            pass
    transport.abort()


def _one_direction(direction: str) -> int:
    if direction not in ("c2s", "s2c"):
        raise ValueError(f"direction must be 'c2s' or 's2c', not {direction!r}")
    return _DIRECTIONS[direction][0]


def _dirs_of(direction: Direction) -> tuple[int, ...]:
    try:
        return _DIRECTIONS[direction]
    except KeyError:
        raise ValueError(f"direction must be 'c2s', 's2c' or 'both', not {direction!r}") from None


@dataclass(frozen=True)
class ShaperStats:
    """A snapshot: connections accepted and still open, bytes forwarded each way, bytes queued."""

    connections: int
    active: int
    bytes_c2s: int
    bytes_s2c: int
    queued: int  # waiting in the delay queues of the live connections, both directions


@dataclass
class _DirSettings:
    """How one direction is shaped (seconds and bytes/s)."""

    delay: float = 0.0
    jitter: float = 0.0
    dist: JitterDist = "uniform"
    rate: float | None = None
    burst: float = 0.0
    quantum: int = 0

    def shapes(self) -> bool:
        return bool(self.delay or self.jitter or self.rate)

    def extra_delay(self) -> float:
        """Delay plus one jitter sample, never negative."""
        if not self.jitter:
            return self.delay
        if self.dist == "normal":
            j = random.gauss(0.0, self.jitter)
        else:
            j = random.uniform(-self.jitter, self.jitter)
        return max(0.0, self.delay + j)


@dataclass(eq=False)
class _FlipRule:
    offset: int
    direction: int
    min_conn_bytes: int


@dataclass(eq=False)
class _CutRule:
    nbytes: int
    direction: int
    remaining: int


class _Lane:
    """One direction of one connection: the chunks waiting for their due time."""

    __slots__ = ("high", "last_due", "peak", "qbytes", "queue", "timer", "timer_due", "tx_clock")

    def __init__(self) -> None:
        self.queue: collections.deque[tuple[float, Any]] = collections.deque()
        self.qbytes = 0
        self.peak = 0  # the most qbytes has been
        self.last_due = 0.0  # due time of the latest chunk queued: no chunk is due earlier
        self.tx_clock = 0.0  # token bucket virtual clock
        self.high = False  # over queue_limit: its source is not read
        self.timer: asyncio.TimerHandle | None = None
        self.timer_due = 0.0


class _End(asyncio.Protocol):
    """Protocol for one socket of a shaped connection: side 0 faces the client, 1 the target."""

    __slots__ = ("_conn", "_side")

    def __init__(self, conn: ShapedConn, side: int) -> None:
        self._conn = conn
        self._side = side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._conn._on_made(self._side, transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        self._conn._on_data(self._side, data)

    def eof_received(self) -> bool:
        self._conn._on_eof(self._side)
        return True  # half-close: keep the transport open for the other direction

    def pause_writing(self) -> None:
        self._conn._set_write_paused(self._side, True)

    def resume_writing(self) -> None:
        self._conn._set_write_paused(self._side, False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._conn._on_lost(self._side, exc)


class _Rejected(asyncio.Protocol):
    """Protocol for connections accepted while ``reject_new(True)`` or closing: reset at once."""

    def __init__(self, shaper: Shaper) -> None:
        self._shaper = shaper
        self._lost = shaper._loop.create_future()
        shaper._rejecting.add(self._lost)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._shaper.rejected += 1
        _reset(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._lost.done():
            self._lost.set_result(None)
        self._shaper._rejecting.discard(self._lost)


class ShapedConn:
    """A client connection and its connection to the target; direction d is read from side d
    (0: c2s, the client's bytes to the target; 1: s2c)."""

    def __init__(self, shaper: Shaper, index: int) -> None:
        self._shaper = shaper
        self.index = index  # the how-manieth accepted connection, from 0
        self._loop = shaper._loop
        self._ends: list[asyncio.Transport | None] = [None, None]
        self._lost = [False, False]
        self._reading = [True, True]  # what was last asked of each transport
        self._wpaused = [False, False]  # that side's transport asked us to stop writing
        self._eof_in = [False, False]  # that side half-closed
        self._eof_out = [False, False]  # EOF forwarded in that direction
        self._lanes = (_Lane(), _Lane())
        self._fwd = [0, 0]  # bytes forwarded per direction
        self._rcvd = [0, 0]  # bytes read from each side
        self._hold: list[_FlipRule | None] = [None, None]  # direction held back for a flip
        self._skip: set[_FlipRule] = set()  # flips this connection cannot take any more
        self._connected = False
        self._dead = False  # torn down (or tearing down): forward nothing more
        self._connect_task: asyncio.Task[Any] | None = None
        self._done: asyncio.Future[None] = self._loop.create_future()
        self.closed = False
        self.error: BaseException | None = None  # why the target connect failed
        self.peername: Any = None

    # -- public -----------------------------------------------------------

    @property
    def bytes_c2s(self) -> int:
        """Bytes forwarded client -> target so far."""
        return self._fwd[0]

    @property
    def bytes_s2c(self) -> int:
        """Bytes forwarded target -> client so far."""
        return self._fwd[1]

    @property
    def queued(self) -> int:
        """Bytes waiting in this connection's delay queues, both directions."""
        return self._lanes[0].qbytes + self._lanes[1].qbytes

    @property
    def queued_peak(self) -> int:
        """The most bytes one direction's delay queue has held."""
        return max(lane.peak for lane in self._lanes)

    def abort(self) -> None:
        """Reset both sides of this connection now."""
        self._teardown(rst=True)

    async def wait_closed(self, timeout: float | None = 10) -> None:
        """Return once both sides are closed (TimeoutError after ``timeout``)."""
        await asyncio.wait_for(asyncio.shield(self._done), timeout)

    def __repr__(self) -> str:
        return f"<ShapedConn #{self.index} c2s={self._fwd[0]} s2c={self._fwd[1]} closed={self.closed}>"

    # -- setup ------------------------------------------------------------

    def _on_made(self, side: int, transport: asyncio.Transport) -> None:
        self._ends[side] = transport
        sock = transport.get_extra_info("socket")
        try:
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, ValueError):  # already closed by the peer
            pass
        if self._dead:
            _reset(transport)
        elif side == 0:  # read nothing from the client until the target answers
            self.peername = transport.get_extra_info("peername")
            self._reading[0] = False
            transport.pause_reading()
            host, port = self._shaper._target
            coro = self._loop.create_connection(lambda: _End(self, 1), host, port)
            self._connect_task = self._loop.create_task(coro)
            self._connect_task.add_done_callback(self._connect_done)
        else:
            self._connected = True
            self._flush(0)
            self._flush(1)

    def _connect_done(self, task: asyncio.Task[Any]) -> None:
        self._connect_task = None
        if not task.cancelled() and task.exception() is not None:
            self.error = task.exception()
            log.warning("target connect failed", target=self._shaper._target, error=str(self.error))
            self._teardown(rst=True)
        self._check_done()

    # -- data path --------------------------------------------------------

    def _on_data(self, side: int, data: bytes) -> None:
        if self._dead:
            return
        self._rcvd[side] += len(data)
        if not self._connected:
            # uvloop starts reading after connection_made, undoing its pause_reading: pause
            # again, so that at most this chunk waits for the target.
            self._enqueue_data(side, data)
            self._reading[side] = False
            self._ends[side].pause_reading()  # type: ignore[union-attr]
        elif (self._lanes[side].queue or self._shaper._dirs[side].shapes() or self._shaper._paused
              or self._wpaused[1 - side] or not self._deliver(side, data)):
            self._enqueue_data(side, data)
            self._flush(side)
        # else: the fast path, written at once
        if self._hold[1 - side] is not None:
            self._flush(1 - side)  # that direction waits for this connection to carry more

    def _enqueue_data(self, d: int, data: bytes) -> None:
        step = self._shaper._dirs[d].quantum
        if step and len(data) > step:  # rate-limited: smooth, not one lump per read
            for off in range(0, len(data), step):
                self._enqueue(d, data[off:off + step])
        else:
            self._enqueue(d, data)

    def _on_eof(self, side: int) -> None:
        if self._dead or self._eof_in[side]:
            return
        self._eof_in[side] = True
        self._reading[side] = False
        self._enqueue(side, _EOF)
        self._flush(side)

    def _enqueue(self, d: int, item: Any) -> None:
        lane = self._lanes[d]
        cfg = self._shaper._dirs[d]
        now = time.monotonic()
        size = 0 if item is _EOF else len(item)
        sent = now
        if cfg.rate and size:
            lane.tx_clock = max(lane.tx_clock, now - cfg.burst / cfg.rate) + size / cfg.rate
            sent = max(now, lane.tx_clock)
        due = max(sent + cfg.extra_delay(), lane.last_due)
        lane.last_due = due
        lane.queue.append((due, item))
        if size:
            lane.qbytes += size
            lane.peak = max(lane.peak, lane.qbytes)
            if lane.qbytes > self._shaper._queue_limit and not lane.high:
                lane.high = True
                self._update_reading(d)

    def _flush(self, d: int) -> None:
        """Write what is due in direction ``d`` while the destination takes it."""
        lane = self._lanes[d]
        shaper = self._shaper
        now = 0.0
        while (lane.queue and self._connected and not self._dead and not shaper._paused
               and not self._wpaused[1 - d]):
            due, item = lane.queue[0]
            if due > now:
                now = time.monotonic()
                if due > now:
                    self._arm_timer(d, due, now)
                    break
            if item is _EOF:
                lane.queue.popleft()
                self._forward_eof(d)
            elif self._deliver(d, item):
                if self._dead:
                    break  # cut: the teardown emptied the queues
                lane.queue.popleft()
                lane.qbytes -= len(item)
            else:
                break  # held back for a flip: it stays at the head
        if lane.high and lane.qbytes <= shaper._queue_limit // 2:
            lane.high = False
        self._update_reading(d)

    def _arm_timer(self, d: int, due: float, now: float) -> None:
        lane = self._lanes[d]
        if lane.timer is not None:
            if lane.timer_due == due:
                return
            lane.timer.cancel()
        lane.timer_due = due
        lane.timer = self._loop.call_later(max(due - now, _MIN_TIMER), self._on_timer, d)

    def _on_timer(self, d: int) -> None:
        self._lanes[d].timer = None
        self._flush(d)

    def _deliver(self, d: int, data: bytes) -> bool:
        """Write ``data`` on, faults applied; False: held back for a flip, nothing done."""
        shaper = self._shaper
        cut = False
        self._hold[d] = None
        if shaper._flips or shaper._cuts:
            if shaper._flips and self._must_hold(d, len(data)):
                return False
            data, cut = self._apply_faults(d, data)
        self._fwd[d] += len(data)
        shaper._bytes[d] += len(data)
        if data:
            self._ends[1 - d].write(data)  # type: ignore[union-attr]
        if cut:
            shaper.cuts_done += 1
            self._teardown(rst=True)
        return True

    # -- faults -----------------------------------------------------------

    def _cut_point(self, d: int, start: int, end: int) -> _CutRule | None:
        """The earliest armed cut that the chunk ``[start, end)`` of direction ``d`` triggers."""
        found = None
        for rule in self._shaper._cuts:
            if rule.direction == d and start <= rule.nbytes < end:
                if found is None or rule.nbytes < found.nbytes:
                    found = rule
        return found

    def _flip_eligible(self, rule: _FlipRule) -> bool:
        return rule not in self._skip and self._rcvd[0] + self._rcvd[1] > rule.min_conn_bytes

    def _must_hold(self, d: int, size: int) -> bool:
        """Whether the chunk of ``size`` bytes next in direction ``d`` must wait.

        It waits when it carries the offset of an armed flip but this connection has not yet
        carried more than that flip's ``min_conn_bytes``; it stops waiting once it has, or once
        it cannot: the stream ended or the queue is full (the connection is then ineligible for
        that flip).
        """
        start = self._fwd[d]
        end = start + size
        cut = self._cut_point(d, start, end)
        if cut is not None:
            end = cut.nbytes
        for rule in self._shaper._flips:
            if rule.direction != d or not start <= rule.offset < end or self._flip_eligible(rule):
                continue
            if rule in self._skip:
                continue
            if self._eof_in[d] or self._lanes[d].high:
                self._skip.add(rule)
                continue
            self._hold[d] = rule
            return True
        return False

    def _apply_faults(self, d: int, data: bytes) -> tuple[bytes, bool]:
        shaper = self._shaper
        start = self._fwd[d]
        end = start + len(data)
        cut = self._cut_point(d, start, end)
        if cut is not None:
            cut.remaining -= 1
            if cut.remaining <= 0:
                shaper._cuts.remove(cut)
            data = data[: cut.nbytes - start]
            end = cut.nbytes
        for rule in list(shaper._flips):
            if rule.direction != d or not start <= rule.offset < end or not self._flip_eligible(rule):
                continue
            buf = bytearray(data)
            buf[rule.offset - start] ^= 0xFF
            data = bytes(buf)
            shaper._spend_flip(rule)
        return data, cut is not None

    def _forward_eof(self, d: int) -> None:
        self._eof_out[d] = True
        dest = self._ends[1 - d]
        assert dest is not None
        if dest.can_write_eof():
            dest.write_eof()
        else:
            dest.close()
        if all(self._eof_out):  # both halves closed cleanly: close, flushing what is buffered
            self._dead = True
            self._cancel_timers()
            for t in self._ends:
                if t is not None:
                    t.close()

    # -- flow control -----------------------------------------------------

    def _update_reading(self, d: int) -> None:
        """Read side ``d`` only while its lane has room, its destination takes writes and the
        shaper is not paused."""
        t = self._ends[d]
        if t is None or self._lost[d] or self._eof_in[d] or self._dead:
            return
        want = (self._connected and not self._shaper._paused and not self._wpaused[1 - d]
                and not self._lanes[d].high)
        if want != self._reading[d]:
            self._reading[d] = want
            if want:
                t.resume_reading()
            else:
                t.pause_reading()

    def _set_write_paused(self, side: int, paused: bool) -> None:
        self._wpaused[side] = paused
        if paused:
            self._update_reading(1 - side)
        else:
            self._flush(1 - side)

    # -- teardown ---------------------------------------------------------

    def _cancel_timers(self) -> None:
        for lane in self._lanes:
            if lane.timer is not None:
                lane.timer.cancel()
                lane.timer = None

    def _teardown(self, *, rst: bool) -> None:
        """Forward nothing more; close both sides (with an RST when ``rst``)."""
        if not self._dead:
            self._dead = True
            self._cancel_timers()
            for lane in self._lanes:
                lane.queue.clear()
                lane.qbytes = 0
        if self._connect_task is not None:
            self._connect_task.cancel()
        for side, t in enumerate(self._ends):
            if t is not None and not self._lost[side]:
                if rst:
                    _reset(t)
                elif not t.is_closing():
                    t.close()
        self._check_done()

    def _on_lost(self, side: int, exc: Exception | None) -> None:
        self._lost[side] = True
        if self._dead:
            self._check_done()
        else:  # the peer went away on its own: a reset goes on as a reset, a close as a close
            self._teardown(rst=exc is not None)

    def _check_done(self) -> None:
        if self._done.done() or self._connect_task is not None or self._ends[0] is None:
            return
        if all(t is None or lost for t, lost in zip(self._ends, self._lost)):
            self.closed = True
            self._done.set_result(None)
            self._shaper._conn_closed(self)


class Shaper:
    """Relays TCP from ``listen`` to ``target`` with delay, jitter and a rate limit per direction,
    and the faults of the module docstring.

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
        self._target = check_address(*target, what="target")
        if queue_limit < 1:
            raise ValueError("queue_limit must be >= 1 byte")
        self._queue_limit = queue_limit
        self._dirs = (_DirSettings(), _DirSettings())
        self.set_delay(delay_ms, jitter_ms, dist=jitter_dist)
        self.set_rate(rate_Bps)
        self._loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._server: asyncio.AbstractServer | None = None
        self._closing = False
        self._close_task: asyncio.Task[None] | None = None
        self._live: set[ShapedConn] = set()
        self._rejecting: set[asyncio.Future[None]] = set()
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._accepted = 0
        self._bytes = [0, 0]
        self._paused = False
        self._reject = False
        self._flips: list[_FlipRule] = []
        self._cuts: list[_CutRule] = []
        self.connections: collections.deque[ShapedConn] = collections.deque(maxlen=keep_conns)
        self.flips_done = 0
        self.cuts_done = 0
        self.rejected = 0  # connections reset at once by reject_new(True)
        self.address: tuple[str, int] = self._listen

    @property
    def port(self) -> int:
        """The port listened on (the real one once started)."""
        return self.address[1]

    # -- settings ---------------------------------------------------------

    def set_delay(
        self, ms: float, jitter_ms: float = 0.0, *, dist: JitterDist = "uniform", direction: Direction = "both"
    ) -> None:
        """One-way delay and jitter in ms for chunks read from now on (order is always kept)."""
        if not all(math.isfinite(v) and v >= 0 for v in (ms, jitter_ms)):
            raise ValueError(f"delay and jitter must be finite and >= 0 ms, not {ms} and {jitter_ms}")
        if dist not in ("uniform", "normal"):
            raise ValueError(f"jitter distribution must be 'uniform' or 'normal', not {dist!r}")
        for d in _dirs_of(direction):
            cfg = self._dirs[d]
            cfg.delay, cfg.jitter, cfg.dist = ms / 1e3, jitter_ms / 1e3, dist

    def set_rate(self, Bps: float | None, *, direction: Direction = "both") -> None:
        """Rate limit in bytes/s for chunks read from now on; None (or 0) removes it."""
        if Bps is not None and not (math.isfinite(Bps) and Bps >= 0):
            raise ValueError(f"rate must be > 0 bytes/s or None, not {Bps}")
        for d in _dirs_of(direction):
            cfg = self._dirs[d]
            cfg.rate = float(Bps) if Bps else None
            cfg.burst = max(cfg.rate * _BURST_S, _MIN_BURST) if cfg.rate else 0.0
            lo, hi = _QUANTUM_RANGE
            cfg.quantum = int(min(max(cfg.rate * _QUANTUM_S, lo), hi)) if cfg.rate else 0

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
        self._flips.append(_FlipRule(offset, _one_direction(direction), min_conn_bytes))

    def cut_after(self, nbytes: int, *, direction: str = "c2s", count: int = 1) -> None:
        """Reset the next ``count`` connections whose ``direction`` stream passes ``nbytes``.

        Exactly the first ``nbytes`` bytes are forwarded (as with any RST, bytes still in flight
        may be lost), nothing after; then both sides are reset.  A connection already past
        ``nbytes`` when this is called does not count.
        """
        if nbytes < 0 or count < 1:
            raise ValueError("need nbytes >= 0 and count >= 1")
        self._cuts.append(_CutRule(nbytes, _one_direction(direction), count))

    def pause(self) -> None:
        """Stop forwarding: stop reading both sides; held data waits in kernel buffers."""
        self._paused = True
        for conn in list(self._live):
            conn._update_reading(0)
            conn._update_reading(1)

    def resume(self) -> None:
        self._paused = False
        for conn in list(self._live):
            conn._flush(0)
            conn._flush(1)

    def abort_all(self) -> None:
        """Reset every live connection (link drop).  The listener stays up."""
        for conn in list(self._live):
            conn._teardown(rst=True)

    def reject_new(self, flag: bool) -> None:
        """While True, new connections are accepted and reset at once (link down)."""
        self._reject = bool(flag)

    def _spend_flip(self, rule: _FlipRule) -> None:
        self._flips.remove(rule)
        self.flips_done += 1
        for conn in self._live:
            for d in (0, 1):
                if conn._hold[d] is rule:  # spent elsewhere: let the held stream go, unflipped
                    self._loop.call_soon(conn._flush, d)

    # -- stats ------------------------------------------------------------

    @property
    def stats(self) -> ShaperStats:
        queued = sum(conn.queued for conn in self._live)
        return ShaperStats(self._accepted, len(self._live), self._bytes[0], self._bytes[1], queued)

    def _conn_closed(self, conn: ShapedConn) -> None:
        self._live.discard(conn)

    async def wait_connections(self, n: int, timeout: float | None = 10) -> list[ShapedConn]:
        """Once at least ``n`` connections were accepted, the kept ones (TimeoutError otherwise)."""
        if self._accepted < n:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append((n, fut))
            await asyncio.wait_for(fut, timeout)
        return list(self.connections)

    # -- lifecycle --------------------------------------------------------

    def _accept(self) -> asyncio.Protocol:
        if self._reject or self._closing:
            return _Rejected(self)
        conn = ShapedConn(self, self._accepted)
        self._accepted += 1
        self._live.add(conn)
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
        return _End(conn, 0)

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("shaper already started")
        self._loop = asyncio.get_running_loop()
        host, port = self._listen
        self._server = await self._loop.create_server(self._accept, host, port)
        self.address = self._server.sockets[0].getsockname()[:2]
        log.info("shaper listening", listen=f"{self.address[0]}:{self.address[1]}",
                 target=f"{self._target[0]}:{self._target[1]}")

    async def close(self) -> None:
        """Stop listening and reset every live connection (the link goes away).  Idempotent;
        concurrent calls all return once it is done."""
        if self._server is None:
            return
        if self._close_task is None:
            self._close_task = self._loop.create_task(self._close(self._server))
        await asyncio.shield(self._close_task)

    async def _close(self, server: asyncio.AbstractServer) -> None:
        self._closing = True
        server.close()
        conns = list(self._live)
        for conn in conns:
            conn._teardown(rst=True)
        pending = [c._done for c in conns] + list(self._rejecting)
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


# -- CLI -------------------------------------------------------------------


def _endpoint(what: str, listen: bool = False):
    def parse(text: str) -> tuple[str, int]:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
        try:
            return check_address(host, int(port), what=what, listen=listen)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = "HOST:PORT"
    return parse


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {text}")
    return value


def _positive(text: str) -> float:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m pdd_tools.shaper",
        description="TCP relay adding one-way delay, jitter and a rate limit (loopback/private only)",
    )
    ap.add_argument("--listen", required=True, type=_endpoint("listen address", listen=True),
                    metavar="HOST:PORT", help="where to listen (port 0: any free port)")
    ap.add_argument("--target", required=True, type=_endpoint("target"), metavar="HOST:PORT",
                    help="where to connect for each accepted connection")
    ap.add_argument("--delay-ms", type=_non_negative, default=0.0, help="one-way delay, each direction")
    ap.add_argument("--jitter-ms", type=_non_negative, default=0.0, help="jitter around the delay")
    ap.add_argument("--jitter-dist", choices=("uniform", "normal"), default="uniform")
    ap.add_argument("--rate-mbit", type=_positive, help="rate limit, Mbit/s (10^6 bit/s), each direction")
    ap.add_argument("--queue-mib", type=_positive, default=QUEUE_LIMIT / (1 << 20),
                    help="delay queue bound per direction")
    ap.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return ap


async def _serve(args: argparse.Namespace) -> int:
    shaper = Shaper(
        args.listen,
        args.target,
        delay_ms=args.delay_ms,
        jitter_ms=args.jitter_ms,
        jitter_dist=args.jitter_dist,
        rate_Bps=args.rate_mbit * 1e6 / 8 if args.rate_mbit else None,
        queue_limit=int(args.queue_mib * (1 << 20)),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await shaper.start()
    except OSError as exc:
        log.error("cannot listen", listen=args.listen, error=str(exc))
        return 1
    host, port = shaper.address
    print(f"shaper listening on {host}:{port} -> {args.target[0]}:{args.target[1]}", flush=True)
    try:
        await stop.wait()
    finally:
        await shaper.close()
    s = shaper.stats
    log.info("shaper stopped", connections=s.connections, bytes_c2s=s.bytes_c2s, bytes_s2c=s.bytes_s2c)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from pdd_wire import log as logmod

    logmod.configure(args.log_level)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_serve(args))
    return uvloop.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())
