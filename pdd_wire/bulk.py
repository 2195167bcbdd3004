"""Bulk connections on their event-loop threads: queueing chunks out, landing chunks in.

A :class:`BulkHandler` owns one bulk connection's frames on its :class:`BulkLoop`. Incoming KV
chunks land through the session's routes (``Route.claim`` gives the destination views, the frame
reader writes into them, ``Route.settle`` ends the claim); everything else the main loop must
know goes there by ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

from .errors import ErrorCode, ProtocolError
from .transfer import Route
from .transport.tcp import FrameProtocol
from .wire import FrameType, Lane, decode_body, encode, encode_body
from .wire import messages as m
from .wire.frame import Frame

if TYPE_CHECKING:
    from .session import PeerSession

log = structlog.get_logger("pdd_wire.bulk")


def bulk_send(conn: FrameProtocol, tid: int, k: int, views) -> None:
    """On the bulk loop: checksum and queue one chunk (the views are not copied)."""
    if conn.closed:
        return  # the main loop requeues it when it hears the connection is gone
    conn.send(encode(FrameType.KV_CHUNK, lane=Lane.BULK, transfer_id=tid, seq=k, payload=views))


class BulkHandler:
    """Frames of one bulk connection, on its bulk loop. Chunks land through the session's routes."""

    def __init__(self, session: "PeerSession | None", stream: int, main: asyncio.AbstractEventLoop, *,
                 resolve=None, max_body: int = 64 << 10, on_attach=None) -> None:
        self.session = session
        self.stream = stream
        self.main = main
        self.resolve = resolve
        self.on_attach = on_attach
        self._claim: tuple[Route, int] | None = None
        self._invalid = False
        self.conn = FrameProtocol(max_body=max_body, max_payload=64 << 20, sink=self._sink, bulk=True)
        self.conn.on_frame = self._on_frame
        self.conn.on_lost = self._on_lost

    def _sink(self, header, body):
        if self.session is None:
            # Refuse before a payload byte is read (no scratch for unauthenticated peers).
            raise ProtocolError("payload before BULK_HELLO", ErrorCode.UNEXPECTED_FRAME)
        if header.type != FrameType.KV_CHUNK:
            self._claim = None
            return None
        route = self.session.routes.get(header.transfer_id)
        self._invalid = False
        if route is None:
            self._claim = None
            return None
        if not route.fits(header.seq, header.payload_len):
            self._claim = None
            self._invalid = True
            return None
        views = route.claim(header.seq, header.payload_len)
        self._claim = (route, header.seq) if views is not None else None
        return views

    def _on_frame(self, conn: FrameProtocol, frame: Frame) -> None:
        h = frame.header
        if h.type == FrameType.KV_CHUNK:
            s = self.session
            if s is None:
                conn.fail(ProtocolError("KV_CHUNK before BULK_HELLO", ErrorCode.UNEXPECTED_FRAME))
                return
            claim, self._claim = self._claim, None
            if claim is not None:
                claim[0].settle(claim[1], frame.payload_ok)
            self.main.call_soon_threadsafe(s.chunk_arrived, h.transfer_id, h.seq, frame.payload_ok,
                                           h.payload_len, claim is not None, self._invalid)
            self._invalid = False
            return
        try:
            msg = decode_body(h.type, frame.body)
        except ProtocolError as exc:
            conn.fail(exc)
            return
        match msg:
            case m.BulkHello() if self.resolve is not None and self.session is None:
                session = self.resolve(msg)
                if session is None:
                    conn.fail(ProtocolError("unknown session token or peer on a bulk connection",
                                            ErrorCode.UNKNOWN_SESSION))
                    return
                if not session.is_up or not 0 <= msg.stream < session.streams:
                    conn.fail(ProtocolError(f"bulk stream {msg.stream} out of range", ErrorCode.UNEXPECTED_FRAME))
                    return
                self.session = session
                self.stream = msg.stream
                conn.send(encode(FrameType.BULK_WELCOME, encode_body(m.BulkWelcome(msg.stream))))
                self.on_attach(self)
            case m.BulkWelcome():
                w = getattr(conn, "bulk_welcomed", None)
                if w is not None and not w.done():
                    w.set_result(None)
            case m.Error():
                log.warning("peer reported an error on a bulk connection", code=msg.code, message=msg.message)
            case _:
                conn.fail(ProtocolError(f"unexpected {FrameType(h.type).name} on a bulk connection",
                                        ErrorCode.UNEXPECTED_FRAME))

    def _on_lost(self, conn: FrameProtocol, exc) -> None:
        claim, self._claim = self._claim, None
        if claim is not None:
            claim[0].settle(claim[1], False)
        if self.session is not None:
            self.main.call_soon_threadsafe(self.session.bulk_lost, conn, self.stream, exc)
