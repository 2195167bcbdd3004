"""The wire test vectors in proto/vectors/ decode as vectors.json says, and are in sync with the code.

The vectors are what a second implementation tests itself against; these tests keep the
files (and so the prose in proto/ that cites them) from drifting away from pdd_wire.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import msgspec
import pytest

from pdd_wire.engine import protocol as p
from pdd_wire.errors import ErrorCode, ProtocolError
from pdd_wire.wire import FrameReader, decode_body
from pdd_wire.wire.frame import HEADER_SIZE, MAGIC, FrameType

VECTORS = Path(__file__).resolve().parent.parent / "proto" / "vectors"
DOC = json.loads((VECTORS / "vectors.json").read_text())
FRAMES = [e for e in DOC["vectors"] if e["kind"] == "frame"]
ENGINE = [e for e in DOC["vectors"] if e["kind"] == "engine"]
MAX_BODY = DOC["limits"]["max_body"]
MAX_PAYLOAD = DOC["limits"]["max_payload"]

HEADER_FIELDS = ("version", "type", "flags", "lane", "transfer_id", "seq", "body_len", "payload_len",
                 "payload_xxh3")


def _jsonable(v):
    if isinstance(v, msgspec.Struct):
        return {f: _jsonable(getattr(v, f)) for f in v.__struct_fields__}
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"hex": bytes(v).hex()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return v


def _reader() -> FrameReader:
    return FrameReader(max_body=MAX_BODY, max_payload=MAX_PAYLOAD)


def _feed_whole(data: bytes):
    return _reader().feed(data)


def _feed_bytewise(data: bytes):
    """Feed one byte at a time; returns (frames, bytes fed when it raised or None, the error)."""
    r = _reader()
    out = []
    for i in range(len(data)):
        try:
            out += r.feed(data[i:i + 1])
        except ProtocolError as exc:
            return out, i + 1, exc
    assert r.idle, "bytes left over after the last frame"
    return out, None, None


def _check_frame(f, want: dict) -> None:
    h = want["header"]
    for k in HEADER_FIELDS:
        assert getattr(f.header, k) == h[k], k
    assert bytes.fromhex(h["magic"]) == MAGIC and h["reserved"] == 0
    assert f.body == bytes.fromhex(want["body_hex"])
    if "payload_hex" in want:
        assert f.payload is not None and bytes(f.payload) == bytes.fromhex(want["payload_hex"])
        assert f.payload_ok is want["payload_ok"]
    else:
        assert f.payload is None and f.payload_ok
    if "body" in want:
        assert _jsonable(decode_body(f.header.type, f.body)) == want["body"]
    if "body_wire" in want:
        assert _jsonable(msgspec.msgpack.decode(f.body)) == want["body_wire"]
    if want.get("type_name"):
        assert FrameType(f.header.type).name == want["type_name"]


def _headers_in(raw: bytes, n: int) -> list[tuple[int, int]]:
    """(check, reserved) of the first n frames of ``raw``, read from the bytes."""
    out, pos = [], 0
    for _ in range(n):
        blen, plen = struct.unpack_from("<II", raw, pos + 24)
        out.append(struct.unpack_from("<II", raw, pos + 40))
        pos += HEADER_SIZE + blen + plen
    return out


def test_vectors_present():
    names = [e["name"] for e in DOC["vectors"]]
    assert len(names) == len(set(names))
    covered = {f["header"]["type"] for e in FRAMES if e["outcome"] == "ok" for f in e["frames"]}
    assert covered == {int(t) for t in FrameType}, "every frame type has a well-formed vector"
    outcomes = {e["outcome"] for e in FRAMES}
    for code in ("BAD_MAGIC", "UNSUPPORTED_FRAME_VERSION", "HEADER_CHECKSUM", "FRAME_TOO_LARGE",
                 "UNKNOWN_FRAME_TYPE", "MALFORMED_BODY"):
        assert code in outcomes
    assert any(f.get("payload_ok") is False for e in FRAMES for f in e["frames"])
    assert any("split_at" in e for e in FRAMES)
    assert {"engine_register", "engine_kv_received"} <= {e["name"] for e in ENGINE}


@pytest.mark.parametrize("vec", FRAMES, ids=lambda e: e["name"])
def test_frame_vector(vec):
    raw = (VECTORS / vec["file"]).read_bytes()
    outcome = vec["outcome"]
    if vec.get("stage") == "frame":
        with pytest.raises(ProtocolError) as ei:
            _feed_whole(raw)
        assert ei.value.code == ErrorCode[outcome]
        frames, at, exc = _feed_bytewise(raw)
        assert frames == [] and exc is not None and exc.code == ErrorCode[outcome]
        assert at == vec["error_after"], "the error must be detected at the documented byte"
        return

    for frames in (_feed_whole(raw), _feed_bytewise(raw)[0]):
        assert len(frames) == len(vec["frames"])
        for (check, reserved), want in zip(_headers_in(raw, len(frames)), vec["frames"]):
            assert want["header"]["check"] == check and reserved == 0
        if vec.get("stage") == "body":
            (f,) = frames
            assert f.header.type == vec["frames"][0]["header"]["type"]
            assert f.body == bytes.fromhex(vec["frames"][0]["body_hex"])
            with pytest.raises(ProtocolError) as ei:
                decode_body(f.header.type, f.body)
            assert ei.value.code == ErrorCode[outcome]
        else:
            assert outcome == "ok"
            for f, want in zip(frames, vec["frames"]):
                _check_frame(f, want)

    if "split_at" in vec:
        k = vec["split_at"]
        assert k % 2 == 1
        r = _reader()
        first, second = r.feed(raw[:k]), r.feed(raw[k:])
        assert [len(first), len(second)] == vec["split_yields"]
        for f, want in zip(first + second, vec["frames"]):
            _check_frame(f, want)
        assert r.idle


def test_frame_reader_bulk_interface():
    """The buffer()/advance() interface decodes the payload-carrying vectors the same way."""
    for name in ("kv_chunk", "kv_chunk_corrupt"):
        vec = next(e for e in FRAMES if e["name"] == name)
        raw = memoryview((VECTORS / vec["file"]).read_bytes())
        r = _reader()
        got = []
        while raw:
            buf = r.buffer()
            n = min(len(buf), len(raw), 7)
            buf[:n] = raw[:n]
            raw = raw[n:]
            f = r.advance(n)
            if f is not None:
                got.append(f)
        (f,) = got
        _check_frame(f, vec["frames"][0])


def test_a_deferred_payload_sink_holds_the_frame_until_resumed():
    """A sink that answers DEFER (a bulk connection holding a chunk for its KV_BEGIN): no payload
    byte is asked for until resume() names where it goes; then the frame completes there."""
    from pdd_wire.wire.frame import DEFER

    vec = next(e for e in FRAMES if e["name"] == "kv_chunk")
    raw = (VECTORS / vec["file"]).read_bytes()
    seen = []
    r = FrameReader(max_body=MAX_BODY, max_payload=MAX_PAYLOAD, sink=lambda h, body: seen.append(h) or DEFER)
    buf = r.buffer()
    buf[:len(buf)] = raw[:len(buf)]
    assert r.advance(len(buf)) is None and r.waiting and len(seen) == 1
    with pytest.raises(ProtocolError):
        r.buffer()  # nothing may be read meanwhile
    dest = bytearray(seen[0].payload_len)
    r.resume([memoryview(dest)])
    (f,) = r.feed(memoryview(raw)[HEADER_SIZE + seen[0].body_len:])
    assert f.payload_ok and bytes(dest) == bytes.fromhex(vec["frames"][0]["payload_hex"])
    assert not r.waiting and r.idle
    with pytest.raises(ProtocolError):
        r.resume(None)  # nothing deferred


@pytest.mark.parametrize("vec", ENGINE, ids=lambda e: e["name"])
def test_engine_vector(vec):
    raw = (VECTORS / vec["file"]).read_bytes()
    assert struct.unpack(">I", raw[:4])[0] == len(raw) - 4 or vec["outcome"] != "ok"
    if vec["outcome"] != "ok":
        with pytest.raises(ProtocolError) as ei:
            p.Decoder(to_agent=vec["to_agent"]).feed(raw)
        assert ei.value.code == ErrorCode[vec["outcome"]]
        d = p.Decoder(to_agent=vec["to_agent"])
        for i in range(len(raw)):
            try:
                assert d.feed(raw[i:i + 1]) == []
            except ProtocolError as exc:
                assert exc.code == ErrorCode[vec["outcome"]] and i + 1 == vec["error_after"]
                break
        else:
            pytest.fail("no error")
        return
    whole = p.Decoder(to_agent=vec["to_agent"]).feed(raw)
    d = p.Decoder(to_agent=vec["to_agent"])
    bytewise = [msg for i in range(len(raw)) for msg in d.feed(raw[i:i + 1])]
    for msgs in (whole, bytewise):
        assert [json.loads(json.dumps(msgspec.to_builtins(x))) for x in msgs] == vec["messages"]
    assert _jsonable(msgspec.msgpack.decode(raw[4:])) == vec["body_wire"]
    assert p.encode(whole[0]) == raw, "re-encoding gives the same bytes"


def _load_generator():
    spec = importlib.util.spec_from_file_location("pdd_vectors_generate", VECTORS / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generator_reproduces_the_files(tmp_path):
    names = _load_generator().generate(tmp_path)
    stored = sorted(x.name for x in VECTORS.iterdir() if x.suffix in (".bin", ".json"))
    assert sorted(names) == stored, "vector files added or removed: rerun proto/vectors/generate.py"
    for n in names:
        assert (tmp_path / n).read_bytes() == (VECTORS / n).read_bytes(), \
            f"{n} differs from what the code produces: rerun proto/vectors/generate.py"


def test_engine_request_fields_with_defaults_may_be_left_out():
    """proto/engine.md gives `prefix_hit_tokens` of choose_pipeline a default of 0: a request
    without it is served, not refused as malformed."""
    body = msgspec.msgpack.encode({"op": "choose_pipeline", "id": 3, "request_id": "r", "to": "B",
                                   "input_tokens": 100, "expected_output_tokens": 10, "kv_bytes_per_token": 64})
    (msg,) = p.Decoder(to_agent=True).feed(struct.pack(">I", len(body)) + body)
    assert isinstance(msg, p.ChoosePipeline) and msg.prefix_hit_tokens == 0 and msg.block_hashes is None
