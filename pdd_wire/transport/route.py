"""Where the chunks of one incoming transfer land: the one object a data path's threads touch.

It is the lock that keeps a cancelled transfer from writing into memory that was already
handed back to its engine.
"""

from __future__ import annotations

import asyncio
import threading

from ..memory import BlockMap, chunk_range, n_chunks


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
        # False: the transfer takes no LZ4 chunks (a probe: its sender never compresses, and a
        # chunk of a few KiB that decodes to megabytes of scratch would only cost the receiver).
        self.lz4 = True
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

    def land(self, k: int, length: int):
        """Where chunk ``k`` of ``length`` bytes lands, as ``(views, invalid)``: the claimed views,
        or None to read it into scratch (``invalid``: it does not fit the transfer)."""
        if not self.fits(k, length):
            return None, True
        return self.claim(k, length), False

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
