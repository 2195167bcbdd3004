"""KV as UCX tagged messages, for peers on the same node or RDMA fabric; bulk TCP otherwise.

One lane (:data:`UCX_LANE`): UCX stripes over its own transports. Delivery is acknowledged on
the control lane as over TCP (a completed UCX send does not mean the peer kept the bytes).
A peer that offers no UCX address gets the bulk TCP connections instead.

Which transports (``transfer.ucx_tls``, UCX's ``TLS`` option): by default every one but
``tcp`` (shared memory, RDMA), because a worker with ``tcp`` listens on a TCP port of every
interface, and anything that can reach that port can make an endpoint to the worker (a worker
address is easily forged from the port) and send it tagged messages. ``""`` leaves the choice
to UCX (``UCX_TLS`` from the environment, else every transport). The shared UCX context takes
the setting of the first session that makes it (every session of an agent has the same).

What may wait for its receive is bounded (:class:`~.ucx_recv.Inbox`). A chunk often arrives
before its receive is posted (an offered transfer's chunks leave right behind its KV_BEGIN), so
it must find room; what a process that is not the peer sends must not take that room:

* only a *plausible* tag may wait (:meth:`UcxDataPath._admit`): its direction bit is the peer's
  (the tags of the transfers it allocated), and where tags are keyed its transfer id bits invert
  to a transfer id of 1 .. ``AHEAD_TIDS`` past the highest this path has posted receives for
  (the peer counts its transfer ids over all its peers, so it may have moved on a good way).
  Anything else is drained on arrival (``drained_implausible``) and counts toward no budget.
  Under keys a tag made without the key passes with odds of about ``AHEAD_TIDS / 2^40``
  (2^-20); with plain tags any tag of the peer's direction does;
* a message larger than ``MAX_CHUNK`` is drained on arrival, and so is one past
  :func:`unclaimed_limit` messages (one credit window of the smallest chunks a peer may send,
  twice: ``2 x credit_bytes / MIN_CHUNK``, at least ``MAX_UNCLAIMED``, at most
  ``MAX_UNCLAIMED_CAP``) or ``2 x max(credit_bytes, MAX_CHUNK)`` bytes (what a sender can have
  in flight is one credit window, which is at most the larger of the two).

A message of the wrong size for a posted chunk is never written: the chunk is received again
(its receive posted anew, the sender asked with ``KV_NACK`` as for a checksum failure, and the
receiver told why: ``chunk_arrived(..., wrong_size=True)``), unless its transfer is being forgotten or
the path closed; after ``MAX_WRONG_SIZE`` such messages in one transfer the transfer fails
(``MALFORMED_BODY``).

Keyed tags (capability ``ucx-keys.v1``): each UCX worker comes with a random 64-bit key of its
own (:meth:`UcxDataPath.tag_key`, renewed with the worker), sent to the peer in HELLO/WELCOME
``ucx_tag_key``, only over the authenticated control connection. Where both agents advertised
the capability, the transfer id bits of every tag are the transfer id permuted under the key
of the agent that *receives* the chunk (:class:`~.ucx_tags.TagKey`), so a process that can
reach a worker but is not its peer cannot tell the tags of transfers to come. The key lives as
long as the worker, not the control connection: receives posted before a reconnect still match
the chunks resent after it, and chunks sent before it still land where they belong (a second
copy of one stays unclaimed until its transfer is forgotten or the unclaimed TTL passes, as
without keys). A renewed worker has a new key and a new address; its first handshake carries
both (messages for the old worker never reach the new one).
"""

from __future__ import annotations

import asyncio
import functools
import secrets
from collections.abc import Callable
from typing import Any

import structlog

from ..errors import ErrorCode, TransportError
from ..memory import scatter
from ..wire.handshake import MAX_CHUNK
from ..wire.messages import MIN_CHUNK
from . import ucx
from .base import BulkOwner, DataPath
from .route import Route
from .tcp_path import PathSettings, TcpDataPath

UCX_LANE = -1
MAX_UNCLAIMED = 4096          # UCX messages waiting for their receive, per peer: at least
MAX_UNCLAIMED_CAP = 1 << 14   # and at most this: UCX holds about 9 KiB per message however small (~150 MiB)
AHEAD_TIDS = 1 << 20          # how far past the highest transfer id seen a keyed tag may be
ADMITTED_CACHE = 4096         # transfer-id prefixes whose admission is remembered (keyed tags)
MAX_WRONG_SIZE = 3            # messages of the wrong size for posted chunks one transfer survives


def unclaimed_limit(credit_bytes: int) -> int:
    """How many UCX messages may wait for their receive, per peer: a sender may have one credit
    window in flight before the receives are posted, in chunks no smaller than ``MIN_CHUNK``
    (a transfer's last chunk may be smaller: hence twice), bounded on both sides."""
    return max(MAX_UNCLAIMED, min(2 * credit_bytes // MIN_CHUNK, MAX_UNCLAIMED_CAP))


def ucx_options(settings: PathSettings) -> dict[str, str]:
    """The UCX context options of ``settings`` (``TLS`` unless ``ucx_tls`` is "")."""
    return {"TLS": settings.ucx_tls} if settings.ucx_tls else {}


def open_path(owner: BulkOwner, settings: PathSettings) -> DataPath:
    """The UCX path, or bulk TCP with a warning where UCX cannot be loaded here."""
    ok, why = ucx.available()
    log = settings.log or structlog.get_logger("pdd_wire.transport")
    if not ok:
        log.warning("transport = 'ucx' but UCX is unavailable; KV to this peer uses TCP", reason=why)
        return TcpDataPath(owner, settings)
    log.info("KV to this peer goes over UCX", ucx=why)
    return UcxDataPath(owner, settings)


class UcxDataPath(DataPath):
    """KV over UCX, driven from the session's own loop (:mod:`.ucx_loop`): a chunk's send is
    started by :meth:`send` itself and every completion is handled where the session runs, so
    no chunk crosses a thread (only a chunk whose blocks are not contiguous is gathered, or
    scattered, by a worker thread)."""

    kind = "ucx"

    def __init__(self, owner: BulkOwner, settings: PathSettings) -> None:
        self.owner = owner
        self.settings = settings
        self.tcp = TcpDataPath(owner, settings)
        self.log = self.tcp.log
        self.main = asyncio.get_running_loop()
        self.loop = ucx.acquire_loop(self.main, options=ucx_options(settings))
        self._key = 0
        self._invert_in: Callable[[int], int] | None = None   # incoming tag bits -> transfer id (keyed)
        self._admitted: dict[int, int] = {}   # tag prefix -> its transfer id, for prefixes admitted (keyed)
        self._max_in = 0                      # the highest incoming transfer id receives were posted for
        self._forgetting: set[int] = set()    # transfer ids whose forget() is under way
        self.peer = self._new_peer()
        self._peer_key: int | None = None   # the peer's ucx_tag_key where both agreed ucx-keys.v1
        self._wire_out: Callable[[int], int] = ucx.plain   # transfer id -> its tag bits, outgoing
        self._wire_in: Callable[[int], int] = ucx.plain    # and incoming
        self.ready = False  # endpoint to the peer's worker made (this connection)
        self._remote = b""
        self._dir_out = ucx.DIR_DIALER if settings.dialer else ucx.DIR_ACCEPTOR
        self._dir_in = ucx.DIR_ACCEPTOR if settings.dialer else ucx.DIR_DIALER
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._wrong_size: dict[int, int] = {}   # transfer id -> messages of the wrong size so far

    def _new_peer(self) -> ucx.UcxPeer:
        self._key = secrets.randbits(64) or 1   # a worker's own tag key (ucx-keys.v1)
        return ucx.UcxPeer(self.loop, name=self.settings.name, max_message=MAX_CHUNK,
                           max_unclaimed=unclaimed_limit(self.settings.credit_bytes),
                           max_unclaimed_bytes=2 * max(self.settings.credit_bytes, MAX_CHUNK), admit=self._admit)

    @property
    def active(self) -> str:
        return "ucx" if self.ready else self.tcp.active

    @property
    def links(self):
        return self.tcp.links

    def address(self) -> bytes:
        return self.peer.local_address()

    def tag_key(self) -> int:
        """This worker's own tag key (HELLO/WELCOME ``ucx_tag_key``): made with the worker."""
        return self._key

    def use_tag_keys(self, peer_key: int | None) -> None:
        self._peer_key = peer_key
        self._rekey()

    def _rekey(self) -> None:
        """Which transfer ids the tags carry: keyed where both agreed ``ucx-keys.v1``, each
        direction under its receiver's key (a peer key of 0: that direction plain)."""
        self._admitted = {}
        if self._peer_key is None:
            self._wire_out = self._wire_in = ucx.plain
            self._invert_in = None
            return
        # (cached: a permutation costs a few microseconds, once per transfer rather than per chunk)
        out = ucx.TagKey(self._peer_key, self._dir_out) if self._peer_key else ucx.plain
        key_in = ucx.TagKey(self._key, self._dir_in)
        self._wire_out = functools.lru_cache(maxsize=1024)(out)
        self._wire_in = functools.lru_cache(maxsize=1024)(key_in)
        self._invert_in = key_in.invert

    def _admit(self, tag: int) -> bool:
        """Whether a message tagged ``tag`` that no receive waits for may wait for one (the UCX
        loop's thread, once per such arrival): its direction is the peer's, and where tags are
        keyed its transfer id is 1 .. ``AHEAD_TIDS`` past the highest one receives were posted
        for. The inverse permutation (4 BLAKE2b) is remembered per admitted transfer (its chunks
        share the prefix), never for a refused one (a flood of random tags fills nothing)."""
        if tag >> 63 != self._dir_in:
            return False
        invert = self._invert_in
        if invert is None:   # plain tags: a tag of any transfer id may be the peer's
            return True
        prefix = tag >> ucx.INDEX_BITS
        if prefix in self._admitted:
            return True
        tid = invert(prefix & ucx.MAX_TRANSFER_ID)
        if not 0 < tid <= self._max_in + AHEAD_TIDS:
            return False
        if len(self._admitted) >= ADMITTED_CACHE:
            self._admitted.clear()
        self._admitted[prefix] = tid
        return True

    def tag_out(self, tid: int, k: int) -> int:
        """The UCX tag of chunk ``k`` of our transfer ``tid`` to the peer."""
        return ucx.tag_for(self._dir_out, self._wire_out(tid), k)

    def tag_in(self, tid: int, k: int) -> int:
        """The UCX tag of chunk ``k`` of the peer's transfer ``tid`` to us."""
        return ucx.tag_for(self._dir_in, self._wire_in(tid), k)

    def connected(self, remote: bytes, *, streams: int) -> None:
        if not remote:
            self.tcp.connected(remote, streams=streams)
        elif not self.ready:
            self._spawn(self._connect(remote))
        elif remote != self._remote:
            # The peer restarted with a new UCX worker; ours is bound to its old one. Start over
            # with a fresh worker (a new handshake carries its address).
            self._renew()

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro, name=f"{self.settings.name}:ucx")
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _connect(self, remote: bytes) -> None:
        try:
            await self.loop.run(self.peer.connect(remote))
        except (TransportError, RuntimeError) as exc:
            self.log.error("UCX endpoint failed; KV to this peer waits", error=str(exc))
            return
        self._remote = remote
        self.ready = True
        # (each direction on its own: a peer that sent key 0 gets plain tags, ours stay keyed)
        self.log.info("UCX endpoint up", tags_out="keyed (ucx-keys.v1)" if self._peer_key else "plain",
                      tags_in="keyed (ucx-keys.v1)" if self._peer_key is not None else "plain")
        self.owner.lane_up(UCX_LANE)

    def _renew(self) -> None:
        old, self.peer, self.ready = self.peer, self._new_peer(), False
        self._rekey()   # our incoming tags under the new worker's key; the next handshake sends it
        old.close()
        self.owner.lane_lost(UCX_LANE)
        self.owner.reconnect("the peer's UCX worker changed")

    def chunk_bytes(self, default: int, *, window: int, peer_max_chunk: int) -> int:
        if not self.ready:
            return default
        # never above the credit window, or it could never be sent
        return max(default, min(self.settings.ucx_chunk_bytes, peer_max_chunk, window))

    # -- sending
    def send(self, lane: int, tid: int, k: int, views: list[memoryview], compression: Any = None) -> None:
        if lane != UCX_LANE:
            self.tcp.send(lane, tid, k, views, compression)
            return
        if len(views) == 1:
            self._start_send(tid, k, views[0])
        else:   # blocks not contiguous: gathered by a worker thread (a copy the loop must not make)
            self._spawn(self._gather_send(tid, k, views))

    async def _gather_send(self, tid: int, k: int, views: list[memoryview]) -> None:
        self._start_send(tid, k, await self.main.run_in_executor(self.settings.executor, b"".join, views))

    def _start_send(self, tid: int, k: int, buf: Any) -> None:
        def done(exc: BaseException | None) -> None:
            if exc is not None:
                self._send_failed(tid, k, exc)
        try:
            self.peer.start_send(self.tag_out(tid, k), buf, done)
        except (TransportError, RuntimeError) as exc:
            self.main.call_soon(self._send_failed, tid, k, exc)  # not inside the session's pump

    def _send_failed(self, tid: int, k: int, exc: BaseException) -> None:
        self.log.warning("UCX send failed", transfer_id=tid, chunk=k, error=str(exc))
        self.owner.send_failed(tid, k, "ucx_error")

    # -- receiving
    def saw_tid(self, tid: int) -> None:
        """The peer announced transfer ``tid`` (its KV_BEGIN, on the authenticated control
        connection): its ids this far, and a way past, are plausible tags (:meth:`_admit`)."""
        if tid > self._max_in:
            self._max_in = tid

    def expect(self, tid: int, route: Route) -> None:
        """Post a receive for every chunk of ``tid`` (a waiting receive costs nothing until
        its message comes, and a message that came first is taken at once). No xxh3 here:
        UCX moves the bytes memory to memory (RDMA carries its own link CRC), and the checksum
        pass would cost as much as the copy."""
        self.saw_tid(tid)
        if not self.ready:
            return
        for k in range(route.n_chunks):
            n = route.chunk_len(k)
            if n is None:
                continue
            views = route.claim(k, n)
            if views is not None:
                self._start_recv(tid, route, k, n, views)

    def _start_recv(self, tid: int, route: Route, k: int, n: int, views: list[memoryview]) -> None:
        """Chunk ``k`` straight into the posted blocks (staged, and scattered by a worker
        thread, only when they are not contiguous)."""
        staging = bytearray(n) if len(views) > 1 else None

        def done(exc: BaseException | None) -> None:
            if exc is not None:
                route.settle(k, False)
                if isinstance(exc, TransportError) and exc.code == ErrorCode.SIZE_MISMATCH:
                    self._received_wrong_size(tid, route, k, n, exc)
            elif staging is not None:
                self._spawn(self._scatter(tid, route, k, n, staging, views))
            else:
                self._landed(tid, route, k, n)
        try:
            self.peer.start_recv(self.tag_in(tid, k), staging if staging is not None else views[0],
                                 done)
        except (TransportError, RuntimeError):
            route.settle(k, False)

    def _received_wrong_size(self, tid: int, route: Route, k: int, n: int, exc: TransportError) -> None:
        """A message of the wrong size came for chunk ``k`` (nothing was written; it was
        drained): post its receive again and ask for the chunk again, as for a checksum
        failure; fail the transfer after ``MAX_WRONG_SIZE`` of them. The route decides what
        lands, so a chunk still lands exactly once. Not while the transfer is being forgotten
        (this failure can come after :meth:`forget` cancelled the transfer's receives, and before
        the route closes: nothing would cancel a receive posted now), nor once its route or the
        path closed."""
        got = getattr(exc, "length", -1)
        if tid in self._forgetting or route.closed or self._closed or self.peer.closed:
            self.log.info("UCX message of the wrong size for a chunk of a transfer that is ending (drained, "
                          "nothing written)", transfer_id=tid, chunk=k, expected=n, got=got)
            return
        seen = self._wrong_size[tid] = self._wrong_size.get(tid, 0) + 1
        if seen > MAX_WRONG_SIZE:
            self.log.warning("UCX messages of the wrong size for this transfer's chunks again; failing it",
                             transfer_id=tid, chunk=k, expected=n, got=got, times=seen)
            self.owner.chunk_arrived(tid, k, False, got, True, invalid=True)
            return
        self.log.warning("UCX message of the wrong size for a chunk (drained, nothing written); "
                         "receiving the chunk again", transfer_id=tid, chunk=k, expected=n, got=got)
        views = route.claim(k, n)
        if views is not None:
            self._start_recv(tid, route, k, n, views)
        self.owner.chunk_arrived(tid, k, False, n, True, wrong_size=True)

    async def _scatter(self, tid: int, route: Route, k: int, n: int, staging: bytearray,
                       views: list[memoryview]) -> None:
        work = asyncio.ensure_future(self.main.run_in_executor(self.settings.executor, scatter, staging, views))
        try:
            await asyncio.shield(work)
        except BaseException:
            await asyncio.wait([work])  # a copy cannot be stopped: the blocks are free once it has ended
            route.settle(k, False)
            raise
        self._landed(tid, route, k, n)

    def _landed(self, tid: int, route: Route, k: int, n: int) -> None:
        route.settle(k, True)
        self.owner.chunk_arrived(tid, k, True, n, True)

    async def forget(self, tid: int) -> None:
        self._wrong_size.pop(tid, None)
        self._forgetting.add(tid)   # a wrong-size failure that comes meanwhile posts nothing again
        try:
            if self.loop.running and not self.peer.closed:
                try:
                    await self.loop.run(self.peer.cancel_transfer(self._dir_in, self._wire_in(tid), drain_s=5.0))
                except TransportError:
                    pass
        finally:
            self._forgetting.discard(tid)

    # -- the bulk TCP connections (peers without UCX)
    def adopt_bulk(self, stream, loop, conn) -> None:
        self.tcp.adopt_bulk(stream, loop, conn)

    def bulk_lost(self, conn, stream, exc) -> None:
        self.tcp.bulk_lost(conn, stream, exc)

    def make_bulk_protocol(self, stream, main):
        return self.tcp.make_bulk_protocol(stream, main)

    def stall(self) -> None:
        self.tcp.stall()

    def down(self) -> None:
        self.tcp.down()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.ready:
            self.ready = False
            self.owner.lane_lost(UCX_LANE)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.tcp.close()
        self.peer.close()
        try:
            async with asyncio.timeout(5):
                await self.loop.run(self.peer.wait_closed())
        except (TimeoutError, TransportError, RuntimeError):
            pass
        await ucx.arelease_loop(self.loop)

    def describe(self) -> dict[str, Any]:
        return {"data_path": self.active, "bulk_streams_up": len(self.tcp.links),
                "ucx": dict(self.peer.stats) | {f"engine_{k}": v for k, v in self.loop.stats.items()}}
