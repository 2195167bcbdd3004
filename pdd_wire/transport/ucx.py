"""UCX local path: KV between agents on the same node (or the same RDMA fabric) over ``ucxx``.

Layout
------
* :class:`UcxPeer` (here) is one peer agent: its own UCX worker (so tags of different peers
  never meet in one matching queue), whose address (:meth:`UcxPeer.local_address`) travels to
  the peer over our TCP control connection, and one endpoint made from the peer's address
  (:meth:`UcxPeer.connect`). Its operations run on the :class:`~.ucx_loop.UcxLoop`'s event
  loop only: coroutines (``send``/``recv``: ``await ucx_loop.run(...)``, or
  ``ucx_loop.submit(...)`` from another thread) and, for the data path, the same operations
  without a coroutine or a task each (``start_send``/``start_recv`` with a ``done`` callback).
* :mod:`.ucx_loop`: the :class:`~.ucx_loop.UcxLoop`, its progress engine on the agent's own
  loop (or a thread of its own; and why not ucxx's own asyncio layer), and the shared
  instances (:func:`acquire_loop` / :func:`release_loop`).
* :mod:`.ucx_recv`: "pull" matching of arrived messages to receives, and what cancelling a
  receive guarantees (when ``recv`` returns or raises, UCX no longer touches the buffer).
* :mod:`.ucx_tags`: :func:`tag_for` packs (direction, transfer id, index) into a UCX tag;
  :class:`TagKey` hides the transfer id behind a keyed permutation (``ucx-keys.v1``).
* :mod:`.ucx_lib`: the lazy ``import ucxx`` (:func:`available`) and what it does to the
  process environment.

This module re-exports the names callers use (``from pdd_wire.transport import ucx``).

Hazard: error handling is off; a dead peer is not noticed, and CMA failures are fatal
-------------------------------------------------------------------------------------
Endpoints are made with UCX peer error handling off (``connect(error_handling=False)``):
with it on, UCX refuses shared memory (``posix``/``sysv`` have "no peer failure handler", the
endpoint is ``UCXXUnreachableError``) and only ``tcp`` remains (0.5-2 GB/s here). The price,
measured here:

* over ``sm`` UCX does not notice that the peer process died: small (eager) sends to it
  still "complete", rendezvous sends never do, receives wait. Liveness must come from the
  control connection, which then closes the :class:`UcxPeer`. Over ``tcp`` the sends fail
  with ``UCXXConnectionResetError`` (a ``TransportError`` here).
* over ``sm`` the rendezvous protocol (>= 8 KiB) is "zero-copy read from remote" by **CMA**
  (``process_vm_readv`` of the sender's memory). A failing CMA call with error handling off
  is *unhandled*, and UCX turns it into a fatal log and ``abort()`` of the **receiving
  process** (seen with a sender that freed its buffer early: ``cma_ep.c:85
  process_vm_readv(...) returned -1: Bad address``, exit 134). A peer agent that dies while
  we read its memory can therefore take this agent down. This module keeps every send
  buffer referenced until its request completes (our side never causes it).
  ``UCX_TLS=posix,self`` (no CMA: rendezvous by copies through the shared segment) avoids
  remote memory access altogether.
* a malformed worker address makes UCX fail an assertion and abort, so :meth:`UcxPeer.connect`
  checks the address header's version nibble against ours; addresses must come from the
  authenticated control connection.
* UCX does not authenticate endpoints: whatever can reach a worker can make an endpoint to it
  and send it tagged messages (a worker with ``tcp`` listens on a TCP port of every interface,
  and its address is easily forged from the port). The agent therefore leaves ``tcp`` out by
  default (``transfer.ucx_tls``, :mod:`.ucx_path`), and bounds what may wait unclaimed
  (:class:`~.ucx_recv.Inbox`). Over shared memory a worker is reached by processes of the
  host that learn its address (it carries no secret) and may attach its segments. Between
  agents that both advertise ``ucx-keys.v1`` the transfer id bits of every tag are keyed
  (:class:`TagKey`, with a key that travels only in the TLS handshake), so such a process
  cannot pre-seed the tags of transfers to come: its messages match no receive and, their tags
  being of no transfer the peer could be sending, are drained on arrival without taking any of
  the unclaimed budget the peer's early chunks need (:mod:`.ucx_path`). It still can if it sees
  the tags in use (reads the fabric or the shared-memory queues).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any

from ..errors import TransportError
from .ucx_lib import UCXX_IMPORT_ENV, available, load, translate
from .ucx_loop import SPIN_S, UcxLoop, acquire_loop, arelease_loop, release_loop
from .ucx_recv import MAX_UNCLAIMED, MAX_UNCLAIMED_BYTES, STARTED, WAITING, Inbox, Op, settle
from .ucx_tags import (
    DIR_ACCEPTOR,
    DIR_DIALER,
    INDEX_BITS,
    MAX_INDEX,
    MAX_TRANSFER_ID,
    TagKey,
    plain,
    tag_for,
    tag_parts,
    transfer_prefix,
)

__all__ = ["CLOSE_S", "DIR_ACCEPTOR", "DIR_DIALER", "INDEX_BITS", "MAX_INDEX", "MAX_TRANSFER_ID", "SPIN_S",
           "TagKey", "UCXX_IMPORT_ENV", "UcxLoop", "UcxPeer", "acquire_loop", "arelease_loop", "available", "plain",
           "release_loop", "tag_for", "tag_parts", "transfer_prefix"]

CLOSE_S = 2.0            # how long an endpoint close may take before the worker is abandoned


def _view(buf: Any, *, writable: bool) -> memoryview:
    """Our own flat byte view of ``buf`` (the caller releasing theirs cannot unmap ours)."""
    mv = memoryview(buf)
    if writable and mv.readonly:
        raise ValueError("recv needs a writable buffer")
    if not mv.c_contiguous:
        raise ValueError("buffer must be contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


class UcxPeer:
    """One peer agent over UCX. Construct from any thread (the worker is made on the UCX
    loop's thread); its operations run on the :class:`UcxLoop`'s event loop only. The engine
    drives it as a :class:`~.ucx_loop.Driven` (:meth:`poll`, :meth:`arm`, :meth:`sweep`,
    :meth:`begin_close`). ``admit``, ``max_message``, ``max_unclaimed``, ``max_unclaimed_bytes``
    bound the messages that wait for their receive (:class:`~.ucx_recv.Inbox`; ``admit(tag)``
    runs on the UCX loop's thread)."""

    def __init__(self, ucx: UcxLoop, name: str = "", *, max_message: int | None = None,
                 max_unclaimed: int = MAX_UNCLAIMED, max_unclaimed_bytes: int = MAX_UNCLAIMED_BYTES,
                 admit: Callable[[int], bool] | None = None) -> None:
        if not ucx.running:
            raise TransportError("UCX loop is not running")
        self.ucx = ucx
        self.name = name
        self._limits = (max_message, max_unclaimed, max_unclaimed_bytes)
        self._admit = admit
        self._m = load()
        self._closed = False
        self._ep = None
        self._inflight: dict[int, Op] = {}                       # id(op) -> op (UCX owns the buffer)
        self._inbox: Inbox                                       # made with the worker (_open)
        self._closing = None                                     # the endpoint close request
        self._closed_fut: asyncio.Future | None = None
        self._close_deadline = 0.0
        self.stats: collections.Counter = collections.Counter()
        ucx.call(self._open)

    def _open(self) -> None:
        try:
            self._worker = self._m.L.UCXWorker(self.ucx.context)
            self._worker.init_blocking_progress_mode()
        except self._m.UCXError as exc:
            raise translate(exc, "worker creation") from exc
        self.epoll_fd = self._worker.epoll_file_descriptor
        self._address = bytes(memoryview(self._worker.address))
        max_message, max_unclaimed, max_unclaimed_bytes = self._limits
        self._inbox = Inbox(self._worker, self._m, self.ucx, self.stats, self._track, name=self.name,
                            max_message=max_message, max_unclaimed=max_unclaimed,
                            max_unclaimed_bytes=max_unclaimed_bytes, admit=self._admit)
        self._any_tag = self._m.Tag(0)
        self._any_mask = self._m.TagMask(0)
        self.ucx.attach(self)

    # public ----------------------------------------------------------------------------
    def local_address(self) -> bytes:
        """This peer's UCX worker address, to send to the peer over the control connection."""
        return self._address

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_flight(self) -> int:
        """How many operations UCX holds a buffer for."""
        return len(self._inflight)

    @property
    def has_expiring(self) -> bool:
        """Whether :meth:`sweep` has unclaimed messages or discard marks to expire."""
        return self._inbox.has_expiring

    def pending(self) -> dict[str, int]:
        """Counts of receives waiting for their message, operations UCX holds a buffer for,
        and arrived messages nobody has claimed yet."""
        return {"waiting": self._inbox.waiting,
                "in_flight": len(self._inflight),
                "unclaimed": self._inbox.unclaimed}

    def unclaimed_budget(self) -> dict[str, int | None]:
        """The unclaimed messages and their bytes, against their limits (see :class:`Inbox`)."""
        ib = self._inbox
        return {"unclaimed": ib.unclaimed, "unclaimed_bytes": ib.unclaimed_bytes, "max_message": ib.max_message,
                "max_unclaimed": ib.max_unclaimed, "max_unclaimed_bytes": ib.max_unclaimed_bytes}

    async def connect(self, remote_address: bytes, *, error_handling: bool = False) -> None:
        """An endpoint to the peer's worker. ``error_handling`` stays off by default: with it
        on, UCX refuses shared memory (see the module docstring)."""
        self._check()
        if self._ep is not None:
            raise RuntimeError("already connected")
        L = self._m.L
        remote_address = bytes(remote_address)
        # UCX parses the address without checking it: a malformed one fails an assertion and
        # aborts the process. It comes from an authenticated peer; this catches the obvious.
        if not remote_address or (remote_address[0] & 0x0F) != (self._address[0] & 0x0F):
            raise TransportError("not a UCX worker address of this UCX version")
        try:
            addr = L.UCXAddress.create_from_buffer(remote_address)
            self._ep = L.UCXEndpoint.create_from_worker_address(self._worker, addr, error_handling)
        except self._m.UCXError as exc:
            raise translate(exc, "connect") from exc
        self.ucx.kick()

    async def send(self, tag: int, buf: Any) -> None:
        """Send ``buf`` as one tagged message. ``buf`` must stay unchanged until this returns;
        the view is held until UCX is done with it, even when the caller is cancelled (UCX
        cannot cancel a send: cancellation waits until the peer has taken or drained it)."""
        fut = asyncio.get_running_loop().create_future()
        op = self.start_send(tag, buf, settle(fut), fut)
        await self._wait(op)

    async def recv(self, tag: int, buf: Any) -> None:
        """Receive the message tagged ``tag`` straight into ``buf`` (writable, exactly the
        message's length). See :mod:`.ucx_recv` for what cancellation guarantees."""
        fut = asyncio.get_running_loop().create_future()
        op = self.start_recv(tag, buf, settle(fut), fut)
        await self._wait(op)

    def start_send(self, tag: int, buf: Any, done: Callable[[BaseException | None], None],
                   fut: asyncio.Future | None = None) -> Op:
        """:meth:`send` without a coroutine (loop thread): ``done(exc)`` is called exactly
        once, on the loop and never before this returns, when UCX no longer holds ``buf``
        (``exc`` None: sent; a TransportError otherwise). Raises at once when the send cannot
        start."""
        self._check()
        if self._ep is None:
            raise RuntimeError("send before connect")
        view = _view(buf, writable=False)
        op = Op("send", tag, view, self._m.Array(view), done, fut)
        try:
            op.req = self._ep.tag_send(op.arr, self._m.Tag(tag))
        except self._m.UCXError as exc:
            view.release()
            raise translate(exc, f"send of tag {tag:#x}") from exc
        op.state = STARTED
        self.stats["sends"] += 1
        self._track(op)
        return op

    def start_recv(self, tag: int, buf: Any, done: Callable[[BaseException | None], None],
                   fut: asyncio.Future | None = None) -> Op:
        """:meth:`recv` without a coroutine (loop thread): ``done(exc)`` is called exactly
        once, on the loop and never before this returns, when UCX no longer touches ``buf``
        (``exc`` None: the message is in it; TransferError ``TRANSFER_CANCELLED`` when
        cancelled before its data came, which a cancel call may report at once; a
        TransportError otherwise)."""
        self._check()
        view = _view(buf, writable=True)
        op = Op("recv", tag, view, self._m.Array(view), done, fut)
        self.stats["recvs"] += 1
        self._inbox.post(op)
        return op

    async def cancel_recv(self, tag: int, *, drain_s: float | None = None) -> bool:
        """Cancel the receives waiting on ``tag``: they raise ``TransferError``
        (``TRANSFER_CANCELLED``) and their buffers were never handed to UCX. Returns True
        when there was such a receive. A receive whose data was already landing is left to
        finish; this returns once it has (the buffer is then free either way). A message of
        ``tag`` that arrived unclaimed, or arrives within ``drain_s`` (default
        ``unclaimed_ttl_s``), is drained so that its sender completes."""
        self._check_thread()
        found = self._inbox.cancel_tag(tag, self._drain_s(drain_s))
        await self._quiesce(lambda t: t == tag)
        return found

    async def cancel_transfer(self, direction: int, transfer_id: int, *, drain_s: float | None = None) -> int:
        """Cancel every receive of one transfer (as :meth:`cancel_recv`), drain its messages
        that arrived or will arrive within ``drain_s`` (default: ``unclaimed_ttl_s``), and wait
        for its receives that were already landing. Returns how many receives were cancelled
        before their data came."""
        self._check_thread()
        prefix = transfer_prefix(direction, transfer_id)
        n = self._inbox.cancel_prefix(prefix, transfer_id, self._drain_s(drain_s))
        await self._quiesce(lambda t: t >> INDEX_BITS == prefix)
        return n

    def close(self) -> None:
        """Close, without blocking: receives still waiting for their message fail at once with
        TransportError (UCX never had their buffers); the endpoint is flushed and closed while
        the engine keeps progressing (at most ``CLOSE_S``); then every operation still in
        flight ends (completed, or failed with TransportError) and the worker is released
        (:meth:`wait_closed`). An operation UCX never finished (the peer vanished mid-way)
        keeps its buffer view, and the worker, referenced for ever: nothing is freed under UCX.
        Idempotent, from any thread."""
        if self._closed or not self.ucx.running:
            return
        if self.ucx.on_loop():
            self.begin_close()
        else:
            self.ucx.call(self.begin_close)

    async def wait_closed(self) -> None:
        """After :meth:`close`: returns once every operation has ended and the worker is gone."""
        self._check_thread()
        fut = self._closed_fut
        if not self._closed or fut is None:
            raise RuntimeError("wait_closed() before close()")
        await asyncio.shield(fut)

    # internals -------------------------------------------------------------------------
    def _drain_s(self, drain_s: float | None) -> float:
        return self.ucx.unclaimed_ttl_s if drain_s is None else drain_s

    def _check(self) -> None:
        self._check_thread()
        if self._closed:
            raise TransportError("UCX peer closed")

    def _check_thread(self) -> None:
        if not self.ucx.on_loop():
            raise RuntimeError("UcxPeer coroutines run on its UcxLoop: ucx_loop.submit(...) / "
                               "await ucx_loop.run(...)")

    def _track(self, op: Op) -> None:
        """A started operation: UCX holds its buffer until the request completes. One that
        completed at once (an eager message) ends on the next loop turn, never inside the
        ``start_*`` call that started it."""
        self._inflight[id(op)] = op
        if op.req.completed:
            self.ucx.event_loop().call_soon(self._finish, op)
        else:
            self.ucx.kick()

    def _finish(self, op: Op) -> None:
        if self._inflight.pop(id(op), None) is None:
            return  # ended already (by teardown)
        nbytes = op.nbytes
        if op.finish(self._m.UCXError):
            self.stats["bytes_sent" if op.kind == "send" else "bytes_received"] += nbytes

    async def _wait(self, op: Op) -> None:
        assert op.fut is not None
        cancelled = False
        while not op.fut.done():
            try:
                await asyncio.shield(op.fut)
            except asyncio.CancelledError:
                if op.fut.done():             # finished meanwhile: still a cancellation
                    cancelled = True
                    break
                if op.state == WAITING:       # never handed to UCX: nothing can write to it
                    self._inbox.unwait(op)
                    self.stats["cancelled_unstarted"] += 1
                    raise
                cancelled = True              # UCX owns the buffer: wait for it to let go
                self.stats["cancel_waited"] += 1
            except BaseException:  # noqa: BLE001 - the op's own outcome, raised below
                break
        if cancelled:
            if op.fut.done() and not op.fut.cancelled():
                op.fut.exception()            # retrieved: the cancellation wins
            raise asyncio.CancelledError
        op.fut.result()

    async def _quiesce(self, match: Callable[[int], bool]) -> None:
        while True:
            busy = [op.ended() for op in self._inflight.values() if op.kind == "recv" and match(op.tag)]
            if not busy:
                return
            self.stats["cancel_waited"] += len(busy)
            await asyncio.wait(busy)

    # driven by the loop (its thread only) ----------------------------------------------
    def poll(self, until: float) -> bool:
        """Progress the worker until ``time.perf_counter()`` passes ``until`` or nothing moves
        (each ``progress_once()`` is one step: a 512 KiB segment of a shared-memory read at
        most), complete finished requests, take arrived messages (loop thread)."""
        w = self._worker
        if w is None:
            return False
        if self._closed:
            clock = time.perf_counter
            while w.progress_once() and clock() < until:
                pass
            self._drain_arrivals()
            if self._closing is None or self._closing.completed or time.monotonic() > self._close_deadline:
                self._teardown(time.monotonic())
                return True
        busy = w.progress_once()
        if busy:
            clock = time.perf_counter
            while clock() < until and w.progress_once():
                pass
            for op in [op for op in self._inflight.values() if op.req.completed]:
                self._finish(op)
            self._inbox.reap_drains()
        now = None
        while True:
            probe = w.tag_probe(self._any_tag, self._any_mask, True)
            if not probe.matched:
                break
            busy = True
            self._inbox.on_message(probe, now if now is not None else (now := time.monotonic()))
        return busy

    def _drain_arrivals(self) -> None:
        """Drain every message UCX holds unclaimed (a closing worker must not keep any: its
        destructor would receive each one in full, reading a dead peer's memory over CMA)."""
        w = self._worker
        while True:
            probe = w.tag_probe(self._any_tag, self._any_mask, True)
            if not probe.matched:
                return
            self._inbox.drain(probe)

    def arm(self) -> bool:
        """Arm the worker's epoll fd; False when events are pending (loop thread)."""
        if self._worker is None:
            return True
        try:
            return self._worker.arm()
        except self._m.UCXError:
            return False

    def sweep(self, now: float) -> None:
        """Expire discard marks and drain long-unclaimed messages (loop thread)."""
        self._inbox.sweep(now)

    def begin_close(self) -> None:
        """Start closing (loop thread): fail what UCX never held, start the endpoint close."""
        if self._closed:
            return
        self._closed = True
        self._inbox.close(TransportError("UCX peer closed"))
        self._closed_fut = self.ucx.event_loop().create_future()
        self._close_deadline = time.monotonic() + CLOSE_S
        if self._ep is not None:
            # Not close_blocking(): it progresses only this worker, and a flush that needs the
            # peer (tcp, a peer on this same loop) would wait for ever. The engine keeps
            # progressing us until the close request completes (or CLOSE_S passes).
            try:
                self._closing = self._ep.close()
            except Exception:  # noqa: BLE001 - closing anyway
                self._closing = None
        self.ucx.kick()

    def _teardown(self, now: float) -> None:
        """Finish closing (loop thread): every operation ends; the worker goes (or, when UCX
        still holds something, is kept for ever together with the buffers it holds)."""
        w = self._worker
        closing = self._closing
        clean = closing is None or closing.completed
        w.progress()
        self._drain_arrivals()
        w.progress()
        for op in list(self._inflight.values()):
            if op.req.completed:
                self._finish(op)
            else:   # UCX cannot let go of it: fail the caller, keep the buffer referenced
                self._inflight.pop(id(op), None)
                op.abandon(TransportError(f"UCX peer closed with its {op.kind} of tag {op.tag:#x} unfinished"))
                _orphans.append(op)
                clean = False
        unfinished = self._inbox.release()
        if unfinished:
            _orphans.extend(unfinished)
            clean = False
        self.ucx.detach(self)  # (its epoll fd too)
        if not clean:
            # Dropping an endpoint whose close did not finish blocks in its destructor until
            # the peer answers; keep it, and its worker, instead.
            _orphans.append((self._ep, closing, w))
            self.stats["orphaned"] += 1
        self._ep = self._closing = None
        self._worker = None
        fut = self._closed_fut
        if fut is not None and not fut.done():
            fut.set_result(None)


#: Operations UCX never finished when their peer closed: kept so their buffers stay mapped.
_orphans: list = []
