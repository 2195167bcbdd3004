"""The receiving side of a peer session: KV transfers from the peer, KV_OFFER to KV_DONE.

What to answer about a chunk, a repeated KV_BEGIN or a KV_RESUME is decided by the sans-IO
:class:`~.protocol.ReceiveLedger`; this module carries it out. Memory goes back to the engine
only once no data path can write into it (:meth:`Receiver.fail` closes the route and waits).

Offers: a receive posted for this peer is offered to it (KV_OFFER), so that its transfer moves
without waiting for KV_ACCEPT. Such a transfer's first chunks leave right behind its KV_BEGIN,
on other connections read by other threads, and may come before the KV_BEGIN was handled: the
:class:`BeginGate` holds them (their data path stops reading that connection) until it was.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import ErrorCode, ProtocolError
from ..memory import BlockMap
from ..transfer import InTransfer, State
from ..transport.route import Route
from ..wire import Frame, FrameType, Header
from ..wire import messages as m
from ..wire.chunkset import bitmap_from
from ..wire.frame import F_CHECKSUM, F_LZ4
from ..wire.handshake import MAX_CHUNK
from .protocol import Landing, ReceiveLedger, Status, code_name

if TYPE_CHECKING:
    from ..transport.tcp import FrameProtocol
    from .host import Shell

#: The receiver's own clock ends a transfer this long after the sender's deadline, so that
#: both sides end even if the sender's KV_CANCEL is lost.
DEADLINE_SLACK_S = 1.0
#: How long a stalled data path may keep writing into a closing transfer before its lanes are cut.
QUIESCE_S = 1.0
#: How long a chunk may wait for its KV_BEGIN to be handled (it was sent first, on the control
#: connection: only a stalled loop or a broken peer takes this long). Then it is dropped.
PARK_S = 2.0
#: Chunks of one peer held for their KV_BEGIN at once (a bulk connection holds at most one).
MAX_PARKED = 256


class BeginGate:
    """Holds chunks that outran their KV_BEGIN (offered transfers only): any thread asks
    :meth:`hold`, the session's loop reports each KV_BEGIN handled (:meth:`begun`). A chunk of a
    transfer whose KV_BEGIN was handled is never held, so a chunk of a transfer that ended
    (or never matched) is dropped as before; ``keep`` bounds the transfers remembered."""

    def __init__(self, keep: int, count: Callable[[str], None] = lambda outcome: None) -> None:
        self.keep = keep
        self.count = count  # "held" / "expired", from any thread
        self._loop: asyncio.AbstractEventLoop | None = None  # set by open(): the peer may send early
        self._lock = threading.Lock()
        self._begun: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._held: dict[int, list[Callable[[], None]]] = {}
        self.holding = 0

    @property
    def enabled(self) -> bool:
        return self._loop is not None

    def open(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Hold early chunks from now on (``loop``: the session's), or never (None): the peer
        sends before KV_ACCEPT only where both sides advertised offer.v1."""
        self._loop = loop

    def hold(self, tid: int, wake: Callable[[], None]) -> bool:
        """Any thread: should a chunk of ``tid``, whose transfer is not open, wait? If so
        ``wake()`` is called (from the session's loop) once its KV_BEGIN was handled or after
        :data:`PARK_S`; it must be safe to call from there."""
        loop = self._loop
        with self._lock:
            if loop is None or tid in self._begun or self.holding >= MAX_PARKED:
                return False
            self._held.setdefault(tid, []).append(wake)
            self.holding += 1
        self.count("held")
        loop.call_soon_threadsafe(loop.call_later, PARK_S, self._expire, tid, wake)
        return True

    def begun(self, tid: int) -> None:
        """The session's loop handled the KV_BEGIN of ``tid`` (opened, refused or waiting)."""
        if not self.enabled:
            return
        with self._lock:
            self._begun[tid] = None
            if len(self._begun) > self.keep:
                self._begun.popitem(last=False)
            wakes = self._held.pop(tid, ())
            self.holding -= len(wakes)
        for wake in wakes:
            wake()

    def _expire(self, tid: int, wake: Callable[[], None]) -> None:
        with self._lock:
            waiting = self._held.get(tid, [])
            if wake not in waiting:
                return
            waiting.remove(wake)
            if not waiting:
                del self._held[tid]
            self.holding -= 1
        self.count("expired")
        wake()

    def clear(self) -> None:
        """The peer restarted: its transfer ids start again from 1."""
        with self._lock:
            self._begun.clear()
            held, self._held, self.holding = self._held, {}, 0
        for wakes in held.values():
            for wake in wakes:
                wake()


class InlineLanding:
    """Inline chunks (inline.v1) of one control connection: KV_CHUNKs of at most INLINE_MAX read
    on the session's loop, landing in the posted memory exactly as a bulk connection's would
    (proto/transfer.md §7 and §17). At most one is being read at a time (one stream)."""

    def __init__(self, receiver: "Receiver", conn: "FrameProtocol") -> None:
        self.receiver = receiver
        self.conn = conn
        self._claim: tuple[Route, int] | None = None
        self._invalid = False
        conn.payload_sink = self.sink
        conn.add_close_callback(self.lost)

    def sink(self, header: Header, body: bytes):
        """Where the chunk's payload goes (the frame reader checked: a KV_CHUNK, <= INLINE_MAX)."""
        if not header.flags & F_CHECKSUM:
            raise ProtocolError("KV_CHUNK without its payload checksum (flag bit 0)", ErrorCode.MALFORMED_BODY)
        if header.flags & F_LZ4:
            raise ProtocolError("an inline KV_CHUNK is never compressed (flag LZ4)", ErrorCode.MALFORMED_BODY)
        self._claim, self._invalid = None, False
        route = self.receiver.routes.get(header.transfer_id)
        if route is None:
            return None  # read into scratch: the transfer is not open (§7)
        views, self._invalid = route.land(header.seq, header.payload_len)
        self._claim = (route, header.seq) if views is not None else None
        return views

    def landed(self, frame: Frame) -> None:
        h = frame.header
        claim, self._claim = self._claim, None
        invalid, self._invalid = self._invalid, False
        if claim is not None:
            claim[0].settle(claim[1], frame.payload_ok)
        s = self.receiver.s
        s.metrics.child(s.metrics.inline_chunks, s.key, "rx").inc()
        self.receiver.chunk_arrived(h.transfer_id, h.seq, frame.payload_ok, h.payload_len, claim is not None,
                                    invalid)

    def holds(self, route: Route) -> bool:
        """A chunk of ``route`` is being read now (its payload split across reads)."""
        return self._claim is not None and self._claim[0] is route

    def lost(self) -> None:
        """The connection ended, maybe in the middle of a payload: nothing writes any more."""
        claim, self._claim = self._claim, None
        if claim is not None:
            claim[0].settle(claim[1], False)


class Receiver:
    def __init__(self, session: "Shell") -> None:
        self.s = session
        self.inn: dict[int, InTransfer] = {}
        self.routes: dict[int, Route] = {}  # read by data-path threads; mutated only here
        self.by_request: dict[str, set[int]] = {}  # request id -> its open transfers' ids
        self.ledger = ReceiveLedger(keep=4 * session.cfg.transfer.max_transfers)
        # The request of every transfer id a KV_BEGIN named (waiting, open, done or failed), so that
        # a reused id is refused (proto/transfer.md §1); the last 8 x max_transfers of the peer's run.
        self.begun: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._begun_keep = 8 * session.cfg.transfer.max_transfers
        self.gate = BeginGate(4 * session.cfg.transfer.max_transfers,
                              lambda outcome: session.metrics.child(session.metrics.chunks_held, session.key,
                                                                    outcome).inc())
        # Receives offered to this peer (KV_OFFER): request id -> (total, block bytes, until).
        self.offered: dict[str, tuple[int, int, float]] = {}
        self.inline: InlineLanding | None = None  # the control connection's, when this agent takes inline chunks
        # Open transfers whose verified chunks a KV_STATUS told, on the control connection ``_told_on``
        # (a sender asks once a connection: a copy on the same one is ignored, proto/transfer.md §6).
        self._told: set[int] = set()
        self._told_on: weakref.ref | None = None  # (weak: the old connection and its buffers go)

    # -- offers
    def offers_on(self) -> bool:
        s = self.s
        return s.cfg.transfer.offers and s.is_up and "offer.v1" in (s.remote_caps or ())

    def offer(self, request_id: str, dest: BlockMap, until: float) -> bool:
        """Offer a receive posted for this peer (sent now and again after a reconnect, until
        :meth:`withdraw`). False if the peer takes no offers or has its share of them."""
        if not self.offers_on() or (len(self.offered) >= self.s.cfg.transfer.max_transfers
                                    and request_id not in self.offered):
            return False
        self.offered[request_id] = (dest.total, dest.block_bytes, until)
        self._send_offer(request_id, asyncio.get_running_loop().time())
        return True

    def _send_offer(self, request_id: str, now: float) -> None:
        total, block, until = self.offered[request_id]
        self.s.send_frame(FrameType.KV_OFFER, m.KvOffer(request_id, total, block, max(1, int((until - now) * 1000))))
        self.s.metrics.child(self.s.metrics.offers, self.s.key, "sent").inc()

    def withdraw(self, request_id: str, *, tell: bool) -> None:
        """The offered receive is gone (taken, aborted, expired); ``tell``: the peer may still hold
        the offer (it is not the one whose transfer took the receive)."""
        if self.offered.pop(request_id, None) is not None and tell and self.s.is_up:
            self.s.send_frame(FrameType.KV_WITHDRAW, m.KvWithdraw(request_id))

    def session_up(self) -> None:
        """The control connection is (back) up: the peer forgot our offers with the last one."""
        c = self.s.control
        # This agent advertised inline.v1 (transfer.inline_bytes > 0): the connection takes inline chunks.
        self.inline = InlineLanding(self, c) if c is not None and self.s.cfg.transfer.inline_bytes else None
        loop = asyncio.get_running_loop()
        self.gate.open(loop if self.s.cfg.transfer.offers and "offer.v1" in (self.s.remote_caps or ()) else None)
        if not self.gate.enabled:
            self.offered.clear()
            return
        now = loop.time()
        for rid in [r for r, (_, _, until) in self.offered.items() if until <= now]:
            del self.offered[rid]
        for rid in self.offered:
            self._send_offer(rid, now)

    # -- transfers
    def on_begin(self, tid: int, begin: m.KvBegin, conn=None) -> None:
        """``conn``: the control connection it came on (failed if the frame is refused)."""
        if tid == 0:  # proto/transfer.md §1: transfer ids start at 1
            self.s.count_error(ErrorCode.OUT_OF_RANGE)
            if (conn := conn or self.s.control) is not None:
                conn.fail(ProtocolError("KV_BEGIN with transfer_id 0 (transfer ids start at 1)",
                                        ErrorCode.OUT_OF_RANGE))
            return
        t = self.inn.get(tid)  # (an open transfer is known even past the memory's bound)
        known = self.begun.get(tid) or (t.request_id if t is not None else self.ledger.completed.get(tid))
        if known is not None and known != begin.request_id:
            # A resent KV_BEGIN names its transfer's request again; another request under a
            # transfer id still known here would be answered for the first one's bytes.
            self.s.count_error(ErrorCode.UNEXPECTED_FRAME)
            if (conn := conn or self.s.control) is not None:
                conn.fail(ProtocolError(f"KV_BEGIN for transfer {tid} names request {begin.request_id!r}, but that "
                                        f"transfer is request {known!r} (transfer ids are never reused)",
                                        ErrorCode.UNEXPECTED_FRAME))
            return
        self.s.data.saw_tid(tid)
        if known is None:
            self.begun[tid] = begin.request_id
            if len(self.begun) > self._begun_keep:
                self.begun.popitem(last=False)
        if self.s.closing and tid not in self.inn and tid not in self.ledger.completed:  # nothing new opens
            self.reject(tid, begin, *self._closing())
            self.gate.begun(tid)
            return
        self._on_begin(tid, begin)
        self.gate.begun(tid)  # chunks that came before it go on now (into the route, if it matched)

    def _on_begin(self, tid: int, begin: m.KvBegin) -> None:
        s = self.s
        t = self.inn.get(tid)
        if t is not None:
            if t.state == State.MOVING:  # our KV_ACCEPT was lost with a connection
                s.send_frame(FrameType.KV_ACCEPT, m.KvAccept(begin.request_id), tid=tid)
            return
        if tid in self.ledger.completed:
            s.send_frame(FrameType.KV_DONE, m.KvDone(begin.request_id, begin.total_bytes), tid=tid)
            return
        s.host.incoming_begin(s, tid, begin)

    def accept(self, tid: int, begin: m.KvBegin, engine, dest: BlockMap, *, late: bool = False,
               lz4: bool = True) -> InTransfer | None:
        """``late``: matched after its KV_BEGIN waited for the post (an offered sender is told
        with KV_ACCEPT then: the chunks it sent meanwhile were dropped). ``lz4`` False: an LZ4
        chunk of it fails it MALFORMED_BODY (probes, proto/transfer.md §7)."""
        s = self.s
        problem = None
        if dest.total != begin.total_bytes or dest.block_bytes != begin.block_bytes:
            problem = (ErrorCode.SIZE_MISMATCH,
                       f"sender has {begin.n_blocks} blocks of {begin.block_bytes} bytes, receiver posted "
                       f"{dest.n_blocks} blocks of {dest.block_bytes} bytes")
        elif begin.chunk_bytes <= 0 or begin.chunk_bytes > MAX_CHUNK or \
                begin.n_chunks != -(-begin.total_bytes // begin.chunk_bytes):
            problem = (ErrorCode.MALFORMED_BODY, "inconsistent chunking in KV_BEGIN")
        elif len(self.inn) >= s.cfg.transfer.max_transfers:
            problem = (ErrorCode.TOO_MANY_TRANSFERS, "receiver has too many open transfers")
        elif s.closing:  # a post matched a KV_BEGIN that waited, while the session ends
            problem = self._closing()
        loop = asyncio.get_running_loop()
        budget = begin.deadline_ms / 1000 if begin.deadline_ms else s.cfg.transfer.default_deadline_s
        t = InTransfer(tid, begin.request_id, engine, s.key, dest, begin.chunk_bytes, loop.time() + budget, loop=loop)
        if problem is not None:
            self.reject(tid, begin, *problem)
            t.state = State.FAILED
            s.host.transfer_failed(t, "in", int(problem[0]), problem[1])
            return None
        t.state = State.MOVING
        t.route.lz4 = lz4  # before a bulk thread can find the route
        self.inn[tid] = t
        self.by_request.setdefault(t.request_id, set()).add(tid)
        self.routes[tid] = t.route
        t.timer = loop.call_at(t.deadline + DEADLINE_SLACK_S, self.fail_later, t, ErrorCode.TRANSFER_TIMEOUT,
                               "transfer deadline passed", True)
        s.metrics.child(s.metrics.inflight, "in").inc()
        s.data.expect(tid, t.route)
        if late or not begin.offered:
            s.send_frame(FrameType.KV_ACCEPT, m.KvAccept(begin.request_id), tid=tid)
        return t

    def reject(self, tid: int, begin: m.KvBegin, code: int, message: str) -> None:
        s = self.s
        s.count_error(code)
        s.lines.line(s.log.warning, "refused incoming KV", code=code_name(code),  # (each is counted)
                     detail={"transfer_id": tid, "request_id": begin.request_id[:64], "reason": message})
        s.send_frame(FrameType.KV_REJECT, m.KvReject(begin.request_id, int(code), message), tid=tid)

    def inline_chunk(self, conn: "FrameProtocol", frame: Frame) -> None:
        """A KV_CHUNK on the control connection ``conn``, read whole."""
        if self.inline is None or self.inline.conn is not conn:  # this agent did not advertise inline.v1
            err = ProtocolError("KV_CHUNK on the control connection (inline.v1 not advertised)",
                                ErrorCode.UNEXPECTED_FRAME)
        elif not frame.header.payload_len:
            err = ProtocolError("KV_CHUNK without a payload", ErrorCode.MALFORMED_BODY)
        else:
            self.inline.landed(frame)
            return
        self.s.count_error(err.code)
        conn.fail(err)

    def _closing(self) -> tuple[ErrorCode, str]:
        """Why a KV_BEGIN is refused while this session closes: the agent stops, or the session
        ends alone (a fleet session retired)."""
        code = ErrorCode.SHUTTING_DOWN if self.s.host.stopping else ErrorCode.PEER_UNREACHABLE
        return code, "the receiving agent is closing this session"

    def chunk_arrived(self, tid: int, k: int, ok: bool, nbytes: int, claimed: bool, invalid: bool = False,
                      wrong_size: bool = False) -> None:
        s = self.s
        t = self.inn.get(tid)
        # Complete: every chunk's arrival handled here, not only written (a report may be on its way).
        last = t is not None and t.state == State.MOVING and len(t.landed) + (k not in t.landed) == t.route.n_chunks
        verdict = self.ledger.landing(
            tid, is_open=t is not None, verified=t is not None and k in t.route.verified, claimed=claimed,
            ok=ok, invalid=invalid, complete=last)
        match verdict:
            case Landing.DROP:
                return
            case Landing.ACK_AGAIN:
                s.metrics.duplicates.labels(peer=s.key).inc()
                s.send_frame(FrameType.KV_ACK, m.KvAck(k, 1), tid=tid)
                return
            case Landing.NACK_BUSY:
                # Another connection still holds this chunk (one that died mid-chunk and has
                # not noticed yet): ask for it again a little later.
                s.send_frame(FrameType.KV_NACK, m.KvNack(k, int(ErrorCode.CHUNK_BUSY)), tid=tid)
                return
        assert t is not None  # every other verdict is about an open transfer
        match verdict:
            case Landing.FAIL_INVALID:
                self.fail_later(t, ErrorCode.MALFORMED_BODY,
                                f"chunk {k} of {nbytes} bytes does not fit the announced transfer"
                                + ("" if t.route.lz4 else ", or is LZ4, which a probe transfer does not take"), True)
            case Landing.NACK_CHECKSUM:
                # (a data path may say why the chunk did not land when it is not its checksum: the
                # UCX path got a message of another length for it; KV_NACK's code stays the same)
                if wrong_size:
                    s.count_error(ErrorCode.SIZE_MISMATCH)
                    s.lines.line(s.log.warning, "chunk came as a UCX message of the wrong size (nothing written); "
                                 "asking for it again",
                                 detail={"transfer_id": tid, "request_id": t.request_id, "chunk": k})
                else:
                    s.metrics.checksum_failures.labels(peer=s.key).inc()
                    s.count_error(ErrorCode.CHUNK_CHECKSUM)
                    s.lines.line(s.log.warning, "chunk payload checksum failed; asking for it again",
                                 detail={"transfer_id": tid, "request_id": t.request_id, "chunk": k})
                s.send_frame(FrameType.KV_NACK, m.KvNack(k), tid=tid)
            case Landing.ACK | Landing.ACK_COMPLETE:
                s.metrics.child(s.metrics.bytes, s.key, "bulk", "rx").inc(nbytes)
                s.metrics.child(s.metrics.chunks, s.key, "rx").inc()
                t.landed.add(k)
                if verdict is Landing.ACK:
                    s.send_frame(FrameType.KV_ACK, m.KvAck(k, 1), tid=tid)
                    return
                # The last one: KV_DONE acknowledges it with the rest, once nothing writes any more.
                t.state = State.DONE
                if t.route.close().done():
                    self._completed(t)
                else:
                    s.spawn(self._complete(t), f"complete{tid}")

    async def _complete(self, t: InTransfer) -> None:
        await t.route.quiesced
        self._completed(t)

    def _completed(self, t: InTransfer) -> None:
        s = self.s
        self._forget(t)
        self.ledger.completed_transfer(t.tid, t.request_id)
        s.host.kv_received(t)  # the engine first: it waits for this, the sender only frees its pages
        s.send_frame(FrameType.KV_DONE, m.KvDone(t.request_id, t.total), tid=t.tid)
        s.metrics.child(s.metrics.transfers, s.key, "in", "done").inc()
        s.metrics.child(s.metrics.transfer_seconds, "in").observe(time.monotonic() - t.started)

    async def _quiesce(self, route: Route) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(route.close()), QUIESCE_S)
        except TimeoutError:
            # A data path is stalled in the middle of one of this transfer's chunks: cut its
            # lanes so the claim is released (the control connection, if it is its inline chunk).
            if self.inline is not None and self.inline.holds(route):
                self.s.log.warning("control connection stalled mid inline chunk; dropping it")
                self.inline.conn.abort()
            else:
                self.s.log.warning("bulk connection stalled mid-chunk; resetting bulk connections")
                self.s.data.stall()
            await route.quiesced

    def _forget(self, t: InTransfer) -> None:
        if self.inn.pop(t.tid, None) is not None:
            self.s.metrics.child(self.s.metrics.inflight, "in").dec()
            self.s.host.transfer_ended()
            tids = self.by_request.get(t.request_id)
            if tids is not None:
                tids.discard(t.tid)
                if not tids:
                    del self.by_request[t.request_id]
        self.routes.pop(t.tid, None)
        if t.timer is not None:
            t.timer.cancel()

    def fail_later(self, t: InTransfer, code: int, message: str, notify_peer: bool) -> None:
        """Schedule :meth:`fail` (it waits for the data path to let go of the memory)."""
        self.s.spawn(self.fail(t, code, message, notify_peer=notify_peer), f"fail{t.tid}")

    async def fail(self, t: InTransfer, code: int, message: str, *, notify_peer: bool) -> None:
        """End ``t``; returns once no data path writes into its blocks, also to a caller that
        found another fail under way (an engine gone, an abort: they free the blocks next)."""
        while True:
            if self.inn.get(t.tid) is not t or t.state == State.DONE:
                return
            if t.failing is None:
                break
            await asyncio.shield(t.failing)  # that fail was cancelled if t is still here: this one goes on
        s = self.s
        t.state = State.FAILED
        t.failing = asyncio.get_running_loop().create_future()
        try:
            self.routes.pop(t.tid, None)
            await s.data.forget(t.tid)
            await self._quiesce(t.route)  # no data path writes into the blocks after this
            self._forget(t)
            if notify_peer:
                s.cancel_transfer(t.tid, m.KvCancel(t.request_id, int(code), message, True))
            s.count_failure("in", code)
            s.host.transfer_failed(t, "in", int(code), message)
        finally:
            done, t.failing = t.failing, None
            done.set_result(None)

    async def fail_all(self, code: int, message: str, *, notify_peer: bool, engine=None) -> int:
        ts = [t for t in self.inn.values() if engine in (None, t.engine)]
        for t in ts:
            try:  # one transfer's failure must not leave the others writing into their blocks
                await self.fail(t, code, message, notify_peer=notify_peer)
            except Exception:
                self.s.log.exception("ending a transfer failed", transfer_id=t.tid, request_id=t.request_id)
        return len(ts)

    def on_cancel(self, tid: int, msg: m.KvCancel) -> None:
        t = self.inn.get(tid)
        if t is not None:
            self.fail_later(t, msg.code, f"cancelled by peer {self.s.key}: {msg.message}", False)
        self.s.host.incoming_cancelled(self.s, tid, msg)

    def on_resume(self, tid: int, msg: m.KvResume) -> None:
        if tid == 0:  # names no transfer: no KV_STATUS carries transfer id 0 (proto/transfer.md §1)
            return
        t = self.inn.get(tid)
        if t is not None:
            ctl = self.s.control
            if ctl is None:  # (no connection to answer on)
                return
            if self._told_on is None or self._told_on() is not ctl:
                self._told_on, self._told = weakref.ref(ctl), set()
            if tid in self._told:  # a copy: its bitmap cost O(verified chunks) a 20-byte frame
                return
            if len(self._told) > 2 * len(self.inn):  # bounded by the open transfers
                self._told = {k for k in self._told if k in self.inn}
            self._told.add(tid)
        verified = t.route.snapshot() if t is not None else None
        state = self.ledger.status(tid, verified)
        have = bitmap_from(verified, t.route.n_chunks) if t is not None and verified is not None else b""
        if state == Status.RECEIVING:
            self.s.send_frame(FrameType.KV_STATUS, m.KvStatus(msg.request_id, int(state), have), tid=tid)
        else:
            self.s.send_frame(FrameType.KV_STATUS, m.KvStatus(msg.request_id, int(state)), tid=tid)

    def peer_restarted(self) -> None:
        for t in list(self.inn.values()):
            self.fail_later(t, ErrorCode.PEER_RESTARTED, f"peer {self.s.key} restarted", False)
        self.ledger.clear()
        self.begun.clear()  # its transfer ids start again from 1
        self.gate.clear()
