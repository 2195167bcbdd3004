"""The sending side of a peer session: KV transfers to the peer, from PREFIX_QUERY to KV_DONE.

The books (credit, chunks in flight, acks, what to send again) are the sans-IO
:class:`~.protocol.SendWindow`; this module turns control frames into its inputs and its
answers into frames, timers and engine events. It also keeps the peer's KV_OFFERs (receives
posted there for this agent to fill): a send that finds its request's offer moves at once,
without the KV_ACCEPT round trip.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import TYPE_CHECKING, NamedTuple

from ..errors import ErrorCode, PddWireError, TransportError
from ..memory import BlockMap
from ..transfer import OutTransfer, State
from ..wire import FrameType, Lane, encode
from ..wire import messages as m
from .protocol import INLINE, Resumed, SendWindow, Status

if TYPE_CHECKING:
    from .host import Shell

#: How long a chunk the receiver is still writing from a lost connection waits before it is
#: sent again (KV_NACK CHUNK_BUSY), doubling with each such NACK of the transfer since its last
#: ack up to BUSY_RETRY_MAX_S (the claim lasts until the receiver finds that connection stalled,
#: `timeouts.dead_after_s`: 5 s were 100 copies of the chunk at a fixed 50 ms); and one whose
#: send failed.
BUSY_RETRY_S = 0.05
BUSY_RETRY_MAX_S = 0.4
SEND_RETRY_S = 0.1


def refusals_allowed(n_chunks: int) -> int:
    """KV_NACK CHUNK_CHECKSUM a transfer's receiver may answer before its sender gives the
    transfer up (each one had a whole chunk sent again at once, for a 53-byte frame)."""
    return 2 * n_chunks + 8


#: Transfers smaller than this measure the RTT, not the bandwidth: not fed to the goodput EWMA.
GOODPUT_MIN_BYTES = 1 << 20


class Offer(NamedTuple):
    """A receive the peer posted for us to fill (KV_OFFER): its sizes, and until when it stands."""

    total_bytes: int
    block_bytes: int
    until: float  # loop time


class Sender:
    def __init__(self, session: "Shell", flow: SendWindow[OutTransfer]) -> None:
        self.s = session
        self.flow = flow
        self._lookups: dict[str, list[asyncio.Future]] = {}  # PREFIX_QUERYs of choose_pipeline
        # The peer's standing KV_OFFERs by request id (at most transfer.max_transfers, the oldest
        # dropped first), and the open transfers of each request here (an offer for a request
        # already being sent is stale: ignored; a REQUEST_ABORT finds them without a scan).
        self.offers: collections.OrderedDict[str, Offer] = collections.OrderedDict()
        self.by_request: dict[str, set[int]] = {}

    # -- offers
    def on_offer(self, msg: m.KvOffer | m.KvWithdraw) -> None:
        """KV_OFFER: held (the newest per request, at most max_transfers); KV_WITHDRAW: dropped."""
        s = self.s
        if isinstance(msg, m.KvWithdraw):
            self.offers.pop(msg.request_id, None)
            return
        if not (s.cfg.transfer.offers and "offer.v1" in (s.remote_caps or ())):
            # Offers were not agreed (one side did not advertise offer.v1): a KV_BEGIN `offered`
            # would go to a peer that never said it reads the field.
            s.metrics.child(s.metrics.offers, s.key, "ignored").inc()
            return
        if msg.request_id in self.by_request:
            s.metrics.child(s.metrics.offers, s.key, "stale").inc()
            return
        self.offers[msg.request_id] = Offer(msg.total_bytes, msg.block_bytes,
                                            asyncio.get_running_loop().time() + msg.ttl_ms / 1000)
        self.offers.move_to_end(msg.request_id)
        if len(self.offers) > s.cfg.transfer.max_transfers:
            self.offers.popitem(last=False)
            s.metrics.child(s.metrics.offers, s.key, "dropped").inc()

    def _take_offer(self, request_id: str, blocks: BlockMap, now: float) -> bool:
        """Whether a send of ``blocks`` may move at once on the peer's offer (which it uses up)."""
        offer = self.offers.pop(request_id, None)
        if offer is None:
            return False
        fits = offer.until > now and (offer.total_bytes, offer.block_bytes) == (blocks.total, blocks.block_bytes)
        self.s.metrics.child(self.s.metrics.offers, self.s.key, "taken" if fits else "unfit").inc()
        return fits

    # -- starting
    def start(self, engine, request_id: str, blocks: BlockMap, deadline_s: float,
              hashes: list[int] | None = None, post_wait_s: float = 0.0) -> OutTransfer:
        s, cfg = self.s, self.s.cfg.transfer
        if len(self.flow.out) >= cfg.max_transfers:
            raise PddWireError(f"{len(self.flow.out)} transfers open to {s.key} (limit transfer.max_transfers)",
                               ErrorCode.TOO_MANY_TRANSFERS)
        loop = asyncio.get_running_loop()
        chunk = s.data.chunk_bytes(s.chunk_bytes, window=self.flow.window, peer_max_chunk=s.peer_max_chunk)
        now = loop.time()
        t = OutTransfer(s.host.next_transfer_id(), request_id, engine, s.key, blocks, chunk, now + deadline_s)
        t.post_wait_ms = int(post_wait_s * 1000)
        t.offered = self._take_offer(request_id, blocks, now) if self.offers else False
        self.flow.add(t)
        self.by_request.setdefault(request_id, set()).add(t.tid)
        t.timer = loop.call_at(t.deadline, self._deadline, t)
        s.metrics.child(s.metrics.inflight, "out").inc()
        asked = min(len(hashes), blocks.n_blocks - 1, self.query_room(request_id)) if hashes else 0
        if hashes and asked > 0 and self.may_query():
            # Ask first which leading blocks the receiver's node holds; at least one block is
            # always sent (the last one is usually partial and never shared anyway).
            t.hashes = hashes[:asked]
            t.state = State.QUERYING
            s.send_frame(FrameType.PREFIX_QUERY, m.PrefixQuery(request_id, t.hashes, int(cfg.prefix_lease_s * 1000)),
                         tid=t.tid)
            t.query_timer = loop.call_later(self._query_wait(), self._query_unanswered, t)
        else:
            self._announce(t)
        return t

    def may_query(self) -> bool:
        """A PREFIX_QUERY (up to ~590 KB) may go: the peer takes them, and the control connection
        has less than half of ``limits.control_buffer_bytes`` unsent. Else the transfer sends every
        block (a query is an optimisation): an engine's queries never make the peer look unread."""
        s, conn = self.s, self.s.control
        return (s.is_up and "prefix.v1" in (s.remote_caps or ()) and conn is not None
                and conn.paced_room() > 0)

    def query_room(self, request_id: str) -> int:
        """The hashes one PREFIX_QUERY may carry: what fits the peer's ``max_body``, at most
        65536 (a query is of the leading blocks, so fewer hashes ask about a shorter prefix)."""
        return min(m.MAX_PREFIX_HASHES, m.u64s_that_fit(self.s.peer_max_body, request_id))

    def _query_wait(self) -> float:
        return max(self.s.cfg.transfer.prefix_query_s, 4 * (self.s.link.est.rtt_s or 0.0))

    def _query_unanswered(self, t: OutTransfer) -> None:
        if self.flow.out.get(t.tid) is t and t.state == State.QUERYING:
            self.s.log.info("no PREFIX_MATCH in time; sending every block", request_id=t.request_id)
            t.state = State.ANNOUNCED
            self._announce(t)

    async def prefix_lookup(self, request_id: str, hashes: list[int], timeout: float | None = None) -> int | None:
        s = self.s
        if not self.may_query():
            return None
        fut = asyncio.get_running_loop().create_future()
        self._lookups.setdefault(request_id, []).append(fut)
        s.send_frame(FrameType.PREFIX_QUERY, m.PrefixQuery(request_id, hashes[:self.query_room(request_id)],
                                                           int(s.cfg.transfer.prefix_lease_s * 1000)))
        try:
            async with asyncio.timeout(timeout or self._query_wait()):
                return await fut
        except TimeoutError:
            return None
        finally:
            waiters = self._lookups.get(request_id, [])
            if fut in waiters:
                waiters.remove(fut)
            if not waiters:
                self._lookups.pop(request_id, None)

    def on_prefix_match(self, tid: int, msg: m.PrefixMatch) -> None:
        if tid == 0:
            for fut in self._lookups.pop(msg.request_id, []):
                if not fut.done():
                    fut.set_result(msg.matched)
            return
        t = self.flow.out.get(tid)
        if t is None or t.state != State.QUERYING or t.request_id != msg.request_id:
            return
        if t.query_timer is not None:
            t.query_timer.cancel()
        k = max(0, min(msg.matched, len(t.hashes or ()), t.blocks.n_blocks - 1))
        n = t.blocks.n_blocks
        if k:
            t.skip = k
            t.blocks = t.full_blocks.after_blocks(k)
            self.s.metrics.prefix_bytes_saved.labels(peer=self.s.key).inc(k * t.blocks.block_bytes)
        self.s.metrics.prefix_hit_ratio.observe(k / n)
        t.state = State.ANNOUNCED
        self._announce(t)

    def _restart_full(self, t: OutTransfer, message: str) -> None:
        """The receiver lost the prefix it matched (a broken lease): send the request again,
        every block, as a new transfer. The engine sees only the new transfer's outcome, under the
        transfer id it was given."""
        s = self.s
        s.log.warning("receiver lost the matched prefix; sending every block", request_id=t.request_id,
                      transfer_id=t.tid, reason=message)
        s.metrics.retransmits.labels(peer=s.key, reason="prefix_lost").inc(t.n_chunks)
        left = t.deadline - asyncio.get_running_loop().time()
        if left <= 0:
            s.host.transfer_failed(t, "out", int(ErrorCode.TRANSFER_TIMEOUT), "deadline passed")
            return
        self.start(t.engine, t.request_id, t.full_blocks, left).engine_tid = t.engine_tid

    def _announce(self, t: OutTransfer) -> None:
        remaining = max(1, int((t.deadline - asyncio.get_running_loop().time()) * 1000))
        sent = self.s.send_frame(FrameType.KV_BEGIN, m.KvBegin(t.request_id, t.total, t.chunk_bytes, t.n_chunks,
                                                               t.blocks.block_bytes, t.blocks.n_blocks, remaining,
                                                               t.skip, t.post_wait_ms, t.offered),
                                 tid=t.tid, now=t.offered and not self._goes_inline(t))
        # An offered transfer's first chunk leaves at once: on a bulk thread, its KV_BEGIN is written
        # first (now=), or the chunk usually reaches the receiver before it and is held there;
        # inline, it follows the KV_BEGIN in the same write.
        if t.offered and sent:  # the receiver posted for it already: no KV_ACCEPT to wait for (and if the
            self.flow.start(t.tid)  # connection is down, it stays ANNOUNCED: the reconnect announces it)
            self.pump()

    # -- moving
    def on_accept(self, tid: int) -> None:
        if self.flow.accepted(tid):
            self.pump()

    def pump(self) -> None:
        """Send what the window allows now."""
        s = self.s
        if not s.is_up:
            return
        for d in self.flow.dispatch(time.monotonic()):
            t = self.flow.out[d.tid]
            if d.lane == INLINE:
                self._send_inline(d.tid, d.k, t.chunk(d.k))
            else:
                s.data.send(d.lane, d.tid, d.k, t.chunk(d.k), s.link.compression_for(t, s.remote_caps))
        s.metrics.child(s.metrics.inflight_bytes, s.key).set(self.flow.in_flight_bytes)

    def _send_inline(self, tid: int, k: int, views: list[memoryview]) -> None:
        """A chunk of at most transfer.inline_bytes, on the control connection (inline.v1): hashed
        here (xxh3 of 64 KiB: microseconds), copied once when the turn's frames are written."""
        s, c = self.s, self.s.control
        frame = encode(FrameType.KV_CHUNK, lane=Lane.BULK, transfer_id=tid, seq=k, payload=views)
        try:
            if c is None or c.closed:
                raise TransportError("control connection closed")
            s.acks.hold(c, FrameType.KV_CHUNK, None, tid)  # acks due before it go first
            c.send(frame)
        except TransportError as exc:
            if exc.code == ErrorCode.PEER_NOT_READING:
                s.count_error(exc.code)
                s.log.warning("control connection failed: the peer does not read", error=str(exc))
            self.send_failed(tid, k, "connection_lost")
            return
        s.metrics.child(s.metrics.inline_chunks, s.key, "tx").inc()

    def _goes_inline(self, t: OutTransfer) -> bool:
        """Whether every chunk of ``t`` goes inline when it is dispatched now (the first pump)."""
        lanes = self.flow.lanes
        return INLINE in lanes and t.n_chunks == 1 and lanes[INLINE] + t.total <= self.flow.inline_bytes

    def inline_lane(self) -> None:
        """The control connection is up: it is a lane too where both agents advertised inline.v1
        and KV goes over TCP (a UCX peer's chunks stay on UCX: zero copy)."""
        s, size = self.s, self.s.cfg.transfer.inline_bytes
        if size and s.data.kind == "tcp" and "inline.v1" in (s.remote_caps or ()):
            self.flow.inline_bytes = size
            self.flow.lane_up(INLINE)

    def on_ack(self, tid: int, first: int, count: int) -> None:
        self._acked(tid, first, count)
        self.pump()

    def _acked(self, tid: int, first: int, count: int) -> None:
        s = self.s
        acked = self.flow.on_ack(tid, first, count)
        if not acked.chunks and not acked.sent_at:
            return
        if acked.chunks:
            self.flow.out[tid].busy_nacks = 0  # the receiver moves on: a CHUNK_BUSY waits the least again
        now = time.monotonic()
        for sent in acked.sent_at:
            s.metrics.chunk_seconds.observe(now - sent)
        self._count_tx(acked.nbytes, acked.chunks)
        if acked.nbytes:
            s.link.acks_landed(now, acked.nbytes, busy=bool(self.flow.inflight))

    def _count_tx(self, nbytes: int, chunks: int) -> None:
        if chunks:
            mx = self.s.metrics
            mx.child(mx.bytes, self.s.key, "bulk", "tx").inc(nbytes)
            mx.child(mx.chunks, self.s.key, "tx").inc(chunks)

    def on_nack(self, tid: int, k: int, code: int) -> None:
        s = self.s
        if not self.flow.on_nack(tid, k):
            return
        t = self.flow.out[tid]
        if code == ErrorCode.CHUNK_BUSY:
            s.metrics.retransmits.labels(peer=s.key, reason="busy").inc()
            wait = min(BUSY_RETRY_S * 2 ** min(t.busy_nacks, 8), BUSY_RETRY_MAX_S)
            t.busy_nacks += 1
            asyncio.get_running_loop().call_later(wait, self.requeue, tid, k)
            return
        t.refused += 1
        if t.refused > refusals_allowed(t.n_chunks):
            self.fail(t, ErrorCode.CHUNK_CHECKSUM, f"the receiver refused {t.refused} copies of the transfer's "
                      f"{t.n_chunks} chunks (KV_NACK CHUNK_CHECKSUM)", notify_peer=True)
            return
        s.metrics.retransmits.labels(peer=s.key, reason="checksum").inc()
        # (over UCX there is no checksum: the receiver got a message of the wrong size for it)
        s.lines.line(s.log.warning, "chunk refused by the receiver (over TCP its checksum failed; over UCX it "
                     "came in a message of the wrong size); sending it again", path=s.data.active,
                     detail={"transfer_id": tid, "request_id": t.request_id, "chunk": k})
        self.requeue(tid, k)

    def send_failed(self, tid: int, k: int, why: str) -> None:
        if self.flow.send_failed(tid, k):
            self.s.metrics.retransmits.labels(peer=self.s.key, reason=why).inc()
            asyncio.get_running_loop().call_later(SEND_RETRY_S, self.requeue, tid, k)

    def requeue(self, tid: int, k: int) -> None:
        if self.flow.requeue(tid, k):
            self.pump()

    def lane_lost(self, lane: int) -> None:
        requeued = self.flow.lane_down(lane)
        if requeued:
            self.s.metrics.retransmits.labels(peer=self.s.key, reason="connection_lost").inc(requeued)
        self.s.metrics.inflight_bytes.labels(peer=self.s.key).set(self.flow.in_flight_bytes)
        self.pump()

    def expire(self, now: float, ack_timeout: float) -> None:
        retried = self.flow.expire(now, ack_timeout)
        if retried:
            self.s.metrics.retransmits.labels(peer=self.s.key, reason="ack_timeout").inc(len(retried))
            self.pump()

    # -- ending
    def on_done(self, tid: int) -> None:
        t = self.flow.begun(tid)
        if t is None:
            return
        self._acked(tid, 0, t.n_chunks)  # KV_DONE acknowledges every chunk (the last has no KV_ACK of its own)
        self._release(t)
        self.pump()  # the credit it held
        t.state = State.DONE
        s = self.s
        dt = time.monotonic() - t.started
        s.metrics.child(s.metrics.transfers, s.key, "out", "done").inc()
        s.metrics.child(s.metrics.transfer_seconds, "out").observe(dt)
        if t.total >= GOODPUT_MIN_BYTES and dt > 0:
            s.link.transfer_goodput(t.total / dt)
        s.host.kv_sent(t)

    def _release(self, t: OutTransfer) -> None:
        self.flow.remove(t.tid)
        tids = self.by_request.get(t.request_id)
        if tids is not None:
            tids.discard(t.tid)
            if not tids:
                del self.by_request[t.request_id]
        self.s.host.transfer_ended()
        if t.timer is not None:
            t.timer.cancel()
        if t.query_timer is not None:
            t.query_timer.cancel()
        mx = self.s.metrics
        mx.child(mx.inflight, "out").dec()
        mx.child(mx.inflight_bytes, self.s.key).set(self.flow.in_flight_bytes)

    def fail(self, t: OutTransfer, code: int, message: str, *, notify_peer: bool) -> None:
        if self.flow.out.get(t.tid) is not t:
            return
        self._release(t)
        t.state = State.FAILED
        s = self.s
        if code == ErrorCode.PREFIX_LOST and t.skip and not notify_peer:
            self._restart_full(t, message)
            return
        if notify_peer:
            s.cancel_transfer(t.tid, m.KvCancel(t.request_id, int(code), message, False))
        s.count_failure("out", code)
        s.host.transfer_failed(t, "out", int(code), message)

    def fail_all(self, code: int, message: str, *, notify_peer: bool, engine=None) -> int:
        ts = [t for t in self.flow.out.values() if engine in (None, t.engine)]
        for t in ts:
            try:  # one transfer's failure must not leave the others running
                self.fail(t, code, message, notify_peer=notify_peer)
            except Exception:
                self.s.log.exception("ending a transfer failed", transfer_id=t.tid, request_id=t.request_id)
        return len(ts)

    def drop(self, t: OutTransfer) -> None:
        """Withdraw a transfer its engine was told never started (tells the peer, no event)."""
        if self.flow.out.get(t.tid) is not t:
            return
        self._release(t)
        t.state = State.FAILED
        self.s.cancel_transfer(t.tid, m.KvCancel(t.request_id, int(ErrorCode.TRANSFER_CANCELLED),
                                                 "withdrawn by the sender", False))

    def _deadline(self, t: OutTransfer) -> None:
        self.fail(t, ErrorCode.TRANSFER_TIMEOUT, "transfer deadline passed before the receiver confirmed",
                  notify_peer=True)

    def on_cancel(self, tid: int, msg: m.KvCancel) -> None:
        t = self.flow.out.get(tid)
        if t is not None:
            self.fail(t, msg.code, f"cancelled by peer {self.s.key}: {msg.message}", notify_peer=False)

    def on_reject(self, tid: int, msg: m.KvReject) -> None:
        t = self.flow.out.get(tid)
        if t is not None:
            self.fail(t, msg.code, msg.message, notify_peer=False)

    # -- resume after a reconnect
    def connection_lost(self) -> None:
        """The peer's offers end with the control connection (it sends them again once back), and
        the inline chunks in flight on it are sent again."""
        self.offers.clear()
        if INLINE in self.flow.lanes:
            self.lane_lost(INLINE)

    def resume(self) -> None:
        self.inline_lane()
        for t in list(self.flow.out.values()):
            if t.state == State.QUERYING:  # the answer may be lost: do not wait for it
                if t.query_timer is not None:
                    t.query_timer.cancel()
                t.state = State.ANNOUNCED
            if t.state == State.ANNOUNCED:
                self._announce(t)
            elif t.state == State.RESUMING:
                self.s.send_frame(FrameType.KV_RESUME, m.KvResume(t.request_id), tid=t.tid)

    def on_status(self, tid: int, msg: m.KvStatus) -> None:
        t = self.flow.out.get(tid)
        if t is None:
            return
        outcome, acked = self.flow.on_status(tid, msg.state, msg.have if msg.state == Status.RECEIVING else b"")
        if outcome is Resumed.DONE:
            self.on_done(tid)
        elif outcome is Resumed.MOVING:
            self._count_tx(acked.nbytes, acked.chunks)
            self.pump()
        elif outcome is Resumed.UNKNOWN:
            self.fail(t, ErrorCode.PEER_RESTARTED, "the receiver no longer knows this transfer", notify_peer=False)
