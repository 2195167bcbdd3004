"""Errors: one tree rooted in :class:`PddWireError`, and the codes that cross the wire.

Every error that can reach a peer or an engine carries an :class:`ErrorCode`; the codes are
grouped by phase in the hundreds digit and listed, with their meaning, in ``proto/errors.md``.
``Fatal*`` classes mean "do not retry": a reconnect would meet the same refusal.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Wire error codes. The hundreds digit is the phase (see ``proto/errors.md``)."""

    OK = 0
    # 1xx: framing, any connection
    BAD_MAGIC = 100
    UNSUPPORTED_FRAME_VERSION = 101
    HEADER_CHECKSUM = 102
    FRAME_TOO_LARGE = 103
    UNKNOWN_FRAME_TYPE = 104
    MALFORMED_BODY = 105
    UNEXPECTED_FRAME = 106
    OUT_OF_RANGE = 107  # a body field outside its range in proto/messages.md, or inconsistent
    PEER_NOT_READING = 108  # a control connection's unsent bytes passed limits.control_buffer_bytes
    # 2xx: handshake
    UNSUPPORTED_PROTOCOL_VERSION = 200
    UNKNOWN_PEER = 201
    IDENTITY_MISMATCH = 202
    UNKNOWN_SESSION = 203
    HANDSHAKE_TIMEOUT = 204
    TLS_REFUSED = 205
    DIAL_BACK = 206  # fleet: the HELLO came from a peer this agent dials; it dials now
    TOO_MANY_CONNECTIONS = 207  # the listener's limits.max_peer_connections are all open: dial again later
    # 3xx: transfer
    NOT_POSTED = 300
    SIZE_MISMATCH = 301
    CHUNK_CHECKSUM = 302
    TRANSFER_CANCELLED = 303
    TRANSFER_TIMEOUT = 304
    PEER_UNREACHABLE = 305
    PEER_RESTARTED = 306
    DUPLICATE_TRANSFER = 307
    TOO_MANY_TRANSFERS = 308
    CHUNK_BUSY = 309
    PREFIX_LOST = 310
    PEER_ERROR = 311  # the peer sent a code this agent does not know
    # 4xx: engine socket
    BAD_REQUEST = 400
    UNKNOWN_REGION = 401
    OUT_OF_BOUNDS = 402
    UNKNOWN_PEER_SITE = 403
    ENGINE_GONE = 404
    LIMIT_EXCEEDED = 405
    UNKNOWN_REQUEST = 406
    UNSUPPORTED_BY_PEER = 407
    MEMORY_NOT_SEALED = 408  # register: the memfd is not sealed against shrinking (F_SEAL_SHRINK)
    # 5xx: agent lifecycle
    SHUTTING_DOWN = 500
    INTERNAL = 501


def peer_code(code: int) -> ErrorCode:
    """A code from a peer as this agent's ErrorCode; an unassigned one is PEER_ERROR."""
    try:
        return ErrorCode(code)
    except ValueError:
        return ErrorCode.PEER_ERROR


class PddWireError(Exception):
    """Root of every pdd-wire error. ``code`` is what a peer or an engine is told."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


MAX_DURATION_S = 7 * 86400  # the longest deadline, ttl or lease an engine may ask for
#: The largest KV_CHUNK payload a control connection carries (capability inline.v1,
#: proto/transfer.md §17); here so that the config can check against it (the wire re-exports it).
INLINE_MAX = 64 << 10


def check_duration(name: str, value: float) -> float:
    """``value`` seconds, if in (0, MAX_DURATION_S] (which also refuses nan and inf)."""
    if not 0 < value <= MAX_DURATION_S:
        raise EngineRequestError(f"{name} must be in (0, {MAX_DURATION_S}], got {value}", ErrorCode.BAD_REQUEST)
    return value


class ConfigError(PddWireError, ValueError):
    """Bad configuration; ``key`` names the offending key (dotted path)."""

    code = ErrorCode.BAD_REQUEST

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"config key {key!r}: {problem}")
        self.key = key
        self.problem = problem


class ProtocolError(PddWireError):
    """A peer broke the framing or the message rules; the connection must be closed."""

    code = ErrorCode.MALFORMED_BODY


class HandshakeError(ProtocolError):
    code = ErrorCode.UNSUPPORTED_PROTOCOL_VERSION


class FatalHandshakeError(HandshakeError):
    """Refused in a way a retry cannot fix (version, identity)."""


class TransportError(PddWireError, OSError):
    """A connection failed or was closed mid-operation."""

    code = ErrorCode.PEER_UNREACHABLE


class TransferError(PddWireError):
    """A transfer ended without delivering; ``code`` says why."""

    code = ErrorCode.TRANSFER_CANCELLED


class EngineRequestError(PddWireError):
    """An engine asked for something the agent will not do; the reply carries ``code``."""

    code = ErrorCode.BAD_REQUEST
