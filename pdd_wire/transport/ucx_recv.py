"""The receive side of one UCX worker: :class:`Inbox` matches arrived messages to receives, and
:class:`Op` is one operation (send or receive) whose buffer UCX may hold.

Receiving: "pull" matching, and what cancel guarantees
------------------------------------------------------
A :meth:`~.ucx.UcxPeer.recv` does **not** post a UCX receive up front. The engine probes the
worker for arrived messages (``ucp_tag_probe_nb`` with remove); a message whose tag has a
waiting receive is received into that buffer with its message handle
(``ucp_tag_msg_recv_nbx``), one that has none is kept (a later ``recv`` of that tag takes it
at once). So:

* cancelling a receive whose message has not arrived (task cancel,
  :meth:`~.ucx.UcxPeer.cancel_recv`, :meth:`~.ucx.UcxPeer.cancel_transfer`) is immediate and
  **guarantees no write ever happens into that buffer**: UCX was never given it;
* once the message has arrived, the receive is committed; UCX cannot cancel a matched
  receive (``ucp_request_cancel`` only removes *unmatched* receives), so cancelling then
  *waits until UCX has finished writing* and only then returns/raises. Either way, **when
  ``recv`` returns or raises, UCX no longer touches the buffer**; ``send`` keeps the same
  rule for its (read-only) buffer;
* a message of another length than the posted buffer is never written into it: the receive
  fails with ``SIZE_MISMATCH`` and the message is drained;
* messages nobody will take (their receive was cancelled, or never posted) are drained
  (received with a 1-byte buffer, which UCX completes as truncated) when
  :meth:`~.ucx.UcxPeer.cancel_transfer` marked them, or after ``unclaimed_ttl_s``, so the
  sender's rendezvous send completes and releases its buffer. A completed ``send`` therefore
  does not mean the peer kept the bytes: delivery is acknowledged on the control lane.
* what waits unclaimed is bounded (:class:`Inbox`: ``admit``, ``max_message``,
  ``max_unclaimed``, ``max_unclaimed_bytes``): UCX keeps an eager message's bytes in this
  process until it is received, and anything that can reach the worker can send messages of
  any tag. A message whose tag cannot be of a transfer of the peer's (``admit`` says no), one
  larger than ``max_message``, or one that arrives unclaimed while the others fill the budget,
  is drained at once (counted in ``stats``: ``drained_implausible`` / ``drained_oversize`` /
  ``drained_over_budget``, and logged at most every ``WARN_EVERY_S``); only what ``admit``
  lets in counts toward the budget, so a flood of tags of no transfer cannot crowd out the
  peer's chunks. The budget must hold what a legitimate sender can have in flight before its
  receives are posted (one credit window).
* :meth:`~.ucx.UcxPeer.close` fails the receives still waiting at once (UCX never had their
  buffers), flushes and closes the endpoint, and then ends whatever UCX still holds: a
  request UCX never finishes (the peer vanished mid-rendezvous) fails with
  ``TransportError`` and its buffer view, with the worker, stays referenced for ever, so
  nothing is unmapped under UCX (the worker is never progressed again, so nothing in this
  process writes to it; over ``sm`` and ``tcp`` the writes into a receive buffer are made by
  our own progress calls: ``sm`` rendezvous is a CMA *read* by the receiver).

Everything here runs on the :class:`~.ucx_loop.UcxLoop` thread.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import structlog

from ..errors import ErrorCode, TransferError, TransportError
from .ucx_lib import translate
from .ucx_tags import INDEX_BITS

if TYPE_CHECKING:
    from .ucx_loop import UcxLoop

log = structlog.get_logger("pdd_wire.transport.ucx")
WAITING, STARTED, DONE = 0, 1, 2   # Op.state: UCX never had the buffer / holds it / let go
DRAIN_SCRATCH = 1  # bytes: unwanted messages are drained as truncated receives
MAX_UNCLAIMED = 4096                 # messages waiting for their receive, per worker (default)
MAX_UNCLAIMED_BYTES = 1 << 30        # their bytes (default)
WARN_EVERY_S = 10.0                  # the "drained at once" warning, at most this often


class Op:
    """One send or receive: the caller's byte view, the UCX request once started, and
    ``done(exc)``, called exactly once on the loop (``exc`` None: it completed) when UCX no
    longer holds the buffer. ``fut``: the future a coroutine caller awaits, if any."""

    __slots__ = ("arr", "done", "fut", "kind", "nbytes", "req", "state", "tag", "view", "waiters")

    def __init__(self, kind: str, tag: int, view: memoryview, arr: Any,
                 done: Callable[[BaseException | None], None], fut: asyncio.Future | None = None) -> None:
        self.kind = kind
        self.tag = tag
        self.view = view
        self.arr = arr
        self.req: Any = None
        self.done = done
        self.fut = fut
        self.state = WAITING
        self.nbytes = view.nbytes
        self.waiters: list[asyncio.Future] | None = None

    def finish(self, ucx_error: type[BaseException]) -> bool:
        """UCX completed the request: the buffer is let go, its outcome goes to the caller.
        True when it succeeded."""
        exc: BaseException | None = None
        try:
            self.req.check_error()
        except ucx_error as e:
            exc = translate(e, f"{self.kind} of tag {self.tag:#x}")
        self.req = None
        self._end(exc)
        return exc is None

    def fail(self, exc: BaseException) -> None:
        """End an operation UCX does not hold (never had, or finished) with ``exc``."""
        self._end(exc)

    def abandon(self, exc: BaseException) -> None:
        """UCX will never let go of this operation (its peer vanished mid-way): tell the
        caller ``exc`` but keep the buffer view referenced (the caller keeps the op for ever)."""
        self._end(exc, release=False)

    def _end(self, exc: BaseException | None, release: bool = True) -> None:
        if self.state == DONE:
            return
        self.state = DONE
        if release:
            self.arr = None
            self.view.release()
        try:
            self.done(exc)
        except Exception:  # noqa: BLE001 - a caller's bug must not stop the engine that called it
            log.exception("UCX operation's done callback failed", kind=self.kind, tag=hex(self.tag))
        for w in self.waiters or ():
            if not w.done():
                w.set_result(None)
        self.waiters = None

    def ended(self) -> asyncio.Future:
        """A future that resolves once this operation has ended (loop thread)."""
        fut = asyncio.get_running_loop().create_future()
        if self.state == DONE:
            fut.set_result(None)
        else:
            self.waiters = (self.waiters or []) + [fut]
        return fut


def settle(fut: asyncio.Future) -> Callable[[BaseException | None], None]:
    """An :class:`Op` ``done`` that hands the outcome to ``fut`` (a coroutine's)."""
    def done(exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(None)
        elif isinstance(exc, asyncio.CancelledError):
            fut.cancel()
        else:
            fut.set_exception(exc)
    return done


class Inbox:
    """Receives waiting for their message, messages waiting for their receive, and the marks
    that say which arrivals nobody will take. ``track`` hands a started receive to the
    peer's in-flight table; ``stats`` is the peer's counter.

    Unclaimed messages are bounded: one whose tag ``admit(tag)`` refuses (a tag of no transfer
    the peer could be sending; None: every tag is admitted) is drained on arrival, and so is one
    larger than ``max_message`` bytes (None: no limit), and one that would take the unclaimed
    messages past ``max_unclaimed`` or ``max_unclaimed_bytes`` (each counted at its full
    length, eager or rendezvous alike). ``admit`` is called on the loop thread for each arrival
    that has no receive waiting: it must be cheap."""

    def __init__(self, worker: Any, mods: SimpleNamespace, loop: UcxLoop, stats: collections.Counter,
                 track: Callable[[Op], None], *, name: str = "", max_message: int | None = None,
                 max_unclaimed: int = MAX_UNCLAIMED, max_unclaimed_bytes: int = MAX_UNCLAIMED_BYTES,
                 admit: Callable[[int], bool] | None = None) -> None:
        self.worker = worker
        self._m = mods
        self._loop = loop
        self._stats = stats
        self._track = track
        self.name = name
        self.max_message = max_message
        self.max_unclaimed = max_unclaimed
        self.max_unclaimed_bytes = max_unclaimed_bytes
        self.admit = admit
        self.unclaimed_bytes = 0
        self._unclaimed = 0
        self._warned_at = -WARN_EVERY_S
        self._refused = 0                                        # drained at once since the last warning
        self.closed = False
        self._waiting: dict[int, collections.deque] = {}         # tag -> ops without a message yet
        self._arrived: dict[int, collections.deque] = {}         # tag -> (probe result, when)
        self._discard: dict[int, float] = {}                     # transfer prefix -> until
        self._discard_tags: dict[int, float] = {}                # tag -> until (one message)
        self._drains: dict[int, tuple] = {}                      # id(req) -> (req, scratch)

    # counts --------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    @property
    def unclaimed(self) -> int:
        return self._unclaimed

    @property
    def has_expiring(self) -> bool:
        return bool(self._arrived or self._discard or self._discard_tags)

    # receives ------------------------------------------------------------------------------
    def post(self, op: Op) -> None:
        """Start ``op`` on its message if that arrived already, else wait for it."""
        queue = self._arrived.get(op.tag)
        if queue:
            probe, _ = queue.popleft()
            if not queue:
                del self._arrived[op.tag]
            self._claimed(probe)
            self._start(op, probe, inside_post=True)
        else:
            self._waiting.setdefault(op.tag, collections.deque()).append(op)
            self._loop.kick()

    def unwait(self, op: Op) -> None:
        """A waiting receive's caller was cancelled: forget it (UCX never had its buffer)."""
        q = self._waiting.get(op.tag)
        if q is not None:
            try:
                q.remove(op)
            except ValueError:
                pass
            if not q:
                del self._waiting[op.tag]
        op.fail(asyncio.CancelledError())

    def cancel_tag(self, tag: int, drain_s: float) -> bool:
        """Fail the receives waiting on ``tag``; drain its arrived message, or the next one
        that arrives within ``drain_s``. True when a receive was waiting."""
        found = False
        for op in self._waiting.pop(tag, ()):
            found = True
            op.fail(TransferError(f"receive of tag {tag:#x} cancelled before its data came",
                                  ErrorCode.TRANSFER_CANCELLED))
            self._stats["cancelled_unstarted"] += 1
        arrived = self._arrived.pop(tag, ())
        for probe, _ in arrived:
            self._claimed(probe)
            self.drain(probe)
        if not arrived:
            self._discard_tags[tag] = time.monotonic() + drain_s
        return found

    def cancel_prefix(self, prefix: int, transfer_id: int, drain_s: float) -> int:
        """:meth:`cancel_tag` for every tag whose top bits are ``prefix`` (one transfer), and
        every message of it arriving within ``drain_s``. How many receives were waiting."""
        n = 0
        for tag in [t for t in self._waiting if t >> INDEX_BITS == prefix]:
            for op in self._waiting.pop(tag):
                op.fail(TransferError(f"transfer {transfer_id} cancelled before its data came",
                                      ErrorCode.TRANSFER_CANCELLED))
                n += 1
        self._stats["cancelled_unstarted"] += n
        for tag in [t for t in self._arrived if t >> INDEX_BITS == prefix]:
            for probe, _ in self._arrived.pop(tag):
                self._claimed(probe)
                self.drain(probe)
        self._discard[prefix] = time.monotonic() + drain_s
        return n

    def _start(self, op: Op, probe: Any, inside_post: bool = False) -> None:
        """Receive ``probe``'s message into ``op``'s buffer. A failure inside :meth:`post`
        reaches the caller on the next loop turn (never inside ``start_recv``)."""
        err: BaseException | None = None
        if probe.length != op.nbytes:
            self.drain(probe)
            self._stats["wrong_size"] += 1
            err = TransportError(f"message tagged {op.tag:#x} is {probe.length} bytes, the receive buffer "
                                 f"{op.nbytes}", ErrorCode.SIZE_MISMATCH)
            err.length = probe.length  # type: ignore[attr-defined]
        else:
            try:
                op.req = self.worker.tag_recv_with_handle(op.arr, probe)
            except self._m.UCXError as exc:
                err = translate(exc, f"recv of tag {op.tag:#x}")
        if err is not None:
            if inside_post:
                self._loop.event_loop().call_soon(op.fail, err)
            else:
                op.fail(err)
            return
        op.state = STARTED
        self._track(op)

    # arrivals ------------------------------------------------------------------------------
    def drain(self, probe: Any) -> None:
        """Receive an unwanted message into a scratch byte: UCX completes it as truncated,
        and a rendezvous sender gets its completion."""
        scratch = bytearray(DRAIN_SCRATCH)
        try:
            req = self.worker.tag_recv_with_handle(self._m.Array(scratch), probe)
        except self._m.UCXError:
            return
        self._stats["drained"] += 1
        if not req.completed:
            self._drains[id(req)] = (req, scratch)

    def on_message(self, probe: Any, now: float) -> None:
        """A message the worker's probe took (at ``now``): start its waiting receive, drain it
        when nobody will take it, else keep it for a later ``recv``."""
        tag = probe.sender_tag.value
        q = self._waiting.get(tag)
        if q:
            op = q.popleft()
            if not q:
                del self._waiting[tag]
            self._start(op, probe)
            return
        if self.closed or self._discard_tags.pop(tag, None) is not None or (tag >> INDEX_BITS) in self._discard:
            # (closing: nobody will claim it, and teardown does not drain the arrived table)
            self.drain(probe)
            return
        if self.admit is not None and not self.admit(tag):
            self._refuse(probe, "drained_implausible", now)
            return
        n = probe.length
        if self.max_message is not None and n > self.max_message:
            self._refuse(probe, "drained_oversize", now)
            return
        if self._unclaimed >= self.max_unclaimed or self.unclaimed_bytes + n > self.max_unclaimed_bytes:
            self._refuse(probe, "drained_over_budget", now)
            return
        self._arrived.setdefault(tag, collections.deque()).append((probe, now))
        self._unclaimed += 1
        self.unclaimed_bytes += n
        self._stats["unexpected"] += 1

    def _claimed(self, probe: Any) -> None:
        """``probe``'s message left the unclaimed table."""
        self._unclaimed -= 1
        self.unclaimed_bytes -= probe.length

    def _refuse(self, probe: Any, why: str, now: float) -> None:
        """Drain an arrival nobody waits for at once (a tag of no transfer, too large, or over
        the budget), and say so now and then."""
        tag, n = probe.sender_tag.value, probe.length
        self.drain(probe)
        self._stats[why] += 1
        self._refused += 1
        if now - self._warned_at >= WARN_EVERY_S:
            log.warning("UCX messages nobody asked for drained on arrival (tagged for no transfer of the peer's, "
                        "too large, or over the budget for unclaimed messages): a peer sending ahead of its "
                        "credit, or something that is not the peer reaching this worker", peer=self.name,
                        reason=why, tag=hex(tag), nbytes=n,
                        drained=self._refused, unclaimed=self._unclaimed, unclaimed_bytes=self.unclaimed_bytes,
                        max_message=self.max_message, max_unclaimed=self.max_unclaimed,
                        max_unclaimed_bytes=self.max_unclaimed_bytes)
            self._warned_at = now
            self._refused = 0

    def reap_drains(self) -> None:
        """Forget the drains UCX has completed."""
        if self._drains:
            for key in [k for k, (r, _) in self._drains.items() if r.completed]:
                del self._drains[key]

    def sweep(self, now: float) -> None:
        """Expire discard marks, and drain messages unclaimed for ``unclaimed_ttl_s``."""
        for marks in (self._discard, self._discard_tags):
            for key in [k for k, until in marks.items() if until <= now]:
                del marks[key]
        ttl = self._loop.unclaimed_ttl_s
        for tag in [t for t, q in self._arrived.items() if q[0][1] + ttl <= now]:
            q = self._arrived[tag]
            while q and q[0][1] + ttl <= now:
                probe = q.popleft()[0]
                self._claimed(probe)
                self.drain(probe)
                self._stats["unclaimed_expired"] += 1
            if not q:
                del self._arrived[tag]

    # closing -------------------------------------------------------------------------------
    def close(self, err: BaseException) -> None:
        """Fail the waiting receives with ``err`` (UCX never had their buffers), drain what
        arrived, and drain whatever arrives from now on."""
        self.closed = True
        for q in self._waiting.values():
            for op in q:
                op.fail(err)
        self._waiting.clear()
        for q in self._arrived.values():
            for probe, _ in q:
                self.drain(probe)
        self._arrived.clear()
        self._unclaimed = self.unclaimed_bytes = 0

    def release(self) -> list[tuple[Any, bytearray]]:
        """Let go of the worker; the drains UCX has not finished, whose scratch buffers must
        then stay referenced for ever."""
        unfinished = [(req, scratch) for req, scratch in self._drains.values() if not req.completed]
        self._drains.clear()
        self.worker = None
        return unfinished
