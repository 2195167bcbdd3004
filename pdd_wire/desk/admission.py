"""What every engine request passes before a desk takes it: the agent still takes new work,
the request id is one the wire can carry, and a site named is a site name."""

from __future__ import annotations

from ..config import NAME
from ..errors import EngineRequestError, ErrorCode
from ..probe import PROBE_PREFIX

MAX_REQUEST_ID = 256  # bytes; every control frame about a request carries it


class Gate:
    """Open while the agent takes new work; closed once shutdown begins."""

    def __init__(self) -> None:
        self.closed = False

    def check(self) -> None:
        if self.closed:
            raise EngineRequestError("agent is shutting down", ErrorCode.SHUTTING_DOWN)


def check_request_id(request_id: str) -> None:
    if not 0 < len(request_id.encode()) <= MAX_REQUEST_ID:
        raise EngineRequestError(f"request_id must be 1..{MAX_REQUEST_ID} bytes, got {len(request_id.encode())}",
                                 ErrorCode.BAD_REQUEST)
    if request_id.startswith(PROBE_PREFIX[0]):
        raise EngineRequestError("request ids starting with a NUL character are reserved (probes)",
                                 ErrorCode.BAD_REQUEST)


def check_token_ids(tokens: list[int]) -> None:
    """Token IDs are 0..2^32-1 (min and max in C: a per-token check was 0.5 s on the loop for 15M)."""
    if tokens and not (min(tokens) >= 0 and max(tokens) < 1 << 32):
        raise EngineRequestError("token IDs must be in 0..2^32-1", ErrorCode.BAD_REQUEST)


def check_site(key: str, site: str | None) -> None:
    """``site`` (None: any) names a site as peers are named (``[A-Za-z0-9][A-Za-z0-9._-]{0,62}``):
    a post or a token stream tied to "A/a1" or "" could never be filled, and would end only at
    its ttl. Not checked against the configured peers: a peer may join later."""
    if site is not None and not NAME.match(site):
        raise EngineRequestError(f"{key} {site!r} is not a site name (1-63 of [A-Za-z0-9._-], starting with a "
                                 "letter or digit; a node is named in send_kv's to, never here)", ErrorCode.BAD_REQUEST)
