"""A user-space TCP shaping relay: one-way delay, jitter and a rate limit, per direction.

Why: the demo and the fault-injection suite want two "datacenters" 20 ms apart on one machine,
and this kernel has no ``netem`` qdisc (``tbf`` and ``htb`` exist, see :mod:`pdd_tools.netns`,
but neither delays packets).  So the WAN's latency is added here, above TCP: a :class:`Shaper`
listens on ``listen`` and, for every accepted connection, connects to ``target`` and copies
bytes both ways.  "c2s" is the direction from whoever connected to the shaper to the target,
"s2c" the other one.

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

Memory is bounded: a side stops being read while more than ``queue_limit`` bytes wait in its
delay queue (reading resumes below half of it) and while the transport it feeds is paused for
writing (``pause_writing`` / ``resume_writing``).  Throughput under delay is thus capped at
about ``queue_limit / delay`` (8 MiB / 20 ms = 400 MiB/s by default); kernel socket buffers
add to what is in flight.  EOF is forwarded, in order and delayed like data, as a half-close;
a reset on one side is passed on at once as a reset (SO_LINGER 0) on the other.

Settings can be changed at any time (:meth:`Shaper.set_delay`, :meth:`Shaper.set_rate`) and
apply to the chunks read from then on, on live connections too.  Only loopback and private
addresses (127/8, 10/8, 172.16/12, 192.168/16, ::1) may be listened on or targeted: this is a
test tool and must never relay to, or be reachable from, the outside.

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

__all__ = ["Shaper", "ShaperStats", "check_address", "main"]

log = structlog.get_logger("pdd_tools.shaper")

Direction = Literal["c2s", "s2c", "both"]
JitterDist = Literal["uniform", "normal"]

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


class _Lane:
    """One direction of one connection: the chunks waiting for their due time."""

    __slots__ = ("high", "last_due", "qbytes", "queue", "timer", "timer_due", "tx_clock")

    def __init__(self) -> None:
        self.queue: collections.deque[tuple[float, Any]] = collections.deque()
        self.qbytes = 0
        self.last_due = 0.0  # due time of the latest chunk queued: no chunk is due earlier
        self.tx_clock = 0.0  # token bucket virtual clock
        self.high = False  # over queue_limit: its source is not read
        self.timer: asyncio.TimerHandle | None = None
        self.timer_due = 0.0


class _End(asyncio.Protocol):
    """Protocol for one socket of a shaped connection: side 0 faces the client, 1 the target."""

    __slots__ = ("_conn", "_side")

    def __init__(self, conn: _Conn, side: int) -> None:
        self._conn = conn
        self._side = side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._conn.on_made(self._side, transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        self._conn.on_data(self._side, data)

    def eof_received(self) -> bool:
        self._conn.on_eof(self._side)
        return True  # half-close: keep the transport open for the other direction

    def pause_writing(self) -> None:
        self._conn.set_write_paused(self._side, True)

    def resume_writing(self) -> None:
        self._conn.set_write_paused(self._side, False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._conn.on_lost(self._side, exc)


class _Conn:
    """A client connection and its connection to the target; direction d is read from side d."""

    def __init__(self, shaper: Shaper) -> None:
        self._shaper = shaper
        self._loop = shaper._loop
        self._ends: list[asyncio.Transport | None] = [None, None]
        self._lost = [False, False]
        self._reading = [True, True]  # what was last asked of each transport
        self._wpaused = [False, False]  # that side's transport asked us to stop writing
        self._eof_in = [False, False]  # that side half-closed
        self._eof_out = [False, False]  # EOF forwarded in that direction
        self._lanes = (_Lane(), _Lane())
        self._connected = False
        self._dead = False
        self._connect_task: asyncio.Task[Any] | None = None
        self.done: asyncio.Future[None] = self._loop.create_future()

    # -- setup ------------------------------------------------------------

    def on_made(self, side: int, transport: asyncio.Transport) -> None:
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
            log.warning("target connect failed", target=self._shaper._target, error=str(task.exception()))
            self.teardown(rst=True)
        self._check_done()

    # -- data path --------------------------------------------------------

    def on_data(self, side: int, data: bytes) -> None:
        if self._dead:
            return
        if not self._connected:
            # uvloop starts reading after connection_made, undoing its pause_reading: pause
            # again, so that at most this chunk waits for the target.
            self._enqueue_data(side, data)
            self._reading[side] = False
            self._ends[side].pause_reading()  # type: ignore[union-attr]
        elif self._lanes[side].queue or self._shaper._dirs[side].shapes() or self._wpaused[1 - side]:
            self._enqueue_data(side, data)
            self._flush(side)
        else:
            self._write(side, data)  # the fast path: nothing to wait for

    def _enqueue_data(self, d: int, data: bytes) -> None:
        step = self._shaper._dirs[d].quantum
        if step and len(data) > step:  # rate-limited: smooth, not one lump per read
            for off in range(0, len(data), step):
                self._enqueue(d, data[off:off + step])
        else:
            self._enqueue(d, data)

    def on_eof(self, side: int) -> None:
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
            if lane.qbytes > self._shaper._queue_limit and not lane.high:
                lane.high = True
                self._update_reading(d)

    def _flush(self, d: int) -> None:
        """Write what is due in direction ``d`` while the destination takes it."""
        lane = self._lanes[d]
        now = 0.0
        while lane.queue and self._connected and not self._dead and not self._wpaused[1 - d]:
            due, item = lane.queue[0]
            if due > now:
                now = time.monotonic()
                if due > now:
                    self._arm_timer(d, due, now)
                    break
            lane.queue.popleft()
            if item is _EOF:
                self._forward_eof(d)
            else:
                lane.qbytes -= len(item)
                self._write(d, item)
        if lane.high and lane.qbytes <= self._shaper._queue_limit // 2:
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

    def queued(self) -> int:
        return self._lanes[0].qbytes + self._lanes[1].qbytes

    def _write(self, d: int, data: bytes) -> None:
        self._shaper._count(d, len(data))
        self._ends[1 - d].write(data)  # type: ignore[union-attr]

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
        """Read side ``d`` only while its lane has room and its destination takes writes."""
        t = self._ends[d]
        if t is None or self._lost[d] or self._eof_in[d] or self._dead:
            return
        want = self._connected and not self._wpaused[1 - d] and not self._lanes[d].high
        if want != self._reading[d]:
            self._reading[d] = want
            if want:
                t.resume_reading()
            else:
                t.pause_reading()

    def set_write_paused(self, side: int, paused: bool) -> None:
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

    def teardown(self, *, rst: bool) -> None:
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

    def on_lost(self, side: int, exc: Exception | None) -> None:
        self._lost[side] = True
        if self._dead:
            self._check_done()
        else:  # the peer went away on its own: a reset goes on as a reset, a close as a close
            self.teardown(rst=exc is not None)

    def _check_done(self) -> None:
        if self.done.done() or self._connect_task is not None or self._ends[0] is None:
            return
        if all(t is None or lost for t, lost in zip(self._ends, self._lost)):
            self.done.set_result(None)
            self._shaper._conn_closed(self)


def _dirs_of(direction: Direction) -> tuple[int, ...]:
    try:
        return _DIRECTIONS[direction]
    except KeyError:
        raise ValueError(f"direction must be 'c2s', 's2c' or 'both', not {direction!r}") from None


class Shaper:
    """Relays TCP from ``listen`` to ``target`` with delay, jitter and a rate limit per direction.

    ``delay_ms``, ``jitter_ms``, ``jitter_dist`` and ``rate_Bps`` set both directions; change
    them, per direction if need be, with :meth:`set_delay` and :meth:`set_rate`.  Use as
    ``async with Shaper(...) as sh:``; ``sh.address`` is the ``(host, port)`` to connect to.
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
        queue_limit: int = 8 << 20,
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
        self._conns: set[_Conn] = set()
        self._accepted = 0
        self._bytes = [0, 0]
        self.address: tuple[str, int] = self._listen

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

    # -- stats ------------------------------------------------------------

    @property
    def stats(self) -> ShaperStats:
        queued = sum(conn.queued() for conn in self._conns)
        return ShaperStats(self._accepted, len(self._conns), self._bytes[0], self._bytes[1], queued)

    def _count(self, d: int, n: int) -> None:
        self._bytes[d] += n

    def _conn_closed(self, conn: _Conn) -> None:
        self._conns.discard(conn)

    # -- lifecycle --------------------------------------------------------

    def _accept(self) -> asyncio.Protocol:
        conn = _Conn(self)
        self._conns.add(conn)
        self._accepted += 1
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
        """Stop listening and reset every live connection (the link goes away).  Idempotent."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.close()
        conns = list(self._conns)
        for conn in conns:
            conn.teardown(rst=True)
        if conns:
            await asyncio.wait([c.done for c in conns], timeout=5)
        await server.wait_closed()

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
    ap.add_argument("--queue-mib", type=_positive, default=8.0, help="delay queue bound per direction")
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
