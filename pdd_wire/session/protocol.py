"""The sans-IO core of a peer session: credits, in-flight chunks, acks, NACK repair, resume.

Nothing here reads a clock, a socket or an event loop: the shell (:mod:`.peer`) feeds it what
arrived (acks, NACKs, KV_STATUS, a lane going down, a timer firing, with the time as a number)
and carries out what it answers (send chunk k of transfer t on lane l, acknowledge, ask again).
The rules are ``proto/transfer.md``; ``tests/test_session_core.py`` holds them under loss,
duplication, reordering and reconnects.

Sender: a transfer's chunks are dispatched while the credit window (unacknowledged bytes in
flight, the smaller of both agents' ``credit_bytes``) allows, round robin over transfers,
each on the least loaded lane. A lane is whatever the data path moves chunks on (a bulk TCP
connection, a UCX endpoint); the core only counts bytes on it. One lane is special: ``INLINE``,
the control connection itself (capability ``inline.v1``), which takes a chunk of at most
``inline_bytes`` while no more than ``inline_bytes`` are in flight on it, so a small transfer
costs no hop to a bulk thread and a token frame waits behind at most that much KV. A transfer that took the
receiver's KV_OFFER (``offered``) moves from its KV_BEGIN on, without waiting for KV_ACCEPT;
until the receiver has shown it matched it (an ack, a KV_STATUS, a late KV_ACCEPT) it is
*unconfirmed*: a KV_ACCEPT means its early chunks were dropped, a reconnect announces it again.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ..errors import ErrorCode
from ..memory import chunk_range
from ..transfer import State
from ..wire.chunkset import ChunkSet, from_bitmap


def code_name(code: int) -> str:
    """The name of a wire error code; codes from a newer peer print as numbers."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"CODE_{int(code)}"


class Status(enum.IntEnum):
    """KV_STATUS ``state``: what the receiver knows of a transfer after a reconnect."""

    UNKNOWN = 0  # never seen or forgotten: the sender fails it (PEER_RESTARTED)
    RECEIVING = 1  # open; ``have`` lists the verified chunks
    COMPLETE = 2  # every chunk verified and handed to the engine


class Outgoing(Protocol):
    """What the core reads and writes of a transfer being sent (an :class:`~pdd_wire.transfer.OutTransfer`)."""

    tid: int
    chunk_bytes: int
    state: State
    acked: ChunkSet
    pending: collections.deque[int]
    retransmits: int
    streams_limit: int | None
    offered: bool  # took a KV_OFFER: moving since its KV_BEGIN
    confirmed: bool  # the receiver showed it matched it (an ack, KV_STATUS, a late KV_ACCEPT)

    @property
    def total(self) -> int: ...

    @property
    def n_chunks(self) -> int: ...


T = TypeVar("T", bound=Outgoing)

#: The control connection as a lane (proto/transfer.md §17). Bulk TCP streams are lanes 0..n-1 and
#: a UCX endpoint is lane -1 (``transport.ucx_path.UCX_LANE``): this one is apart from both.
INLINE = -2


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Send chunk ``k`` (``nbytes``) of transfer ``tid`` on ``lane`` now."""

    tid: int
    k: int
    nbytes: int
    lane: int


@dataclass(frozen=True, slots=True)
class Acked:
    """What one KV_ACK settled: newly acknowledged bytes, and for each chunk that was in
    flight, when it was sent (for the chunk latency histogram)."""

    nbytes: int
    chunks: int
    sent_at: tuple[float, ...]


NOTHING = Acked(0, 0, ())


class Resumed(enum.Enum):
    """What a KV_STATUS means for the sender."""

    IGNORED = "ignored"  # no such transfer here
    DONE = "done"  # the receiver has it all: finish it
    MOVING = "moving"  # the missing chunks are queued again
    UNKNOWN = "unknown"  # the receiver forgot it: fail it


class SendWindow(Generic[T]):
    """The sender's books for one peer: open transfers, credit, chunks in flight per lane."""

    def __init__(self, window: int, inline_bytes: int = 0) -> None:
        self.window = window
        self.inline_bytes = inline_bytes  # the most KV in flight on the INLINE lane (when it is up)
        self.credit = window
        self.out: dict[int, T] = {}
        # (tid, k) -> (lane, nbytes, sent at)
        self.inflight: dict[tuple[int, int], tuple[int, int, float]] = {}
        self.lanes: dict[int, int] = {}  # lane -> bytes dispatched on it and not yet acknowledged
        self.rr: collections.deque[int] = collections.deque()  # transfers with chunks to send

    # -- configuration and lanes
    def configure(self, window: int) -> None:
        """A (re)negotiated window: what is in flight stays counted against it."""
        self.window = window
        self.credit = window - sum(n for _, n, _ in self.inflight.values())

    def lane_up(self, lane: int) -> None:
        self.lanes[lane] = 0

    def lane_down(self, lane: int) -> int:
        """A lane went with what was in flight on it: those chunks go back to the front of their
        transfer's queue. Returns how many were requeued (retransmits)."""
        self.lanes.pop(lane, None)
        requeued = 0
        for key, (on, n, _) in list(self.inflight.items()):
            if on != lane:
                continue
            del self.inflight[key]
            self.credit += n
            t = self.out.get(key[0])
            if t is not None and key[1] not in t.acked:
                t.pending.appendleft(key[1])
                t.retransmits += 1
                requeued += 1
                self._ready(t)
        return requeued

    @property
    def in_flight_bytes(self) -> int:
        return self.window - self.credit

    # -- transfers
    def add(self, t: T) -> None:
        self.out[t.tid] = t

    def begun(self, tid: int) -> T | None:
        """The open transfer ``tid`` if its KV_BEGIN was sent: a KV_ACK, KV_DONE or KV_STATUS for
        one still waiting for its PREFIX_MATCH (its chunks not numbered yet) is ignored."""
        t = self.out.get(tid)
        return None if t is None or t.state == State.QUERYING else t

    def remove(self, tid: int) -> T | None:
        """Forget a transfer (done, failed, withdrawn); its chunks in flight give credit back."""
        t = self.out.pop(tid, None)
        if t is not None:
            for k in range(t.n_chunks):
                self.uninflight(tid, k)
        return t

    def accepted(self, tid: int) -> bool:
        """KV_ACCEPT: an announced transfer starts moving; an offered one that was moving already
        was matched late, so its early chunks were dropped: what was in flight goes back on the
        queue, every chunk not acknowledged is sent (again). False if there is nothing to start."""
        t = self.out.get(tid)
        if t is None:
            return False
        if t.state == State.MOVING and t.offered:
            if t.confirmed:  # a copy (the receiver accepts an offered transfer late once): each
                return False  # requeued every chunk, O(n_chunks) a 60-byte frame
            for k in range(t.n_chunks):
                self.uninflight(tid, k)
            t.confirmed = True
        elif t.state != State.ANNOUNCED:
            return False
        self.start(tid)
        return True

    def start(self, tid: int) -> None:
        """Queue every chunk not acknowledged and move (after KV_ACCEPT, or at once when offered)."""
        t = self.out[tid]
        t.state = State.MOVING
        t.pending = collections.deque(k for k in t.acked.missing(t.n_chunks) if (tid, k) not in self.inflight)
        self._ready(t)

    def _ready(self, t: T) -> None:
        if t.tid not in self.rr:
            self.rr.append(t.tid)

    def dispatch(self, now: float) -> list[Dispatch]:
        """Chunks to send now, while credit and lanes allow, round robin over transfers."""
        out: list[Dispatch] = []
        if not self.lanes:
            return out
        while self.rr:
            t = self.out.get(self.rr[0])
            if t is None or t.state != State.MOVING or not t.pending:
                self.rr.popleft()
                continue
            k = t.pending[0]
            if k in t.acked or (t.tid, k) in self.inflight:
                t.pending.popleft()
                continue
            start, end = chunk_range(k, t.total, t.chunk_bytes)
            n = end - start
            if n > self.credit:
                break
            inline = self.lanes.get(INLINE)
            if inline is not None and inline + n <= self.inline_bytes:
                lane = INLINE
            else:
                limit = t.streams_limit
                bulk = [lane for lane in self.lanes if lane != INLINE]
                pool = [lane for lane in bulk if limit is None or lane < limit] or bulk
                if not pool:  # only the control connection is up, and this chunk is too big for it
                    break
                lane = min(pool, key=self.lanes.__getitem__)
            t.pending.popleft()
            self.rr.rotate(-1)
            self.credit -= n
            self.lanes[lane] += n
            self.inflight[(t.tid, k)] = (lane, n, now)
            out.append(Dispatch(t.tid, k, n, lane))
        return out

    def uninflight(self, tid: int, k: int) -> float | None:
        """Take chunk k off the in-flight books (credit back); returns when it was sent."""
        entry = self.inflight.pop((tid, k), None)
        if entry is None:
            return None
        lane, n, sent = entry
        self.credit += n
        if lane in self.lanes:
            self.lanes[lane] -= n
        return sent

    def on_ack(self, tid: int, first: int, count: int) -> Acked:
        """KV_ACK {first, count}. Costs what it newly acknowledges: a chunk acknowledged is never
        in flight (what acknowledges it takes it off the books), so only the chunks the range
        adds are walked, each once in the transfer's life (the range itself is a word operation)."""
        t = self.begun(tid)
        if t is None:
            return NOTHING
        first, end = max(0, first), min(first + max(0, count), t.n_chunks)  # the peer's numbers bound no loop of ours
        if end <= first:
            return NOTHING
        t.confirmed = True
        fresh = t.acked.add_range(first, end)
        return self._settled(t, fresh)

    def _settled(self, t: T, fresh: list[int]) -> Acked:
        """Chunks ``fresh`` were just acknowledged: off the in-flight books, counted."""
        nbytes = 0
        sent_at = []
        for k in fresh:
            sent = self.uninflight(t.tid, k)
            if sent is not None:
                sent_at.append(sent)
            start, end = chunk_range(k, t.total, t.chunk_bytes)
            nbytes += end - start
        return Acked(nbytes, len(fresh), tuple(sent_at))

    def on_nack(self, tid: int, k: int) -> bool:
        """KV_NACK for chunk k: True if it must be sent again (the caller requeues it, at once
        for a checksum failure, a little later while the receiver is busy with it). A NACK for a
        chunk not in flight is ignored: it was queued again already (its lane went, its ack timed
        out, a NACK came before), is acknowledged, or names no chunk; acting on each one queued a
        copy (and, for CHUNK_BUSY, a timer) per 58-byte frame."""
        if self.uninflight(tid, k) is None:
            return False
        t = self.out.get(tid)
        if t is None or k in t.acked:
            return False
        t.retransmits += 1
        return True

    def send_failed(self, tid: int, k: int) -> bool:
        """The data path could not send chunk k: True if it must be requeued (later)."""
        return self.on_nack(tid, k)

    def requeue(self, tid: int, k: int) -> bool:
        """Put chunk k back at the front of its transfer's queue (unless it got acknowledged or
        is in flight again meanwhile). True if it was queued."""
        t = self.out.get(tid)
        if t is None or k in t.acked or (tid, k) in self.inflight:
            return False
        t.pending.appendleft(k)
        self._ready(t)
        return True

    def expire(self, now: float, ack_timeout: float) -> list[tuple[int, int]]:
        """Chunks in flight for longer than ``ack_timeout``: off the books, queued again.
        Returns those of open transfers (each a retransmit)."""
        stale = [key for key, (_, _, sent) in self.inflight.items() if now - sent > ack_timeout]
        retried = []
        for tid, k in stale:
            self.uninflight(tid, k)
            t = self.out.get(tid)
            if t is not None:
                t.retransmits += 1
                self.requeue(tid, k)
                retried.append((tid, k))
        return retried

    # -- reconnects
    def connection_lost(self) -> None:
        """Moving transfers wait for the receiver's KV_STATUS after the reconnect; an offered one
        still unconfirmed is announced again (its KV_BEGIN may be what was lost)."""
        for t in self.out.values():
            if t.state == State.MOVING:
                t.state = State.RESUMING if t.confirmed or not t.offered else State.ANNOUNCED

    def on_status(self, tid: int, state: int, have: bytes) -> tuple[Resumed, Acked]:
        """KV_STATUS (``have``: its bitmap). For RECEIVING, what the receiver verified whose acks
        were lost with the connection is acknowledged now; a transfer that was waiting for the
        answer (RESUMING, or announced again) queues the rest. One the sender did not ask about
        (MOVING) queues nothing: its other chunks are queued, in flight or about to be asked
        again already, and rebuilding its queue cost O(n_chunks) a frame (proto/transfer.md §5)."""
        t = self.begun(tid)
        if t is None:
            return Resumed.IGNORED, NOTHING
        if state == Status.COMPLETE:
            return Resumed.DONE, NOTHING
        if state != Status.RECEIVING:
            return Resumed.UNKNOWN, NOTHING
        t.confirmed = True
        acked = self._settled(t, t.acked.add_bits(from_bitmap(have, t.n_chunks)))
        if t.state == State.MOVING:
            return Resumed.MOVING, acked
        missing = [k for k in t.acked.missing(t.n_chunks) if (tid, k) not in self.inflight]
        t.pending = collections.deque(missing)
        t.state = State.MOVING
        if missing:
            t.retransmits += len(missing)
            self._ready(t)
        return Resumed.MOVING, acked

    def peer_restarted(self) -> None:
        """The peer is a new process: nothing in flight will ever be acknowledged (the caller
        has failed every transfer already)."""
        for key in list(self.inflight):
            self.uninflight(*key)
        for lane in self.lanes:
            self.lanes[lane] = 0

    def queue_bytes(self) -> int:
        """KV bytes accepted for this peer and not yet acknowledged."""
        return sum(max(0, t.total - len(t.acked) * t.chunk_bytes) for t in self.out.values())


class Landing(enum.Enum):
    """What to do about a chunk that a data path finished reading."""

    ACK = "ack"  # verified now: acknowledge it
    ACK_COMPLETE = "ack_complete"  # verified, and it was the last one: acknowledge, then complete
    ACK_AGAIN = "ack_again"  # a duplicate of a verified chunk (its ack was lost)
    NACK_BUSY = "nack_busy"  # another connection still holds it: ask again a little later
    NACK_CHECKSUM = "nack_checksum"  # the bytes are wrong: ask again
    FAIL_INVALID = "fail_invalid"  # it does not fit the announced transfer: fail the transfer
    DROP = "drop"  # for a transfer that is gone


class ReceiveLedger:
    """The receiver's memory of finished transfers, so that a KV_BEGIN or a chunk that comes
    again after a reconnect is answered instead of opening the transfer anew. Bounded."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.completed: collections.OrderedDict[int, str] = collections.OrderedDict()

    def completed_transfer(self, tid: int, request_id: str) -> None:
        self.completed[tid] = request_id
        while len(self.completed) > self.keep:
            self.completed.popitem(last=False)

    def clear(self) -> None:
        self.completed.clear()

    def status(self, tid: int, open_chunks: set[int] | None) -> Status:
        """KV_STATUS's state for ``tid``: ``open_chunks`` is the verified set of an open transfer."""
        if open_chunks is not None:
            return Status.RECEIVING
        return Status.COMPLETE if tid in self.completed else Status.UNKNOWN

    def landing(self, tid: int, *, is_open: bool, verified: bool, claimed: bool, ok: bool, invalid: bool,
                complete: bool) -> Landing:
        """Decide about chunk of ``tid``: ``is_open``: the transfer is open here; ``verified``:
        this chunk was verified before; ``claimed``: the bytes were written to the transfer's
        blocks; ``ok``: their checksum held; ``complete``: every chunk is verified now."""
        if invalid:
            return Landing.FAIL_INVALID if is_open else Landing.DROP
        if not claimed:
            if (is_open and verified) or tid in self.completed:
                return Landing.ACK_AGAIN
            return Landing.NACK_BUSY if is_open else Landing.DROP
        if not is_open:
            return Landing.DROP
        if not ok:
            return Landing.NACK_CHECKSUM
        return Landing.ACK_COMPLETE if complete else Landing.ACK
