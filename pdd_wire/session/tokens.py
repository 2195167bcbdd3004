"""Token-ID relay for one peer session: per-request sequence numbers, in order, once (the limits:
``proto/transfer.md`` §12, "Exactly once, in order").

Token frames take the TOKEN lane of the control connection: they never queue behind KV, which
moves on the data path. The sender keeps every frame until TOKENS_ACK covers it and sends the
unacknowledged ones again after a reconnect; the receiver delivers each index once, drops what
it already delivered, asks for a resend when it sees a gap, and takes a stream it forgot from
where its next frame starts. Rules: ``proto/transfer.md``.

Frames are written *paced*: only while the control connection has room (half of
``limits.control_buffer_bytes`` unsent, :meth:`FrameProtocol.paced_room`), the rest as it drains,
one frame per stream in turn. A resend after a reconnect, or any burst of tokens, so never trips
``PEER_NOT_READING`` by itself; new frames of a stream queue behind its resend, and tokens queued
for a stream (not written yet) join its last unwritten frame. What is kept for one peer is bounded
by ``limits.max_unacked_tokens``; a peer that takes none of what waits for
``timeouts.dead_after_s`` is cut as not reading.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ErrorCode, PddWireError, TransportError
from ..wire import FrameType, Lane
from ..wire import messages as m

if TYPE_CHECKING:
    from ..config import Config
    from ..metrics import Metrics


MAX_UNACKED_TOKENS = 1 << 20
#: A frame kept for resend counts as this many token IDs more toward ``limits.max_unacked_tokens``:
#: its tuple, list, sequence number and time take about 200 bytes, a token ID about 40.
FRAME_COST = 5
#: Tokens relayed for a request no engine here owns yet are held for an owner to claim, per peer:
#: at most this many requests ...
MAX_HELD_REQUESTS = 1024
#: ... and this many token IDs, all of the peer's held requests together (oldest dropped first).
MAX_HELD_TOKENS = 1 << 16
#: At most one log line a second per peer about dropped tokens (the counter has every one).
DROP_LOG_S = 1.0
#: A stream's unacknowledged frames are sent again at most once per round trip (and at least this
#: long apart): resend requests the receiver sent before the first resend reached it ask for
#: nothing new, and a peer that repeats them cannot make the agent queue the stream over and over.
RESEND_MIN_INTERVAL_S = 0.05
#: A request for a resend that comes before the last resend was acknowledged whole (the receiver
#: asks again and has not taken what it was sent) waits twice as long as the one before, up to
#: this: a peer repeating TOKENS_ACK {resend} for a stream it never acknowledges had the agent
#: send its whole backlog once per round trip (941 MB in 5 s, each request ~30 bytes).
RESEND_MAX_INTERVAL_S = 2.0
#: A frame for an engine with no room (a quarter of ``limits.engine_queue_bytes`` unread) is
#: neither delivered nor acknowledged: its stream *waits*, checked this often, and once the engine
#: has room the receiver asks for it again (TOKENS_ACK {resend}), then again twice as long after,
#: up to ``RESEND_MAX_INTERVAL_S``, until a frame of it is delivered. A waiting stream is kept
#: apart from the streams forgotten least recently used (its tokens past ``expect`` were never
#: delivered) ...
WAIT_CHECK_S = 0.05
#: ... at most this many per peer (past them a frame is delivered as before: its engine may be cut
#: off at ``limits.engine_queue_bytes``) ...
MAX_WAITING_STREAMS = 1024
#: ... and one that hears nothing from its sender this long while its engine has room (asked
#: meanwhile: the sender restarted, or gave up on this peer) is a stream like any other again.
WAIT_GIVE_UP_S = 20.0


class Waiting:
    """A received stream whose engine had no room for its next frame."""

    __slots__ = ("expect", "ask_at", "gap", "heard")

    def __init__(self, expect: int, now: float) -> None:
        self.expect = expect  # the next index to deliver (the stream is out of tok_in meanwhile)
        self.ask_at = 0.0  # the next resend request, once the engine has room
        self.gap = WAIT_CHECK_S  # ... and the one after it waits this much longer
        self.heard = now  # the last frame of it (delivered or not)


class PacedConn(Protocol):
    """What pacing needs of a control connection (a :class:`~pdd_wire.transport.tcp.FrameProtocol`)."""

    closed: bool
    on_drain: Callable[[], None] | None

    @property
    def unsent(self) -> int: ...
    def paced_room(self) -> int: ...
    def fail(self, exc: BaseException) -> None: ...
    def abort(self) -> None: ...


class TokenLink(Protocol):
    """What the relay needs of its session (a :class:`~pdd_wire.session.PeerSession`)."""

    key: str
    cfg: "Config"
    metrics: "Metrics"
    log: Any
    lines: Any  # its PeerLines: lines a peer can repeat at will, once per period
    peer_max_body: int
    host: Any  # its SessionHost: tokens_room(session, request_id), whether a frame may be delivered now

    @property
    def control(self) -> PacedConn | None: ...
    @property
    def rtt_s(self) -> float | None: ...
    def send_frame(self, ftype: int, body: Any, *, tid: int = 0, lane: int = Lane.CONTROL) -> bool: ...
    def tokens_arrived(self, msg: m.Tokens) -> None: ...


class TokenStream:
    """Outgoing token IDs of one request: unacknowledged frames are kept for resend."""

    __slots__ = ("next_seq", "unacked", "queued", "pending", "handoff", "resent_at", "resend_gap", "resend_upto")

    def __init__(self, handoff: bool = False) -> None:
        self.next_seq = 0
        self.pending = 0  # token IDs in unacked
        self.resent_at = float("-inf")  # when the unacknowledged frames were last sent again on request
        self.resend_gap = 0.0  # the next resend on request waits this long after the last (backoff)
        self.resend_upto = 0  # the seq after the last frame that resend sent
        self.handoff = handoff  # every frame of the stream carries the TOKENS handoff flag
        #: Every frame not acknowledged, (seq, tokens, first queued), in seq order ...
        self.unacked: collections.deque[tuple[int, list[int], float]] = collections.deque()
        #: ... and its tail not yet written on the current connection (the same tuples).
        self.queued: collections.deque[tuple[int, list[int], float]] = collections.deque()

    @property
    def cost(self) -> int:
        """What the stream counts toward ``limits.max_unacked_tokens``."""
        return self.pending + FRAME_COST * len(self.unacked)


class TokenRelay:
    """Both directions of token relay with one peer. Streams are kept until evicted least
    recently used (never with unacknowledged tokens), so an index never restarts under a live
    receiver."""

    def __init__(self, session: TokenLink) -> None:
        self.s = session
        self.tok_out: collections.OrderedDict[str, TokenStream] = collections.OrderedDict()
        self.tok_in: collections.OrderedDict[str, int] = collections.OrderedDict()
        # Delivered by the relay but owned by no engine yet: request id -> (first arrival, frames).
        self.held: collections.OrderedDict[str, tuple[float, list[m.Tokens]]] = collections.OrderedDict()
        self.held_tokens = 0
        self._held_timer: asyncio.TimerHandle | None = None  # the oldest held request's expiry
        # Streams whose engine had no room for their next frame (not in tok_in meanwhile).
        self.waiting: dict[str, Waiting] = {}
        self._wait_timer: asyncio.TimerHandle | None = None
        self._drops_unlogged = 0
        self._drop_logged_at = 0.0
        self.ready: collections.OrderedDict[str, None] = collections.OrderedDict()  # streams with queued frames
        self.backlog = 0  # what tok_out counts toward limits.max_unacked_tokens
        # Read when /metrics is scraped, not set per token (the relay's hot path).
        session.metrics.tokens_unacked.labels(peer=session.key).set_function(lambda: self.backlog)
        self._pumping = False
        self._waiting_on: PacedConn | None = None  # the connection whose drain the queued frames wait for
        self._stall: asyncio.TimerHandle | None = None  # ... and the check that it drains at all

    def clear(self) -> None:
        """The peer restarted: its streams are gone, and so are ours to it."""
        self.drop_out()
        self.tok_in.clear()
        self.waiting.clear()
        self._release_held(list(self.held), "unowned")

    def drop_out(self) -> None:
        """Our streams to the peer are gone (their engines were told): nothing of them is resent."""
        self.tok_out.clear()
        self.ready.clear()
        self.backlog = 0
        self._unwatch()

    def close(self) -> None:
        """The session ends: nothing is held any more."""
        if self._held_timer is not None:
            self._held_timer.cancel()
            self._held_timer = None
        self.held.clear()
        self.held_tokens = 0
        self.ready.clear()
        self.waiting.clear()
        if self._wait_timer is not None:
            self._wait_timer.cancel()
            self._wait_timer = None
        self._unwatch()

    def knows(self, request_id: str) -> bool:
        """Tokens of ``request_id`` go to this peer or come from it (a stream either way, or held)."""
        return any(request_id in d for d in (self.tok_out, self.tok_in, self.waiting, self.held))

    def drop(self, request_id: str) -> None:
        """The request is dead: forget its streams both ways (nothing is resent)."""
        ts = self.tok_out.pop(request_id, None)
        if ts is not None:
            self.backlog -= ts.cost
        self.ready.pop(request_id, None)
        self.tok_in.pop(request_id, None)
        self.waiting.pop(request_id, None)
        self._release_held([request_id], "unowned")

    # -- tokens no engine owns yet ---------------------------------------------------------
    def hold(self, msg: m.Tokens) -> None:
        """Keep ``msg`` (delivered by the relay, owned by no engine yet) for an engine to claim
        within ``transfer.unposted_wait_s``; bounded per peer, the oldest request dropped first."""
        now = asyncio.get_running_loop().time()
        self._expire_held(now)
        n = len(msg.tokens)
        if n > MAX_HELD_TOKENS:
            self.dropped(n, "over_bounds", msg.request_id)
            return
        entry = self.held.get(msg.request_id)
        if entry is None:
            entry = self.held[msg.request_id] = (now, [])
        entry[1].append(msg)
        self.held_tokens += n
        while self.held and (self.held_tokens > MAX_HELD_TOKENS or len(self.held) > MAX_HELD_REQUESTS):
            self._release_held([next(iter(self.held))], "over_bounds")
        self._arm_held_timer()

    def claim(self, request_id: str) -> list[m.Tokens]:
        """An engine here took ``request_id``: the frames held for it, in order."""
        self._expire_held(asyncio.get_running_loop().time())
        entry = self.held.pop(request_id, None)
        if entry is None:
            return []
        self.held_tokens -= sum(len(f.tokens) for f in entry[1])
        return entry[1]

    def _expire_held(self, now: float) -> None:
        limit = self.s.cfg.transfer.unposted_wait_s
        old = []
        for rid, (since, _) in self.held.items():  # in first-arrival order
            if now - since < limit:
                break
            old.append(rid)
        self._release_held(old, "unowned")

    def _arm_held_timer(self) -> None:
        """One timer per peer, for the oldest held request (the rest are younger)."""
        if self._held_timer is not None or not self.held:
            return
        since, _ = next(iter(self.held.values()))
        self._held_timer = asyncio.get_running_loop().call_at(since + self.s.cfg.transfer.unposted_wait_s,
                                                              self._held_timer_fired)

    def _held_timer_fired(self) -> None:
        self._held_timer = None
        self._expire_held(asyncio.get_running_loop().time())
        self._arm_held_timer()

    def _release_held(self, request_ids: list[str], reason: str) -> None:
        for rid in request_ids:
            entry = self.held.pop(rid, None)
            if entry is not None:
                n = sum(len(f.tokens) for f in entry[1])
                self.held_tokens -= n
                self.dropped(n, reason, rid)

    def dropped(self, n: int, reason: str, request_id: str) -> None:
        """``n`` relayed tokens reached no engine: counted, and logged at most once a second."""
        self.s.metrics.tokens_dropped.labels(peer=self.s.key, reason=reason).inc(n)
        self._drops_unlogged += n
        now = time.monotonic()
        if now - self._drop_logged_at >= DROP_LOG_S:
            self.s.log.warning("relayed tokens reached no engine", reason=reason, request_id=request_id[:64],
                               tokens=self._drops_unlogged)
            self._drops_unlogged = 0
            self._drop_logged_at = now

    # -- sending, paced ----------------------------------------------------------------------
    def resend_unacked(self) -> None:
        """The control connection is back (same incarnation): every unacknowledged frame goes
        again, per stream in ``seq`` order, as the new connection takes them."""
        self._unwatch()
        self.ready.clear()
        for rid, ts in self.tok_out.items():
            ts.queued = collections.deque(ts.unacked)
            if ts.queued:
                self.ready[rid] = None
        self.pump()

    def send(self, request_id: str, tokens: list[int], *, handoff: bool = False) -> int:
        """Queue token IDs for ``request_id``; returns the sequence number of the first one.
        Frames carry at most ``limits.max_tokens_per_frame`` tokens."""
        room = m.u64s_that_fit(self.s.peer_max_body, request_id)
        step = max(1, min(self.s.cfg.limits.max_tokens_per_frame, room))
        cap = self.s.cfg.limits.max_unacked_tokens
        # A handoff's relay is not refused here: a refused run would leave its stream out of step
        # with the positions MD holds (it counts, and is bounded per request as any stream).
        if not handoff and self.backlog + len(tokens) + FRAME_COST * -(-len(tokens) // step) > cap:
            raise PddWireError(f"over limits.max_unacked_tokens ({cap}) token IDs unacknowledged by peer "
                               f"{self.s.key} (each frame kept counts {FRAME_COST} more): it is down or does not "
                               "acknowledge them", ErrorCode.LIMIT_EXCEEDED)
        ts = self.tok_out.get(request_id)
        if ts is None:
            self._evict_token_streams(handoff)
            ts = self.tok_out[request_id] = TokenStream(handoff)
        else:
            self.tok_out.move_to_end(request_id)
        if ts.pending + len(tokens) > MAX_UNACKED_TOKENS:
            raise PddWireError(f"over {MAX_UNACKED_TOKENS} unacknowledged tokens for request {request_id!r}",
                               ErrorCode.LIMIT_EXCEEDED)
        first = ts.next_seq
        ts.next_seq += len(tokens)
        ts.pending += len(tokens)
        self.backlog += len(tokens)
        i = 0
        if ts.queued and len(ts.queued[-1][1]) < step:
            # The stream's last frame is not written yet (the connection is down or full): the
            # tokens join it. Safe even if an earlier connection carried it: the receiver delivers
            # only the indexes past what it has.
            tail = ts.queued[-1][1]
            i = min(len(tokens), step - len(tail))
            tail.extend(tokens[:i])
        now = time.monotonic()
        while i < len(tokens):
            part = tokens[i:i + step]
            ts.unacked.append(frame := (first + i, part, now))
            ts.queued.append(frame)
            self.backlog += FRAME_COST
            i += len(part)
        if ts.queued:
            self.ready[request_id] = None  # (a stream already waiting keeps its turn)
        self.s.metrics.child(self.s.metrics.tokens, self.s.key, "tx").inc(len(tokens))
        self.pump()
        return first

    def pump(self) -> None:
        """Write queued frames while the control connection has room, one frame per stream in
        turn (each stream's in ``seq`` order); the rest waits for the connection to drain."""
        conn = self.s.control
        if conn is None or conn.closed or self._pumping:
            return  # down: everything waits for the reconnect (resend_unacked)
        self._pumping = True
        try:
            while self.ready:
                if conn.paced_room() <= 0:
                    self._watch(conn)
                    return
                rid = next(iter(self.ready))
                ts = self.tok_out.get(rid)
                if ts is None or not ts.queued:
                    del self.ready[rid]
                    continue
                seq, part, _ = ts.queued[0]
                if not self.s.send_frame(FrameType.TOKENS, m.Tokens(rid, seq, part, ts.handoff), lane=Lane.TOKEN):
                    return  # the connection failed: the reconnect resends
                ts.queued.popleft()
                if ts.queued:
                    self.ready.move_to_end(rid)
                else:
                    del self.ready[rid]
            self._unwatch()
        finally:
            self._pumping = False

    def _watch(self, conn: PacedConn) -> None:
        """Wait for ``conn`` to drain; if it takes nothing for ``timeouts.dead_after_s`` the peer
        does not read (it may still send: its silence would be caught by the heartbeat)."""
        if self._waiting_on is not conn:
            self._unwatch()
            self._waiting_on = conn
            conn.on_drain = self._drained
        if self._stall is None:
            loop = asyncio.get_running_loop()
            wait = self.s.cfg.timeouts.dead_after_s
            self._stall = loop.call_later(wait, self._stalled, conn, conn.unsent, loop.time() + wait)

    def _unwatch(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        if self._waiting_on is not None:
            self._waiting_on.on_drain = None
            self._waiting_on = None

    def _drained(self) -> None:
        """The connection took bytes (below its low-water mark, or a write without filling it)."""
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        self.pump()

    def _stalled(self, conn: PacedConn, unsent: int, due: float) -> None:
        self._stall = None
        if conn is not self.s.control or conn.closed or conn is not self._waiting_on:
            return
        if not self.ready:  # acknowledged or dropped meanwhile: nothing waits
            self._unwatch()
            return
        wait = self.s.cfg.timeouts.dead_after_s
        late = asyncio.get_running_loop().time() - due
        if conn.unsent < unsent or late > max(self.s.cfg.timeouts.heartbeat_s, 1.0):
            self._watch(conn)  # it took some; or this process did not run (as the dead-peer check)
            return
        exc = TransportError(f"{conn.unsent} bytes unsent and none taken in {wait}s while token frames wait: "
                             "the peer does not read", ErrorCode.PEER_NOT_READING)
        self.s.metrics.error(exc.code)
        self.s.log.warning("control connection failed: the peer does not read", error=str(exc), code=exc.code.name)
        self._unwatch()
        conn.fail(exc)
        conn.abort()  # what waits goes now: the ERROR frame would only queue behind it

    def _evict_token_streams(self, handoff: bool = False) -> None:
        """Bound the streams kept: forget the least recently used ones with nothing unacknowledged."""
        cap = self.s.cfg.transfer.max_transfers * 8  # >= the receiver's: see on_tokens
        if len(self.tok_out) < cap:
            return
        for rid in [r for r, ts in self.tok_out.items() if not ts.unacked][: len(self.tok_out) - cap + 1]:
            del self.tok_out[rid]
        if len(self.tok_out) >= cap and not handoff:
            raise PddWireError(f"over {cap} token streams (8 x transfer.max_transfers) with unacknowledged "
                               f"tokens to peer {self.s.key}", ErrorCode.LIMIT_EXCEEDED)

    def on_tokens(self, msg: m.Tokens) -> None:
        # A stream not known here that does not start at 0 is one forgotten here (least recently
        # used) while its sender kept it: a sender resends from its first unacknowledged frame, in
        # order, so what came before was delivered. Asking for it again would stall the stream for
        # good (the sender no longer holds it): its frames are taken from where they start.
        w = self.waiting.get(msg.request_id)
        expect = w.expect if w is not None else self.tok_in.get(msg.request_id, msg.seq)
        end = msg.seq + len(msg.tokens)
        if end <= expect:
            self.s.send_frame(FrameType.TOKENS_ACK, m.TokensAck(msg.request_id, expect), lane=Lane.TOKEN)
            return  # a resend of what was delivered
        if msg.seq > expect:
            if w is not None:
                w.heard = asyncio.get_running_loop().time()
                return  # its engine has no room yet: asked for when it has (_check_waiting)
            # A gap: something before this frame was lost. Drop it and ask for everything from
            # the first missing token; the sender still holds all it has not seen acknowledged.
            self.s.lines.line(self.s.log.warning, "token gap; asking for a resend",  # a peer's to repeat
                              detail={"request_id": msg.request_id[:64], "expected": expect, "got": msg.seq})
            self.s.metrics.token_gaps.labels(peer=self.s.key).inc()
            self.s.send_frame(FrameType.TOKENS_ACK, m.TokensAck(msg.request_id, expect, True), lane=Lane.TOKEN)
            return
        fresh = msg.tokens[expect - msg.seq:]
        if ((w is not None or len(self.waiting) < MAX_WAITING_STREAMS) and not msg.handoff
                and not self.s.host.tokens_room(self.s, msg.request_id)):
            self._wait(msg.request_id, expect, w)
            return
        self.waiting.pop(msg.request_id, None)
        self._stream_in(msg.request_id, end)
        self.s.send_frame(FrameType.TOKENS_ACK, m.TokensAck(msg.request_id, end), lane=Lane.TOKEN)
        self.s.metrics.child(self.s.metrics.tokens, self.s.key, "rx").inc(len(fresh))
        self.s.tokens_arrived(m.Tokens(msg.request_id, expect, fresh, msg.handoff))

    def _stream_in(self, request_id: str, expect: int) -> None:
        self.tok_in[request_id] = expect
        self.tok_in.move_to_end(request_id)
        # Fewer than the sender keeps (8x): a stream the sender forgot (and restarts at 0) was
        # forgotten here first, so its new tokens are not mistaken for a resend.
        if len(self.tok_in) > self.s.cfg.transfer.max_transfers * 4:
            self.tok_in.popitem(last=False)  # least recently used

    def _wait(self, request_id: str, expect: int, w: Waiting | None) -> None:
        """The frame's engine has no room: nothing delivered or acknowledged, the stream waits."""
        now = asyncio.get_running_loop().time()
        self.s.metrics.child(self.s.metrics.token_frames_waited, self.s.key).inc()
        if w is not None:
            w.heard = now
        else:
            self.tok_in.pop(request_id, None)
            self.waiting[request_id] = Waiting(expect, now)
            self.s.lines.line(self.s.log.warning, "relayed tokens wait: their engine reads its events too slowly",
                              detail={"request_id": request_id[:64], "next_seq": expect})
        if self._wait_timer is None:
            self._wait_timer = asyncio.get_running_loop().call_later(WAIT_CHECK_S, self._check_waiting)

    def _check_waiting(self) -> None:
        """Ask again for the waiting streams whose engine has room now (TOKENS_ACK {resend}: the
        sender sends its unacknowledged frames again, at most once per round trip)."""
        self._wait_timer = None
        now = asyncio.get_running_loop().time()
        for rid, w in list(self.waiting.items()):
            if not self.s.host.tokens_room(self.s, rid):
                w.heard = now  # nothing is asked of the sender meanwhile: its silence says nothing
            elif now - w.heard > WAIT_GIVE_UP_S:  # asked, and silent: a stream like any other again
                del self.waiting[rid]
                self._stream_in(rid, w.expect)
            elif now >= w.ask_at:
                self.s.send_frame(FrameType.TOKENS_ACK, m.TokensAck(rid, w.expect, True), lane=Lane.TOKEN)
                w.ask_at, w.gap = now + w.gap, min(2 * w.gap, RESEND_MAX_INTERVAL_S)
        if self.waiting:
            self._wait_timer = asyncio.get_running_loop().call_later(WAIT_CHECK_S, self._check_waiting)

    def on_ack(self, msg: m.TokensAck) -> None:
        ts = self.tok_out.get(msg.request_id)
        if ts is None:
            return
        now = time.monotonic()
        while ts.unacked and ts.unacked[0][0] + len(ts.unacked[0][1]) <= msg.next_seq:
            _, part, sent = ts.unacked.popleft()
            ts.pending -= len(part)
            self.backlog -= len(part) + FRAME_COST
            self.s.metrics.token_seconds.observe(now - sent)
        while ts.queued and ts.queued[0][0] + len(ts.queued[0][1]) <= msg.next_seq:
            ts.queued.popleft()  # delivered on an earlier connection: not written again
        if not ts.queued:
            self.ready.pop(msg.request_id, None)
        if msg.next_seq >= ts.resend_upto:
            ts.resend_gap = 0.0  # the last resend was taken whole
        if msg.resend and ts.unacked:
            gap = max(RESEND_MIN_INTERVAL_S, self.s.rtt_s or 0.0, ts.resend_gap)
            if now - ts.resent_at < gap:
                return  # the last resend is still on its way: this request asks for nothing new
            ts.resent_at = now
            ts.resend_gap = min(2 * gap, RESEND_MAX_INTERVAL_S)
            ts.resend_upto = ts.unacked[-1][0] + len(ts.unacked[-1][1])
            ts.queued = collections.deque(ts.unacked)
            self.ready[msg.request_id] = None
            self.pump()
