"""The sans-IO session core (pdd_wire/session/protocol.py, proto/transfer.md).

Two parts:

* exact sequences: the credit window, striping over lanes, acks, NACK repair, a lane lost,
  resume after a reconnect, the receiver's answers (kept as regression tests);
* a hypothesis state machine that drives a sender's :class:`SendWindow` and a receiver built
  on :class:`ReceiveLedger` through simulated lanes (FIFO each, like one TCP connection, read
  in any order across lanes) and a control connection (FIFO), with chunks lost, duplicated and
  corrupted, lanes lost, ack timeouts, transfers cancelled, and the control connection lost
  and resumed at any point; chunks inline on the control connection (inline.v1), in order with
  its frames; transfers that took a KV_OFFER (moving before KV_ACCEPT, chunks
  that outrun their KV_BEGIN held by the receiver's gate) and receives posted late. After
  every step: credit never exceeds the window and equals it minus what is in flight; each
  lane's count is what is in flight on it. At the end, once everything is delivered: every
  transfer ended exactly once with one outcome, one that ended done only once the receiver
  held every chunk, no chunk was newly acknowledged twice, and nothing is left on the books
  (credit, lanes, queues).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdd_wire.memory import chunk_range, n_chunks
from pdd_wire.session.protocol import INLINE, NOTHING, Landing, ReceiveLedger, Resumed, SendWindow, Status, code_name
from pdd_wire.transfer import State
from pdd_wire.wire import chunkset
from pdd_wire.wire.chunkset import ChunkSet, bitmap_from


@dataclass
class Tx:
    """A transfer being sent, as the core sees it (an OutTransfer without memory)."""

    tid: int
    total: int
    chunk_bytes: int
    streams_limit: int | None = None
    state: State = State.ANNOUNCED
    acked: ChunkSet = field(default_factory=ChunkSet)
    pending: collections.deque[int] = field(default_factory=collections.deque)
    retransmits: int = 0
    offered: bool = False
    confirmed: bool = False

    @property
    def n_chunks(self) -> int:
        return n_chunks(self.total, self.chunk_bytes)


def size(t: Tx, k: int) -> int:
    start, end = chunk_range(k, t.total, t.chunk_bytes)
    return end - start


# ---------------------------------------------------------------------------------- sequences
def test_the_window_bounds_what_is_in_flight_and_acks_give_it_back():
    w = SendWindow(10)
    w.lane_up(0)
    t = Tx(1, total=12, chunk_bytes=4)
    w.add(t)
    assert w.dispatch(0.0) == []  # announced, not accepted
    assert w.accepted(1)
    sent = w.dispatch(0.0)
    assert [(d.k, d.nbytes, d.lane) for d in sent] == [(0, 4, 0), (1, 4, 0)]
    assert w.credit == 2 and w.in_flight_bytes == 8
    acked = w.on_ack(1, 0, 1)
    assert (acked.nbytes, acked.chunks, acked.sent_at) == (4, 1, (0.0,))
    assert [d.k for d in w.dispatch(1.0)] == [2]
    assert w.on_ack(1, 0, 3).chunks == 2  # chunk 0 again counts nothing
    assert w.credit == 10 and w.lanes == {0: 0} and set(t.acked) == {0, 1, 2}


def test_chunks_go_to_the_least_loaded_lane_and_a_stream_limit_keeps_probes_on_lane_0():
    w = SendWindow(100)
    for lane in (0, 1, 2):
        w.lane_up(lane)
    a, b = Tx(1, 16, 4), Tx(2, 16, 4, streams_limit=1)
    w.add(a)
    w.add(b)
    w.accepted(1)
    w.accepted(2)
    sent = w.dispatch(0.0)
    assert {d.lane for d in sent if d.tid == 1} == {0, 1, 2}
    assert {d.lane for d in sent if d.tid == 2} == {0}
    assert [d.tid for d in sent[:4]] == [1, 2, 1, 2]  # round robin over transfers


def test_a_lost_lane_requeues_its_chunks_first_and_a_nack_repairs_one():
    w = SendWindow(100)
    w.lane_up(0)
    w.lane_up(1)
    t = Tx(1, 16, 4)
    w.add(t)
    w.accepted(1)
    sent = w.dispatch(0.0)
    on1 = [d.k for d in sent if d.lane == 1]
    assert w.lane_down(1) == len(on1) and t.retransmits == len(on1)
    again = w.dispatch(1.0)
    assert sorted(d.k for d in again) == sorted(on1) and {d.lane for d in again} == {0}
    assert w.on_nack(1, 0) and w.requeue(1, 0)
    assert [d.k for d in w.dispatch(2.0)] == [0]
    w.on_ack(1, 0, 4)
    assert not w.on_nack(1, 0)  # acknowledged meanwhile: nothing to repair


def test_a_nack_for_a_chunk_not_in_flight_is_ignored():
    """Each one queued a copy of the chunk (and for CHUNK_BUSY armed a timer): 8 bytes and a
    timer per 58-byte frame a peer sends at will."""
    w = SendWindow(4)
    w.lane_up(0)
    t = Tx(1, 16, 4)
    w.add(t)
    w.accepted(1)
    assert [d.k for d in w.dispatch(0.0)] == [0]
    for _ in range(1000):  # chunks 1..3 wait in the queue, chunk 9 is none of the transfer's
        assert not w.on_nack(1, 2) and not w.on_nack(1, 9)
    assert w.on_nack(1, 0) and not w.on_nack(1, 0)  # in flight: repaired once; the copy finds it queued
    assert w.requeue(1, 0) and list(t.pending) == [0, 1, 2, 3] and t.retransmits == 1
    w.lane_down(0)
    w.lane_up(0)
    w.dispatch(1.0)
    assert w.lane_down(0) == 1 and not w.on_nack(1, 0)  # its lane went: queued again already


def test_the_inline_lane_takes_small_chunks_while_its_bound_allows_and_nothing_big():
    """inline.v1 (proto/transfer.md §17): chunks of at most inline_bytes go on the control
    connection while at most inline_bytes are in flight there; the rest on the bulk lanes."""
    from pdd_wire.transport.ucx_path import UCX_LANE

    assert INLINE not in (UCX_LANE, 0)  # a UCX peer's one lane is not the control connection
    w = SendWindow(100, inline_bytes=8)
    w.lane_up(INLINE)
    big = Tx(1, 16, 16)  # one 16-byte chunk: never inline
    w.add(big)
    w.accepted(1)
    assert w.dispatch(0.0) == []  # only the control connection is up, and the chunk is too big for it
    smalls = [Tx(tid, 4, 4) for tid in (2, 3, 4)]
    for t in smalls:
        w.add(t)
        w.accepted(t.tid)
    assert w.dispatch(0.0) == []  # the big chunk heads the round robin: it waits for a bulk lane
    w.lane_up(0)
    sent = w.dispatch(0.0)
    assert [(d.tid, d.lane) for d in sent] == [(1, 0), (2, INLINE), (3, INLINE), (4, 0)]
    assert w.lanes == {INLINE: 8, 0: 20}
    w.on_ack(2, 0, 1)
    assert w.lanes[INLINE] == 4
    t5 = Tx(5, 4, 4)
    w.add(t5)
    w.accepted(5)
    assert [(d.tid, d.lane) for d in w.dispatch(1.0)] == [(5, INLINE)]
    # The control connection goes: what was in flight on it is queued again, and goes bulk.
    assert w.lane_down(INLINE) == 2 and INLINE not in w.lanes
    assert sorted((d.tid, d.lane) for d in w.dispatch(2.0)) == [(3, 0), (5, 0)]
    assert w.credit == 100 - 16 - 4 - 4 - 4


def test_an_ack_timeout_sends_again_and_the_late_ack_counts_once():
    w = SendWindow(100)
    w.lane_up(0)
    t = Tx(1, 8, 4)
    w.add(t)
    w.accepted(1)
    w.dispatch(0.0)
    assert w.expire(5.0, ack_timeout=10.0) == []
    assert w.expire(11.0, ack_timeout=10.0) == [(1, 0), (1, 1)]
    assert w.credit == 100
    assert sorted(d.k for d in w.dispatch(11.0)) == [0, 1]
    assert w.on_ack(1, 0, 2).chunks == 2 and w.on_ack(1, 0, 2).chunks == 0


def test_resume_after_a_reconnect_sends_only_what_the_receiver_lacks():
    w = SendWindow(100)
    w.lane_up(0)
    t = Tx(1, 16, 4)
    w.add(t)
    w.accepted(1)
    w.dispatch(0.0)
    w.on_ack(1, 0, 1)
    w.lane_down(0)
    w.connection_lost()
    assert t.state == State.RESUMING
    w.lane_up(0)
    assert w.dispatch(1.0) == []  # waits for KV_STATUS
    outcome, acked = w.on_status(1, Status.RECEIVING, bitmap_from({0, 2}, 4))  # chunk 2's ack was lost
    assert outcome is Resumed.MOVING and (acked.nbytes, acked.chunks) == (4, 1)
    assert [d.k for d in w.dispatch(2.0)] == [1, 3]
    assert w.on_status(1, Status.COMPLETE, b"")[0] is Resumed.DONE
    assert w.on_status(1, Status.UNKNOWN, b"")[0] is Resumed.UNKNOWN
    assert w.on_status(9, Status.RECEIVING, b"")[0] is Resumed.IGNORED
    q = Tx(2, 16, 4, state=State.QUERYING)  # waiting for its PREFIX_MATCH: its KV_BEGIN was not sent
    w.add(q)
    assert w.on_status(2, Status.RECEIVING, b"") == (Resumed.IGNORED, NOTHING) and q.state == State.QUERYING
    assert w.on_ack(2, 0, 4) == NOTHING and not q.acked and not q.confirmed  # nor an ack: its chunks are unnumbered


def test_an_offered_transfer_moves_at_once_and_a_late_accept_sends_its_chunks_again():
    w = SendWindow(100)
    w.lane_up(0)
    t = Tx(1, 12, 4, offered=True)
    w.add(t)
    w.start(1)  # KV_BEGIN {offered}: no KV_ACCEPT to wait for
    assert [d.k for d in w.dispatch(0.0)] == [0, 1, 2]
    # The receive was gone: the KV_BEGIN waited, the chunks were dropped; matched late, the
    # receiver says KV_ACCEPT: every chunk not acknowledged goes again.
    assert w.accepted(1) and t.confirmed and w.credit == 100
    assert [d.k for d in w.dispatch(1.0)] == [0, 1, 2]
    w.on_ack(1, 0, 1)
    assert not Tx(2, 4, 4).confirmed and t.confirmed
    # A copy of KV_ACCEPT (the receiver accepts late once; a peer may repeat it at will) starts
    # nothing: each one took every chunk off the books and queued it again, O(n_chunks) a frame.
    assert not w.accepted(1)
    assert [d.k for d in w.dispatch(2.0)] == []


class CountingWindow(SendWindow):
    """Counts the chunks the core takes off the in-flight books (one look each)."""

    looked = 0

    def uninflight(self, tid: int, k: int) -> float | None:
        self.looked += 1
        return super().uninflight(tid, k)


def test_a_repeated_ack_or_status_costs_nothing_per_chunk():
    """A receiver that advertises a small ``max_chunk`` gets transfers of many chunks (65,536 at
    4 KiB for 256 MiB): each KV_ACK {0, 2^32} walked every one of them again (8 ms a 20-byte
    frame), and each KV_STATUS the sender did not ask for rebuilt the transfer's queue."""
    n = 1 << 16
    w = CountingWindow(1 << 20)
    w.lane_up(0)
    t = Tx(1, n * 4096, 4096)
    w.add(t)
    w.accepted(1)
    sent = w.dispatch(0.0)
    assert len(sent) == 256 and w.credit == 0
    got = w.on_ack(1, 0, 100)
    assert (got.chunks, got.nbytes, len(got.sent_at)) == (100, 100 * 4096, 100) and w.credit == 100 * 4096
    w.looked = 0
    for _ in range(1000):  # a copy touches no chunk
        assert w.on_ack(1, 0, 100).chunks == 0
        assert w.on_ack(1, 50, 1 << 32).chunks == 0 or t.acked.bits == (1 << n) - 1
    assert len(t.acked) == n and w.looked == n - 100  # each chunk looked at once, when first acknowledged
    assert w.credit == 1 << 20 and not w.inflight

    u = Tx(2, n * 4096, 4096)
    w.add(u)
    w.accepted(2)
    w.dispatch(0.0)
    queue, retransmits = u.pending, u.retransmits
    for _ in range(1000):  # unasked KV_STATUS {RECEIVING, nothing verified}: its chunks are on their way already
        outcome, got = w.on_status(2, Status.RECEIVING, b"")
        assert outcome is Resumed.MOVING and got.chunks == 0
    assert u.pending is queue and len(queue) == n - 256 and u.retransmits == retransmits
    outcome, got = w.on_status(2, Status.RECEIVING, bitmap_from({0, 1, n - 1}, n))  # what it names counts
    assert got.chunks == 3 and set(u.acked) == {0, 1, n - 1} and w.credit == (1 << 20) - 254 * 4096


def test_a_chunkset_is_the_wire_bitmap():
    s = ChunkSet()
    assert s.add_range(3, 7) == [3, 4, 5, 6] and s.add_range(0, 5) == [0, 1, 2] and len(s) == 7
    assert s.add(70) and not s.add(70) and 70 in s and 71 not in s and -1 not in s and "x" not in s
    assert list(s.missing(10)) == [7, 8, 9] and list(s) == [0, 1, 2, 3, 4, 5, 6, 70]
    assert s.add_range(-5, 2) == [] and s.add_range(9, 9) == []
    bm = bitmap_from({1, 8, 70}, 72)
    assert chunkset.from_bitmap(bm, 72) == (1 << 1) | (1 << 8) | (1 << 70)
    assert chunkset.from_bitmap(bm + b"\xff", 72) == chunkset.from_bitmap(bm, 72)  # bits past n name no chunk
    assert chunkset.from_bitmap(bm, 72).to_bytes(9, "little") == bm
    assert s.add_bits(chunkset.from_bitmap(bm, 72)) == [8] and len(s) == 9


def test_a_chunkset_touches_only_the_bytes_a_range_names(monkeypatch):
    """One chunk is one byte of the bitmap and a range only its bytes: a per-chunk KV_ACK for
    chunk k cost O(k) when the set was one int (a transfer's acks quadratic in n_chunks)."""
    s = ChunkSet()
    assert len(s.add_range(0, 1 << 20)) == 1 << 20
    widths: list[int] = []
    merge = ChunkSet._merge
    monkeypatch.setattr(ChunkSet, "_merge", lambda self, a, b, bits: (widths.append(b - a), merge(self, a, b, bits))[1])
    fresh = ChunkSet()
    for k in range(0, 1 << 20, 4099):
        assert not s.add(k) and s.add_range(k, k + 9) == [] and fresh.add(k + 1)
        assert fresh.add_range(k + 2, k + 5) == [k + 2, k + 3, k + 4]
    assert widths and max(widths) <= 2  # 9 chunks span at most 2 bytes; single chunks never merge
    assert len(fresh) == 4 * len(range(0, 1 << 20, 4099))


def test_a_reconnect_announces_an_unconfirmed_offered_transfer_again():
    w = SendWindow(100)
    w.lane_up(0)
    a, b = Tx(1, 8, 4, offered=True), Tx(2, 8, 4, offered=True)
    for t in (a, b):
        w.add(t)
        w.start(t.tid)
    w.dispatch(0.0)
    w.on_ack(2, 0, 1)  # b was matched; a's KV_BEGIN may be what the connection lost
    w.lane_down(0)
    w.connection_lost()
    assert (a.state, b.state) == (State.ANNOUNCED, State.RESUMING)


def test_the_receiver_answers_each_kind_of_chunk():
    led = ReceiveLedger(keep=2)
    kw = dict(verified=False, claimed=True, ok=True, invalid=False, complete=False)
    assert led.landing(1, is_open=True, **kw) is Landing.ACK
    assert led.landing(1, is_open=True, **kw | {"complete": True}) is Landing.ACK_COMPLETE
    assert led.landing(1, is_open=True, **kw | {"ok": False}) is Landing.NACK_CHECKSUM
    assert led.landing(1, is_open=True, **kw | {"invalid": True}) is Landing.FAIL_INVALID
    assert led.landing(1, is_open=True, **kw | {"claimed": False, "verified": True}) is Landing.ACK_AGAIN
    assert led.landing(1, is_open=True, **kw | {"claimed": False}) is Landing.NACK_BUSY
    assert led.landing(1, is_open=False, **kw) is Landing.DROP
    led.completed_transfer(1, "r1")
    assert led.landing(1, is_open=False, **kw | {"claimed": False}) is Landing.ACK_AGAIN
    assert led.status(1, None) == Status.COMPLETE and led.status(2, {0}) == Status.RECEIVING
    led.completed_transfer(2, "r2")
    led.completed_transfer(3, "r3")
    assert led.status(1, None) == Status.UNKNOWN  # bounded: the oldest is forgotten
    assert code_name(2**15) == "CODE_32768"


# ---------------------------------------------------------------------------------- the state machine
@dataclass
class Rx:
    """The receiving end of one transfer."""

    tid: int
    total: int
    chunk_bytes: int
    verified: set[int] = field(default_factory=set)
    open: bool = True
    waiting: bool = False  # its KV_BEGIN waits for the receive to be posted


class SessionCore(RuleBasedStateMachine):
    LANES = 3
    CHUNK = 4
    ACK_TIMEOUT = 10.0

    @initialize(window_chunks=st.integers(1, 5), inline_chunks=st.sampled_from([0, 0, 1, 2]))
    def setup(self, window_chunks: int, inline_chunks: int) -> None:
        """``inline_chunks``: the control connection is a lane too (inline.v1) for that many
        chunks in flight; its chunks travel in order with the control frames."""
        self.w = SendWindow(window_chunks * self.CHUNK, inline_bytes=inline_chunks * self.CHUNK)
        self.ledger = ReceiveLedger(keep=1000)
        self.tx: dict[int, Tx] = {}
        self.rx: dict[int, Rx] = {}
        self.lanes: dict[int, collections.deque] = {}  # lane -> chunks on the wire (tid, k, good)
        self.to_sender: collections.deque = collections.deque()  # control frames from the receiver
        self.to_receiver: collections.deque = collections.deque()  # control frames from the sender
        self.control_up = True
        self.now = 0.0
        self.next_tid = 1
        self.acks: collections.Counter = collections.Counter()  # (tid, k) -> times newly acknowledged
        self.outcomes: dict[int, list[str]] = collections.defaultdict(list)
        self.posted: dict[int, bool] = {}  # tid -> its receive is posted when its KV_BEGIN comes
        self.begun: set[int] = set()  # KV_BEGINs the receiver handled (its BeginGate)
        self.held: list[tuple[int, int, bool]] = []  # chunks that outran their KV_BEGIN
        for lane in range(self.LANES):
            self.lane_up(lane)
        if self.w.inline_bytes:
            self.w.lane_up(INLINE)

    # -- helpers
    def lane_up(self, lane: int) -> None:
        self.lanes[lane] = collections.deque()
        self.w.lane_up(lane)

    def pump(self) -> None:
        if not self.control_up:
            return
        for d in self.w.dispatch(self.now):
            t = self.tx[d.tid]
            if d.lane == INLINE:  # on the control connection, behind what was sent before it
                assert d.nbytes <= self.w.inline_bytes
                self.to_receiver.append(("chunk", d.tid, d.k, True))
                continue
            assert d.nbytes == size(t, d.k) and d.lane in self.lanes
            self.lanes[d.lane].append((d.tid, d.k, True))

    def ended(self, tid: int, outcome: str) -> None:
        self.outcomes[tid].append(outcome)
        self.w.remove(tid)

    def acked(self, tid: int, first: int, count: int) -> None:
        t = self.tx[tid]
        before = set(t.acked) if tid in self.w.out else None
        got = self.w.on_ack(tid, first, count)
        if before is not None:
            for k in set(t.acked) - before:
                self.acks[(tid, k)] += 1
            assert got.chunks == len(set(t.acked) - before)
            assert got.nbytes == sum(size(t, k) for k in set(t.acked) - before)

    # -- rules: the sender's side
    @rule(chunks=st.integers(1, 6), tail=st.integers(0, CHUNK - 1), probe=st.booleans(), offered=st.booleans(),
          posted=st.booleans())
    def start(self, chunks: int, tail: int, probe: bool, offered: bool, posted: bool) -> None:
        """``offered``: it took a KV_OFFER (moves at once); ``posted``: the receive is still there
        when the KV_BEGIN arrives (else the KV_BEGIN waits for a post: always so when offered)."""
        tid, self.next_tid = self.next_tid, self.next_tid + 1
        total = chunks * self.CHUNK - tail if chunks > 1 or tail == 0 else self.CHUNK - tail
        t = self.tx[tid] = Tx(tid, total, self.CHUNK, streams_limit=1 if probe else None, offered=offered)
        self.posted[tid] = posted
        self.w.add(t)
        self.announce(t)

    def announce(self, t: Tx) -> None:
        if not self.control_up:
            return  # announced on reconnect
        self.to_receiver.append(("begin", t.tid))
        if t.offered:
            self.w.start(t.tid)
            self.pump()

    @precondition(lambda self: any(r.waiting for r in self.rx.values()))
    @rule(data=st.data())
    def post_late(self, data) -> None:
        """The engine posts the receive a waiting KV_BEGIN wants: matched late (KV_ACCEPT)."""
        self.posted_now(data.draw(st.sampled_from(sorted(tid for tid, r in self.rx.items() if r.waiting))))

    def posted_now(self, tid: int) -> None:
        rx = self.rx[tid]
        rx.waiting, rx.open = False, True
        if self.control_up:
            self.to_sender.append(("accept", rx.tid))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def held_chunk_expires(self, data) -> None:
        """A chunk held for its KV_BEGIN longer than the gate waits: dropped."""
        del self.held[data.draw(st.integers(0, len(self.held) - 1))]

    @precondition(lambda self: any(t.tid in self.w.out for t in self.tx.values()))
    @rule(data=st.data())
    def cancel(self, data) -> None:
        tid = data.draw(st.sampled_from(sorted(self.w.out)))
        self.ended(tid, "cancelled")
        if tid in self.rx:
            self.rx[tid].open = False  # KV_CANCEL: the receiver closes it (sent on reconnect if down)

    @rule(dt=st.floats(0.0, 2 * ACK_TIMEOUT))
    def tick(self, dt: float) -> None:
        self.now += dt
        for tid, _ in self.w.expire(self.now, self.ACK_TIMEOUT):
            assert tid in self.w.out
        self.pump()

    # -- rules: the wire
    @precondition(lambda self: any(self.lanes.values()))
    @rule(data=st.data())
    def deliver_chunk(self, data) -> None:
        lane = data.draw(st.sampled_from(sorted(lane for lane, q in self.lanes.items() if q)))
        tid, k, good = self.lanes[lane].popleft()
        self.land(tid, k, good)

    @precondition(lambda self: any(self.lanes.values()))
    @rule(data=st.data(), what=st.sampled_from(["lose", "duplicate", "corrupt"]))
    def mangle_chunk(self, data, what: str) -> None:
        lane = data.draw(st.sampled_from(sorted(lane for lane, q in self.lanes.items() if q)))
        q = self.lanes[lane]
        i = data.draw(st.integers(0, len(q) - 1))
        tid, k, good = q[i]
        if what == "lose":  # an ack timeout repairs it
            del q[i]
        elif what == "duplicate":
            q.insert(data.draw(st.integers(i, len(q))), (tid, k, good))
        else:
            q[i] = (tid, k, False)

    @precondition(lambda self: len(self.lanes) > 1)
    @rule(data=st.data())
    def lose_lane(self, data) -> None:
        lane = data.draw(st.sampled_from(sorted(self.lanes)))
        del self.lanes[lane]  # what was on it is gone
        self.w.lane_down(lane)
        self.pump()

    @precondition(lambda self: self.control_up and len(self.lanes) < SessionCore.LANES)
    @rule()
    def redial_lane(self) -> None:
        self.lane_up(min(set(range(self.LANES)) - set(self.lanes)))
        self.pump()

    @precondition(lambda self: self.to_sender)
    @rule(duplicate=st.booleans())
    def deliver_to_sender(self, duplicate: bool) -> None:
        frame = self.to_sender[0] if duplicate else self.to_sender.popleft()
        kind, tid, *rest = frame
        match kind:
            case "accept":
                self.w.accepted(tid)
            case "ack":
                self.acked(tid, rest[0], 1)
            case "nack":
                if self.w.on_nack(tid, rest[0]):
                    self.w.requeue(tid, rest[0])
            case "done":  # it acknowledges every chunk
                if tid in self.w.out:
                    self.acked(tid, 0, self.tx[tid].n_chunks)
                    self.ended(tid, "done")
            case "status":
                state, have = rest
                t = self.tx[tid]
                before = set(t.acked) if tid in self.w.out else None
                outcome, got = self.w.on_status(tid, state, bitmap_from(have, t.n_chunks))
                if before is not None:
                    for k in set(t.acked) - before:
                        self.acks[(tid, k)] += 1
                    assert got.chunks == len(set(t.acked) - before)
                if outcome is Resumed.DONE:
                    self.ended(tid, "done")
                elif outcome is Resumed.UNKNOWN:
                    self.ended(tid, "failed")
        self.pump()

    @precondition(lambda self: self.to_receiver)
    @rule()
    def deliver_to_receiver(self) -> None:
        kind, tid, *rest = self.to_receiver.popleft()
        t = self.tx[tid]
        if kind == "chunk":  # inline: its KV_BEGIN came first on this connection, so it is never held
            assert tid in self.begun or tid not in self.w.out  # its KV_BEGIN was handled: never held
            self.land(tid, *rest)
        elif kind == "begin":
            rx = self.rx.get(tid)
            # (a KV_CANCEL of a transfer not yet begun here is the sender's not opening it)
            if rx is None and tid not in self.ledger.completed and tid in self.w.out:
                posted = self.posted[tid]
                self.rx[tid] = Rx(tid, t.total, t.chunk_bytes, open=posted, waiting=not posted)
                if posted and not t.offered:
                    self.to_sender.append(("accept", tid))
            elif rx is not None and rx.open:
                self.to_sender.append(("accept", tid))
            elif tid in self.ledger.completed:
                self.to_sender.append(("done", tid))
            self.begun.add(tid)
            for chunk in [c for c in self.held if c[0] == tid]:  # the gate lets them go on
                self.held.remove(chunk)
                self.land(*chunk)
        else:  # resume
            rx = self.rx.get(tid)
            have = set(rx.verified) if rx is not None and rx.open else None
            state = self.ledger.status(tid, have)
            self.to_sender.append(("status", tid, int(state), have or set()))

    @precondition(lambda self: self.control_up)
    @rule()
    def lose_control(self) -> None:
        self.control_up = False
        for lane in list(self.lanes):
            del self.lanes[lane]
            self.w.lane_down(lane)
        self.held.clear()  # their bulk connections went with the control connection
        if INLINE in self.w.lanes:  # and the inline chunks in flight on it
            self.w.lane_down(INLINE)
        self.w.connection_lost()
        self.to_sender.clear()
        self.to_receiver.clear()

    @precondition(lambda self: not self.control_up)
    @rule()
    def reconnect(self) -> None:
        self.control_up = True
        for t in self.tx.values():
            if t.tid not in self.w.out:
                continue
            if t.state == State.RESUMING:
                self.to_receiver.append(("resume", t.tid))
        for lane in range(self.LANES):
            self.lane_up(lane)
        if self.w.inline_bytes:
            self.w.lane_up(INLINE)
        for t in self.tx.values():
            if t.tid in self.w.out and t.state == State.ANNOUNCED:
                self.announce(t)
        self.pump()

    # -- the receiver's side of a chunk (what a bulk connection's reader and Receiver do)
    def land(self, tid: int, k: int, good: bool) -> None:
        rx = self.rx.get(tid)
        if rx is None and tid not in self.begun and self.tx[tid].offered:
            self.held.append((tid, k, good))  # it outran its KV_BEGIN
            return
        is_open = rx is not None and rx.open
        claimed = is_open and k not in rx.verified
        if claimed and good:
            rx.verified.add(k)
        verdict = self.ledger.landing(tid, is_open=is_open, verified=is_open and k in rx.verified and not claimed,
                                      claimed=claimed, ok=good, invalid=False,
                                      complete=is_open and len(rx.verified) == n_chunks(rx.total, rx.chunk_bytes))
        frames = []
        match verdict:
            case Landing.ACK | Landing.ACK_AGAIN:
                frames.append(("ack", tid, k))
            case Landing.ACK_COMPLETE:  # KV_DONE acknowledges this last one too
                rx.open = False
                self.ledger.completed_transfer(tid, f"r{tid}")
                frames.append(("done", tid))
            case Landing.NACK_CHECKSUM | Landing.NACK_BUSY:
                frames.append(("nack", tid, k))
            case Landing.DROP:
                pass
            case other:
                raise AssertionError(f"unexpected {other}")
        if self.control_up:  # otherwise its answers are lost with the connection
            self.to_sender.extend(frames)

    # -- invariants
    @invariant()
    def credit_within_the_window(self) -> None:
        if not hasattr(self, "w"):
            return
        w = self.w
        assert 0 <= w.credit <= w.window
        assert w.window - w.credit == sum(n for _, n, _ in w.inflight.values())
        for lane, out in w.lanes.items():
            assert out == sum(n for on, n, _ in w.inflight.values() if on == lane)
        assert w.lanes.get(INLINE, 0) <= w.inline_bytes
        assert all(key[0] in w.out for key in w.inflight), "chunks in flight of an ended transfer"

    @invariant()
    def only_open_unacknowledged_chunks_are_in_flight(self) -> None:
        """What on_ack relies on to walk only what a KV_ACK newly acknowledges: whatever
        acknowledges a chunk takes it off the in-flight books (else its credit would leak)."""
        if not hasattr(self, "w"):
            return
        for tid, k in self.w.inflight:
            assert tid in self.w.out and k not in self.w.out[tid].acked, (tid, k)

    @invariant()
    def acknowledged_at_most_once_and_ended_at_most_once(self) -> None:
        if not hasattr(self, "w"):
            return
        assert all(n == 1 for n in self.acks.values())
        assert all(len(o) == 1 for o in self.outcomes.values())

    def teardown(self) -> None:
        if not hasattr(self, "w"):
            return
        if not self.control_up:
            self.reconnect()
        for _ in range(10_000):
            if not self.w.out:
                break
            if self.to_receiver:
                self.deliver_to_receiver()
            elif self.to_sender:
                self.deliver_to_sender(False)
            elif waiting := [tid for tid, r in self.rx.items() if r.waiting]:
                self.posted_now(waiting[0])
            elif any(self.lanes.values()):
                lane = next(lane for lane, q in self.lanes.items() if q)
                self.land(*self.lanes[lane].popleft())
            else:
                self.tick(2 * self.ACK_TIMEOUT)
        assert not self.w.out, "transfers never ended"
        for tid, t in self.tx.items():
            assert len(self.outcomes[tid]) == 1, f"transfer {tid} ended {self.outcomes[tid]}"
            if self.outcomes[tid] == ["done"]:  # only once the receiver holds every chunk
                assert all(k in self.rx[tid].verified for k in range(t.n_chunks))
        assert not self.w.inflight and self.w.credit == self.w.window
        assert all(v == 0 for v in self.w.lanes.values())
        self.w.dispatch(self.now)
        assert not self.w.rr


SessionCore.TestCase.settings = settings(max_examples=600, stateful_step_count=80, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestSessionCore = SessionCore.TestCase
