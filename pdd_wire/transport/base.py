"""The transport seam: what a peer session needs from whatever moves its frames and chunks.

Three roles, after dask's ``comm/`` (one contract suite, ``tests/test_transport_contract.py``,
runs against every implementation):

* a :class:`Connector` opens a control connection to a peer and a :class:`Listener` accepts
  them; control connections carry the handshake, control, token-ID and ack frames;
* a :class:`DataPath` moves one peer's KV chunks: bulk TCP connections on their own threads
  (:mod:`.tcp_path`), UCX tagged messages (:mod:`.ucx_path`), or memory within this process
  for tests (:mod:`.inproc`).

Implementations are chosen by name through :func:`pdd_wire.transport.data_path`; the session
never asks which one it has. The session schedules (credits, lanes, acks); a data path only
moves bytes and reports back through the :class:`DataPathOwner` it was given.

Example (what a session does with its data path)::

    path = transport.data_path(peer.transport, owner=session, ...)
    hello = Hello(..., ucx_address=path.address())      # the field names the first such path
    path.connected(welcome.ucx_address, streams=4)     # lanes come up: owner.lane_up(lane)
    path.send(lane, tid, k, views, compression)          # a chunk, on a lane the owner chose
    path.expect(t)                                       # receiving: t's chunks may arrive
    await path.forget(t.tid)                             # nothing writes into t after this
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from .route import Route


class DataPathOwner(Protocol):
    """What a data path reports to (a :class:`~pdd_wire.session.PeerSession`). Every call
    comes on the owner's loop unless it says otherwise."""

    @property
    def routes(self) -> Mapping[int, Route]:
        """Open incoming transfers by id. Read by data-path threads (a dict read is atomic);
        a route is the lock that keeps a cancelled transfer from being written."""

    @property
    def is_up(self) -> bool: ...

    def lane_up(self, lane: int) -> None:
        """Lane ``lane`` can carry chunks now."""

    def lane_lost(self, lane: int) -> None:
        """Lane ``lane`` went, with whatever chunks were in flight on it."""

    def send_failed(self, tid: int, k: int, why: str) -> None:
        """Sending chunk ``k`` of ``tid`` failed (``why``: a short label for metrics); the
        lane stays. The owner sends it again a little later."""

    def chunk_arrived(self, tid: int, k: int, ok: bool, nbytes: int, claimed: bool, invalid: bool = False,
                      wrong_size: bool = False) -> None:
        """Chunk ``k`` of ``tid`` was read: ``claimed``: into the transfer's blocks (through its
        route); ``ok``: its checksum held; ``invalid``: it does not fit the transfer;
        ``wrong_size`` (with ``ok`` False): not a checksum, a UCX message of another length came
        for it (nothing written)."""

    def chunk_early(self, tid: int, wake: Callable[[], None]) -> bool:
        """Any thread: a chunk of ``tid`` arrived and no transfer ``tid`` is open. True: it may
        have outrun its KV_BEGIN (an offered transfer's chunks leave right behind it, on another
        connection): hold it, reading nothing more of that connection, until ``wake()`` is called
        (on the owner's loop; once the KV_BEGIN was handled, or after a bound), then look its
        route up again. False: drop it, as before."""
        return False

    def reconnect(self, why: str) -> None:
        """The data path cannot go on with this control connection (a peer restarted its
        UCX worker): drop it; the next handshake starts over."""


class BulkOwner(DataPathOwner, Protocol):
    """What a bulk TCP connection's frames report to (the session it was attached to)."""

    @property
    def streams(self) -> int: ...

    def bulk_lost(self, conn: Any, stream: int, exc: BaseException | None) -> None:
        """Bulk connection ``conn`` (stream ``stream``) ended."""


class DataPath(abc.ABC):
    """Moves the KV chunks of one peer's transfers. Created once per session, it lives as
    long as the session; its lanes come and go with the connections."""

    #: The registry name (``peer.transport``).
    kind: str = ""
    #: Bulk TCP connections up, by stream (status pages; empty on paths without them).
    links: Mapping[int, Any] = {}

    @abc.abstractmethod
    def address(self) -> bytes:
        """What the peer needs to reach this path, sent in HELLO/WELCOME (empty: nothing)."""

    def tag_key(self) -> int:
        """This path's secret for the peer, sent in HELLO/WELCOME ``ucx_tag_key`` (0: none)."""
        return 0

    def use_tag_keys(self, peer_key: int | None) -> None:
        """Each handshake, before :meth:`connected`: the peer's ``ucx_tag_key`` where both
        agents advertised ``ucx-keys.v1``, None where either did not."""

    @abc.abstractmethod
    def connected(self, remote: bytes, *, streams: int) -> None:
        """The control connection is up; ``remote`` is the peer's :meth:`address`. Bring
        lanes up (each reported with ``owner.lane_up``)."""

    @property
    @abc.abstractmethod
    def active(self) -> str:
        """What is moving chunks now ("tcp", "ucx", "inproc"), for status pages."""

    def chunk_bytes(self, default: int, *, window: int, peer_max_chunk: int) -> int:
        """The chunk size for a new transfer: ``default`` unless the path prefers larger."""
        return default

    @abc.abstractmethod
    def send(self, lane: int, tid: int, k: int, views: list[memoryview], compression: Any = None) -> None:
        """Send chunk ``k`` of ``tid`` (its bytes: ``views``, not copied; they stay valid until
        the chunk is acknowledged or its transfer ends). Delivery is acknowledged by the peer on
        the control lane; a failure comes back as ``owner.lane_lost`` or ``owner.send_failed``."""

    def saw_tid(self, tid: int) -> None:
        """The peer announced its transfer ``tid`` (a KV_BEGIN), matched or not."""

    def expect(self, tid: int, route: Route) -> None:
        """Receiving: chunks of ``tid`` may arrive now (they land through ``route``)."""

    async def forget(self, tid: int) -> None:
        """Receiving: when this returns, nothing of this path writes into ``tid``'s blocks
        any more, except through its route (which the caller closes next)."""

    def adopt_bulk(self, stream: int, loop: Any, conn: Any) -> None:
        """An accepted bulk TCP connection named this session; a path without them refuses it."""
        loop.call(conn.abort)

    def bulk_lost(self, conn: Any, stream: int, exc: BaseException | None) -> None:
        """A bulk TCP connection of this session ended."""

    @abc.abstractmethod
    def stall(self) -> None:
        """A chunk has been half-written for too long: cut the lanes so the claim is released."""

    @abc.abstractmethod
    def down(self) -> None:
        """The control connection went: drop the lanes that depend on it."""

    @abc.abstractmethod
    async def close(self) -> None:
        """The session ends: release everything."""

    def describe(self) -> dict[str, Any]:
        return {"data_path": self.active}


class Listener(abc.ABC):
    """Accepts connections and hands each, as a socket whose preamble is not read yet, to the
    callback it was created with (the agent reads the preamble and attaches the protocol)."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Accept from now on (bound and listening when this returns)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Accept no more; connections already handed over are the callback's."""


class Connector(abc.ABC):
    """Opens control connections to one peer."""

    @abc.abstractmethod
    async def connect(self, protocol: Any, *, timeout: float) -> Any:
        """Connect ``protocol`` (a :class:`~pdd_wire.transport.tcp.FrameProtocol`) to the
        peer as a control connection; returns it connected, or raises
        :class:`~pdd_wire.errors.TransportError` (or ``FatalHandshakeError`` when TLS refused)."""
