"""What every engine request passes before a desk takes it: the agent still takes new work,
and the request id is one the wire can carry."""

from __future__ import annotations

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
