"""Pure handshake rules: which version two agents speak and whether a peer may join.

No I/O: the session layer feeds it the decoded Hello and acts on the answer.
"""

from __future__ import annotations

from ..errors import ErrorCode, FatalHandshakeError
from .messages import SUPPORTED_VERSIONS, Hello

#: What this implementation can do beyond the base protocol (advertised in Hello/Welcome).
CAPABILITIES = ("kv.v1", "tokens.v1", "resume.v1", "handoff.v1", "abort.v1", "prefix.v1", "lz4.v1")


def choose_version(offered: list[int], supported=SUPPORTED_VERSIONS) -> int:
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
