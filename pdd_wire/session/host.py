"""What a peer session needs from the agent that owns it (implemented by :class:`pdd_wire.agent.Agent`).

Generic in the session type so that this module imports nothing of the session it serves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ..config import Config
from ..wire import messages as m

if TYPE_CHECKING:
    from ..metrics import Metrics
    from ..transfer import InTransfer, OutTransfer
    from ..transport.base import DataPath
    from ..transport.bulk_loop import BulkLoop
    from ..transport.tcp import FrameProtocol
    from .acks import AckBatch
    from .link import LinkState

S = TypeVar("S", contravariant=True)


class SessionHost(Protocol[S]):
    config: Config
    metrics: "Metrics"
    incarnation: int

    @property
    def stopping(self) -> bool: ...  # the agent is shutting down (its sessions close for good)
    def next_transfer_id(self) -> int: ...
    def transfer_ended(self) -> None: ...
    def bulk_loop(self, stream: int) -> "BulkLoop": ...
    work_executor: Any  # where a session's copies off the loop run (None: the loop's default)
    def ssl_client(self, bulk: bool = False) -> Any: ...
    def incoming_begin(self, session: S, tid: int, begin: m.KvBegin) -> None: ...
    def kv_received(self, t: "InTransfer") -> None: ...
    def kv_sent(self, t: "OutTransfer") -> None: ...
    def transfer_failed(self, t: Any, direction: str, code: int, message: str) -> None: ...
    def tokens_received(self, session: S, msg: m.Tokens) -> None: ...
    def tokens_room(self, session: S, request_id: str) -> bool: ...
    def incoming_cancelled(self, session: S, tid: int, msg: m.KvCancel) -> None: ...
    def handoff_message(self, session: S, msg: Any) -> None: ...
    def session_up(self, session: S) -> None: ...
    def peer_lost(self, session: S, reason: str) -> None: ...
    def tokens_lost(self, session: S, why: str, code: int) -> None: ...  # before its token streams are dropped
    def peer_goodbye(self, session: S, reason: str) -> None: ...
    def request_aborted(self, session: S, msg: m.RequestAbort) -> None: ...
    def prefix_query(self, session: S, msg: m.PrefixQuery) -> int: ...


class Shell(Protocol):
    """What the sending and receiving sides use of their session (:class:`~.peer.PeerSession`)."""

    key: str
    cfg: Config
    host: SessionHost[Any]
    metrics: "Metrics"
    log: Any
    lines: Any  # its PeerLines: lines a peer can repeat at will go out once per period
    data: "DataPath"
    link: "LinkState"
    remote_caps: frozenset[str] | None
    closing: bool
    control: "FrameProtocol | None"
    acks: "AckBatch"
    chunk_bytes: int
    peer_max_chunk: int
    peer_max_body: int

    @property
    def is_up(self) -> bool: ...
    def send_frame(self, ftype: int, body: Any, *, tid: int = 0, lane: int = ..., now: bool = ...) -> bool: ...
    def spawn(self, coro: Any, name: str) -> Any: ...
    def cancel_transfer(self, tid: int, msg: m.KvCancel) -> None: ...
    def count_error(self, code: int) -> None: ...
    def count_failure(self, direction: str, code: int) -> None: ...
