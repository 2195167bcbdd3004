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
import threading
import time

from .memory import BlockMap, chunk_range, n_chunks


class State(enum.Enum):
    ANNOUNCED = "announced"  # KV_BEGIN sent, waiting for KV_ACCEPT
    WAITING_POST = "waiting_post"  # receiver: KV_BEGIN arrived before the engine posted
    MOVING = "moving"
    RESUMING = "resuming"  # sender: connection lost; waiting for KV_STATUS after the reconnect
    QUERYING = "querying"  # sender: PREFIX_QUERY sent, waiting for PREFIX_MATCH before KV_BEGIN
    DONE = "done"
    FAILED = "failed"


class Route:
    """Where chunks of one incoming transfer land; shared with the bulk threads.

    ``claim(k)`` is called by a bulk thread when chunk k's header arrives: it returns the
    destination buffers, or None when the bytes must go to scratch (chunk already verified,
    being written by another connection, or the transfer closed). ``settle(k, ok)`` ends the
    claim. ``close()`` (main loop) stops new claims and resolves ``quiesced`` once no bulk
    thread is writing, so memory is returned to the engine only after the last write.
    """

    def __init__(self, dest: BlockMap, chunk_bytes: int, loop: asyncio.AbstractEventLoop) -> None:
        self.dest = dest
        self.chunk_bytes = chunk_bytes
        self.n_chunks = n_chunks(dest.total, chunk_bytes)
        self.verified: set[int] = set()
        self._writing: set[int] = set()
        self._lock = threading.Lock()
        self._loop = loop
        self.closed = False
        self.quiesced: asyncio.Future = loop.create_future()

    def fits(self, k: int, length: int) -> bool:
        return self.chunk_len(k) == length

    def snapshot(self) -> set[int]:
        """The verified chunks, read under the lock the bulk threads write them under."""
        with self._lock:
            return set(self.verified)

    def chunk_len(self, k: int) -> int | None:
        """The length of chunk ``k``, or None if there is no such chunk."""
        if not 0 <= k < self.n_chunks:
            return None
        start, end = chunk_range(k, self.dest.total, self.chunk_bytes)
        return end - start

    def claim(self, k: int, length: int):
        with self._lock:
            if self.closed or k in self.verified or k in self._writing or not 0 <= k < self.n_chunks:
                return None
            start, end = chunk_range(k, self.dest.total, self.chunk_bytes)
            if end - start != length:
                return None
            self._writing.add(k)
        return self.dest.slice(start, end)

    def settle(self, k: int, ok: bool) -> None:
        with self._lock:
            self._writing.discard(k)
            if ok and not self.closed:
                self.verified.add(k)
            idle = self.closed and not self._writing
        if idle:
            self._loop.call_soon_threadsafe(self._set_quiesced)

    def close(self) -> asyncio.Future:
        with self._lock:
            self.closed = True
            idle = not self._writing
        if idle:
            self._set_quiesced()
        return self.quiesced

    def _set_quiesced(self) -> None:
        if not self.quiesced.done():
            self.quiesced.set_result(None)

    @property
    def complete(self) -> bool:
        return len(self.verified) == self.n_chunks


class Transfer:
    """What both directions share."""

    def __init__(self, tid: int, request_id: str, engine, peer_key: str, blocks: BlockMap,
                 chunk_bytes: int, deadline: float) -> None:
        self.tid = tid
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
        self.query_timer: asyncio.TimerHandle | None = None
        self.acked: set[int] = set()
        self.pending: collections.deque[int] = collections.deque()
        self.retransmits = 0

    def queue_all(self) -> None:
        self.pending = collections.deque(k for k in range(self.n_chunks) if k not in self.acked)

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
        self.route = Route(self.blocks, self.chunk_bytes, loop)

    def describe(self) -> dict:
        d = super().describe()
        d["verified_chunks"] = len(self.route.verified)
        return d
