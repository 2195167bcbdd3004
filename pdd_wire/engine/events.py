"""Events from the agent, delivered per request: what :class:`~pdd_wire.engine.client.EngineClient`
keeps until the engine takes it.

Each request id has two bounded mailboxes: its **outcomes** (``KvReceived``, ``KvSent``,
``TransferFailed``, ``RequestAborted``: a handful per request) and its **stream** (``TokensReceived``
and the handoff events ``Emit``, ``Extend``, ``StopGenerating``, ``StartGenerating``,
``HandoffDone``: one per token frame). A flood of tokens can therefore never push out the KV
outcome an engine waits for. Events without a request (``Shutdown``) have a mailbox of their own.

A waiter looks only at its request's mailbox and is woken only by an event for it. Within a
mailbox events keep their arrival order; :meth:`EventBox.next_event` and :meth:`EventBox.take_all`
see every event in arrival order across requests.

Nothing is dropped silently. When a request's mailbox is full (``max_request_events``), further
events for it are lost and counted: once the events still kept there are taken, every wait on it
raises :class:`EventOverflow` (until :meth:`EventBox.forget`). When the client as a whole holds
``max_events`` (the engine does not take its events at all), every wait that finds nothing kept
raises :class:`EventOverflow` from then on: the engine should reconnect. ``on_overflow`` (if
given) is called once per request that overflows (and with ``None`` for the client) so that an
engine that only polls learns of it too.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable

from ..errors import ErrorCode, PddWireError
from . import protocol as p

TRANSFER_OUTCOMES = (p.KvReceived, p.KvSent, p.TransferFailed)  # what ``wait`` waits for by default
OUTCOMES = (*TRANSFER_OUTCOMES, p.RequestAborted)
STREAM = (p.TokensReceived, p.Emit, p.Extend, p.StopGenerating, p.StartGenerating, p.HandoffDone)
HANDOFF_EVENTS = (p.Emit, p.Extend, p.StopGenerating, p.StartGenerating, p.HandoffDone)

_OUTCOME, _STREAM = 0, 1  # which of a request's two mailboxes


def _family(kind: type) -> int:
    return _STREAM if issubclass(kind, STREAM) else _OUTCOME


class EventOverflow(PddWireError, BufferError):
    """Events were lost because the engine did not take them as fast as they came."""

    code = ErrorCode.LIMIT_EXCEEDED


Key = tuple[str | None, int]  # (request id, mailbox)


class _Mailbox:
    __slots__ = ("seqs", "waiters", "lost")

    def __init__(self) -> None:
        self.seqs: collections.deque[int] = collections.deque()  # arrival numbers, oldest first
        self.waiters: set[asyncio.Future[None]] = set()
        self.lost = 0


class EventBox:
    """The event store of one engine connection (see the module docstring).

    Args:
        max_events: events kept for the whole connection (plus one per overflowed mailbox).
        max_request_events: events kept in one request's outcomes, and in its stream.
        on_overflow: called with the request id (``None``: the whole client) the first time
            events for it are lost. It runs on the reader task and must not raise.
    """

    def __init__(self, *, max_events: int = 100_000, max_request_events: int = 10_000,
                 on_overflow: Callable[[str | None], None] | None = None) -> None:
        if max_events < 1 or max_request_events < 1:
            raise ValueError("max_events and max_request_events must be >= 1")
        self.max_events = max_events
        self.max_request_events = max_request_events
        self.on_overflow = on_overflow
        self._seq = 0
        self._order: dict[int, tuple[Key, p.Msg]] = {}  # every kept event, in arrival order
        self._boxes: dict[Key, _Mailbox] = {}
        self._overflowed = 0  # mailboxes that lost events (each counts against max_events)
        self._any: set[asyncio.Future[None]] = set()  # waiters on any event (next_event, wait_for)
        self.overflow: EventOverflow | None = None  # the whole client lost events
        self.dropped = 0  # events lost, all mailboxes together
        self.closed: BaseException | None = None  # set when the connection ends

    def __len__(self) -> int:
        return len(self._order)

    # -- the reader's side ------------------------------------------------------------------
    def put(self, ev: p.Msg) -> None:
        """Keep ``ev`` for its request, or count it lost (never silently)."""
        rid = getattr(ev, "request_id", None)
        if self.overflow is not None:
            self.dropped += 1
            return
        if len(self._order) + self._overflowed >= self.max_events:
            self.dropped += 1
            self.overflow = EventOverflow(
                f"{len(self._order)} events were not taken (max_events {self.max_events}); "
                f"{type(ev).__name__} for request {rid!r} and every later event are lost: reconnect")
            self._wake_all()
            self._notify(None)
            return
        key = (rid, _family(type(ev)))
        box = self._boxes.get(key)
        if box is None:
            box = self._boxes[key] = _Mailbox()
        if len(box.seqs) >= self.max_request_events:
            self.dropped += 1
            box.lost += 1
            if box.lost == 1:
                self._overflowed += 1
                self._notify(rid)
            self._wake(box.waiters)
            return
        self._seq += 1
        box.seqs.append(self._seq)
        self._order[self._seq] = (key, ev)
        self._wake(box.waiters)
        self._wake(self._any)

    def close(self, exc: BaseException) -> None:
        """The connection ended: waits that find nothing kept raise ``exc``."""
        self.closed = exc
        self._wake_all()

    # -- the engine's side ------------------------------------------------------------------
    async def wait(self, request_id: str | None, kinds: tuple[type, ...], timeout: float | None = None) -> p.Msg:
        """The oldest kept event of ``kinds`` for ``request_id``, removed."""
        keys = self._keys(request_id, kinds)
        async with asyncio.timeout(timeout):
            while True:
                ev = self._take_first(keys, kinds)
                if ev is not None:
                    return ev
                fut = asyncio.get_running_loop().create_future()
                for k in keys:
                    self._box(k).waiters.add(fut)
                try:
                    await fut
                finally:
                    for k in keys:
                        box = self._boxes.get(k)
                        if box is not None:
                            box.waiters.discard(fut)
                            self._collect(k, box)

    def take(self, request_id: str | None, kinds: tuple[type, ...]) -> list[p.Msg]:
        """Every kept event of ``kinds`` for ``request_id``, in arrival order, without waiting."""
        keys = self._keys(request_id, kinds)
        out: list[p.Msg] = []
        while (ev := self._take_first(keys, kinds, empty_ok=bool(out))) is not None:
            out.append(ev)
        return out

    async def next_event(self, timeout: float | None = None) -> p.Msg:
        """The oldest kept event of any request, removed."""
        return await self.wait_for(None, timeout=timeout)

    async def wait_for(self, predicate: Callable[[p.Msg], bool] | None, *, timeout: float | None = None) -> p.Msg:
        """The oldest kept event (of any request) that ``predicate`` accepts. Scans every kept
        event and wakes on each new one: for tests and tools; engines wait per request."""
        async with asyncio.timeout(timeout):
            while True:
                for seq, (key, ev) in self._order.items():
                    if predicate is None or predicate(ev):
                        self._remove(seq, key)
                        return ev
                self._check_failed()
                fut = asyncio.get_running_loop().create_future()
                self._any.add(fut)
                try:
                    await fut
                finally:
                    self._any.discard(fut)

    def take_all(self) -> list[p.Msg]:
        """Every kept event, in arrival order. Raises :class:`EventOverflow` once the client lost
        events (a request's own overflow is raised by its waits and told to ``on_overflow``)."""
        if self.overflow is not None:
            raise self.overflow
        out = [ev for _, ev in self._order.values()]
        self._order.clear()
        for key, box in list(self._boxes.items()):
            box.seqs.clear()
            self._collect(key, box)
        return out

    def forget(self, request_id: str) -> int:
        """Drop what is kept for ``request_id`` and its overflow marks; returns the events dropped."""
        n = 0
        for fam in (_OUTCOME, _STREAM):
            key = (request_id, fam)
            box = self._boxes.get(key)
            if box is None:
                continue
            for seq in box.seqs:
                del self._order[seq]
            n += len(box.seqs)
            box.seqs.clear()
            if box.lost:
                box.lost = 0
                self._overflowed -= 1
            self._collect(key, box)
        return n

    # -- internals ---------------------------------------------------------------------------
    @staticmethod
    def _keys(request_id: str | None, kinds: Iterable[type]) -> list[Key]:
        return sorted({(request_id, _family(k)) for k in kinds})

    def _box(self, key: Key) -> _Mailbox:
        box = self._boxes.get(key)
        if box is None:
            box = self._boxes[key] = _Mailbox()
        return box

    def _take_first(self, keys: list[Key], kinds: tuple[type, ...], *, empty_ok: bool = False) -> p.Msg | None:
        """The oldest matching event in ``keys``; if none is kept: raise the overflow or the
        connection's end that explains why (unless ``empty_ok``), else None."""
        best: tuple[int, Key] | None = None
        for key in keys:
            box = self._boxes.get(key)
            if box is None:
                continue
            for seq in box.seqs:
                if isinstance(self._order[seq][1], kinds):
                    if best is None or seq < best[0]:
                        best = (seq, key)
                    break
        if best is not None:
            ev = self._order[best[0]][1]
            self._remove(*best)
            return ev
        if empty_ok:
            return None
        for key in keys:
            box = self._boxes.get(key)
            if box is not None and box.lost:
                raise EventOverflow(f"{box.lost} events for request {key[0]!r} were lost: more than "
                                    f"{self.max_request_events} were waiting (max_request_events)")
        self._check_failed()
        return None

    def _check_failed(self) -> None:
        if self.overflow is not None:
            raise self.overflow
        if self.closed is not None:
            raise self.closed

    def _remove(self, seq: int, key: Key) -> None:
        del self._order[seq]
        box = self._boxes[key]
        if box.seqs[0] == seq:
            box.seqs.popleft()
        else:
            box.seqs.remove(seq)
        self._collect(key, box)

    def _collect(self, key: Key, box: _Mailbox) -> None:
        if not box.seqs and not box.waiters and not box.lost and self._boxes.get(key) is box:
            del self._boxes[key]

    @staticmethod
    def _wake(waiters: set[asyncio.Future[None]]) -> None:
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _wake_all(self) -> None:
        for box in self._boxes.values():
            self._wake(box.waiters)
        self._wake(self._any)

    def _notify(self, request_id: str | None) -> None:
        if self.on_overflow is not None:
            self.on_overflow(request_id)
