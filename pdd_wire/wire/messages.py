"""Frame bodies between agents: msgspec Structs, one per frame type.

The handshake bodies are msgpack maps (named fields) so they can grow; every other body is a
msgpack array (``array_like=True``): small and fast on the hot path. New fields are only ever
appended, with defaults. KV bytes never appear here: they travel as the frame's payload.
The field tables are in ``proto/messages.md``.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from ..errors import ErrorCode, ProtocolError
from .frame import FrameType

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)

# Ranges of every peer-supplied number, checked while decoding (proto/messages.md "Ranges"). A
# value outside its range is OUT_OF_RANGE: the frame's connection is closed, nothing is handled.
MiB = 1 << 20
MAX_TOTAL_BYTES = 1 << 48  # one transfer (256 TiB)
MAX_CHUNKS = 1 << 32  # chunks of one transfer; chunk indexes are 0 .. MAX_CHUNKS-1
MIN_CHUNK = 4096  # smallest max_chunk / chunk_bytes a peer may ask for
MAX_DEADLINE_MS = 7 * 86400 * 1000  # errors.MAX_DURATION_S
MAX_TOKEN_ID = (1 << 32) - 1  # engines are held to token ids below 2^32 too
MAX_REQUEST_ID = 256  # characters on the wire (engines are held to 256 bytes)
MAX_TEXT = 4096  # characters of a free-text reason or message (ERROR: 512)
MAX_PREFIX_HASHES = 1 << 16  # hashes of one PREFIX_QUERY (a longer one is answered matched 0)
U16 = Annotated[int, Meta(ge=0, le=0xFFFF)]
U63 = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
U64 = Annotated[int, Meta(ge=0)]  # msgpack ints end at 2^64-1
Name = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")]  # \Z: $ lets a final newline through
RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID)]
Text = str  # free text is never refused: __post_init__ cuts it to MAX_TEXT (both when built and decoded)
Code = U16  # an unassigned code becomes PEER_ERROR when decoded (errors.peer_code)
ChunkIndex = Annotated[int, Meta(ge=0, le=MAX_CHUNKS - 1)]
Seq = Annotated[int, Meta(ge=0, le=(1 << 62))]  # token stream positions, handoff positions
Epoch = U63
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
Version = Annotated[int, Meta(ge=1, le=0xFFFF)]
Capability = Annotated[str, Meta(min_length=1, max_length=64)]
MaxBody = Annotated[int, Meta(ge=4096, le=16 * MiB)]
MaxChunk = Annotated[int, Meta(ge=MIN_CHUNK, le=256 * MiB)]
CreditBytes = Annotated[int, Meta(ge=MIN_CHUNK, le=MAX_TOTAL_BYTES)]
Streams = Annotated[int, Meta(ge=0, le=64)]
StreamIndex = Annotated[int, Meta(ge=0, le=63)]
Incarnation = Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]
DeadlineMs = Annotated[int, Meta(ge=0, le=MAX_DEADLINE_MS)]

#: The codes this agent knows (proto/errors.md); a peer's other codes, and 0 (OK: never sent, so
#: a failure "OK" would tell an engine nothing), become PEER_ERROR.
_KNOWN_CODES = frozenset(int(c) for c in ErrorCode if c != ErrorCode.OK)  # OK (0) is never sent


def _clip(msg: msgspec.Struct, field: str, limit: int = MAX_TEXT) -> None:
    """Cut a free-text field to ``limit`` characters: a long reason (an engine's, say) is not
    worth a closed connection, and only ``limit`` characters are kept or logged."""
    v = getattr(msg, field)
    if len(v) > limit:
        msgspec.structs.force_setattr(msg, field, v[:limit])


def _known_code(msg: Any) -> None:
    """A code this agent does not know becomes PEER_ERROR, the original kept in the message, so
    a handler never meets an unassigned code (proto/errors.md)."""
    if msg.code not in _KNOWN_CODES:
        msgspec.structs.force_setattr(msg, "message", f"{msg.message} (peer code {msg.code})"[:MAX_TEXT])
        msgspec.structs.force_setattr(msg, "code", int(ErrorCode.PEER_ERROR))

_fast = dict(array_like=True, frozen=True, gc=False, forbid_unknown_fields=False)


class Hello(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """First frame on a control connection, from the dialing agent."""

    versions: Annotated[list[Version], Meta(min_length=1, max_length=64)]
    site: Name
    node: Name
    incarnation: Incarnation  # random per agent process: a change means the peer restarted
    capabilities: Annotated[list[Capability], Meta(max_length=64)] = []
    max_body: MaxBody = 1 << 20
    max_chunk: MaxChunk = 64 << 20
    credit_bytes: CreditBytes = 256 << 20  # bytes of unacknowledged KV this side accepts in flight
    bulk_streams: Streams = 4
    ucx_address: Annotated[bytes, Meta(max_length=65536)] = b""  # UCX worker address; empty = TCP only
    ucx_tag_key: U64 = 0  # the key of the tags this side receives (ucx-keys.v1); 0 = none


class Welcome(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The listening agent's answer: the chosen version and its own identity and limits."""

    version: Version
    site: Name
    node: Name
    incarnation: Incarnation
    session: U63  # token the dialer presents on its bulk connections
    capabilities: Annotated[list[Capability], Meta(max_length=64)] = []
    max_body: MaxBody = 1 << 20
    max_chunk: MaxChunk = 64 << 20
    credit_bytes: CreditBytes = 256 << 20
    bulk_streams: Streams = 4
    resumed: bool = False  # same incarnations as the last session: transfers resume
    ucx_address: Annotated[bytes, Meta(max_length=65536)] = b""
    ucx_tag_key: U64 = 0


class BulkHello(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    session: U63
    stream: StreamIndex
    site: Name
    node: Name


class BulkWelcome(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    stream: StreamIndex


class Error(msgspec.Struct, **_fast):
    code: Code
    message: str

    def __post_init__(self) -> None:
        _known_code(self)
        _clip(self, "message", 512)


class Ping(msgspec.Struct, **_fast):
    nonce: U64
    sent_ns: U64


class Pong(msgspec.Struct, **_fast):
    nonce: U64
    sent_ns: U64  # echoed from the ping


class Goodbye(msgspec.Struct, **_fast):
    reason: Text = ""

    def __post_init__(self) -> None:
        _clip(self, "reason")


class KvBegin(msgspec.Struct, **_fast):
    """Announces a transfer; the header's transfer_id names it from now on."""

    request_id: RequestId
    total_bytes: Annotated[int, Meta(ge=1, le=MAX_TOTAL_BYTES)]
    chunk_bytes: Annotated[int, Meta(ge=MIN_CHUNK, le=64 * MiB)]
    n_chunks: Annotated[int, Meta(ge=1, le=MAX_CHUNKS)]
    block_bytes: Annotated[int, Meta(ge=1, le=MAX_TOTAL_BYTES)]
    n_blocks: Annotated[int, Meta(ge=1, le=MAX_TOTAL_BYTES)]
    deadline_ms: DeadlineMs = 0  # remaining budget at send time, 0 = the receiver's default
    skip_blocks: Annotated[int, Meta(ge=0, le=MAX_TOTAL_BYTES)] = 0  # the receiver holds the post's first blocks
    # The sender's lease: how long the receiver holds this KV_BEGIN until its receive is posted
    # (capped by the receiver's transfer.post_ttl_s); 0 = the receiver's transfer.unposted_wait_s.
    post_wait_ms: DeadlineMs = 0
    # Taken from a KV_OFFER: the chunks follow at once, without waiting for KV_ACCEPT (which the
    # receiver then sends only if it matched the transfer late: the early chunks were dropped).
    offered: bool = False

    def __post_init__(self) -> None:
        if self.total_bytes != self.block_bytes * self.n_blocks:
            raise ValueError(f"total_bytes {self.total_bytes} != block_bytes {self.block_bytes} "
                             f"x n_blocks {self.n_blocks}")
        if self.n_chunks != -(-self.total_bytes // self.chunk_bytes):
            raise ValueError(f"n_chunks {self.n_chunks} != ceil(total_bytes / chunk_bytes)")


class KvAccept(msgspec.Struct, **_fast):
    request_id: RequestId


class KvReject(msgspec.Struct, **_fast):
    request_id: RequestId
    code: Code
    message: Text

    def __post_init__(self) -> None:
        _known_code(self)
        _clip(self, "message")


class KvAck(msgspec.Struct, **_fast):
    """Chunks [first, first+count) of the header's transfer were verified and written."""

    first: ChunkIndex
    count: Annotated[int, Meta(ge=1, le=MAX_CHUNKS)] = 1

    def __post_init__(self) -> None:
        if self.first + self.count > MAX_CHUNKS:
            raise ValueError(f"chunks {self.first}+{self.count} run past {MAX_CHUNKS}")


class KvNack(msgspec.Struct, **_fast):
    chunk: ChunkIndex
    code: Code = int(ErrorCode.CHUNK_CHECKSUM)

    def __post_init__(self) -> None:
        if self.code not in _KNOWN_CODES:
            msgspec.structs.force_setattr(self, "code", int(ErrorCode.PEER_ERROR))


class KvDone(msgspec.Struct, **_fast):
    request_id: RequestId
    total_bytes: Annotated[int, Meta(ge=1, le=MAX_TOTAL_BYTES)]


class KvCancel(msgspec.Struct, **_fast):
    request_id: RequestId
    code: Code
    message: Text
    by_receiver: bool = False  # True: the header's transfer_id is one the peer is sending to us

    def __post_init__(self) -> None:
        _known_code(self)
        _clip(self, "message")


class KvResume(msgspec.Struct, **_fast):
    """After a reconnect: "which chunks of this transfer do you hold?" """

    request_id: RequestId


class KvStatus(msgspec.Struct, **_fast):
    """Answer to KvResume. ``state``: 0 unknown, 1 receiving, 2 complete.
    ``have`` is a bitmap of verified chunks (bit i = chunk i), little-endian bytes."""

    request_id: RequestId
    state: Annotated[int, Meta(ge=0, le=2)]
    have: Annotated[bytes, Meta(max_length=MAX_CHUNKS // 8)] = b""


class Tokens(msgspec.Struct, **_fast):
    """Token IDs of a request; ``seq`` is the index of the first token in the request's stream."""

    request_id: RequestId
    seq: Seq
    tokens: list[TokenId]
    handoff: bool = False  # RLD's relay of a handoff: MD's agent keeps it until MD's engine registers


class TokensAck(msgspec.Struct, **_fast):
    request_id: RequestId
    next_seq: Seq
    resend: bool = False  # a gap was seen: send again everything unacknowledged from next_seq


# Handoff of output ownership from relay decode to main decode (pdd_wire.desk.handoff_protocol drives them;
# proto/handoff.md specifies them). Control connection, lane TOKEN, transfer_id 0.
class HandoffProgress(msgspec.Struct, **_fast):
    """MD -> RLD: MD holds the request's KV and has absorbed every relayed token ``< absorbed``.
    The first one (after the KV arrived) says "ready"; then one after every extend, until the
    commit. Monotone: a smaller ``absorbed`` than one seen before is a stale copy."""

    request_id: RequestId
    epoch: Epoch
    absorbed: Seq


class HandoffCommit(msgspec.Struct, **_fast):
    """RLD -> MD: RLD emitted exactly positions ``[0, position)``, has relayed all of them, and
    emits nothing more unless MD releases; MD owns the output from ``position`` (>= 1)."""

    request_id: RequestId
    epoch: Epoch
    position: Seq
    mode: str = ""  # "one-shot" | "catch-up": for MD's logs and metrics

    def __post_init__(self) -> None:
        _clip(self, "mode", 64)


class HandoffTaken(msgspec.Struct, **_fast):
    """MD -> RLD: MD has absorbed every token < ``position`` and emits from it: RLD may free the
    request (its KV, its slot)."""

    request_id: RequestId
    epoch: Epoch
    position: Seq


class HandoffRelease(msgspec.Struct, **_fast):
    """MD -> RLD: MD has not emitted any position of this request and never will (this epoch).
    Before the commit: RLD keeps ownership. After it: RLD resumes from the commit position."""

    request_id: RequestId
    epoch: Epoch
    reason: Text = ""  # "kv_cancelled", "md_failed", "deadline", ...

    def __post_init__(self) -> None:
        _clip(self, "reason")


class HandoffAbort(msgspec.Struct, **_fast):
    """RLD -> MD: RLD never committed and never will (this epoch): it keeps the output. MD drops
    the request's KV and tokens."""

    request_id: RequestId
    epoch: Epoch
    reason: Text = ""  # "deadline", "md_failed", "finished", "md_released"

    def __post_init__(self) -> None:
        _clip(self, "reason")


class RequestAbort(msgspec.Struct, **_fast):
    """Either way: the request is dead (its client went away, an engine aborted it). The
    receiver ends everything it holds for it from the sender's site -- transfers, posted
    receives, KV waiting unposted, token streams, handoffs -- and tells its engines."""

    request_id: RequestId
    reason: Text = ""

    def __post_init__(self) -> None:
        _clip(self, "reason")


class PrefixQuery(msgspec.Struct, **_fast):
    """KV sender -> receiver: how many leading blocks of this chain does your node hold? Hold
    them for ``lease_ms`` for this request (a later query for the request replaces the lease)."""

    request_id: RequestId
    hashes: list[U64]  # (as many as max_body holds) chained 64-bit block hashes, in block order
    lease_ms: DeadlineMs = 30000


class PrefixMatch(msgspec.Struct, **_fast):
    """Receiver -> sender: the first ``matched`` blocks are held (and leased) here."""

    request_id: RequestId
    matched: Annotated[int, Meta(ge=0, le=MAX_CHUNKS)]


class KvOffer(msgspec.Struct, **_fast):
    """KV receiver -> sender: a receive is posted for ``request_id`` that this peer may fill; a
    transfer of exactly these sizes may start moving at once (KV_BEGIN ``offered``). Stands for
    ``ttl_ms`` or until KV_WITHDRAW, the control connection's end, or the sender's own send."""

    request_id: RequestId
    total_bytes: Annotated[int, Meta(ge=1, le=MAX_TOTAL_BYTES)]  # the whole post (before any matched prefix)
    block_bytes: Annotated[int, Meta(ge=1, le=MAX_TOTAL_BYTES)]
    ttl_ms: Annotated[int, Meta(ge=1, le=MAX_DEADLINE_MS)]

    def __post_init__(self) -> None:
        if self.total_bytes % self.block_bytes:
            raise ValueError(f"total_bytes {self.total_bytes} is not a whole number of {self.block_bytes}-byte blocks")


class KvWithdraw(msgspec.Struct, **_fast):
    """KV receiver -> sender: the KV_OFFER for ``request_id`` no longer stands (its receive was
    taken by another transfer, aborted, or expired)."""

    request_id: RequestId


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
    FrameType.KV_OFFER: KvOffer,
    FrameType.KV_WITHDRAW: KvWithdraw,
}
TYPE_OF: dict[type, int] = {v: k for k, v in BODY_TYPES.items()}

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[int, msgspec.msgpack.Decoder[Any]] = {t: msgspec.msgpack.Decoder(cls) for t, cls in BODY_TYPES.items()}


def u64s_that_fit(max_body: int, request_id: str) -> int:
    """How many uint64s (9 bytes of msgpack at most) a body of ``max_body`` bytes holds beside
    ``request_id`` and a few small fields: a TOKENS run's token ids, a PREFIX_QUERY's hashes."""
    return max(0, (max_body - 64 - len(request_id.encode())) // 9)


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
    except msgspec.ValidationError as exc:
        # A value of the right type outside its range (or inconsistent with another field) is
        # OUT_OF_RANGE; a wrong type or a missing field is MALFORMED_BODY.
        text = str(exc)
        wrong_type = any(s in text for s in ("`, got `", "Object missing", " of at least length ",
                                             " of at most length "))
        raise ProtocolError(f"{'malformed' if wrong_type else 'out-of-range value in'} "
                            f"{FrameType(frame_type).name} body: {exc}",
                            ErrorCode.MALFORMED_BODY if wrong_type else ErrorCode.OUT_OF_RANGE) from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed {FrameType(frame_type).name} body: {exc}",
                            ErrorCode.MALFORMED_BODY) from exc
    except RecursionError as exc:  # an unknown key's value nested thousands deep (2 KB do it)
        raise ProtocolError(f"malformed {FrameType(frame_type).name} body: nested too deep",
                            ErrorCode.MALFORMED_BODY) from exc


