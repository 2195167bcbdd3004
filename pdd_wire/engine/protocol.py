"""The engine socket protocol: messages between an engine adapter and its local agent.

Sans-IO. Each message is a 4-byte big-endian length followed by a msgpack map tagged with
``"op"``. Requests carry an ``id`` chosen by the engine; the agent answers each with ``Ok`` or
``Err`` carrying the same ``id``. Events come unasked, with ``id`` 0. ``Register`` travels with
one file descriptor as SCM_RIGHTS ancillary data on the same ``sendmsg``. The full table is in
``proto/engine.md``.
"""

from __future__ import annotations

import struct

import msgspec

from ..errors import ErrorCode, ProtocolError

LENGTH = struct.Struct(">I")
MAX_MESSAGE = 16 << 20
ENGINE_PROTOCOL_VERSION = 1

_tagged = dict(tag_field="op", forbid_unknown_fields=False, kw_only=True)


class Msg(msgspec.Struct, **_tagged):
    id: int = 0


# -- requests (engine -> agent) ---------------------------------------------------------
class Hello(Msg, tag="hello"):
    engine: str
    pid: int = 0
    version: int = ENGINE_PROTOCOL_VERSION


class Register(Msg, tag="register"):
    """Register the memory behind the attached fd: ``size`` bytes cut in ``block_bytes`` blocks."""

    size: int
    block_bytes: int
    kind: str = "host-fd"
    name: str = ""


class Deregister(Msg, tag="deregister"):
    region: int


class PostRecv(Msg, tag="post_recv"):
    """Blocks that KV for ``request_id`` may fill, as ``[region, first_block, count]`` runs."""

    request_id: str
    blocks: list[tuple[int, int, int]]
    from_site: str | None = None  # only this site may fill them; None = any peer site


class SendKv(Msg, tag="send_kv"):
    """Send these blocks of ``request_id`` to each destination (``"B"`` or ``"B/b1"``)."""

    request_id: str
    blocks: list[tuple[int, int, int]]
    to: list[str]
    deadline_s: float | None = None


class SendTokens(Msg, tag="send_tokens"):
    request_id: str
    to: str
    tokens: list[int]


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
    prefix_hit_tokens: int
    expected_output_tokens: int
    kv_bytes_per_token: int


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


class Shutdown(Msg, tag="shutdown"):
    """The agent is stopping; open transfers end with TransferFailed(SHUTTING_DOWN)."""

    grace_s: float


Request = Hello | Register | Deregister | PostRecv | SendKv | SendTokens | Abort | Status | ChoosePipeline
ToEngine = Ok | Err | KvReceived | KvSent | TransferFailed | TokensReceived | Shutdown
Event = KvReceived | KvSent | TransferFailed | TokensReceived | Shutdown

_enc = msgspec.msgpack.Encoder()
_dec_request = msgspec.msgpack.Decoder(Request)
_dec_to_engine = msgspec.msgpack.Decoder(ToEngine)


def encode(msg: Msg) -> bytes:
    body = _enc.encode(msg)
    return LENGTH.pack(len(body)) + body


class Decoder:
    """``feed(bytes) -> messages``; raises ProtocolError on a bad length or body."""

    def __init__(self, *, to_agent: bool, max_message: int = MAX_MESSAGE) -> None:
        self._dec = _dec_request if to_agent else _dec_to_engine
        self._buf = bytearray()
        self.max_message = max_message

    def feed(self, data: bytes) -> list[Msg]:
        self._buf += data
        out = []
        while len(self._buf) >= 4:
            (n,) = LENGTH.unpack_from(self._buf)
            if n > self.max_message:
                raise ProtocolError(f"engine message of {n} bytes exceeds the limit of {self.max_message}",
                                    ErrorCode.FRAME_TOO_LARGE)
            if len(self._buf) < 4 + n:
                break
            body = bytes(self._buf[4:4 + n])
            del self._buf[:4 + n]
            try:
                out.append(self._dec.decode(body))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise ProtocolError(f"malformed engine message: {exc}", ErrorCode.MALFORMED_BODY) from exc
        return out
