"""Pure handshake rules: which version two agents speak and whether a peer may join.

No I/O: the session layer feeds it the decoded Hello and acts on the answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import ErrorCode, FatalHandshakeError, HandshakeError
from .messages import SUPPORTED_VERSIONS, Hello, Welcome

#: The largest KV chunk this implementation sends or accepts (advertised as ``max_chunk``).
MAX_CHUNK = 64 << 20

#: What this implementation can do beyond the base protocol (advertised in Hello/Welcome).
#: The capability that gives GOODBYE "idle" its meaning: the receiver drops its side of the
#: session (proto/handshake.md §8).
FLEET_CAPABILITY = "fleet.v1"
CAPABILITIES = ("kv.v1", "tokens.v1", "resume.v1", "handoff.v1", "abort.v1", "prefix.v1", "lz4.v1", "fleet.v1",
                "offer.v1", "inline.v1", "ucx-keys.v1")


def choose_version(offered: list[int], supported: Iterable[int] = SUPPORTED_VERSIONS) -> int:
    """The highest version both sides speak, or a fatal refusal that names both sets."""
    common = set(offered) & set(supported)
    if not common:
        raise FatalHandshakeError(
            f"no common protocol version: peer offers {sorted(offered)}, this agent speaks {sorted(supported)}",
            ErrorCode.UNSUPPORTED_PROTOCOL_VERSION)
    return max(common)


def check_peer(hello: Hello, known: dict[str, set[str]]) -> None:
    """Refuse a dialer whose site is not configured, or whose node is not a peer of that site.

    ``known`` maps site -> node names configured as peers ("*" admits any node of the site).
    """
    nodes = known.get(hello.site)
    if nodes is None:
        raise FatalHandshakeError(f"site {hello.site!r} is not a configured peer (known: {sorted(known)})",
                                  ErrorCode.UNKNOWN_PEER)
    if "*" not in nodes and hello.node not in nodes:
        raise FatalHandshakeError(f"node {hello.node!r} of site {hello.site!r} is not a configured peer",
                                  ErrorCode.UNKNOWN_PEER)


def negotiate_limit(mine: int, theirs: int) -> int:
    return min(mine, theirs)


@dataclass(frozen=True, slots=True)
class Limits:
    """What one side offers in its HELLO or WELCOME."""

    chunk_bytes: int  # the chunk size it would like to send
    credit_bytes: int  # unacknowledged KV bytes it accepts in flight
    bulk_streams: int


@dataclass(frozen=True, slots=True)
class Terms:
    """What a session runs under once both sides have spoken."""

    chunk_bytes: int
    window: int  # the credit window: never below one chunk, or nothing could ever be sent
    streams: int
    peer_max_chunk: int
    peer_max_body: int
    capabilities: frozenset[str]


def negotiate(mine: Limits, theirs: Hello | Welcome) -> Terms:
    """The smaller of both sides' limits (a peer's numbers never raise ours)."""
    chunk = min(mine.chunk_bytes, theirs.max_chunk)
    return Terms(chunk_bytes=chunk,
                 window=max(negotiate_limit(mine.credit_bytes, theirs.credit_bytes), chunk),
                 streams=max(1, min(mine.bulk_streams, theirs.bulk_streams)),
                 peer_max_chunk=theirs.max_chunk, peer_max_body=theirs.max_body,
                 capabilities=frozenset(theirs.capabilities))


def check_welcome(welcome: Welcome, site: str, node: str, address: str) -> None:
    """The dialer's checks of the WELCOME from the peer it dialed at ``address``."""
    if welcome.version not in SUPPORTED_VERSIONS:
        raise FatalHandshakeError(f"peer chose protocol version {welcome.version}, not one we offered",
                                  ErrorCode.UNSUPPORTED_PROTOCOL_VERSION)
    if (welcome.site, welcome.node) != (site, node):
        raise FatalHandshakeError(f"{address} answered as {welcome.site}/{welcome.node}, expected {site}/{node}",
                                  ErrorCode.IDENTITY_MISMATCH)


def refusal(code: int, message: str) -> HandshakeError:
    """A peer's ERROR frame during the handshake as the error the dialer raises: codes of the
    handshake group (2xx) are fatal (retried only after the longest backoff, proto/handshake.md §4),
    the rest are retried with the short one."""
    try:
        known = ErrorCode(code)
    except ValueError:
        known = ErrorCode.INTERNAL
    cls = FatalHandshakeError if 200 <= code < 300 else HandshakeError
    return cls(f"peer refused: {message}", known)
