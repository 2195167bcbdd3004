"""The engine socket protocol: messages between an engine adapter and its local agent.

Sans-IO. Each message is a 4-byte big-endian length followed by a msgpack map tagged with
``"op"``. Requests carry an ``id`` chosen by the engine; the agent answers each with ``Ok`` or
``Err`` carrying the same ``id``. Events come unasked, with ``id`` 0. ``Register`` travels with
one file descriptor as SCM_RIGHTS ancillary data on the same ``sendmsg``. The full table is in
``proto/engine.md``.
"""

from __future__ import annotations

import struct
from typing import Annotated

import msgspec

from ..errors import ErrorCode, ProtocolError

U64 = Annotated[int, msgspec.Meta(ge=0)]  # a block hash (proto/engine.md: [uint64]; msgpack ints end at 2^64-1)

LENGTH = struct.Struct(">I")
MAX_MESSAGE = 16 << 20
ENGINE_PROTOCOL_VERSION = 3  # 2: set_load and the handoff ops and events; 3: expect_tokens, tokens to owners only

class Msg(msgspec.Struct, tag_field="op", forbid_unknown_fields=False, kw_only=True):
    # A request's id is 1..2^64-1 (0 is refused by the Decoder): a negative one is malformed, so
    # the id an engine reads back is always the unsigned one it could have sent.
    id: U64 = 0


# -- requests (engine -> agent) ---------------------------------------------------------
#: An engine's name and a region's: in every log line about them, so bounded.
Label = Annotated[str, msgspec.Meta(max_length=256)]


class Hello(Msg, tag="hello"):
    engine: Label
    pid: int = 0
    version: int = ENGINE_PROTOCOL_VERSION


class Register(Msg, tag="register"):
    """Register the memory behind the attached fd: ``size`` bytes cut in ``block_bytes`` blocks."""

    size: int
    block_bytes: int
    kind: str = "host-fd"
    name: Label = ""


class Deregister(Msg, tag="deregister"):
    region: int


class PostRecv(Msg, tag="post_recv"):
    """Blocks that KV for ``request_id`` may fill, as ``[region, first_block, count]`` runs."""

    request_id: str
    blocks: list[tuple[int, int, int]]
    from_site: str | None = None  # only this site may fill them; None = any peer site
    ttl_s: float | None = None  # dropped (transfer_failed) if no transfer claims it by then; None = post_ttl_s
    # At most this many leading blocks may be covered by a matched prefix (KV_BEGIN skip_blocks:
    # blocks this node holds, not sent); a transfer that would skip more is refused PREFIX_LOST
    # and comes again whole. None = no limit.
    max_skip_blocks: int | None = None


class SendKv(Msg, tag="send_kv"):
    """Send these blocks of ``request_id`` to each destination (``"B"`` or ``"B/b1"``)."""

    request_id: str
    blocks: list[tuple[int, int, int]]
    to: list[str]
    deadline_s: float | None = None
    # Chained hashes of the blocks, in order (pdd_wire.engine.hashes.chain_hashes): a destination
    # whose node holds a leading run of them gets only the rest.
    block_hashes: list[U64] | None = None
    # The lease: how long each destination holds the transfer for its receive to be posted
    # (KV_BEGIN.post_wait_ms; the receiver caps it at its transfer.post_ttl_s). The blocks stay
    # pinned meanwhile. None = the receiver's transfer.unposted_wait_s.
    lease_s: float | None = None


class SendTokens(Msg, tag="send_tokens"):
    request_id: str
    to: str
    tokens: list[int]


class ExpectTokens(Msg, tag="expect_tokens"):
    """This engine takes the tokens peers relay for ``request_id`` (from ``from_site`` only;
    None = any peer site). Tokens that arrived before are delivered at once."""

    request_id: str
    from_site: str | None = None


class KvStored(Msg, tag="kv_stored"):
    """Decode side: this engine holds (and may reuse) these blocks, ``hashes[i]`` at the i-th
    block of ``blocks`` (the prefix inventory)."""

    blocks: list[tuple[int, int, int]]
    hashes: list[U64]


class KvEvict(Msg, tag="kv_evict"):
    """Decode side: the engine wants to drop these blocks. The reply says which it may drop now
    (``evicted``) and which are leased to a request in flight (``kept``). ``force``: they are
    gone anyway (leases on them break; those transfers fall back to shipping the blocks)."""

    hashes: list[U64]
    force: bool = False


class PrefixRelease(Msg, tag="prefix_release"):
    """Decode side: the request's reused prefix blocks have been used (its extend ran)."""

    request_id: str


class Abort(Msg, tag="abort"):
    """Cancel everything of ``request_id`` this engine holds, on both sites."""

    request_id: str
    reason: str = "aborted by engine"


class Status(Msg, tag="status"):
    pass


class ChoosePipeline(Msg, tag="choose_pipeline"):
    """Which PDD pipeline for a request, from its figures and the live link to ``to``."""

    request_id: str
    to: str  # the main decoder's site (or site/node)
    input_tokens: int
    expected_output_tokens: int
    kv_bytes_per_token: int
    prefix_hit_tokens: int = 0
    # With these, the matched prefix comes from MD's inventory (one round trip), not from the engine.
    block_hashes: list[U64] | None = None
    block_tokens: int = 0


class Estimate(Msg, tag="estimate"):
    """How long would ``bytes`` of KV to ``to`` (site or site/node) take now? From the live link
    estimate: ``{seconds (None while unknown), bandwidth_Bps, bandwidth_source, rtt_s, jitter_s, loss,
    queue_bytes, samples}``."""

    to: str
    bytes: int


class SetLoad(Msg, tag="set_load"):
    """This engine's decode load now (0 = idle, 1 = every decode slot in use; may exceed 1).
    RLD engines report it; the handoff mode policy reads the latest value."""

    load: float


class HandoffRld(Msg, tag="handoff_rld"):
    """RLD side (site A): this engine decodes ``request_id`` from position 0 and will hand its
    output to MD at ``to`` (site or site/node). From now on report every generated token with
    :class:`HandoffTokens` and emit to the user only what :class:`Emit` events allow."""

    request_id: str
    to: str
    epoch: int = 0  # 0..2^63-1 (sent to the peer in HANDOFF_*); out of range: BAD_REQUEST
    deadline_s: float | None = None  # commit by then or keep the output (timeouts.handoff_s)


class HandoffMd(Msg, tag="handoff_md"):
    """MD side (site B): this engine will take ``request_id`` over from RLD at ``from_site``
    once its KV (posted with :class:`PostRecv`) is here. The agent sends :class:`Extend` and
    :class:`StartGenerating` events; answer extends with :class:`HandoffExtended`."""

    request_id: str
    from_site: str
    epoch: int = 0  # 0..2^63-1 (sent to the peer in HANDOFF_*); out of range: BAD_REQUEST
    deadline_s: float | None = None  # start by then or release (handoff_s + handoff_md_margin_s)


class HandoffTokens(Msg, tag="handoff_tokens"):
    """Tokens this engine generated for a handoff request, in order (RLD: from position 0; MD:
    after :class:`StartGenerating`). ``last``: the final token of the request is among them."""

    request_id: str
    tokens: list[int]
    last: bool = False


class HandoffExtended(Msg, tag="handoff_extended"):
    """MD: the extend in flight is done: every relayed token < ``absorbed`` is in MD's KV."""

    request_id: str
    absorbed: int


class HandoffFail(Msg, tag="handoff_fail"):
    """MD: this engine cannot take the request over (before it started: RLD keeps it)."""

    request_id: str
    reason: str = "md_failed"


# -- replies (agent -> engine) -----------------------------------------------------------
class Ok(Msg, tag="ok"):
    result: dict = {}


class Err(Msg, tag="err"):
    code: int
    message: str


# -- events (agent -> engine, id 0) --------------------------------------------------------
class KvReceived(Msg, tag="kv_received"):
    request_id: str
    transfer_id: int
    peer: str
    bytes: int
    seconds: float
    # The first reused_blocks blocks of the post were not sent: this node holds them at
    # ``reused`` ([region, block, count] runs, leased until prefix_release or the lease ends).
    reused_blocks: int = 0
    reused: list[tuple[int, int, int]] = []


class KvSent(Msg, tag="kv_sent"):
    request_id: str
    transfer_id: int
    peer: str
    bytes: int
    seconds: float


class TransferFailed(Msg, tag="transfer_failed"):
    request_id: str
    transfer_id: int
    peer: str
    direction: str  # "out" or "in"
    code: int
    reason: str


class TokensReceived(Msg, tag="tokens"):
    request_id: str
    peer: str
    seq: int
    tokens: list[int]


class RequestAborted(Msg, tag="aborted"):
    """The request is dead: an engine aborted it here or at ``origin`` (a peer, "site/node").
    The agent has dropped everything it held for it on this engine's behalf."""

    request_id: str
    reason: str
    origin: str


class Shutdown(Msg, tag="shutdown"):
    """The agent is stopping; open transfers end with TransferFailed(SHUTTING_DOWN)."""

    grace_s: float


class Emit(Msg, tag="emit"):
    """Handoff: send output positions ``[first, first + len(tokens))`` to the user. Only these
    events authorise emitting; across RLD and MD every position is emitted exactly once."""

    request_id: str
    first: int
    tokens: list[int]


class Extend(Msg, tag="extend"):
    """MD: compute the KV of relayed tokens ``[first, first + len(tokens))`` in one extend step,
    then answer :class:`HandoffExtended` with ``absorbed = first + len(tokens)``."""

    request_id: str
    first: int
    tokens: list[int]


class StopGenerating(Msg, tag="stop_generating"):
    """RLD: stop decoding the request (keep reporting tokens of a step already running; keep
    its KV until :class:`HandoffDone`)."""

    request_id: str


class StartGenerating(Msg, tag="start_generating"):
    """Start (MD: take over) or resume (RLD) decoding; the next token is ``position``."""

    request_id: str
    position: int


class HandoffDone(Msg, tag="handoff_done"):
    """Ownership is settled: ``owner`` ("RLD" or "MD") emits the rest (MD from ``position``).
    ``reason``: a stable label (proto/handoff.md, ``Done``)."""

    request_id: str
    owner: str
    reason: str
    mode: str | None = None
    position: int | None = None


Request = (Hello | Register | Deregister | PostRecv | SendKv | SendTokens | ExpectTokens | Abort | Status
           | ChoosePipeline | SetLoad | Estimate | KvStored | KvEvict | PrefixRelease | HandoffRld | HandoffMd
           | HandoffTokens | HandoffExtended | HandoffFail)
ToEngine = (Ok | Err | KvReceived | KvSent | TransferFailed | TokensReceived | Shutdown | Emit | Extend
            | StopGenerating | StartGenerating | HandoffDone | RequestAborted)
_enc = msgspec.msgpack.Encoder()
_dec_request = msgspec.msgpack.Decoder(Request)
_dec_to_engine = msgspec.msgpack.Decoder(ToEngine)


def encode(msg: Msg) -> bytes:
    body = _enc.encode(msg)
    return LENGTH.pack(len(body)) + body


class BadMessage(ProtocolError):
    """The stream broke the protocol. ``decoded``: the messages complete before the offending
    bytes, in order, which the same ``feed`` call would otherwise have lost: the agent still
    serves them before it ends the connection (proto/engine.md §2)."""

    def __init__(self, message: str, code: ErrorCode, decoded: list[Msg]) -> None:
        super().__init__(message, code)
        self.decoded = decoded


class Decoder:
    """``feed(bytes) -> messages``; raises :class:`BadMessage` (a ProtocolError) on a bad length
    or body, carrying the messages decoded before it."""

    def __init__(self, *, to_agent: bool, max_message: int = MAX_MESSAGE) -> None:
        self._dec = _dec_request if to_agent else _dec_to_engine
        self._requests = to_agent  # a request's id must be non-zero (0 is the id of events and connection errors)
        self._buf = bytearray()
        self.max_message = max_message

    @property
    def pending(self) -> int:
        """Bytes of a message begun but not complete."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Msg]:
        self._buf += data
        out: list[Msg] = []
        while len(self._buf) >= 4:
            (n,) = LENGTH.unpack_from(self._buf)
            if n > self.max_message:
                raise BadMessage(f"engine message of {n} bytes exceeds the limit of {self.max_message}",
                                 ErrorCode.FRAME_TOO_LARGE, out)
            if len(self._buf) < 4 + n:
                break
            body = bytes(self._buf[4:4 + n])
            del self._buf[:4 + n]
            try:
                msg = self._dec.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:  # (nested too deep)
                raise BadMessage(f"malformed engine message: {exc}", ErrorCode.MALFORMED_BODY, out) from exc
            if self._requests and msg.id == 0:
                raise BadMessage(f"malformed engine message: {type(msg).__name__} request without an id "
                                 "(id 0 is only for events and connection errors; proto/engine.md §2)",
                                 ErrorCode.MALFORMED_BODY, out)
            out.append(msg)
        return out
