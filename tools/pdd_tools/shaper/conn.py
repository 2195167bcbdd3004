"""One shaped connection (:class:`ShapedConn`): a client's socket and its socket to the target,
the bytes between them held to their due times, the armed faults applied as they are written."""

from __future__ import annotations

import asyncio
import collections
import socket
import time
from typing import Any

import structlog

from .link import CutRule, FlipRule, Link, reset

log = structlog.get_logger("pdd_tools.shaper")

_EOF = object()  # queue marker: the source half-closed after the data queued before it
_MIN_TIMER = 0.001  # uvloop rounds timers to whole milliseconds; a release is re-checked anyway


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


class ShapedConn:
    """A client connection and its connection to the target; direction d is read from side d
    (0: c2s, the client's bytes to the target; 1: s2c)."""

    def __init__(self, link: Link, loop: asyncio.AbstractEventLoop, index: int) -> None:
        self._link = link
        self.index = index  # the how-manieth accepted connection, from 0
        self._loop = loop
        self._ends: list[asyncio.Transport | None] = [None, None]
        self._lost = [False, False]
        self._reading = [True, True]  # what was last asked of each transport
        self._wpaused = [False, False]  # that side's transport asked us to stop writing
        self._eof_in = [False, False]  # that side half-closed
        self._eof_out = [False, False]  # EOF forwarded in that direction
        self._lanes = (_Lane(), _Lane())
        self._fwd = [0, 0]  # bytes forwarded per direction
        self._rcvd = [0, 0]  # bytes read from each side
        self._hold: list[FlipRule | None] = [None, None]  # direction held back for a flip
        self._skip: set[FlipRule] = set()  # flips this connection cannot take any more
        self._connected = False
        self._dead = False  # torn down (or tearing down): forward nothing more
        self._connect_task: asyncio.Task[Any] | None = None
        self.done: asyncio.Future[None] = loop.create_future()  # set once both sides are closed
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
        await asyncio.wait_for(asyncio.shield(self.done), timeout)

    def client_protocol(self) -> asyncio.Protocol:
        """The protocol for the accepted client's socket (side 0); the target's is made here."""
        return _End(self, 0)

    def gate_changed(self) -> None:
        """The shaper was paused or resumed: stop reading, or forward what waits and read on."""
        for d in (0, 1):
            if self._link.paused:
                self._update_reading(d)
            else:
                self._flush(d)

    def release_hold(self, rule: FlipRule) -> None:
        """``rule`` was spent on another connection: a stream held back for it goes on, unflipped."""
        for d in (0, 1):
            if self._hold[d] is rule:
                self._loop.call_soon(self._flush, d)

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
            reset(transport)
        elif side == 0:  # read nothing from the client until the target answers
            self.peername = transport.get_extra_info("peername")
            self._reading[0] = False
            transport.pause_reading()
            host, port = self._link.target
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
            log.warning("target connect failed", target=self._link.target, error=str(self.error))
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
        elif (self._lanes[side].queue or self._link.dirs[side].shapes() or self._link.paused
              or self._wpaused[1 - side] or not self._deliver(side, data)):
            self._enqueue_data(side, data)
            self._flush(side)
        # else: the fast path, written at once
        if self._hold[1 - side] is not None:
            self._flush(1 - side)  # that direction waits for this connection to carry more

    def _enqueue_data(self, d: int, data: bytes) -> None:
        step = self._link.dirs[d].quantum
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
        cfg = self._link.dirs[d]
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
            if lane.qbytes > self._link.queue_limit and not lane.high:
                lane.high = True
                self._update_reading(d)

    def _flush(self, d: int) -> None:
        """Write what is due in direction ``d`` while the destination takes it."""
        lane = self._lanes[d]
        link = self._link
        now = 0.0
        while (lane.queue and self._connected and not self._dead and not link.paused
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
        if lane.high and lane.qbytes <= link.queue_limit // 2:
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
        link = self._link
        cut = False
        self._hold[d] = None
        if link.flips or link.cuts:
            if link.flips and self._must_hold(d, len(data)):
                return False
            data, cut = self._apply_faults(d, data)
        self._fwd[d] += len(data)
        link.forwarded[d] += len(data)
        if data:
            self._ends[1 - d].write(data)  # type: ignore[union-attr]
        if cut:
            self._teardown(rst=True)
        return True

    # -- faults -----------------------------------------------------------

    def _cut_point(self, d: int, start: int, end: int) -> CutRule | None:
        """The earliest armed cut that the chunk ``[start, end)`` of direction ``d`` triggers."""
        found = None
        for rule in self._link.cuts:
            if rule.direction == d and start <= rule.nbytes < end:
                if found is None or rule.nbytes < found.nbytes:
                    found = rule
        return found

    def _flip_eligible(self, rule: FlipRule) -> bool:
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
        for rule in self._link.flips:
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
        link = self._link
        start = self._fwd[d]
        end = start + len(data)
        cut = self._cut_point(d, start, end)
        if cut is not None:
            link.spend_cut(cut)
            data = data[: cut.nbytes - start]
            end = cut.nbytes
        for rule in list(link.flips):
            if rule.direction != d or not start <= rule.offset < end or not self._flip_eligible(rule):
                continue
            buf = bytearray(data)
            buf[rule.offset - start] ^= 0xFF
            data = bytes(buf)
            link.spend_flip(rule)
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
        want = (self._connected and not self._link.paused and not self._wpaused[1 - d]
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
                    reset(t)
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
        if self.done.done() or self._connect_task is not None or self._ends[0] is None:
            return
        if all(t is None or lost for t, lost in zip(self._ends, self._lost)):
            self.closed = True
            self.done.set_result(None)
            self._link.live.discard(self)


