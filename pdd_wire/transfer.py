"""Transfers: the state of one request's KV moving to or from one peer.

An :class:`OutTransfer` cuts a source :class:`BlockMap` into chunks and tracks which were
acknowledged; an :class:`InTransfer` tracks which chunks of a posted destination were
verified. The :class:`Route` is the one object a bulk thread touches: it says where a chunk's
bytes land and is the lock that keeps a cancelled transfer from writing into memory that was
already handed back to its engine.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import time

from .memory import BlockMap, chunk_range, n_chunks
from .transport.route import Route
from .wire.chunkset import ChunkSet


class State(enum.Enum):
    ANNOUNCED = "announced"  # KV_BEGIN sent, waiting for KV_ACCEPT
    WAITING_POST = "waiting_post"  # receiver: KV_BEGIN arrived before the engine posted
    MOVING = "moving"
    RESUMING = "resuming"  # sender: connection lost; waiting for KV_STATUS after the reconnect
    QUERYING = "querying"  # sender: PREFIX_QUERY sent, waiting for PREFIX_MATCH before KV_BEGIN
    DONE = "done"
    FAILED = "failed"


class Transfer:
    """What both directions share."""

    def __init__(self, tid: int, request_id: str, engine, peer_key: str, blocks: BlockMap,
                 chunk_bytes: int, deadline: float) -> None:
        self.tid = tid
        # The id the engine knows it by (send_kv's answer): a transfer restarted whole keeps its
        # first one, though the new one has a tid of its own on the wire.
        self.engine_tid = tid
        self.request_id = request_id
        self.engine = engine
        self.peer_key = peer_key
        self.blocks = blocks
        self.chunk_bytes = chunk_bytes
        self.deadline = deadline  # loop time
        self.state = State.ANNOUNCED
        self.started = time.monotonic()
        self.timer: asyncio.TimerHandle | None = None

    @property
    def total(self) -> int:
        return self.blocks.total

    @property
    def n_chunks(self) -> int:
        return n_chunks(self.blocks.total, self.chunk_bytes)

    def describe(self) -> dict:
        return {"transfer_id": self.tid, "request_id": self.request_id, "peer": self.peer_key,
                "bytes": self.total, "chunks": self.n_chunks, "state": self.state.value,
                "age_s": round(time.monotonic() - self.started, 3)}


class OutTransfer(Transfer):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.streams_limit: int | None = None  # use only bulk streams below this (probes)
        self.compressible = True  # probes measure the raw link
        self.full_blocks = self.blocks  # before a matched prefix was cut off
        self.hashes: list[int] | None = None
        self.skip = 0  # leading blocks the receiver holds (not sent)
        self.post_wait_ms = 0  # KV_BEGIN.post_wait_ms: the receiver holds it this long for a post
        self.offered = False  # took the receiver's KV_OFFER: moving since its KV_BEGIN
        self.confirmed = False  # the receiver showed it matched it (an ack, KV_STATUS, a late KV_ACCEPT)
        self.query_timer: asyncio.TimerHandle | None = None
        self.acked = ChunkSet()  # acknowledged chunks
        self.pending: collections.deque[int] = collections.deque()
        self.retransmits = 0
        self.refused = 0  # chunks the receiver refused (KV_NACK CHUNK_CHECKSUM)
        self.busy_nacks = 0  # KV_NACK CHUNK_BUSY since the last ack (the next resend waits longer)

    def queue_all(self) -> None:
        self.pending = collections.deque(self.acked.missing(self.n_chunks))

    def chunk(self, k: int):
        start, end = chunk_range(k, self.total, self.chunk_bytes)
        return self.blocks.slice(start, end)

    def describe(self) -> dict:
        d = super().describe()
        d["acked_chunks"] = len(self.acked)
        d["retransmits"] = self.retransmits
        return d


class InTransfer(Transfer):
    def __init__(self, *a, loop: asyncio.AbstractEventLoop, **kw) -> None:
        super().__init__(*a, **kw)
        self.reused_blocks = 0  # leading blocks of the post this node already held (not sent)
        self.post = None  # the post it fills (re-posted whole if its matched prefix breaks)
        self.lease = None  # the prefix lease (this peer's) its reused_blocks come from
        self.landed: set[int] = set()  # chunks whose arrival was handled (acknowledged) on the loop
        self.route = Route(self.blocks, self.chunk_bytes, loop)
        self.failing: asyncio.Future | None = None  # a fail under way: done once the data path let go

    def describe(self) -> dict:
        d = super().describe()
        d["verified_chunks"] = len(self.route.verified)
        return d
