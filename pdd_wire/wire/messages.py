"""Frame bodies between agents: msgspec Structs, one per frame type.

The handshake bodies are msgpack maps (named fields) so they can grow; every other body is a
msgpack array (``array_like=True``): small and fast on the hot path. New fields are only ever
appended, with defaults. KV bytes never appear here: they travel as the frame's payload.
The field tables are in ``proto/messages.md``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..errors import ErrorCode, ProtocolError
from .frame import FrameType

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)

_fast = dict(array_like=True, frozen=True, gc=False, forbid_unknown_fields=False)


class Hello(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """First frame on a control connection, from the dialing agent."""

    versions: list[int]
    site: str
    node: str
    incarnation: int  # random per agent process: a change means the peer restarted
    capabilities: list[str] = []
    max_body: int = 1 << 20
    max_chunk: int = 64 << 20
    credit_bytes: int = 256 << 20  # bytes of unacknowledged KV this side accepts in flight
    bulk_streams: int = 4
    ucx_address: bytes = b""  # UCX worker address for the same-site path; empty = TCP only


class Welcome(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The listening agent's answer: the chosen version and its own identity and limits."""

    version: int
    site: str
    node: str
    incarnation: int
    session: int  # token the dialer presents on its bulk connections
    capabilities: list[str] = []
    max_body: int = 1 << 20
    max_chunk: int = 64 << 20
    credit_bytes: int = 256 << 20
    bulk_streams: int = 4
    resumed: bool = False  # same incarnations as the last session: transfers resume
    ucx_address: bytes = b""


class BulkHello(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    session: int
    stream: int
    site: str
    node: str


class BulkWelcome(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    stream: int


class Error(msgspec.Struct, **_fast):
    code: int
    message: str


class Ping(msgspec.Struct, **_fast):
    nonce: int
    sent_ns: int


class Pong(msgspec.Struct, **_fast):
    nonce: int
    sent_ns: int  # echoed from the ping


class Goodbye(msgspec.Struct, **_fast):
    reason: str = ""


class KvBegin(msgspec.Struct, **_fast):
    """Announces a transfer; the header's transfer_id names it from now on."""

    request_id: str
    total_bytes: int
    chunk_bytes: int
    n_chunks: int
    block_bytes: int
    n_blocks: int
    deadline_ms: int = 0  # remaining budget at send time, 0 = the receiver's default
    skip_blocks: int = 0  # the receiver already holds the first blocks of the post (PREFIX_MATCH)
    # The sender's lease: how long the receiver holds this KV_BEGIN until its receive is posted
    # (capped by the receiver's transfer.post_ttl_s); 0 = the receiver's transfer.unposted_wait_s.
    post_wait_ms: int = 0


class KvAccept(msgspec.Struct, **_fast):
    request_id: str


class KvReject(msgspec.Struct, **_fast):
    request_id: str
    code: int
    message: str


class KvAck(msgspec.Struct, **_fast):
    """Chunks [first, first+count) of the header's transfer were verified and written."""

    first: int
    count: int = 1


class KvNack(msgspec.Struct, **_fast):
    chunk: int
    code: int = int(ErrorCode.CHUNK_CHECKSUM)


class KvDone(msgspec.Struct, **_fast):
    request_id: str
    total_bytes: int


class KvCancel(msgspec.Struct, **_fast):
    request_id: str
    code: int
    message: str
    by_receiver: bool = False  # True: the header's transfer_id is one the peer is sending to us


class KvResume(msgspec.Struct, **_fast):
    """After a reconnect: "which chunks of this transfer do you hold?" """

    request_id: str


class KvStatus(msgspec.Struct, **_fast):
    """Answer to KvResume. ``state``: 0 unknown, 1 receiving, 2 complete.
    ``have`` is a bitmap of verified chunks (bit i = chunk i), little-endian bytes."""

    request_id: str
    state: int
    have: bytes = b""


class Tokens(msgspec.Struct, **_fast):
    """Token IDs of a request; ``seq`` is the index of the first token in the request's stream."""

    request_id: str
    seq: int
    tokens: list[int]
    handoff: bool = False  # RLD's relay of a handoff: MD's agent keeps it until MD's engine registers


class TokensAck(msgspec.Struct, **_fast):
    request_id: str
    next_seq: int
    resend: bool = False  # a gap was seen: send again everything unacknowledged from next_seq


# Handoff of output ownership from relay decode to main decode (pdd_wire.handoff drives them;
# proto/handoff.md specifies them). Control connection, lane TOKEN, transfer_id 0.
class HandoffProgress(msgspec.Struct, **_fast):
    """MD -> RLD: MD holds the request's KV and has absorbed every relayed token ``< absorbed``.
    The first one (after the KV arrived) says "ready"; then one after every extend, until the
    commit. Monotone: a smaller ``absorbed`` than one seen before is a stale copy."""

    request_id: str
    epoch: int
    absorbed: int


class HandoffCommit(msgspec.Struct, **_fast):
    """RLD -> MD: RLD emitted exactly positions ``[0, position)``, has relayed all of them, and
    emits nothing more unless MD releases; MD owns the output from ``position`` (>= 1)."""

    request_id: str
    epoch: int
    position: int
    mode: str = ""  # "one-shot" | "catch-up": for MD's logs and metrics


class HandoffTaken(msgspec.Struct, **_fast):
    """MD -> RLD: MD has absorbed every token < ``position`` and emits from it: RLD may free the
    request (its KV, its slot)."""

    request_id: str
    epoch: int
    position: int


class HandoffRelease(msgspec.Struct, **_fast):
    """MD -> RLD: MD has not emitted any position of this request and never will (this epoch).
    Before the commit: RLD keeps ownership. After it: RLD resumes from the commit position."""

    request_id: str
    epoch: int
    reason: str = ""  # "kv_cancelled", "md_failed", "deadline", ...


class HandoffAbort(msgspec.Struct, **_fast):
    """RLD -> MD: RLD never committed and never will (this epoch): it keeps the output. MD drops
    the request's KV and tokens."""

    request_id: str
    epoch: int
    reason: str = ""  # "deadline", "md_failed", "finished", "md_released"


class RequestAbort(msgspec.Struct, **_fast):
    """Either way: the request is dead (its client went away, an engine aborted it). The
    receiver ends everything it holds for it from the sender's site -- transfers, posted
    receives, KV waiting unposted, token streams, handoffs -- and tells its engines."""

    request_id: str
    reason: str = ""


class PrefixQuery(msgspec.Struct, **_fast):
    """KV sender -> receiver: how many leading blocks of this chain does your node hold? Hold
    them for ``lease_ms`` for this request (a later query for the request replaces the lease)."""

    request_id: str
    hashes: list[int]  # chained 64-bit block hashes, in block order
    lease_ms: int = 30000


class PrefixMatch(msgspec.Struct, **_fast):
    """Receiver -> sender: the first ``matched`` blocks are held (and leased) here."""

    request_id: str
    matched: int


BODY_TYPES: dict[int, type] = {
    FrameType.HELLO: Hello,
    FrameType.WELCOME: Welcome,
    FrameType.ERROR: Error,
    FrameType.PING: Ping,
    FrameType.PONG: Pong,
    FrameType.BULK_HELLO: BulkHello,
    FrameType.BULK_WELCOME: BulkWelcome,
    FrameType.GOODBYE: Goodbye,
    FrameType.KV_BEGIN: KvBegin,
    FrameType.KV_ACCEPT: KvAccept,
    FrameType.KV_REJECT: KvReject,
    FrameType.KV_ACK: KvAck,
    FrameType.KV_NACK: KvNack,
    FrameType.KV_DONE: KvDone,
    FrameType.KV_CANCEL: KvCancel,
    FrameType.KV_RESUME: KvResume,
    FrameType.KV_STATUS: KvStatus,
    FrameType.TOKENS: Tokens,
    FrameType.TOKENS_ACK: TokensAck,
    FrameType.HANDOFF_PROGRESS: HandoffProgress,
    FrameType.HANDOFF_COMMIT: HandoffCommit,
    FrameType.HANDOFF_TAKEN: HandoffTaken,
    FrameType.HANDOFF_RELEASE: HandoffRelease,
    FrameType.HANDOFF_ABORT: HandoffAbort,
    FrameType.REQUEST_ABORT: RequestAbort,
    FrameType.PREFIX_QUERY: PrefixQuery,
    FrameType.PREFIX_MATCH: PrefixMatch,
}
TYPE_OF: dict[type, int] = {v: k for k, v in BODY_TYPES.items()}

_encoder = msgspec.msgpack.Encoder()
_decoders = {t: msgspec.msgpack.Decoder(cls) for t, cls in BODY_TYPES.items()}


def encode_body(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decode_body(frame_type: int, body: bytes) -> Any:
    """Decode a body for its frame type; KV_CHUNK has none (returns None)."""
    if frame_type == FrameType.KV_CHUNK:
        return None
    dec = _decoders.get(frame_type)
    if dec is None:
        raise ProtocolError(f"unknown frame type {frame_type}", ErrorCode.UNKNOWN_FRAME_TYPE)
    try:
        return dec.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed {FrameType(frame_type).name} body: {exc}",
                            ErrorCode.MALFORMED_BODY) from exc


def bitmap_from(chunks, n: int) -> bytes:
    out = bytearray((n + 7) // 8)
    for i in chunks:
        out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def bitmap_members(bm: bytes, n: int) -> set[int]:
    return {i for i in range(n) if i >> 3 < len(bm) and bm[i >> 3] >> (i & 7) & 1}
