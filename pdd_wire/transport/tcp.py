"""TCP (and TLS) connections between agents: the control lane and the bulk lanes.

Two kinds of connection share one listening port, told apart by an 8-byte plaintext
preamble (``proto/handshake.md``) sent before TLS starts, so the acceptor can hand the
socket to the event loop that will own it before any TLS state exists:

* the **control** connection lives on the agent's main loop (TCP_NODELAY) and carries the
  handshake, control, token-ID and ack frames;
* **bulk** connections live on :class:`BulkLoop` threads, each with its own uvloop, so KV
  I/O never holds the main loop. Measured here: bulk sends on the control loop delay a
  64-byte ping by p99 0.3-0.5 s; on another thread, whose socket calls and xxh3 release
  the GIL (a bulk thread holds it ~8% of its CPU), the ping waits only for a core and for
  the main loop's own ack work (docs/benchmarks.md, "Token frames under load"). A plaintext
  bulk connection writes its chunks with ``os.writev`` for that reason: uvloop's transport
  makes its first write attempt holding the GIL (``FrameProtocol._write_now``).

Receiving bulk frames uses :class:`asyncio.BufferedProtocol` with the frame reader's
payload sink, so KV bytes go from the kernel straight into the receiver's registered memory.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import struct
import time
from collections.abc import Callable, Iterator

import structlog

from ..errors import ErrorCode, ProtocolError, TransportError
from ..wire import INLINE_MAX, FrameReader, FrameType, encode_body, encode_bytes
from ..wire.frame import Frame, PayloadSink
from ..wire.messages import Error
from .base import Connector
from .tls import peer_certificate_names, tls_error

_log = structlog.get_logger("pdd_wire.transport")

PREAMBLE = struct.Struct("<4sBBH")
PREAMBLE_MAGIC = b"PDDW"
KIND_CONTROL = ord("C")
KIND_BULK = ord("B")
PREAMBLE_VERSION = 1
#: Frames of one control connection handled per loop turn (however many reads libuv makes of it
#: in one wake-up: up to 32), the rest waiting for the next turn with reading paused, so other
#: connections' frames, timers and engine requests come between: about half a millisecond of
#: handling here. A connection's own frames keep their order.
FRAMES_PER_TURN = 32
#: ... and no more frames once this much of the turn went on the connection's frames: a peer
#: whose frames each cost much (a TOKENS of 200,000 IDs, a PREFIX_QUERY of 65,536 hashes) gives
#: the loop back after each, not after 32 (which held other peers' frames 50-135 ms in an audit).
TURN_BUDGET_S = 0.001
#: The least TCP_USER_TIMEOUT given a connection: a receiver may hold a bulk connection's reading
#: for up to 2 s (a chunk waiting for its KV_BEGIN, proto/transfer.md §7), and a window shut that
#: long must not end the flow at the sender.
USER_TIMEOUT_MIN_S = 3.0
try:  # buffers in one os.writev (a chunk of an engine's paged KV can be a view per layer page)
    _IOV_MAX = os.sysconf("SC_IOV_MAX")
except (ValueError, OSError):
    _IOV_MAX = 1024


def _cut(buffers: list, n: int) -> list:
    """``buffers`` without their first ``n`` bytes (a view cut in bytes, whatever its format)."""
    rest = []
    for i, b in enumerate(buffers):
        size = memoryview(b).nbytes
        if n >= size:
            n -= size
            continue
        rest.append(memoryview(b).cast("B")[n:] if n else b)
        rest.extend(buffers[i + 1:])
        break
    return rest


def preamble(kind: int) -> bytes:
    return PREAMBLE.pack(PREAMBLE_MAGIC, kind, PREAMBLE_VERSION, 0)


def parse_preamble(raw: bytes) -> int:
    magic, kind, ver, reserved = PREAMBLE.unpack(raw)
    if magic != PREAMBLE_MAGIC or kind not in (KIND_CONTROL, KIND_BULK) or reserved != 0:
        raise ProtocolError(f"bad connection preamble {raw!r}", ErrorCode.BAD_MAGIC)
    if ver != PREAMBLE_VERSION:
        raise ProtocolError(f"preamble version {ver} not supported", ErrorCode.UNSUPPORTED_FRAME_VERSION)
    return kind


def error_frame(code: int, message: str) -> bytes:
    return encode_bytes(FrameType.ERROR, encode_body(Error(int(code), message[:512])))


def tune_socket(sock: socket.socket, *, nodelay: bool, user_timeout_s: float = 0.0) -> None:
    """``user_timeout_s`` > 0: TCP_USER_TIMEOUT (RFC 5482), so the kernel ends a connection whose
    data has gone unacknowledged, or whose peer's window has stayed shut, that long (a flow
    blackholed on its path) instead of retrying for some 15 minutes."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return  # a socket pair within the process (transport.inproc)
    if nodelay:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if user_timeout_s > 0 and hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(user_timeout_s * 1000)))


#: What a control connection reads: frame payloads only on inline KV_CHUNKs (inline.v1).
CONTROL_PAYLOAD_TYPES = frozenset({FrameType.KV_CHUNK})


def control_protocol(*, max_body: int, max_unsent: int, stall_s: float = 0.0) -> "FrameProtocol":
    """A control connection's protocol: frames up to ``max_body``, payloads only on an inline
    KV_CHUNK (at most INLINE_MAX, accepted once a session sets ``payload_sink``)."""
    return FrameProtocol(max_body=max_body, max_payload=INLINE_MAX, max_unsent=max_unsent,
                         payload_types=CONTROL_PAYLOAD_TYPES, stall_s=stall_s)


class FrameProtocol(asyncio.BufferedProtocol):
    """One framed connection. ``on_frame(conn, frame)`` runs on the owning loop for each frame;
    ``on_lost(conn, exc)`` once when the connection ends. A framing error sends an ERROR frame,
    aborts this connection (its stream is never reused), and reports it through ``on_lost``.

    Control connections read in 64 KiB gulps (many frames per syscall); bulk connections read
    each frame part straight into the buffer :meth:`FrameReader.buffer` names (zero copy).

    Control connections also *write* once per loop turn: :meth:`send` queues the frame and the
    first send of a turn schedules one flush (``call_soon``), which hands every frame of the
    turn to the transport as one buffer: one TLS record and one ``send`` syscall for, say, all
    the KV_ACKs of the chunks that landed in that turn, instead of one each (the receiver's
    loop spent 55% of its time acknowledging chunks one write at a time, docs/benchmarks.md
    "CPU per byte"). Order is kept (frames go in the order sent, and :meth:`fail`,
    :meth:`close` and :meth:`abort` flush the queue before what they do), queued bytes count
    toward ``max_unsent``, and a frame sent to a closed connection raises at once, as before.
    Bulk connections write each frame at once (a chunk is its own large write).
    """

    def __init__(self, *, max_body: int, max_payload: int, sink: PayloadSink | None = None,
                 bulk: bool = False, max_unsent: int = 0, payload_types: frozenset[int] | None = None,
                 stall_s: float = 0.0) -> None:
        #: > 0: TCP_USER_TIMEOUT of that long (at least USER_TIMEOUT_MIN_S), and on a bulk
        #: connection a read deadline: no byte for that long in the middle of a frame ends the
        #: connection (:meth:`_watch_stall`).
        self.stall_s = stall_s
        self._rx_at = 0.0  # a bulk connection's last read (monotonic)
        self._stall_timer: asyncio.TimerHandle | None = None
        self._stall_seen = False  # the last check found it stalled: judged on the next, after a poll
        #: Where frame payloads land (``max_payload`` > 0); may be set once the connection is
        #: known (a control connection's inline chunks). None: a payload is refused.
        self.payload_sink = sink
        self.reader = FrameReader(max_body=max_body, max_payload=max_payload,
                                  sink=self._sink if max_payload else None, payload_types=payload_types)
        self.bulk = bulk
        self.max_unsent = max_unsent  # 0: no cap (bulk connections: the credit window bounds them)
        self.transport: asyncio.Transport | None = None
        self.on_frame: Callable[["FrameProtocol", Frame], None] = lambda c, f: None
        self.on_lost: Callable[["FrameProtocol", BaseException | None], None] = lambda c, e: None
        #: Told the code of a framing error (bad magic, header check, size, type, lane, ...) found
        #: in what the peer sent, before the connection fails with it: the owner counts it.
        self.on_framing_error: Callable[[ErrorCode], None] | None = None
        self.closed = False
        self._ending = False  # this side failed, closed or aborted it: no frame of it is handled any more
        self.error: BaseException | None = None
        self._gulp_view = memoryview(bytearray(0 if bulk else 64 * 1024))  # a control connection's reads
        self._gulp_frames: Iterator[Frame] | None = None  # the read's frames not yet handled (_handle_gulp)
        self._gulp_paused = False  # reading paused until they are
        self._turn = 0  # frames handled in this loop turn
        self._turn_t0 = 0.0  # when the first of them began
        self.connected = asyncio.get_event_loop().create_future()
        self.peer_names: set[str] = set()
        self._close_callbacks: list[Callable[[], None]] = []
        self.coalesce = not bulk
        self._queue: list[bytes | memoryview] = []  # frames sent this loop turn, not yet written
        self._queued = 0  # their bytes
        self._flush_due = False  # a flush is scheduled for the end of this turn
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1  # the socket, for a plaintext bulk connection's direct writes (connection_made)
        #: Called when the turn's frames are about to be written (also by fail/close/abort), while
        #: the connection is open; it may send more (a session's ranged acks, :meth:`flush_soon`).
        self.on_flush: Callable[[], None] | None = None
        #: Set by a paced writer waiting for :meth:`paced_room`: called, while the connection is
        #: open, after each write that left the transport below its high-water mark and when a
        #: full one drained to its low-water mark (a control connection's marks are 1/4 and 1/8 of
        #: ``max_unsent``, below the paced share: a writer that ran out of room is always called).
        self.on_drain: Callable[[], None] | None = None
        self._writing_paused = False
        self._abort_later: asyncio.TimerHandle | None = None  # fail()'s bound on a peer that does not read

    def _sink(self, header, body):
        if self.payload_sink is None:
            raise ProtocolError(f"a payload on frame type {header.type}: not accepted on this connection now "
                                "(an inline KV_CHUNK needs an established session and inline.v1)",
                                ErrorCode.UNEXPECTED_FRAME)
        return self.payload_sink(header, body)

    def add_close_callback(self, cb: Callable[[], None]) -> None:
        """``cb()`` runs (on this connection's loop) once the connection has ended."""
        if self.closed:
            cb()
        else:
            self._close_callbacks.append(cb)

    # asyncio callbacks ----------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self._loop = asyncio.get_running_loop()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            tune_socket(sock, nodelay=True, user_timeout_s=max(self.stall_s, USER_TIMEOUT_MIN_S) if self.stall_s else 0)
        if self.bulk and self.stall_s > 0:
            self._rx_at = time.monotonic()
            self._stall_timer = self._loop.call_at(self._loop.time() + self.stall_s, self._watch_stall)
        # A plaintext bulk connection writes its chunks itself (_write_now); TLS ones through the
        # transport, which encrypts.
        self._fd = (sock.fileno() if self.bulk and sock is not None and transport.get_extra_info("ssl_object") is None
                    else -1)
        self.peer_names = peer_certificate_names(transport)
        if self.max_unsent and self.coalesce:  # see on_drain
            transport.set_write_buffer_limits(high=self.max_unsent // 4, low=self.max_unsent // 8)
        if not self.connected.done():
            self.connected.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.bulk:
            return self.reader.buffer()
        return self._gulp_view

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self.bulk:
                self._rx_at = time.monotonic()
                frame = self.reader.advance(nbytes)
                if frame is not None and not self.closed and not self._ending:
                    self.on_frame(self, frame)
            else:
                # Each frame is handled as soon as it is complete, before the next is read: the
                # payload sink of an inline KV_CHUNK must see the KV_BEGIN that came before it.
                self._gulp_frames = self.reader.frames(self._gulp_view[:nbytes])
                self._handle_gulp()
        except ProtocolError as exc:
            self._framing_failed(exc)

    def _handle_gulp(self, cap: bool = True) -> None:
        """Handle the current read's frames, at most :data:`FRAMES_PER_TURN` of this connection in
        this loop turn, and none once they took :data:`TURN_BUDGET_S` (``cap``): past that,
        reading pauses (the read's bytes stay where they are) and the rest waits for the next
        turn, so that one peer's burst of small frames (a 64 KiB read is some 1,300 PINGs), or of
        costly ones, does not hold other connections' frames behind it. Frames the peer sent
        before it closed are still handled; none after this side ended the connection."""
        loop = asyncio.get_running_loop()
        while (frames := self._gulp_frames) is not None and not (self.closed or self._ending):
            if cap and self._turn and (self._turn >= FRAMES_PER_TURN
                                       or time.perf_counter() - self._turn_t0 >= TURN_BUDGET_S):  # share taken
                if not self._gulp_paused and self.transport is not None and not self.transport.is_closing():
                    self._gulp_paused = True
                    self.transport.pause_reading()
                loop.call_soon(self._more_of_gulp)
                return
            frame = next(frames, None)
            if frame is None:
                break
            if not self._turn:
                loop.call_soon(self._new_turn)
                self._turn_t0 = time.perf_counter()
            self._turn += 1
            self.on_frame(self, frame)
        self._gulp_frames = None
        if self._gulp_paused:
            self._gulp_paused = False
            if not (self.closed or self._ending) and self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()

    def _new_turn(self) -> None:
        self._turn = 0

    def _more_of_gulp(self) -> None:
        try:
            self._handle_gulp()
        except ProtocolError as exc:
            self._framing_failed(exc)
        except Exception:  # a handler's bug: end the connection, as the transport does for one in a read
            _log.exception("control connection: frame handler failed")
            self.abort()

    def drop_rest_of_read(self) -> None:
        """Read the frames left of the current read and drop them (a handshake's first frame must
        come alone: proto/handshake.md §2)."""
        frames, self._gulp_frames = self._gulp_frames, None
        for _ in frames or ():
            pass

    def _watch_stall(self) -> None:
        """A bulk connection in the middle of a frame that got no byte for ``stall_s`` while it
        was reading is a stalled flow (blackholed on its path, the peer's TCP gone): it is
        aborted, which ends its claim on the chunk (another connection can land it) and has the
        dialer dial the stream again. Between frames, or paused (a chunk held for its KV_BEGIN),
        silence is no stall. A stall is judged twice, 50 ms apart: libuv runs due timers before it
        polls the sockets, so after this process did not run (stopped, starved) bytes that came
        meanwhile are read before the verdict."""
        self._stall_timer = None
        if self.closed or self.transport is None:
            return
        loop, now = asyncio.get_running_loop(), time.monotonic()
        stalled = now - self._rx_at >= self.stall_s
        if self.reader.idle or not self.transport.is_reading():
            self._rx_at, stalled = now, False  # silence that is no stall: the clock starts again from here
        elif stalled and self._stall_seen:
            self.error = TransportError(f"no byte for {now - self._rx_at:.1f} s in the middle of a frame "
                                        f"(timeouts.dead_after_s {self.stall_s:g}): the flow is stalled")
            self.abort()
            return
        self._stall_seen = stalled
        delay = 0.05 if stalled else self._rx_at + self.stall_s - now
        self._stall_timer = loop.call_later(delay, self._watch_stall)

    def _framing_failed(self, exc: ProtocolError) -> None:
        self._gulp_frames = None
        if self.on_framing_error is not None:
            try:
                self.on_framing_error(exc.code)
            except Exception:  # counting must not keep the connection from failing
                _log.exception("framing error callback failed")
        self.fail(exc)

    def eof_received(self) -> bool:
        return False

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._drained()

    def _drained(self) -> None:
        if self.on_drain is not None and not self._writing_paused and self._open():
            try:
                self.on_drain()
            except Exception:  # a bug there must not stop this connection's writes
                _log.exception("control connection: drain callback failed")

    def connection_lost(self, exc) -> None:
        if self._gulp_frames is not None:  # what the peer sent before it closed, in order
            try:
                self._handle_gulp(cap=False)
            except Exception:  # the connection is gone: a broken tail has no one to tell
                self._gulp_frames = None
        if self._stall_timer is not None:  # it would hold this protocol until it fires
            self._stall_timer.cancel()
            self._stall_timer = None
        first = not self.closed
        self.closed = True
        if self._abort_later is not None:
            # Not needed any more, and it would hold this protocol (its transport, a TLS one's
            # buffers: ~300 KB) for the rest of the second: a flood of refused handshakes then
            # kept hundreds alive at once (the RSS grew by about 110 KB per refusal).
            self._abort_later.cancel()
            self._abort_later = None
        self._queue, self._queued = [], 0  # unsent: gone with the connection, as the transport's own buffer
        if not self.connected.done():
            self.connected.set_exception(TransportError("connection lost before it was made"))
        if first or self.error is not None:
            err, self.error = self.error or exc, None
            self.on_lost(self, err)
        callbacks, self._close_callbacks = self._close_callbacks, []
        for cb in callbacks:
            cb()

    # use ------------------------------------------------------------------------------
    @property
    def unsent(self) -> int:
        """Bytes sent and not yet taken by the kernel: this turn's queue and the transport's buffer."""
        return self._queued + (self.transport.get_write_buffer_size() if self.transport is not None else 0)

    def paced_room(self) -> int:
        """Bytes a paced writer (resent and queued TOKENS) may still send now: up to half of
        ``max_unsent``, the other half left to the frames that are not paced, so that pacing
        alone never trips ``PEER_NOT_READING``. No cap: unbounded."""
        return self.max_unsent // 2 - self.unsent if self.max_unsent else 1 << 62

    def send(self, buffers, *, now: bool = False) -> None:
        """Queue a frame's buffers (from :func:`pdd_wire.wire.encode`); memoryviews are not copied
        on bulk connections. There is no drain: what a session queues on its bulk connections is
        bounded by its credit window (and held as views of registered memory). ``now``: this turn's
        frames are written now, this one last (before work another thread starts at once and whose
        result the peer needs this frame to use: an offered KV_BEGIN, before its first chunk leaves
        on a bulk connection). Control frames
        are small, but a peer that stops reading would let them pile up: past ``max_unsent``
        unsent bytes (the transport's and this turn's queue) the connection fails
        (``PEER_NOT_READING``, raised as a TransportError with that code)."""
        if self.closed or self.transport is None or self.transport.is_closing():
            raise TransportError("connection closed")
        if self.coalesce:
            self.flush_soon()
            for b in buffers:
                self._queue.append(b)
                self._queued += len(b)
            unsent = self._queued + self.transport.get_write_buffer_size()
        else:
            if self._fd >= 0 and not self.transport.get_write_buffer_size():
                buffers = self._write_now(buffers)
            if buffers:
                self.transport.writelines(buffers)
            unsent = self.transport.get_write_buffer_size() if self.max_unsent else 0
        if self.max_unsent and unsent > self.max_unsent:
            exc = TransportError(f"{unsent} bytes unsent, over limits.control_buffer_bytes ({self.max_unsent}): "
                                 "the peer does not read", ErrorCode.PEER_NOT_READING)
            self.fail(exc)
            self.abort()  # the buffer goes now: the ERROR frame would only queue behind it
            raise exc
        if now and self.coalesce:
            self._flush()

    def _write_now(self, buffers):
        """Write what the socket takes now with ``os.writev``, which releases the GIL during the
        copy (uvloop's own first write attempt holds it: with a bulk thread writing 4 MiB chunks,
        its main loop's wake-ups were 0.37-1.10 ms late at the median, 0.10-0.12 ms this way,
        ``pdd_tools.bench_gil``). The rest goes to the transport, whose later writes mostly run
        inside its loop's poll, without the GIL. Returns the buffers left, the first one cut where
        the socket stopped."""
        rest = list(buffers)
        while rest:
            batch = rest[:_IOV_MAX]
            try:
                n = os.writev(self._fd, batch)
            except OSError:  # full (EAGAIN), or failed: the transport writes, or reports the error
                return rest
            full = n == sum(memoryview(b).nbytes for b in batch)
            rest = _cut(rest, n)
            if not full:
                return rest
        return rest

    def flush_soon(self) -> None:
        """Make this turn end with a flush (and so an ``on_flush`` call), also if nothing is sent."""
        if self.coalesce and not self._flush_due and self._loop is not None:
            self._flush_due = True
            self._loop.call_soon(self._flush)

    def _open(self) -> bool:
        return self.transport is not None and not self.closed and not self.transport.is_closing()

    def _flush(self, drain: bool = True) -> None:
        """Hand this turn's frames to the transport as one write (a no-op once flushed); ``drain``:
        then call ``on_drain`` if the transport took them (not before the connection ends)."""
        if self.on_flush is not None and self._open():
            self._flush_due = True  # what on_flush sends joins this write (no second flush)
            try:
                self.on_flush()
            except Exception:  # a bug there must not stop this connection's writes
                _log.exception("control connection: flush callback failed")
        self._flush_due = False
        open_ = self._open()  # again: on_flush may have failed the connection
        if not self._queue:
            return
        queue, self._queue, self._queued = self._queue, [], 0
        if not open_:
            return  # closed with nothing flushed: what fail/close/abort did not flush is dropped
        assert self.transport is not None
        self.transport.write(queue[0] if len(queue) == 1 else b"".join(queue))
        if drain:
            self._drained()

    def fail(self, exc: BaseException) -> None:
        """Send an ERROR frame naming ``exc`` (best effort) and abort the connection."""
        if self.closed:
            return
        self._ending = True
        if self.transport is None:  # failed before it connected: nothing to tell, nothing to close
            self.error = exc
            self.closed = True
            return
        code = getattr(exc, "code", ErrorCode.INTERNAL)
        self._flush(drain=False)  # what was sent before the failure goes first
        try:
            self.transport.write(error_frame(code, str(exc)))
        except Exception:
            pass
        self.error = exc
        # close() flushes the ERROR frame (under TLS too); a peer that does not read gets aborted.
        self.transport.close()
        if self._abort_later is None:  # (failed twice before it closed: the first bound stands)
            self._abort_later = asyncio.get_event_loop().call_later(1.0, self.abort)

    def abort(self) -> None:
        """End it now, unsent bytes dropped, also after :meth:`close` / :meth:`fail` (a closing
        transport waits for its buffer to drain, which a peer that does not read never lets it)."""
        self._ending = True
        if self.transport is None:
            self.closed = True
        elif not self.closed:
            self._flush(drain=False)  # handed to the kernel as far as it takes it, as an unqueued send was
            self.transport.abort()

    def close(self) -> None:
        self._ending = True
        if self.transport is not None and not self.transport.is_closing():
            self._flush(drain=False)
            self.transport.close()


async def dial(host: str, port: int, kind: int, protocol: FrameProtocol, *,
               ssl_ctx: ssl.SSLContext | None, server_name: str | None, timeout: float) -> FrameProtocol:
    """Connect, send the preamble, start TLS if configured, and attach ``protocol``.
    Must run on the loop that will own the connection."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, type_, proto, _, addr = infos[0]
            sock = socket.socket(family, type_, proto)
            try:
                sock.setblocking(False)
                await loop.sock_connect(sock, addr)
                await loop.sock_sendall(sock, preamble(kind))
                await loop.create_connection(lambda: protocol, sock=sock, ssl=ssl_ctx,
                                             server_hostname=server_name if ssl_ctx else None,
                                             ssl_handshake_timeout=timeout if ssl_ctx else None)
            except BaseException:
                sock.close()
                raise
    except TimeoutError as exc:
        raise TransportError(f"connect to {host}:{port} timed out after {timeout}s") from exc
    except ssl.SSLError as exc:
        raise tls_error(exc, f"TLS with {host}:{port}") from exc
    except OSError as exc:
        raise TransportError(f"connect to {host}:{port} failed: {exc.strerror or exc}") from exc
    return protocol


class TcpConnector(Connector):
    """Control connections to one peer's WAN address (TLS when ``ssl_client()`` gives a context)."""

    def __init__(self, host: str, port: int, *, ssl_client: Callable[[], ssl.SSLContext | None],
                 server_name: str) -> None:
        self.host = host
        self.port = port
        self.ssl_client = ssl_client
        self.server_name = server_name

    async def connect(self, protocol: FrameProtocol, *, timeout: float) -> FrameProtocol:
        return await dial(self.host, self.port, KIND_CONTROL, protocol, ssl_ctx=self.ssl_client(),
                          server_name=self.server_name, timeout=timeout)


async def read_preamble(sock: socket.socket, timeout: float) -> int:
    loop = asyncio.get_running_loop()
    buf = b""
    async with asyncio.timeout(timeout):
        while len(buf) < PREAMBLE.size:
            more = await loop.sock_recv(sock, PREAMBLE.size - len(buf))  # never reads past it
            if not more:
                raise TransportError("connection closed during the preamble")
            buf += more
    return parse_preamble(buf)


async def adopt(sock: socket.socket, protocol: FrameProtocol, *, ssl_ctx: ssl.SSLContext | None,
                timeout: float) -> FrameProtocol:
    """Attach an accepted socket (its preamble already read) to ``protocol`` on this loop."""
    loop = asyncio.get_running_loop()
    try:
        await loop.connect_accepted_socket(lambda: protocol, sock, ssl=ssl_ctx,
                                           ssl_handshake_timeout=timeout if ssl_ctx else None)
    except ssl.SSLError as exc:
        sock.close()
        raise tls_error(exc, "TLS with an inbound peer") from exc
    except OSError as exc:
        sock.close()
        why = str(exc) or type(exc).__name__
        hint = " during TLS: the peer may refuse this agent's certificate (its log says why)" if ssl_ctx else ""
        raise TransportError(f"accepted connection failed ({why}){hint}") from exc
    return protocol
