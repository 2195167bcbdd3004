"""Property tests of the sans-IO decoders and of BlockMap, with hypothesis (bounded).

What a peer or an engine can put on a socket must only ever give frames/messages or a
ProtocolError (never another exception, never an allocation beyond the reader's limits), and
whatever the encoder writes must come back unchanged, however the stream is split.
"""

from __future__ import annotations

import os
import struct
import tracemalloc

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pdd_wire.engine import protocol as p
from pdd_wire.errors import EngineRequestError, ErrorCode, ProtocolError
from pdd_wire.memory import BlockMap, Extent, HostRegion, SharedMemory, chunk_range, n_chunks
from pdd_wire.wire import FrameReader, decode_body, encode_bytes
from pdd_wire.wire.frame import HEADER, HEADER_SIZE, LANE_OF, MAGIC, MAX_BODY, MAX_PAYLOAD, FrameType, Lane
from pdd_wire.wire.messages import BODY_TYPES

MAX_B = 4096
MAX_P = 1 << 20
# Bounded: inputs stay small (a few KiB), so each test takes a second or two.
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])

u8 = st.integers(0, 255)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


def _reader(sink=None) -> FrameReader:
    return FrameReader(max_body=MAX_B, max_payload=MAX_P, sink=sink)


def _pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut at the given offsets (taken modulo its length, sorted, deduplicated)."""
    if not data:
        return [data]
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:])]


@st.composite
def header_like(draw) -> bytes:
    """48 bytes that often get past the first header checks (magic, version, limits)."""
    magic = draw(st.sampled_from([MAGIC, MAGIC, MAGIC, b"PDDX", b"\0\0\0\0"]))
    version = draw(st.sampled_from([1, 1, 1, 0, 2, 255]))
    typ = draw(u8)
    flags = draw(st.sampled_from([0, 1, 2, 3, 0x80, 0xFF]))
    lane = draw(st.sampled_from([0, 1, 2, 3, 255]))
    blen = draw(st.one_of(st.integers(0, 64), st.integers(0, MAX_B + 1), u32))
    plen = draw(st.one_of(st.just(0), st.integers(0, 4096), st.integers(MAX_P - 1, MAX_P + 1), u32))
    return HEADER.pack(magic, version, typ, flags, lane, draw(u64), draw(u64), blen, plen, draw(u64),
                       draw(u32), draw(st.sampled_from([0, 0, 0, 1, 2**32 - 1])))


frame_spec = st.fixed_dictionaries({
    "type": u8,
    "lane": st.sampled_from(list(Lane)),
    "transfer_id": u64,
    "seq": u64,
    "body": st.binary(max_size=300),
    "payload": st.one_of(st.just(b""), st.binary(min_size=1, max_size=3000)),
    "checksum": st.booleans(),
}).map(lambda s: {**s, "lane": LANE_OF.get(s["type"], s["lane"])})  # an assigned type has its own lane


def _encode(spec) -> bytes:
    pay = [spec["payload"]] if spec["payload"] else []
    return encode_bytes(spec["type"], spec["body"], lane=spec["lane"], transfer_id=spec["transfer_id"],
                        seq=spec["seq"], payload=pay, checksum=spec["checksum"])


# Streams a peer could send: noise, headers that pass the first checks, and valid frames.
stream_bytes = st.lists(st.one_of(st.binary(max_size=200), header_like(), frame_spec.map(_encode)),
                        max_size=8).map(b"".join)


# ---------------------------------------------------------------------------------- FrameReader
@FUZZ
@given(data=stream_bytes, cuts=st.lists(st.integers(0, 4000), max_size=12))
def test_reader_on_arbitrary_bytes_gives_frames_or_protocol_error_within_its_limits(data, cuts):
    r = _reader()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            for piece in _pieces(data, cuts):
                for f in r.feed(piece):
                    assert f.header.body_len <= MAX_B and f.header.payload_len <= MAX_P
                    assert len(f.body) == f.header.body_len
                    if f.header.payload_len:
                        assert len(f.payload) == f.header.payload_len
        except ProtocolError as exc:
            assert isinstance(exc.code, ErrorCode)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    # Its own buffers are bounded by the limits, whatever the header announces.
    assert peak <= MAX_B + MAX_P + (256 << 10), peak


@FUZZ
@given(blen=st.integers(MAX_B + 1, 2**32 - 1), plen=u32, typ=u8, payload_too_large=st.booleans())
def test_huge_announced_length_raises_from_the_header_alone_without_allocating(blen, plen, typ,
                                                                               payload_too_large):
    if payload_too_large:
        blen, plen = blen % (MAX_B + 1), max(plen, MAX_P + 1)
    hdr = HEADER.pack(MAGIC, 1, typ, 0, 0, 0, 0, blen, plen, 0, 0, 0)
    r = FrameReader(max_body=MAX_B, max_payload=MAX_P)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        with pytest.raises(ProtocolError) as ei:
            r.feed(hdr)  # the 48 header bytes only: nothing of the body is needed to refuse it
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert ei.value.code == ErrorCode.FRAME_TOO_LARGE
    assert peak < 64 << 10, peak


def test_reader_limits_cannot_exceed_the_format_ceiling():
    with pytest.raises(ValueError):
        FrameReader(max_body=MAX_BODY + 1)
    with pytest.raises(ValueError):
        FrameReader(max_payload=MAX_PAYLOAD + 1)


def _check_frame(f, spec, payload: bytes | None) -> None:
    h = f.header
    assert (h.type, h.lane, h.transfer_id, h.seq, h.version) == (spec["type"], spec["lane"],
                                                                 spec["transfer_id"], spec["seq"], 1)
    assert f.body == spec["body"] and h.body_len == len(spec["body"])
    assert h.payload_len == len(spec["payload"])
    assert f.payload_ok
    if spec["payload"]:
        assert payload == spec["payload"]
        assert bool(h.flags & 1) == spec["checksum"]
    else:
        assert h.flags == 0 and h.payload_xxh3 == 0


@FUZZ
@given(specs=st.lists(frame_spec, min_size=1, max_size=6), cuts=st.lists(st.integers(0, 20000), max_size=16),
       seg_cuts=st.lists(st.integers(1, 3000), max_size=3))
def test_frames_round_trip_at_random_split_points_into_a_sink(specs, cuts, seg_cuts):
    """feed() at random split points, payloads landing in buffers a sink hands out (one or
    several segments per frame, as the bulk path does with scattered blocks)."""
    landed: list[list[bytearray]] = []

    def sink(header, body):
        n = header.payload_len
        points = sorted({c % n for c in seg_cuts} | {0, n})
        bufs = [bytearray(b - a) for a, b in zip(points, points[1:])]
        landed.append(bufs)
        return [memoryview(b) for b in bufs]

    r = _reader(sink)
    data = b"".join(_encode(s) for s in specs)
    frames = []
    for piece in _pieces(data, cuts):
        frames += r.feed(piece)
    assert r.idle and len(frames) == len(specs)
    it = iter(landed)
    for f, spec in zip(frames, specs):
        payload = b"".join(next(it)) if spec["payload"] else None
        _check_frame(f, spec, payload)


@FUZZ
@given(specs=st.lists(frame_spec, min_size=1, max_size=6), steps=st.lists(st.integers(1, 5000), min_size=1,
                                                                             max_size=20))
def test_frames_round_trip_through_the_bulk_interface_at_random_read_sizes(specs, steps):
    """buffer()/advance(n) as a socket would drive it: at most ``n`` bytes per read."""
    r = _reader()
    data = memoryview(b"".join(_encode(s) for s in specs))
    got = []
    pos, i = 0, 0
    while pos < len(data):
        buf = r.buffer()
        n = min(len(buf), steps[i % len(steps)], len(data) - pos)
        i += 1
        buf[:n] = data[pos:pos + n]
        pos += n
        f = r.advance(n)
        if f is not None:
            got.append((f, bytes(f.payload) if f.payload is not None else None))
    assert r.idle and len(got) == len(specs)
    for (f, payload), spec in zip(got, specs):
        _check_frame(f, spec, payload)


def test_feed_keeps_each_returned_frames_payload():
    """Two payload frames completed by one feed() call must each keep their own payload.

    BUG: without a sink, every payload is read into one reused scratch buffer and Frame.payload
    is a view of it, so the first frame's payload is overwritten by the second's before the
    caller sees the list.
    """
    r = _reader()
    data = encode_bytes(FrameType.KV_CHUNK, lane=Lane.BULK, seq=0, payload=[b"a" * 10]) + \
        encode_bytes(FrameType.KV_CHUNK, lane=Lane.BULK, seq=1, payload=[b"b" * 10])
    frames = r.feed(data)
    assert [f.header.seq for f in frames] == [0, 1]
    assert [bytes(f.payload) for f in frames] == [b"a" * 10, b"b" * 10]


@FUZZ
@given(spec=frame_spec, where=st.integers(0, 10**6), bit=st.integers(0, 7))
def test_single_bit_flip_in_header_or_body_is_detected(spec, where, bit):
    raw = bytearray(_encode(spec))
    covered = HEADER_SIZE + len(spec["body"])
    pos = where % covered
    raw[pos] ^= 1 << bit
    # Whatever the flipped header now announces, enough bytes follow for the reader to get to
    # its check (a body_len grown within the limit is read, then fails the CRC).
    tail = bytes(MAX_B + HEADER_SIZE)
    r = _reader()
    with pytest.raises(ProtocolError):
        r.feed(bytes(raw) + tail)


@FUZZ
@given(spec=frame_spec, where=st.integers(0, 10**6), bit=st.integers(0, 7))
def test_single_bit_flip_in_the_payload_gives_payload_not_ok(spec, where, bit):
    assume(spec["payload"])
    spec = dict(spec, checksum=True)
    raw = bytearray(_encode(spec))
    start = HEADER_SIZE + len(spec["body"])
    raw[start + where % len(spec["payload"])] ^= 1 << bit
    frames = _reader().feed(bytes(raw))
    assert len(frames) == 1
    f = frames[0]
    assert not f.payload_ok
    assert f.body == spec["body"] and f.header.seq == spec["seq"]


# ---------------------------------------------------------------------------------- bodies
msgpack_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=False),
                         st.text(max_size=20), st.binary(max_size=20))
msgpack_value = st.recursive(msgpack_leaf, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)), max_leaves=8)

FIELD_NAMES = sorted({f for cls in BODY_TYPES.values() for f in cls.__struct_fields__})


@st.composite
def body_like(draw) -> bytes:
    kind = draw(st.integers(0, 2))
    if kind == 0:
        return draw(st.binary(max_size=300))
    if kind == 1:  # an array, as the hot-path bodies are
        return msgspec.msgpack.encode(draw(st.lists(msgpack_value, max_size=8)))
    # a map with real field names (the handshake bodies), values of any type
    keys = st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=8))
    return msgspec.msgpack.encode(draw(st.dictionaries(keys, msgpack_value, max_size=10)))


@FUZZ
@given(ftype=st.one_of(st.sampled_from(sorted(BODY_TYPES)), st.sampled_from(sorted(BODY_TYPES)),
                      st.just(int(FrameType.KV_CHUNK)), u8), body=body_like())
def test_decode_body_on_random_bytes_only_raises_protocol_error(ftype, body):
    try:
        msg = decode_body(ftype, body)
    except ProtocolError as exc:
        assert exc.code in (ErrorCode.MALFORMED_BODY, ErrorCode.OUT_OF_RANGE, ErrorCode.UNKNOWN_FRAME_TYPE)
        assert (exc.code == ErrorCode.UNKNOWN_FRAME_TYPE) == (ftype not in BODY_TYPES and
                                                              ftype != FrameType.KV_CHUNK)
        return
    if ftype == FrameType.KV_CHUNK:
        assert msg is None
    else:
        assert isinstance(msg, BODY_TYPES[ftype])


# ---------------------------------------------------------------------------------- engine socket
OPS = ["hello", "register", "deregister", "post_recv", "send_kv", "send_tokens", "abort", "status", "ok", "err",
       "kv_received", "kv_sent", "transfer_failed", "tokens", "shutdown", "frobnicate"]


@st.composite
def engine_stream(draw) -> bytes:
    parts = []
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.integers(0, 3))
        if kind == 0:
            parts.append(draw(st.binary(max_size=64)))
            continue
        if kind == 1:
            body = draw(st.binary(max_size=100))
        else:
            msg = draw(st.dictionaries(st.one_of(st.sampled_from(["id", "engine", "size", "block_bytes",
                                                                   "request_id", "blocks", "to", "tokens",
                                                                   "region", "code", "message", "result"]),
                                                  st.text(max_size=6)), msgpack_value, max_size=6))
            if kind == 2:
                msg["op"] = draw(st.one_of(st.sampled_from(OPS), msgpack_leaf))
            body = msgspec.msgpack.encode(msg)
        n = draw(st.one_of(st.just(len(body)), st.integers(0, 2**32 - 1)))
        parts.append(struct.pack(">I", n) + body)
    return b"".join(parts)


@FUZZ
@given(data=engine_stream(), cuts=st.lists(st.integers(0, 2000), max_size=8), to_agent=st.booleans())
def test_engine_decoder_on_random_bytes_only_raises_protocol_error(data, cuts, to_agent):
    dec = p.Decoder(to_agent=to_agent, max_message=4096)
    try:
        for piece in _pieces(data, cuts):
            for msg in dec.feed(piece):
                assert isinstance(msg, p.Msg)
    except ProtocolError as exc:
        assert exc.code in (ErrorCode.MALFORMED_BODY, ErrorCode.FRAME_TOO_LARGE)


def test_engine_decoder_refuses_a_huge_length_from_the_prefix_alone():
    dec = p.Decoder(to_agent=True)
    with pytest.raises(ProtocolError) as ei:
        dec.feed(struct.pack(">I", p.MAX_MESSAGE + 1))
    assert ei.value.code == ErrorCode.FRAME_TOO_LARGE


# ---------------------------------------------------------------------------------- BlockMap
@st.composite
def block_layout(draw):
    block = draw(st.sampled_from([1, 3, 16, 64, 4096]))
    sizes = draw(st.lists(st.integers(1, 24), min_size=1, max_size=3))  # blocks per region
    extents = []
    for _ in range(draw(st.integers(1, 8))):
        ri = draw(st.integers(0, len(sizes) - 1))
        first = draw(st.integers(0, sizes[ri] - 1))
        count = draw(st.integers(1, sizes[ri] - first))
        extents.append((ri, first, count))
    return block, sizes, extents


class _Regions:
    """Real memfd-backed regions, as the agent maps them, and the engine's view of the same pages."""

    def __init__(self, block: int, sizes: list[int]) -> None:
        self.mems = []
        self.regions = {}
        for i, n in enumerate(sizes):
            mem = SharedMemory(n * block)
            mem.buf[:] = os.urandom(n * block)
            self.mems.append(mem)
            self.regions[100 + i] = HostRegion(100 + i, os.dup(mem.fd), n * block, block, owner=None)

    def close(self) -> None:
        for r in self.regions.values():
            r.close()
        for m in self.mems:
            m.close()


@FUZZ
@given(layout=block_layout(), ranges=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)),
                                              min_size=1, max_size=8),
       chunk=st.integers(1, 5000))
def test_blockmap_slice_matches_a_reference_built_from_bytes(layout, ranges, chunk):
    block, sizes, extents = layout
    regs = _Regions(block, sizes)
    try:
        bm = BlockMap(regs.regions, [Extent(100 + ri, first, count) for ri, first, count in extents])
        ref = b"".join(bytes(regs.mems[ri].buf[first * block:(first + count) * block])
                       for ri, first, count in extents)
        assert bm.total == len(ref) and bm.n_blocks == sum(c for _, _, c in extents)
        assert bm.block_bytes == block
        for a, b in ranges:
            start, end = sorted((a % (bm.total + 1), b % (bm.total + 1)))
            views = bm.slice(start, end)
            assert all(len(v) for v in views)
            assert b"".join(bytes(v) for v in views) == ref[start:end]
            for v in views:
                v.release()
        # Cut in chunks as transfers do, the slices cover the stream exactly once, in order.
        parts = []
        for k in range(n_chunks(bm.total, chunk)):
            views = bm.slice(*chunk_range(k, bm.total, chunk))
            parts.append(b"".join(bytes(v) for v in views))
            for v in views:
                v.release()
        assert b"".join(parts) == ref
        # Writes through the slices land in the engine's pages where the reference says.
        start, end = sorted((ranges[0][0] % (bm.total + 1), ranges[0][1] % (bm.total + 1)))
        fill = os.urandom(end - start)
        pos = 0
        for v in bm.slice(start, end):
            v[:] = fill[pos:pos + len(v)]
            pos += len(v)
            v.release()
        want = ref[:start] + fill + ref[end:]
        got = b"".join(bytes(regs.mems[ri].buf[first * block:(first + count) * block])
                       for ri, first, count in extents)
        # Extents may overlap (the same block twice): compare through a fresh read of the map.
        again = b"".join(bytes(v) for v in bm.slice(0, bm.total))
        assert got == again
        if len({(ri, first + j) for ri, first, count in extents for j in range(count)}) == bm.n_blocks:
            assert got == want
    finally:
        regs.close()


@FUZZ
@given(block=st.sampled_from([16, 64]), sizes=st.lists(st.integers(1, 8), min_size=1, max_size=3),
       extents=st.lists(st.tuples(st.integers(98, 104), st.integers(-3, 12), st.integers(-2, 12)), max_size=6),
       other_block=st.booleans())
def test_blockmap_refuses_bad_extents_with_an_engine_error(block, sizes, extents, other_block):
    regs = _Regions(block, sizes)
    if other_block:
        mem = SharedMemory(4 * block * 2)
        regs.mems.append(mem)
        regs.regions[103] = HostRegion(103, os.dup(mem.fd), 4 * block * 2, block * 2, owner=None)
    try:
        try:
            bm = BlockMap(regs.regions, [Extent(*e) for e in extents])
        except EngineRequestError as exc:
            assert exc.code in (ErrorCode.BAD_REQUEST, ErrorCode.UNKNOWN_REGION, ErrorCode.OUT_OF_BOUNDS)
            return
        for r, first, count in extents:
            reg = regs.regions[r]
            assert count > 0 and first >= 0 and first + count <= reg.n_blocks
        assert bm.total == sum(c for _, _, c in extents) * bm.block_bytes
    finally:
        regs.close()
