"""A simulated engine's KV memory (:class:`KvPool`): blocks of one registered shared-memory
region, each stamped with (request, index) so the receiver can check what arrived."""

from __future__ import annotations

import asyncio
import collections
import os
import struct
import zlib

from pdd_wire.engine.client import EngineClient, RegionHandle
from pdd_wire.memory import SharedMemory

_STAMP = struct.Struct("<IIQ")  # crc32(request id), block index in the request, magic
_MAGIC = 0x5044_442D_5349_4D4B


class KvPool:
    """A simulated engine's KV memory: one shared-memory region registered with its agent,
    handed out in blocks (first fit, several extents when fragmented; waiters served in order).

    :meth:`stamp` writes (request, block index) at the start of each block of a request's KV;
    :meth:`verify` counts the blocks of a received request whose stamp is wrong."""

    def __init__(self, size: int, block_bytes: int, name: str = "pdd-sim-kv") -> None:
        if block_bytes < _STAMP.size:
            raise ValueError(f"block_bytes must be >= {_STAMP.size}")
        self.block_bytes = block_bytes
        self.n_blocks = size // block_bytes
        if self.n_blocks < 1:
            raise ValueError(f"a pool of {size} bytes holds no block of {block_bytes}")
        self.mem = SharedMemory(self.n_blocks * block_bytes, name)
        self.region: RegionHandle | None = None
        self._free: list[list[int]] = [[0, self.n_blocks]]  # [start, count], by start
        self.free_blocks = self.n_blocks
        self.peak_used = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    async def register(self, eng: EngineClient) -> RegionHandle:
        self.region = await eng.register(self.mem, block_bytes=self.block_bytes, name="sim-kv")
        return self.region

    def fill_incompressible(self, seed_bytes: bytes | None = None) -> None:
        """Fill the pool with bytes that look like KV to a compressor: real fp16 KV is about
        1.0x under lz4, while the zeros of fresh memory would shrink a thousandfold and make
        the WAN leg vanish. A 1 MiB random pattern, tiled (lz4 looks back 64 KiB at most)."""
        pattern = seed_bytes or os.urandom(1 << 20)
        buf, n, step = self.mem.buf, self.mem.size, len(pattern)
        for off in range(0, n, step):
            k = min(step, n - off)
            buf[off:off + k] = pattern[:k]

    def blocks_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.block_bytes))

    def try_alloc(self, n: int) -> list[tuple[int, int, int]] | None:
        """``n`` blocks as extents, or None when fewer are free."""
        if self.region is None:
            raise RuntimeError("register the pool first")
        if n < 1 or n > self.free_blocks:
            return None if n >= 1 else []
        taken: list[tuple[int, int]] = []
        for i, (start, count) in enumerate(self._free):
            if count >= n:  # first fit, one piece
                taken = [(start, n)]
                if count == n:
                    del self._free[i]
                else:
                    self._free[i] = [start + n, count - n]
                break
        else:  # fragmented: pieces in address order
            need = n
            while need:
                start, count = self._free[0]
                k = min(count, need)
                taken.append((start, k))
                need -= k
                if k == count:
                    del self._free[0]
                else:
                    self._free[0] = [start + k, count - k]
        self.free_blocks -= n
        self.peak_used = max(self.peak_used, self.n_blocks - self.free_blocks)
        return [(self.region.region, s, c) for s, c in taken]

    async def alloc(self, n: int) -> list[tuple[int, int, int]]:
        """``n`` blocks, waiting (in order of asking) until that many are free."""
        if n > self.n_blocks:
            raise ValueError(f"{n} blocks asked of a pool of {self.n_blocks}")
        if not self._waiters:
            got = self.try_alloc(n)
            if got is not None:
                return got
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        return await fut

    def release(self, extents: list[tuple[int, int, int]]) -> None:
        for _, start, count in extents:
            self._insert(start, count)
            self.free_blocks += count
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            got = self.try_alloc(n)
            if got is None:
                break
            self._waiters.popleft()
            fut.set_result(got)

    def _insert(self, start: int, count: int) -> None:
        lo, hi = 0, len(self._free)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._free[mid][0] < start:
                lo = mid + 1
            else:
                hi = mid
        self._free.insert(lo, [start, count])
        if lo + 1 < len(self._free) and start + count == self._free[lo + 1][0]:  # merge right
            self._free[lo][1] += self._free[lo + 1][1]
            del self._free[lo + 1]
        if lo > 0 and self._free[lo - 1][0] + self._free[lo - 1][1] == start:  # merge left
            self._free[lo - 1][1] += self._free[lo][1]
            del self._free[lo]

    def _blocks(self, extents):
        for _, start, count in extents:
            yield from range(start, start + count)

    def stamp(self, request_id: str, extents: list[tuple[int, int, int]]) -> None:
        key = zlib.crc32(request_id.encode())
        buf, bb = self.mem.buf, self.block_bytes
        for i, b in enumerate(self._blocks(extents)):
            _STAMP.pack_into(buf, b * bb, key, i, _MAGIC)

    def verify(self, request_id: str, extents: list[tuple[int, int, int]]) -> int:
        key = zlib.crc32(request_id.encode())
        buf, bb = self.mem.buf, self.block_bytes
        return sum(_STAMP.unpack_from(buf, b * bb) != (key, i, _MAGIC)
                   for i, b in enumerate(self._blocks(extents)))

    def close(self) -> None:
        self.mem.close()
