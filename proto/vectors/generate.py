#!/usr/bin/env python3
"""Generate the wire test vectors in this directory from pdd_wire's own encoders.

    python proto/vectors/generate.py [OUTDIR]      # default: the directory of this script

Deterministic: the same code writes byte-identical files (tests/test_vectors.py checks it).
Each vector is one ``*.bin`` file (exact bytes on the wire, after TLS is removed) described
in ``vectors.json``; the JSON layout is in ``proto/vectors/README.md``.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import crc32c  # noqa: E402
import msgspec  # noqa: E402

from pdd_wire.engine import protocol as p  # noqa: E402
from pdd_wire.errors import ErrorCode  # noqa: E402
from pdd_wire.wire import messages as m  # noqa: E402
from pdd_wire.wire.chunkset import bitmap_from  # noqa: E402
from pdd_wire.wire.frame import (  # noqa: E402
    HEADER,
    HEADER_SIZE,
    MAGIC,
    FrameReader,
    FrameType,
    Header,
    Lane,
    encode_bytes,
    encode_header,
)
from pdd_wire.wire.messages import decode_body, encode_body  # noqa: E402

#: The limits the vectors are decoded under (the test uses the same).
MAX_BODY = 1 << 20
MAX_PAYLOAD = 64 << 20

INCARNATION_A = 0x1234_5678_9ABC_DEF0
INCARNATION_B = 0x0FED_CBA9_8765_4321
SESSION_TOKEN = 0x0123_4567_89AB_CDEF


# -- helpers -------------------------------------------------------------------------------
def jsonable(v):
    """A decoded value as JSON: structs by field name, bytes as {"hex": ...}."""
    if isinstance(v, msgspec.Struct):
        return {f: jsonable(getattr(v, f)) for f in v.__struct_fields__}
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"hex": bytes(v).hex()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    return v


def header_json(raw: bytes) -> dict:
    magic, ver, typ, flags, lane, tid, seq, blen, plen, xx, check, reserved = HEADER.unpack(raw[:HEADER_SIZE])
    return {"magic": magic.hex(), "version": ver, "type": typ, "flags": flags, "lane": lane,
            "transfer_id": tid, "seq": seq, "body_len": blen, "payload_len": plen,
            "payload_xxh3": xx, "check": check, "reserved": reserved}


def reseal(raw: bytes) -> bytes:
    """Recompute the header check of one frame (after a test edited its header)."""
    blen = struct.unpack_from("<I", raw, 24)[0]
    body = raw[HEADER_SIZE:HEADER_SIZE + blen]
    check = crc32c.crc32c(body, crc32c.crc32c(raw[:40]))
    return raw[:40] + struct.pack("<I", check) + raw[44:]


def frame_entry(raw: bytes, *, payload_ok: bool = True) -> dict:
    """What one well-formed frame must decode to (header, body, payload)."""
    h = header_json(raw)
    body = raw[HEADER_SIZE:HEADER_SIZE + h["body_len"]]
    payload = raw[HEADER_SIZE + h["body_len"]:HEADER_SIZE + h["body_len"] + h["payload_len"]]
    e = {"header": h, "type_name": FrameType(h["type"]).name if h["type"] in FrameType._value2member_map_ else None,
         "body_hex": body.hex()}
    if h["type"] in m.BODY_TYPES:
        e["body_wire"] = jsonable(msgspec.msgpack.decode(body))
        e["body"] = jsonable(decode_body(h["type"], body))
    elif h["type"] == FrameType.KV_CHUNK:
        e["body"] = None
    if h["payload_len"]:
        e["payload_hex"] = payload.hex()
        e["payload_ok"] = payload_ok
    return e


def frame(t: int, body=None, **kw) -> bytes:
    return encode_bytes(t, b"" if body is None else encode_body(body), **kw)


class Vectors:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.entries: list[dict] = []

    def write(self, name: str, data: bytes) -> str:
        fn = f"{name}.bin"
        (self.out / fn).write_bytes(data)
        return fn

    def ok(self, name: str, description: str, raw: bytes, *, payload_ok: bool = True) -> None:
        self.entries.append({"name": name, "kind": "frame", "file": self.write(name, raw),
                             "description": description, "outcome": "ok",
                             "frames": [frame_entry(raw, payload_ok=payload_ok)]})

    def bad_frame(self, name: str, description: str, raw: bytes, code: ErrorCode, after: int) -> None:
        self.entries.append({"name": name, "kind": "frame", "file": self.write(name, raw),
                             "description": description, "outcome": code.name, "stage": "frame",
                             "error_after": after, "header": header_json(raw), "frames": []})

    def bad_body(self, name: str, description: str, raw: bytes, code: ErrorCode) -> None:
        h = header_json(raw)
        self.entries.append({"name": name, "kind": "frame", "file": self.write(name, raw),
                             "description": description, "outcome": code.name, "stage": "body",
                             "frames": [{"header": h, "body_hex": raw[HEADER_SIZE:HEADER_SIZE + h["body_len"]].hex()}]})

    def engine(self, name: str, description: str, msg: p.Msg, *, to_agent: bool, fds: int = 0) -> None:
        raw = p.encode(msg)
        self.entries.append({"name": name, "kind": "engine", "file": self.write(name, raw),
                             "description": description, "to_agent": to_agent, "fds": fds, "outcome": "ok",
                             "messages": [msgspec.to_builtins(msg)],
                             "body_wire": jsonable(msgspec.msgpack.decode(raw[4:]))})

    def engine_bad(self, name: str, description: str, raw: bytes, code: ErrorCode, *, to_agent: bool,
                   after: int) -> None:
        self.entries.append({"name": name, "kind": "engine", "file": self.write(name, raw),
                             "description": description, "to_agent": to_agent, "fds": 0,
                             "outcome": code.name, "error_after": after, "messages": []})


# -- the vectors -----------------------------------------------------------------------------
def build(v: Vectors) -> None:
    hello = m.Hello(versions=[1], site="A", node="a1", incarnation=INCARNATION_A,
                    capabilities=["kv.v1", "tokens.v1", "resume.v1"], max_body=1 << 20, max_chunk=64 << 20,
                    credit_bytes=256 << 20, bulk_streams=4, ucx_tag_key=0xF0E1D2C3B4A59687)
    v.ok("hello", "HELLO from the dialer A/a1 (map body, every field present)", frame(FrameType.HELLO, hello))

    v.ok("hello_minimal_future",
         "HELLO with only the required keys plus a key this version does not know: the unknown key is "
         "ignored and absent keys take their defaults",
         encode_bytes(FrameType.HELLO, msgspec.msgpack.encode(
             {"versions": [1, 2], "site": "A", "node": "a1", "incarnation": INCARNATION_A,
              "zstd_level": 3})))

    welcome = m.Welcome(version=1, site="B", node="b1", incarnation=INCARNATION_B, session=SESSION_TOKEN,
                        capabilities=["kv.v1", "tokens.v1", "resume.v1"], max_body=1 << 20, max_chunk=64 << 20,
                        credit_bytes=128 << 20, bulk_streams=4, resumed=False)
    v.ok("welcome", "WELCOME from the listener B/b1", frame(FrameType.WELCOME, welcome))

    v.ok("error", "ERROR (array body) naming UNSUPPORTED_PROTOCOL_VERSION",
         frame(FrameType.ERROR, m.Error(int(ErrorCode.UNSUPPORTED_PROTOCOL_VERSION),
                                        "no common protocol version: peer offers [2], this agent speaks [1]")))
    v.ok("ping", "PING", frame(FrameType.PING, m.Ping(7, 1_234_567_890_123)))
    v.ok("pong", "PONG echoing the PING", frame(FrameType.PONG, m.Pong(7, 1_234_567_890_123)))
    v.ok("ping_future",
         "PING whose array body has one trailing element this version does not know: it is ignored",
         encode_bytes(FrameType.PING, msgspec.msgpack.encode([7, 1_234_567_890_123, "later"])))
    v.ok("bulk_hello", "BULK_HELLO on bulk stream 2, presenting the WELCOME's session token",
         frame(FrameType.BULK_HELLO, m.BulkHello(session=SESSION_TOKEN, stream=2, site="A", node="a1")))
    v.ok("bulk_welcome", "BULK_WELCOME for stream 2", frame(FrameType.BULK_WELCOME, m.BulkWelcome(2)))
    v.ok("goodbye", "GOODBYE", frame(FrameType.GOODBYE, m.Goodbye("shutdown")))
    v.ok("goodbye_idle", "GOODBYE of a fleet idle close (handshake.md section 8)",
         frame(FrameType.GOODBYE, m.Goodbye("idle")))
    v.ok("error_dial_back", "ERROR DIAL_BACK: the answer to a fleet knock (handshake.md section 8)",
         frame(FrameType.ERROR, m.Error(int(ErrorCode.DIAL_BACK), "A/a1 dials you: dialing now")))
    v.ok("error_too_many_connections",
         "ERROR TOO_MANY_CONNECTIONS: a listener at its limits.max_peer_connections answers a HELLO or BULK_HELLO "
         "(handshake.md section 2)",
         frame(FrameType.ERROR, m.Error(int(ErrorCode.TOO_MANY_CONNECTIONS),
                                        "B/b1 has its limits.max_peer_connections (64) authenticated connections "
                                        "open: dial again later")))

    tid = 41
    total, chunk, block = 5 << 20, 2 << 20, 1 << 20  # 5 blocks of 1 MiB in chunks of 2 MiB -> 3 chunks
    v.ok("kv_begin", "KV_BEGIN: 5 blocks of 1 MiB in 3 chunks of 2 MiB, 30 s left",
         frame(FrameType.KV_BEGIN, m.KvBegin("req-42", total, chunk, 3, block, 5, 30_000), transfer_id=tid))
    v.ok("kv_accept", "KV_ACCEPT", frame(FrameType.KV_ACCEPT, m.KvAccept("req-42"), transfer_id=tid))
    v.ok("kv_reject", "KV_REJECT with SIZE_MISMATCH",
         frame(FrameType.KV_REJECT, m.KvReject("req-42", int(ErrorCode.SIZE_MISMATCH),
                                               "sender has 5 blocks of 1048576 bytes, receiver posted 4 blocks "
                                               "of 1048576 bytes"), transfer_id=tid))

    payload = bytes(range(256)) * 2 + b"pdd-wire"  # 520 bytes
    chunk_raw = frame(FrameType.KV_CHUNK, lane=Lane.BULK, transfer_id=tid, seq=2, payload=[payload])
    v.ok("kv_chunk", "KV_CHUNK 2 with a 520-byte payload; flag 1 set, payload_xxh3 over the payload",
         chunk_raw)
    bad = bytearray(chunk_raw)
    bad[HEADER_SIZE + 100] ^= 0x01  # the header check does not cover the payload: framing still ok
    v.ok("kv_chunk_corrupt",
         "the same KV_CHUNK with one payload bit flipped: well formed, payload_ok false (answer KV_NACK)",
         bytes(bad), payload_ok=False)

    v.ok("kv_ack", "KV_ACK of chunks 0..2", frame(FrameType.KV_ACK, m.KvAck(0, 3), transfer_id=tid))
    v.ok("kv_ack_default", "KV_ACK of chunk 1 with count omitted (defaults to 1)",
         encode_bytes(FrameType.KV_ACK, msgspec.msgpack.encode([1]), transfer_id=tid))
    v.ok("kv_nack", "KV_NACK of chunk 2 (CHUNK_CHECKSUM)", frame(FrameType.KV_NACK, m.KvNack(2), transfer_id=tid))
    v.ok("kv_done", "KV_DONE", frame(FrameType.KV_DONE, m.KvDone("req-42", total), transfer_id=tid))
    v.ok("kv_cancel", "KV_CANCEL sent by the receiver (by_receiver true) on its deadline",
         frame(FrameType.KV_CANCEL, m.KvCancel("req-42", int(ErrorCode.TRANSFER_TIMEOUT), "transfer deadline passed",
                                               True), transfer_id=tid))
    v.ok("kv_resume", "KV_RESUME", frame(FrameType.KV_RESUME, m.KvResume("req-42"), transfer_id=tid))
    v.ok("kv_status", "KV_STATUS receiving, chunks 0 and 2 of 3 verified (bitmap 0x05)",
         frame(FrameType.KV_STATUS, m.KvStatus("req-42", 1, bitmap_from([0, 2], 3)), transfer_id=tid))
    v.ok("kv_status_complete", "KV_STATUS complete (have omitted)",
         encode_bytes(FrameType.KV_STATUS, msgspec.msgpack.encode(["req-42", 2]), transfer_id=tid))
    tokens = m.Tokens("req-42", 3, [101, 7592, 2088, 0, 151_643])
    v.ok("tokens", "TOKENS: tokens 3..7 of req-42 on the token lane",
         frame(FrameType.TOKENS, tokens, lane=Lane.TOKEN))
    v.ok("tokens_ack", "TOKENS_ACK: everything before 8 delivered",
         frame(FrameType.TOKENS_ACK, m.TokensAck("req-42", 8), lane=Lane.TOKEN))
    v.ok("handoff_progress", "HANDOFF_PROGRESS: MD holds the KV and absorbed tokens < 40 (epoch 1)",
         frame(FrameType.HANDOFF_PROGRESS, m.HandoffProgress("req-42", 1, 40), lane=Lane.TOKEN))
    v.ok("handoff_commit", "HANDOFF_COMMIT: RLD emitted [0, 100), MD owns from 100, one-shot",
         frame(FrameType.HANDOFF_COMMIT, m.HandoffCommit("req-42", 1, 100, "one-shot"), lane=Lane.TOKEN))
    v.ok("handoff_taken", "HANDOFF_TAKEN: MD emits from 100",
         frame(FrameType.HANDOFF_TAKEN, m.HandoffTaken("req-42", 1, 100), lane=Lane.TOKEN))
    v.ok("handoff_release", "HANDOFF_RELEASE: MD never emitted; RLD keeps or resumes",
         frame(FrameType.HANDOFF_RELEASE, m.HandoffRelease("req-42", 1, "kv_cancelled"), lane=Lane.TOKEN))
    v.ok("handoff_abort", "HANDOFF_ABORT: RLD keeps the output",
         frame(FrameType.HANDOFF_ABORT, m.HandoffAbort("req-42", 1, "deadline"), lane=Lane.TOKEN))
    v.ok("prefix_query", "PREFIX_QUERY: which leading blocks of this chain does your node hold?",
         frame(FrameType.PREFIX_QUERY, m.PrefixQuery("req-42", [0x1234567890ABCDEF, 42, 7], 30000), transfer_id=9))
    v.ok("prefix_match", "PREFIX_MATCH: the first 2 are held (and leased)",
         frame(FrameType.PREFIX_MATCH, m.PrefixMatch("req-42", 2), transfer_id=9))
    v.ok("request_abort", "REQUEST_ABORT: the request is dead on every site",
         frame(FrameType.REQUEST_ABORT, m.RequestAbort("req-42", "client disconnected"), lane=Lane.TOKEN))
    v.ok("kv_offer", "KV_OFFER: a receive of 5 blocks of 1 MiB is posted for this peer, for 60 s more",
         frame(FrameType.KV_OFFER, m.KvOffer("req-42", total, block, 60_000)))
    v.ok("kv_withdraw", "KV_WITHDRAW: the offered receive is gone",
         frame(FrameType.KV_WITHDRAW, m.KvWithdraw("req-42")))
    v.ok("kv_begin_offered", "KV_BEGIN taking the KV_OFFER (offered true; skip_blocks and post_wait_ms 0): "
                             "its chunks follow at once, no KV_ACCEPT",
         frame(FrameType.KV_BEGIN, m.KvBegin("req-42", total, chunk, 3, block, 5, 30_000, 0, 0, True), transfer_id=tid))

    # -- two frames back to back, fed in two pieces split at an odd offset inside the second header
    f1 = frame(FrameType.KV_ACK, m.KvAck(5, 1), transfer_id=tid)
    f2 = frame(FrameType.TOKENS, m.Tokens("req-43", 0, [1, 2, 3]), lane=Lane.TOKEN)
    split = len(f1) + 13
    if split % 2 == 0:
        split += 1
    v.entries.append({"name": "two_frames_split", "kind": "frame", "file": v.write("two_frames_split", f1 + f2),
                      "description": f"KV_ACK then TOKENS back to back; feed bytes [0,{split}) then the rest: "
                                     "the first piece yields one frame, the second the other",
                      "outcome": "ok", "split_at": split, "split_yields": [1, 1],
                      "frames": [frame_entry(f1), frame_entry(f2)]})

    # -- framing errors (FrameReader raises; the receiver sends ERROR and closes the connection)
    ping_body = encode_body(m.Ping(7, 1_234_567_890_123))
    ping = frame(FrameType.PING, m.Ping(7, 1_234_567_890_123))
    v.bad_frame("bad_magic", "magic 'PDDX' (check recomputed): rejected after the 48 header bytes",
                reseal(b"PDDX" + ping[4:]), ErrorCode.BAD_MAGIC, HEADER_SIZE)
    v2 = encode_header(Header(type=FrameType.PING, version=2), ping_body) + ping_body
    v.bad_frame("bad_frame_version", "frame version 2 (check valid): rejected after the header",
                v2, ErrorCode.UNSUPPORTED_FRAME_VERSION, HEADER_SIZE)
    bad = bytearray(ping)
    bad[40] ^= 0xFF
    v.bad_frame("bad_check", "header check off by one byte: rejected once the body has been read",
                bytes(bad), ErrorCode.HEADER_CHECKSUM, len(ping))
    bad = bytearray(ping)
    bad[HEADER_SIZE + 1] ^= 0x01
    v.bad_frame("bad_check_body", "one body bit flipped (the check covers the body): rejected after the body",
                bytes(bad), ErrorCode.HEADER_CHECKSUM, len(ping))
    big = HEADER.pack(MAGIC, 1, FrameType.TOKENS, 0, Lane.TOKEN, 0, 0, MAX_BODY + 1, 0, 0, 0, 0)
    v.bad_frame("body_too_large", f"body_len {MAX_BODY + 1} > max_body {MAX_BODY}: only the header is sent; "
                                  "rejected from the header alone (check not examined)",
                reseal(big), ErrorCode.FRAME_TOO_LARGE, HEADER_SIZE)
    big = HEADER.pack(MAGIC, 1, FrameType.KV_CHUNK, 1, Lane.BULK, tid, 0, 0, MAX_PAYLOAD + 1, 0, 0, 0)
    v.bad_frame("payload_too_large", f"payload_len {MAX_PAYLOAD + 1} > max_payload {MAX_PAYLOAD}: only the header",
                reseal(big), ErrorCode.FRAME_TOO_LARGE, HEADER_SIZE)
    bad = bytearray(ping)
    bad[44] = 1
    v.bad_frame("reserved_nonzero", "header bytes 44..47 not zero: rejected after the header (code MALFORMED_BODY)",
                bytes(bad), ErrorCode.MALFORMED_BODY, HEADER_SIZE)

    # -- body errors (framing ok; decode_body raises)
    v.bad_body("unknown_frame_type", "frame type 9 is not assigned: framing ok, the body cannot be decoded",
               encode_bytes(9, msgspec.msgpack.encode([])), ErrorCode.UNKNOWN_FRAME_TYPE)
    v.bad_body("malformed_short_array", "PING body [7]: fewer elements than required fields",
               encode_bytes(FrameType.PING, msgspec.msgpack.encode([7])), ErrorCode.MALFORMED_BODY)
    v.bad_body("malformed_wrong_type", "KV_ACK body ['0', 1]: a string where an int is required",
               encode_bytes(FrameType.KV_ACK, msgspec.msgpack.encode(["0", 1]), transfer_id=tid),
               ErrorCode.MALFORMED_BODY)
    v.bad_body("malformed_map_for_array", "PING body given as a map: array bodies must be arrays",
               encode_bytes(FrameType.PING, msgspec.msgpack.encode({"nonce": 7, "sent_ns": 1})),
               ErrorCode.MALFORMED_BODY)
    v.bad_body("malformed_trailing_bytes", "PING body followed by one stray byte inside body_len",
               encode_bytes(FrameType.PING, ping_body + b"\xc0"), ErrorCode.MALFORMED_BODY)

    # -- out-of-range values (proto/messages.md "Ranges"): the body decodes by type, a value does not fit
    enc = msgspec.msgpack.encode
    hello_min = {"versions": [1], "site": "A", "node": "a1", "incarnation": INCARNATION_A}
    for name, desc, raw in (
        ("range_kv_ack_negative", "KV_ACK [-1, 1]: a negative chunk index",
         encode_bytes(FrameType.KV_ACK, enc([-1, 1]), transfer_id=tid)),
        ("range_kv_ack_count_0", "KV_ACK [0, 0]: count must be at least 1",
         encode_bytes(FrameType.KV_ACK, enc([0, 0]), transfer_id=tid)),
        ("range_kv_nack_negative", "KV_NACK [-1]: a negative chunk index (must not wrap to the last one)",
         encode_bytes(FrameType.KV_NACK, enc([-1]), transfer_id=tid)),
        ("range_kv_nack_2_32", "KV_NACK [2^32]: above the largest chunk index 2^32-1",
         encode_bytes(FrameType.KV_NACK, enc([1 << 32]), transfer_id=tid)),
        ("range_hello_max_chunk_1", "HELLO max_chunk 1: below the minimum of 4096",
         encode_bytes(FrameType.HELLO, enc({**hello_min, "max_chunk": 1}))),
        ("range_hello_max_body_0", "HELLO max_body 0: below the minimum of 4096",
         encode_bytes(FrameType.HELLO, enc({**hello_min, "max_body": 0}))),
        ("range_hello_credit_0", "HELLO credit_bytes 0: below the minimum of 4096",
         encode_bytes(FrameType.HELLO, enc({**hello_min, "credit_bytes": 0}))),
        ("range_hello_incarnation_0", "HELLO incarnation 0: incarnations are non-zero",
         encode_bytes(FrameType.HELLO, enc({**hello_min, "incarnation": 0}))),
        ("range_hello_bad_site_name", "HELLO site 'A/../x': not a site name",
         encode_bytes(FrameType.HELLO, enc({**hello_min, "site": "A/../x"}))),
        ("range_kv_begin_chunk_bytes_0", "KV_BEGIN chunk_bytes 0",
         encode_bytes(FrameType.KV_BEGIN, enc(["req-42", 8 << 20, 0, 2, 4 << 20, 2]), transfer_id=tid)),
        ("range_kv_begin_n_chunks_wrong", "KV_BEGIN n_chunks 3 where ceil(total_bytes / chunk_bytes) = 2",
         encode_bytes(FrameType.KV_BEGIN, enc(["req-42", 8 << 20, 4 << 20, 3, 4 << 20, 2]), transfer_id=tid)),
        ("range_kv_begin_total_not_blocks", "KV_BEGIN total_bytes 8 MiB + 1 with 2 blocks of 4 MiB",
         encode_bytes(FrameType.KV_BEGIN, enc(["req-42", (8 << 20) + 1, 4 << 20, 3, 4 << 20, 2]), transfer_id=tid)),
        ("range_kv_begin_deadline", "KV_BEGIN deadline_ms above 7 days",
         encode_bytes(FrameType.KV_BEGIN, enc(["req-42", 8 << 20, 4 << 20, 2, 4 << 20, 2, 604_800_001]),
                      transfer_id=tid)),
        ("range_tokens_negative_id", "TOKENS with token id -1",
         encode_bytes(FrameType.TOKENS, enc(["req-42", 0, [101, -1]]), lane=Lane.TOKEN)),
        ("range_tokens_id_2_64", "TOKENS with token id 2^64-1 (ids are 0..2^32-1)",
         encode_bytes(FrameType.TOKENS, enc(["req-42", 0, [(1 << 64) - 1]]), lane=Lane.TOKEN)),
        ("range_request_id_257", "KV_ACCEPT with a request id of 257 characters (at most 256)",
         encode_bytes(FrameType.KV_ACCEPT, enc(["r" * 257]), transfer_id=tid)),
        ("range_request_id_empty", "KV_RESUME with an empty request id",
         encode_bytes(FrameType.KV_RESUME, enc([""]), transfer_id=tid)),
        ("range_kv_offer_ttl_0", "KV_OFFER ttl_ms 0 (an offer stands 1 ms .. 7 days)",
         encode_bytes(FrameType.KV_OFFER, enc(["req-42", 8 << 20, 4 << 20, 0]))),
        ("range_kv_offer_total_not_blocks", "KV_OFFER total_bytes 8 MiB + 1 with blocks of 4 MiB",
         encode_bytes(FrameType.KV_OFFER, enc(["req-42", (8 << 20) + 1, 4 << 20, 1000]))),
        ("range_bulk_stream_64", "BULK_HELLO stream 64 (streams are 0..63)",
         encode_bytes(FrameType.BULK_HELLO, enc({"session": SESSION_TOKEN, "stream": 64, "site": "A", "node": "a1"}))),
    ):
        v.bad_body(name, desc + ": OUT_OF_RANGE, the connection is closed", raw, ErrorCode.OUT_OF_RANGE)
    tokens_on_control = HEADER.pack(MAGIC, 1, FrameType.TOKENS, 0, Lane.CONTROL, 0, 0, 0, 0, 0, 0, 0)
    v.bad_frame("lane_mismatch", "TOKENS (a lane-1 type) on lane 0: rejected after the header (MALFORMED_BODY)",
                reseal(tokens_on_control), ErrorCode.MALFORMED_BODY, HEADER_SIZE)
    v.ok("kv_reject_unknown_code", "KV_REJECT with code 999, which no version assigns: decoded as PEER_ERROR (311), "
                                   "the peer's code appended to the message",
         encode_bytes(FrameType.KV_REJECT, enc(["req-42", 999, "from the future"]), transfer_id=tid))

    # -- the engine socket (4-byte big-endian length + msgpack map tagged by "op")
    v.engine("engine_hello", "hello request", p.Hello(id=1, engine="prefill-0", pid=4242), to_agent=True)
    v.engine("engine_register", "register request; one fd rides with it as SCM_RIGHTS (not in the file)",
             p.Register(id=2, size=64 << 20, block_bytes=2 << 20, kind="host-fd", name="kv-pool"),
             to_agent=True, fds=1)
    v.engine("engine_post_recv", "post_recv request: blocks 32..47 of region 1, site A only",
             p.PostRecv(id=3, request_id="req-42", blocks=[(1, 32, 16)], from_site="A"), to_agent=True)
    v.engine("engine_send_kv", "send_kv request to site B with a 30 s deadline",
             p.SendKv(id=4, request_id="req-42", blocks=[(1, 0, 8), (1, 16, 8)], to=["B"], deadline_s=30.0),
             to_agent=True)
    v.engine("engine_expect_tokens", "expect_tokens request (protocol 3): this engine takes request r-7's tokens "
             "from site A", p.ExpectTokens(id=5, request_id="r-7", from_site="A"), to_agent=True)
    v.engine("engine_ok_register", "ok reply to the register request",
             p.Ok(id=2, result={"region": 1, "blocks": 32}), to_agent=False)
    v.engine("engine_err", "err reply", p.Err(id=3, code=int(ErrorCode.DUPLICATE_TRANSFER),
                                              message="request 'req-42' already has a posted receive"),
             to_agent=False)
    v.engine("engine_kv_received", "kv_received event (id 0)",
             p.KvReceived(request_id="req-42", transfer_id=41, peer="A/a1", bytes=5 << 20, seconds=0.125),
             to_agent=False)
    v.engine("engine_tokens", "tokens event",
             p.TokensReceived(request_id="req-42", peer="A/a1", seq=3, tokens=[101, 7592]), to_agent=False)
    v.engine_bad("engine_too_large", "length prefix 16 MiB + 1: rejected from the 4 length bytes alone",
                 struct.pack(">I", (16 << 20) + 1), ErrorCode.FRAME_TOO_LARGE, to_agent=True, after=4)
    unknown = msgspec.msgpack.encode({"op": "frobnicate", "id": 9})
    v.engine_bad("engine_unknown_op", "an op the agent does not know: MALFORMED_BODY (and the agent closes)",
                 struct.pack(">I", len(unknown)) + unknown, ErrorCode.MALFORMED_BODY, to_agent=True,
                 after=4 + len(unknown))
    no_id = msgspec.msgpack.encode({"op": "status"})
    v.engine_bad("engine_request_id_0", "a request without an id (id 0 is for events and connection errors): "
                 "MALFORMED_BODY (and the agent closes)",
                 struct.pack(">I", len(no_id)) + no_id, ErrorCode.MALFORMED_BODY, to_agent=True,
                 after=4 + len(no_id))
    neg_id = msgspec.msgpack.encode({"op": "status", "id": -1})
    v.engine_bad("engine_request_id_negative", "a request with a negative id (request ids are 1..2^64-1): "
                 "MALFORMED_BODY (and the agent closes)",
                 struct.pack(">I", len(neg_id)) + neg_id, ErrorCode.MALFORMED_BODY, to_agent=True,
                 after=4 + len(neg_id))
    neg = msgspec.msgpack.encode({"op": "send_kv", "id": 4, "request_id": "r-1", "blocks": [[1, 0, 1]],
                                  "to": ["B"], "block_hashes": [-1]})
    v.engine_bad("engine_range_block_hash_negative", "send_kv with a block hash outside uint64 (-1): "
                 "MALFORMED_BODY (and the agent closes)",
                 struct.pack(">I", len(neg)) + neg, ErrorCode.MALFORMED_BODY, to_agent=True, after=4 + len(neg))


def generate(out: Path) -> list[str]:
    """Write every vector and ``vectors.json`` into ``out``; returns the file names."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    v = Vectors(out)
    build(v)
    _self_check(v)
    doc = {"format": 1, "generator": "proto/vectors/generate.py", "protocol_version": m.PROTOCOL_VERSION,
           "limits": {"max_body": MAX_BODY, "max_payload": MAX_PAYLOAD, "engine_max_message": p.MAX_MESSAGE},
           "vectors": v.entries}
    (out / "vectors.json").write_text(json.dumps(doc, indent=1) + "\n")
    return ["vectors.json"] + [e["file"] for e in v.entries]


def _self_check(v: Vectors) -> None:
    """Refuse to write a vector whose outcome the reader disagrees with (a generator bug)."""
    from pdd_wire.errors import ProtocolError

    for e in v.entries:
        if e["kind"] != "frame":
            continue
        data = (v.out / e["file"]).read_bytes()
        r = FrameReader(max_body=MAX_BODY, max_payload=MAX_PAYLOAD)
        try:
            frames = r.feed(data)
            for f in frames:
                decode_body(f.header.type, f.body)
        except ProtocolError as exc:
            assert exc.code.name == e["outcome"], (e["name"], exc)
        else:
            assert e["outcome"] == "ok", e["name"]


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent
    names = generate(target)
    print(f"wrote {len(names)} files to {target}")
