"""The frame: a fixed 48-byte header, a msgpack body, and raw payload bytes beside it.

Sans-IO. :class:`FrameReader` is a state machine driven either with ``feed(bytes)``
(control connections) or with ``buffer()`` / ``advance(n)`` (bulk connections, where the
socket reads straight into the memory the payload is destined for). Nothing here knows
about sockets or asyncio. The byte layout is specified in ``proto/frames.md``.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import crc32c
import xxhash

from ..errors import INLINE_MAX as INLINE_MAX  # the largest KV_CHUNK on a control connection (inline.v1)
from ..errors import ErrorCode, ProtocolError

MAGIC = b"PDDW"
FRAME_VERSION = 1
HEADER = struct.Struct("<4sBBBBQQIIQII")
HEADER_SIZE = HEADER.size  # 48
# Hard ceilings of the format; each connection enforces its own, lower, negotiated limits.
MAX_BODY = 16 << 20
MAX_PAYLOAD = 256 << 20


class FrameType(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    ERROR = 3
    PING = 4
    PONG = 5
    BULK_HELLO = 6
    BULK_WELCOME = 7
    GOODBYE = 8
    KV_BEGIN = 10
    KV_ACCEPT = 11
    KV_REJECT = 12
    KV_CHUNK = 13
    KV_ACK = 14
    KV_NACK = 15
    KV_DONE = 16
    KV_CANCEL = 17
    KV_RESUME = 18
    KV_STATUS = 19
    TOKENS = 20
    TOKENS_ACK = 21
    HANDOFF_PROGRESS = 22
    HANDOFF_COMMIT = 23
    HANDOFF_TAKEN = 24
    HANDOFF_RELEASE = 25
    HANDOFF_ABORT = 26
    REQUEST_ABORT = 27
    PREFIX_QUERY = 28
    PREFIX_MATCH = 29
    KV_OFFER = 30
    KV_WITHDRAW = 31


class Lane(enum.IntEnum):
    """Scheduling class of a frame. Control and token frames never queue behind bulk."""

    CONTROL = 0
    TOKEN = 1
    BULK = 2


class Flags(enum.IntFlag):
    NONE = 0
    PAYLOAD_CHECKSUM = 1  # payload_xxh3 is set and must be verified
    LZ4 = 2  # payload is an lz4 block of the chunk (capability lz4.v1); payload_xxh3 covers the chunk
    SHUFFLE16 = 4  # with LZ4: the chunk was byte-shuffled as 16-bit elements before compression


# The flags as plain ints, for the per-chunk paths: an IntFlag operation builds an enum member
# (about 0.65 us each here, against 0.013 us on ints), paid under the GIL on the bulk threads.
F_CHECKSUM = int(Flags.PAYLOAD_CHECKSUM)
F_LZ4 = int(Flags.LZ4)
F_SHUFFLE16 = int(Flags.SHUFFLE16)


@dataclass(slots=True)
class Header:
    type: int
    flags: int = 0
    lane: int = Lane.CONTROL
    transfer_id: int = 0
    seq: int = 0
    body_len: int = 0
    payload_len: int = 0
    payload_xxh3: int = 0
    version: int = FRAME_VERSION


@dataclass(slots=True)
class Frame:
    """One decoded frame. ``payload_ok`` is False when the payload checksum did not match:
    the frame is still well formed (its header check passed), only its payload is bad."""

    header: Header
    body: bytes
    payload: memoryview | None = None
    payload_ok: bool = True


def payload_checksum(segments: Sequence[memoryview | bytes]) -> int:
    """xxh3-64 over the concatenation of ``segments``."""
    if len(segments) == 1:
        return xxhash.xxh3_64_intdigest(segments[0])
    h = xxhash.xxh3_64()
    for s in segments:
        h.update(s)
    return h.intdigest()


def encode_header(h: Header, body: bytes) -> bytes:
    """The 48 header bytes; the check covers header bytes 0..39 and the body."""
    raw = HEADER.pack(MAGIC, h.version, h.type, h.flags, h.lane, h.transfer_id, h.seq,
                      len(body), h.payload_len, h.payload_xxh3, 0, 0)
    check = crc32c.crc32c(body, crc32c.crc32c(raw[:40]))
    return raw[:40] + struct.pack("<II", check, 0)


def encode(type: int, body: bytes = b"", *, lane: int = Lane.CONTROL, transfer_id: int = 0,
           seq: int = 0, payload: Sequence[memoryview | bytes] = (), checksum: bool = True,
           flags: int = 0, xxh3: int | None = None) -> list[bytes | memoryview]:
    """A frame as a list of buffers (header+body, then the payload segments, uncopied).
    ``flags``/``xxh3``: an lz4 chunk carries LZ4 (and SHUFFLE16) and the xxh3 of the chunk
    *before* compression, which the receiver checks after decoding it."""
    plen = sum(len(p) for p in payload)
    xx = 0
    flags = int(flags)
    if plen and checksum:
        flags |= F_CHECKSUM
        xx = payload_checksum(payload) if xxh3 is None else xxh3
    h = Header(type=type, flags=flags, lane=lane, transfer_id=transfer_id, seq=seq,
               payload_len=plen, payload_xxh3=xx)
    return [encode_header(h, body) + body, *payload]


def encode_bytes(type: int, body: bytes = b"", **kw: Any) -> bytes:
    return b"".join(bytes(b) for b in encode(type, body, **kw))


#: The lane every assigned frame type travels on (proto/frames.md §5); another lane is MALFORMED_BODY.
TOKEN_LANE_TYPES = {FrameType.TOKENS, FrameType.TOKENS_ACK, FrameType.HANDOFF_PROGRESS, FrameType.HANDOFF_COMMIT,
                    FrameType.HANDOFF_TAKEN, FrameType.HANDOFF_RELEASE, FrameType.HANDOFF_ABORT,
                    FrameType.REQUEST_ABORT}
LANE_OF: dict[int, int] = {int(t): Lane.BULK if t == FrameType.KV_CHUNK else
                           Lane.TOKEN if t in TOKEN_LANE_TYPES else Lane.CONTROL for t in FrameType}

KNOWN_FLAGS = int(Flags.PAYLOAD_CHECKSUM | Flags.LZ4 | Flags.SHUFFLE16)  # LZ4 only to peers with lz4.v1



class _Defer:
    def __repr__(self) -> str:
        return "DEFER"


#: A payload sink's "not yet": the reader holds the frame (header and body read, not a payload
#: byte) until :meth:`FrameReader.resume` names where the payload goes. The caller stops feeding
#: the reader meanwhile (a bulk connection pauses reading its socket).
DEFER: Any = _Defer()
#: The most scratch space a reader takes for payloads its sink declined (read and dropped).
SCRATCH_BYTES = 1 << 20

#: ``sink(header, body) -> buffers`` gives where a frame's payload must land, None to have it
#: read into scratch space (and then discarded by the caller), or :data:`DEFER`.
PayloadSink = Callable[[Header, bytes], "Sequence[memoryview] | None"]


class FrameReader:
    """Incremental frame decoder.

    Limits are enforced from the header alone, before any body or payload byte is read, so
    an oversized frame costs 48 bytes. Any framing error raises :class:`ProtocolError`; the
    caller must then close the connection (a half-read stream is never reused).
    """

    _HDR, _BODY, _PAYLOAD, _WAIT = 0, 1, 2, 3

    def __init__(self, *, max_body: int = 1 << 20, max_payload: int = 0,
                 sink: PayloadSink | None = None, payload_types: frozenset[int] | None = None) -> None:
        if max_body > MAX_BODY or max_payload > MAX_PAYLOAD:
            raise ValueError("limit above the format's ceiling")
        self.max_body = max_body
        self.max_payload = max_payload
        # The frame types that may carry a payload here (None: any); for the others the limit is 0
        # (a control connection: only an inline KV_CHUNK, proto/frames.md §3).
        self.payload_types = payload_types
        self._sink = sink
        self._hbuf = bytearray(HEADER_SIZE)
        self._hview = memoryview(self._hbuf)
        self._state = self._HDR
        self._n = 0
        self._header: Header | None = None
        self._check = 0
        self._body = bytearray()
        self._bview = memoryview(self._body)
        self._segments: list[memoryview] = []
        self._seg = 0
        self._scratch: bytearray | None = None
        self._hasher: xxhash.xxh3_64 | None = None

    # -- the bulk-mode interface -------------------------------------------------------
    def buffer(self) -> memoryview:
        """Where the next bytes from the stream must be written."""
        if self._state == self._HDR:
            return self._hview[self._n:]
        if self._state == self._BODY:
            return self._bview[self._n:]
        if self._state == self._WAIT:
            raise ProtocolError("frame reader asked for bytes while its payload sink has not answered",
                                ErrorCode.INTERNAL)
        return self._segments[self._seg][self._n:]

    def advance(self, n: int) -> Frame | None:
        """``n`` bytes were written into :meth:`buffer`; returns a frame when one completes."""
        self._n += n
        if self._state == self._HDR:
            if self._n == HEADER_SIZE:
                return self._on_header()
            return None
        if self._state == self._BODY:
            if self._n == len(self._bview):
                return self._on_body()
            return None
        seg = self._segments[self._seg]
        if self._hasher is not None:
            # Hash what just arrived while it is still in cache (a second pass over a 4 MiB
            # chunk after the fact reads it back from memory).
            self._hasher.update(seg[self._n - n:self._n])
        if self._n == len(seg):
            self._seg += 1
            self._n = 0
            if self._seg == len(self._segments):
                return self._finish(payload_done=True)
        return None

    # -- the stream-mode interface -----------------------------------------------------
    def feed(self, data: bytes | memoryview) -> list[Frame]:
        """Decode what ``data`` completes; returns the frames (possibly none)."""
        return list(self.frames(data))

    def frames(self, data: bytes | memoryview) -> Iterator[Frame]:
        """The frames ``data`` completes, each as soon as it is complete: nothing after it is read
        (no payload sink called) until the caller asks for the next one."""
        mv = memoryview(data)
        while mv:
            buf = self.buffer()
            k = min(len(buf), len(mv))
            buf[:k] = mv[:k]
            mv = mv[k:]
            f = self.advance(k)
            if f is not None:
                yield f

    @property
    def idle(self) -> bool:
        """True between frames (no partial frame buffered)."""
        return self._state == self._HDR and self._n == 0

    # -- state transitions ---------------------------------------------------------------
    def _on_header(self) -> Frame | None:
        magic, ver, typ, flags, lane, tid, seq, blen, plen, xx, check, reserved = HEADER.unpack(self._hbuf)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}", ErrorCode.BAD_MAGIC)
        if ver != FRAME_VERSION:
            raise ProtocolError(f"frame version {ver} not supported (this side speaks {FRAME_VERSION})",
                                ErrorCode.UNSUPPORTED_FRAME_VERSION)
        if blen > self.max_body:
            raise ProtocolError(f"frame body of {blen} bytes exceeds the limit of {self.max_body}",
                                ErrorCode.FRAME_TOO_LARGE)
        if plen > self.max_payload:
            raise ProtocolError(f"frame payload of {plen} bytes exceeds the limit of {self.max_payload}",
                                ErrorCode.FRAME_TOO_LARGE)
        if plen and self.payload_types is not None and typ not in self.payload_types:
            raise ProtocolError(f"frame payload of {plen} bytes exceeds the limit of 0 for frame type {typ} "
                                "on this connection", ErrorCode.FRAME_TOO_LARGE)
        self._header = Header(type=typ, flags=flags, lane=lane, transfer_id=tid, seq=seq,
                              body_len=blen, payload_len=plen, payload_xxh3=xx, version=ver)
        self._check = check
        self._n = 0
        if reserved != 0:
            raise ProtocolError("reserved header bytes 44..47 must be zero", ErrorCode.MALFORMED_BODY)
        if flags & ~KNOWN_FLAGS:
            raise ProtocolError(f"unknown or unsupported flags 0x{flags:02x}", ErrorCode.MALFORMED_BODY)
        if lane > Lane.BULK:
            raise ProtocolError(f"unknown lane {lane}", ErrorCode.MALFORMED_BODY)
        if LANE_OF.get(typ, lane) != lane:
            raise ProtocolError(f"frame type {typ} on lane {lane}: it travels on lane {LANE_OF[typ]}",
                                ErrorCode.MALFORMED_BODY)
        self._body = bytearray(blen)
        self._bview = memoryview(self._body)
        if blen:
            self._state = self._BODY
            return None
        return self._on_body()

    def _on_body(self) -> Frame | None:
        h = self._header
        assert h is not None  # set by _on_header
        want = crc32c.crc32c(self._body, crc32c.crc32c(self._hbuf[:40]))
        if want != self._check:
            raise ProtocolError("header check failed (crc32c over header and body)", ErrorCode.HEADER_CHECKSUM)
        self._n = 0
        if h.payload_len == 0:
            return self._finish(payload_done=False)
        if self._sink is None:
            # No sink: every frame gets its own payload buffer (one feed() may return several).
            got: Sequence[memoryview] | None = [memoryview(bytearray(h.payload_len))]
        else:
            got = self._sink(h, bytes(self._body))
            if got is DEFER:
                self._state = self._WAIT
                return None
        self._start_payload(h, got)
        return None

    def release(self) -> None:
        """The connection is gone: let go of the buffers (an object kept alive a while longer by a
        reference cycle then holds only itself)."""
        self._scratch = None
        self._segments = []
        self._body = bytearray()
        self._bview = memoryview(self._body)
        self._state, self._n, self._header, self._hasher = self._HDR, 0, None, None

    @property
    def waiting(self) -> bool:
        """The sink answered :data:`DEFER` and :meth:`resume` has not been called yet."""
        return self._state == self._WAIT

    def resume(self, got: Sequence[memoryview] | None) -> None:
        """The answer the sink deferred: where the held frame's payload lands (None: scratch)."""
        if self._state != self._WAIT:
            raise ProtocolError("resume() without a deferred payload", ErrorCode.INTERNAL)
        assert self._header is not None  # set by _on_header
        self._start_payload(self._header, got)

    def _start_payload(self, h: Header, got: Sequence[memoryview] | None) -> None:
        if got is None:
            # The sink declined: read into scratch space for the caller to drop, at most
            # SCRATCH_BYTES of it written over and over (hashed as it arrives): a header that
            # declares 64 MiB and then stalls costs the reader that much, not 64 MiB.
            size = min(h.payload_len, SCRATCH_BYTES)
            if self._scratch is None or len(self._scratch) < size:
                self._scratch = bytearray(size)
            view = memoryview(self._scratch)[:size]
            whole, rest = divmod(h.payload_len, size)
            segs = [view] * whole + ([view[:rest]] if rest else [])
        else:
            segs = [s for s in got if len(s)]
            if sum(len(s) for s in segs) != h.payload_len:
                raise ProtocolError("payload sink returned buffers of the wrong total size", ErrorCode.INTERNAL)
        self._segments = segs
        self._seg = 0
        # An lz4 payload's checksum covers the decoded chunk: the caller checks it after decoding.
        self._hasher = xxhash.xxh3_64() if h.flags & F_CHECKSUM and not h.flags & F_LZ4 else None
        self._state = self._PAYLOAD

    def _finish(self, *, payload_done: bool) -> Frame:
        h = self._header
        assert h is not None  # set by _on_header
        payload = None
        ok = True
        if payload_done:
            segs = self._segments
            payload = segs[0] if len(segs) == 1 else None
            if self._hasher is not None:
                ok = self._hasher.intdigest() == h.payload_xxh3
                self._hasher = None
        f = Frame(header=h, body=bytes(self._body), payload=payload, payload_ok=ok)
        self._state = self._HDR
        self._n = 0
        self._segments = []
        self._header = None
        return f
