"""Bulk connections on their event-loop threads: queueing chunks out, landing chunks in.

A :class:`BulkHandler` owns one bulk connection's frames on its :class:`BulkLoop`. Incoming KV
chunks land through the owner's routes (``Route.claim`` gives the destination views, the frame
reader writes into them, ``Route.settle`` ends the claim); everything else the owner's loop must
know goes there by ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING

import structlog

from .. import compress as cz
from ..errors import ErrorCode, ProtocolError, peer_code
from ..log import limited
from ..memory import scatter
from ..wire import FrameType, Lane, decode_body, encode, encode_body
from ..wire import messages as m
from ..wire.frame import DEFER, F_CHECKSUM, F_LZ4, F_SHUFFLE16, Frame, Header, payload_checksum
from ..wire.handshake import MAX_CHUNK, refusal
from .route import Route
from .tcp import FrameProtocol

if TYPE_CHECKING:
    from .base import BulkOwner

log = structlog.get_logger("pdd_wire.bulk")


class Compression:
    """One link's lz4 state, shared by the main loop (which decides) and the bulk threads (which
    compress and feed the estimates). ``on``: compress every chunk; otherwise every
    ``sample_every``-th chunk is compressed only to keep the estimates live (and sent as is).
    The counters are updated under a lock (several bulk threads); ``est`` has its own."""

    def __init__(self, *, shuffle: bool, sample_every: int = 64) -> None:
        self.shuffle = shuffle
        self.on = False
        self.sample_every = sample_every
        self.est = cz.Estimator()
        self.chunks = 0  # compressed and sent
        self.saved = 0  # bytes not sent thanks to it
        self._n = 0
        self._lock = threading.Lock()

    def wants(self) -> bool:
        with self._lock:
            self._n += 1
            n = self._n
        return self.on or self.est.samples < self.est.min_samples or n % self.sample_every == 0

    def sent_compressed(self, saved: int) -> None:
        with self._lock:
            self.chunks += 1
            self.saved += saved


def bulk_send(conn: FrameProtocol, tid: int, k: int, views, lz: Compression | None = None) -> None:
    """On the bulk loop: checksum and queue one chunk (the views are not copied, unless the
    link compresses: then the chunk is lz4-encoded, and sent that way if it shrank)."""
    if conn.closed:
        return  # the main loop requeues it when it hears the connection is gone
    if lz is not None and lz.wants():
        data = views[0] if len(views) == 1 else b"".join(views)
        t0 = time.perf_counter()
        payload = cz.encode_chunk(data, shuffle=lz.shuffle)
        lz.est.feed(len(data), len(payload), time.perf_counter() - t0)
        if lz.on and len(payload) < len(data):
            flags = F_LZ4 | (F_SHUFFLE16 if lz.shuffle else 0)
            lz.sent_compressed(len(data) - len(payload))
            conn.send(encode(FrameType.KV_CHUNK, lane=Lane.BULK, transfer_id=tid, seq=k, payload=[payload],
                             flags=flags, xxh3=payload_checksum([data])))
            return
    conn.send(encode(FrameType.KV_CHUNK, lane=Lane.BULK, transfer_id=tid, seq=k, payload=views))


def _bulk_error(session, code: int, message: str) -> None:
    """An ERROR frame on a bulk connection (main loop): one line per period, whatever its code and text."""
    limited(session.lines if session is not None else _bulk_error, log.warning,
            "peer reported an error on a bulk connection", detail={"code": code, "message": message})


class BulkHandler:
    """Frames of one bulk connection, on its bulk loop. Chunks land through the routes of
    ``session`` (its owner; on an accepted connection, ``resolve(BULK_HELLO)`` names it).
    ``welcomed``: on a dialed connection, resolved by the peer's BULK_WELCOME."""

    def __init__(self, session: "BulkOwner | None", stream: int, main: asyncio.AbstractEventLoop, *,
                 resolve=None, max_body: int = 64 << 10, on_attach=None, count_error=None,
                 stall_s: float = 0.0) -> None:
        self.session = session
        self.count_error = count_error  # count_error(code), on the main loop: the protocol errors found here
        self.welcomed: asyncio.Future | None = None
        self.stream = stream
        self.main = main
        self.resolve = resolve
        self.on_attach = on_attach
        self._claim: tuple[Route, int] | None = None
        self._invalid = False
        self._lz: tuple[list, int] | None = None  # an lz4 chunk's destination views and length
        self._lz_buf = bytearray()
        self._lz_stage = bytearray()
        self._held: Header | None = None  # a chunk waiting for its KV_BEGIN (owner.chunk_early)
        self._loop: asyncio.AbstractEventLoop | None = None  # its bulk loop
        self.conn = FrameProtocol(max_body=max_body, max_payload=MAX_CHUNK, sink=self._sink, bulk=True,
                                  stall_s=stall_s)  # a stalled flow ends (FrameProtocol._watch_stall)
        self.conn.on_frame = self._on_frame
        self.conn.on_lost = self._on_lost
        self.conn.on_framing_error = self._counted

    def _sink(self, header, body):
        if self.session is None:
            # Refuse before a payload byte is read (no scratch for unauthenticated peers).
            raise ProtocolError("payload before BULK_HELLO", ErrorCode.UNEXPECTED_FRAME)
        if header.type != FrameType.KV_CHUNK:
            self._claim = None
            return None
        if not header.flags & F_CHECKSUM:
            # Bytes nobody can verify must not be acknowledged into an engine's memory; there is
            # no setting that drops checksums on TCP, so this is a broken (or hostile) sender.
            raise ProtocolError("KV_CHUNK without its payload checksum (flag bit 0)", ErrorCode.MALFORMED_BODY)
        route = self.session.routes.get(header.transfer_id)
        self._invalid = False
        self._lz = None
        if route is None:
            self._claim = None
            # It may have outrun its KV_BEGIN: then read nothing more of this connection until that
            # is handled (the wake may come at once, from another thread: set up first).
            self._held, self._loop = header, asyncio.get_running_loop()
            if self.session.chunk_early(header.transfer_id, self._wake):
                self.conn.transport.pause_reading()
                return DEFER
            self._held = None
            return None
        return self._land(route, header)

    def _wake(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._release_held)

    def _release_held(self) -> None:
        header, self._held = self._held, None
        if header is None or self.conn.closed or self.session is None:
            return
        route = self.session.routes.get(header.transfer_id)
        self.conn.reader.resume(self._land(route, header) if route is not None else None)
        if self.conn.transport is not None:
            self.conn.transport.resume_reading()

    def _land(self, route: Route, header: Header):
        """Where chunk ``header.seq`` of ``route``'s transfer lands (None: scratch)."""
        if header.flags & F_LZ4:
            # The payload is smaller than the chunk: read it into scratch, decode it into the
            # claimed blocks when it is complete (_on_frame).
            n = route.chunk_len(header.seq)
            if n is None or header.payload_len >= n or not route.lz4:
                self._claim = None
                self._invalid = True
                return None
            views = route.claim(header.seq, n)
            self._claim = (route, header.seq) if views is not None else None
            if views is None:
                return None
            self._lz = (views, n)
            if len(self._lz_buf) < header.payload_len:
                self._lz_buf = bytearray(header.payload_len)
            return [memoryview(self._lz_buf)[:header.payload_len]]
        views, self._invalid = route.land(header.seq, header.payload_len)
        self._claim = (route, header.seq) if views is not None else None
        return views

    def _empty_chunk(self, s: "BulkOwner", h: Header) -> None:
        """A KV_CHUNK with no payload: the reader calls no sink for it, so where it lands is
        decided here. No chunk is empty: it is a chunk of the wrong size (the transfer fails
        MALFORMED_BODY), or an lz4 one that does not decode (KV_NACK). (A frame without payload
        carries flag 0 by frames.md, so the checksum flag is not asked for.)"""
        self._claim, self._lz, self._invalid = None, None, False
        route = s.routes.get(h.transfer_id)
        if route is not None:
            self._land(route, h)

    def _decode_lz4(self, frame: Frame) -> bool:
        """Decode an lz4 chunk into its claimed blocks and check the chunk's xxh3."""
        assert self._lz is not None  # claimed in sink() for this frame
        views, n = self._lz
        self._lz = None
        if not frame.payload:
            return False  # nothing to decode (an empty payload)
        shuffle = bool(frame.header.flags & F_SHUFFLE16)
        try:
            if len(views) == 1:
                cz.decode_chunk(frame.payload, views[0], shuffle=shuffle)
            else:  # blocks not contiguous: decode into a reused staging buffer, then scatter
                if len(self._lz_stage) < n:
                    self._lz_stage = bytearray(n)
                stage = memoryview(self._lz_stage)[:n]
                cz.decode_chunk(frame.payload, stage, shuffle=shuffle)
                scatter(stage, views)
        except cz.CompressedChunkError:
            return False
        return payload_checksum(views) == frame.header.payload_xxh3

    def _counted(self, code: ErrorCode) -> None:
        if self.count_error is not None:
            try:
                self.main.call_soon_threadsafe(self.count_error, code)
            except RuntimeError:  # the main loop is closed (the agent stopped): nothing to count into
                pass

    def _fail(self, conn: FrameProtocol, exc: ProtocolError) -> None:
        self._counted(exc.code)
        conn.fail(exc)

    def _on_frame(self, conn: FrameProtocol, frame: Frame) -> None:
        h = frame.header
        if h.type == FrameType.KV_CHUNK:
            s = self.session
            if s is None:
                self._fail(conn, ProtocolError("KV_CHUNK before BULK_HELLO", ErrorCode.UNEXPECTED_FRAME))
                return
            if h.payload_len == 0:
                self._empty_chunk(s, h)
            claim, self._claim = self._claim, None
            ok, nbytes = frame.payload_ok, h.payload_len
            if h.flags & F_LZ4:
                nbytes = self._lz[1] if self._lz is not None else h.payload_len
                ok = self._decode_lz4(frame) if self._lz is not None else True
            if claim is not None:
                claim[0].settle(claim[1], ok)
            self.main.call_soon_threadsafe(s.chunk_arrived, h.transfer_id, h.seq, ok,
                                           nbytes, claim is not None, self._invalid)
            self._invalid = False
            return
        try:
            msg = decode_body(h.type, frame.body)
        except ProtocolError as exc:
            self._fail(conn, exc)
            return
        match msg:
            case m.BulkHello() if self.resolve is not None and self.session is None:
                try:
                    session = self.resolve(msg)
                except ProtocolError as exc:  # the listener's own refusal (a full room: TOO_MANY_CONNECTIONS)
                    self._fail(conn, exc)
                    return
                if session is None:
                    self._fail(conn, ProtocolError("unknown session token or peer on a bulk connection",
                                                   ErrorCode.UNKNOWN_SESSION))
                    return
                if not session.is_up:
                    self._fail(conn, ProtocolError("the session's control connection is down: bulk connections "
                                                   "attach to an established session", ErrorCode.UNEXPECTED_FRAME))
                    return
                if not 0 <= msg.stream < session.streams:
                    self._fail(conn, ProtocolError(f"bulk stream {msg.stream} out of range: the session has "
                                                   f"{session.streams}", ErrorCode.UNEXPECTED_FRAME))
                    return
                self.session = session
                self.stream = msg.stream
                conn.send(encode(FrameType.BULK_WELCOME, encode_body(m.BulkWelcome(msg.stream))))
                self.on_attach(self)
            case m.BulkWelcome():
                if self.welcomed is not None and not self.welcomed.done():
                    self.welcomed.set_result(None)
            case m.Error() if self.welcomed is not None and not self.welcomed.done():  # BULK_HELLO refused
                self._counted(peer_code(msg.code))
                self.welcomed.set_exception(refusal(msg.code, msg.message))  # the dialer logs it, rate-limited
            case m.Error():  # logged on the main loop, once per period; the peer's last word here (frames.md §4)
                self._counted(peer_code(msg.code))
                try:
                    self.main.call_soon_threadsafe(_bulk_error, self.session, msg.code, msg.message)
                except RuntimeError:  # the main loop is closed (the agent stopped)
                    pass
                conn.abort()
            case _:
                self._fail(conn, ProtocolError(f"unexpected {FrameType(h.type).name} on a bulk connection",
                                               ErrorCode.UNEXPECTED_FRAME))

    def _on_lost(self, conn: FrameProtocol, exc) -> None:
        self._lz = None
        self._held = None
        self._lz_buf, self._lz_stage = bytearray(), bytearray()  # up to a chunk each: not kept past the connection
        conn.reader.release()
        claim, self._claim = self._claim, None
        if claim is not None:
            claim[0].settle(claim[1], False)
        if self.session is not None:
            self.main.call_soon_threadsafe(self.session.bulk_lost, conn, self.stream, exc)
