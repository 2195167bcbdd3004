"""Registered memory: regions an engine shares with its agent, and the block maps over them.

A region is engine memory the agent can address directly. Here it is host memory shared by
file descriptor (``memfd``): the engine passes the fd over the engine socket once and the
agent maps the same pages, so KV goes from the sender's pages onto the socket and from the
socket into the receiver's pages without passing through Python objects. The ``kind`` field
keeps the door open for device memory (``cuda-ipc``: a CUDA IPC handle the UCX path would
register instead of mapping).

A transfer addresses memory as *extents*: ``(region, first_block, count)`` runs of
fixed-size blocks. :class:`BlockMap` flattens a list of extents into one logical byte
stream and cuts it into chunk-sized lists of memoryviews.
"""

from __future__ import annotations

import bisect
import mmap
import os
from dataclasses import dataclass
from typing import Iterable, Sequence

from .errors import EngineRequestError, ErrorCode

HOST_FD = "host-fd"
KINDS = (HOST_FD,)


class SharedMemory:
    """Engine-side helper: anonymous shared memory (memfd) to register with an agent.

    Example::

        mem = SharedMemory(64 << 20)
        mem.buf[:4] = b"KV.."
        region = await client.register(mem, block_bytes=1 << 20)
    """

    def __init__(self, size: int, name: str = "pdd-wire-kv") -> None:
        if size <= 0:
            raise ValueError(f"size must be > 0, got {size}")
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.buf = memoryview(self._map)

    def close(self) -> None:
        if self.fd < 0:
            return
        self.buf.release()
        try:
            self._map.close()
        except BufferError:
            pass  # views still exported by the caller; the mapping goes with the last one
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> "SharedMemory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Region:
    """The agent's handle on one registered region."""

    def __init__(self, region_id: int, kind: str, size: int, block_bytes: int, owner: object) -> None:
        self.region_id = region_id
        self.kind = kind
        self.size = size
        self.block_bytes = block_bytes
        self.n_blocks = size // block_bytes
        self.owner = owner
        self.closed = False

    def view(self) -> memoryview:  # pragma: no cover - overridden
        raise NotImplementedError

    def close(self) -> None:
        self.closed = True


class HostRegion(Region):
    """A memfd (or any mappable fd) mapped into the agent. The fd is closed once mapped;
    the mapping stays until the last memoryview over it is released, so a bulk thread that
    is still writing a chunk can never touch unmapped memory."""

    def __init__(self, region_id: int, fd: int, size: int, block_bytes: int, owner: object) -> None:
        super().__init__(region_id, HOST_FD, size, block_bytes, owner)
        try:
            st = os.fstat(fd)
            if st.st_size < size:
                raise EngineRequestError(f"fd is {st.st_size} bytes, smaller than the declared size {size}",
                                         ErrorCode.OUT_OF_BOUNDS)
            # MAP_POPULATE: fault every page in now, at registration, not during transfers
            # (a 64 MiB region is 16384 minor faults otherwise, on the bulk path).
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._view = memoryview(self._map)

    def view(self) -> memoryview:
        return self._view

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self._view.release()
        try:
            self._map.close()
        except BufferError:
            pass  # a chunk in flight still holds a slice; unmapped when it lets go
        self._map = None


@dataclass(frozen=True, slots=True)
class Extent:
    region: int
    block: int
    count: int


class BlockMap:
    """Extents over regions, seen as one byte stream of ``total`` bytes.

    All blocks of a map have the same size (``block_bytes``); that keeps the two ends of a
    transfer comparable block by block (and prefix matching possible).
    """

    def __init__(self, regions: dict[int, Region], extents: Iterable[Extent]) -> None:
        self._by_id = regions
        self.extents = list(extents)
        if not self.extents:
            raise EngineRequestError("no blocks given", ErrorCode.BAD_REQUEST)
        segs: list[tuple[Region, int, int]] = []
        block_bytes = None
        for e in self.extents:
            r = regions.get(e.region)
            if r is None or r.closed:
                raise EngineRequestError(f"region {e.region} is not registered", ErrorCode.UNKNOWN_REGION)
            if block_bytes is None:
                block_bytes = r.block_bytes
            elif r.block_bytes != block_bytes:
                raise EngineRequestError("all regions of one transfer must have the same block size",
                                         ErrorCode.BAD_REQUEST)
            if e.count <= 0 or e.block < 0 or e.block + e.count > r.n_blocks:
                raise EngineRequestError(
                    f"blocks {e.block}..{e.block + e.count - 1} are outside region {e.region} "
                    f"(0..{r.n_blocks - 1})", ErrorCode.OUT_OF_BOUNDS)
            off, ln = e.block * r.block_bytes, e.count * r.block_bytes
            if segs and segs[-1][0] is r and segs[-1][1] + segs[-1][2] == off:
                segs[-1] = (r, segs[-1][1], segs[-1][2] + ln)  # merge contiguous runs
            else:
                segs.append((r, off, ln))
        self.block_bytes = block_bytes
        self.n_blocks = sum(e.count for e in self.extents)
        self.regions = {id(r): r for r, _, _ in segs}
        self._segs = segs
        self._starts = []
        pos = 0
        for _, _, ln in segs:
            self._starts.append(pos)
            pos += ln
        self.total = pos

    def after_blocks(self, k: int) -> "BlockMap":
        """The same map without its first ``k`` blocks (0 < k < n_blocks)."""
        if not 0 < k < self.n_blocks:
            raise EngineRequestError(f"cannot skip {k} of {self.n_blocks} blocks", ErrorCode.BAD_REQUEST)
        out = []
        for e in self.extents:
            if k >= e.count:
                k -= e.count
                continue
            out.append(Extent(e.region, e.block + k, e.count - k))
            k = 0
        return BlockMap(self._by_id, out)

    def slice(self, start: int, end: int) -> list[memoryview]:
        """Memoryviews covering stream bytes [start, end) (no copy)."""
        out = []
        i = bisect.bisect_right(self._starts, start) - 1
        while start < end:
            r, off, ln = self._segs[i]
            seg_start = self._starts[i]
            a = start - seg_start
            b = min(ln, end - seg_start)
            out.append(r.view()[off + a: off + b])
            start = seg_start + b
            i += 1
        return out


def scatter(src, views) -> None:
    """Copy ``src`` (a contiguous chunk) into ``views`` in order: one copy, no intermediate."""
    sv = memoryview(src)
    pos = 0
    for v in views:
        v[:] = sv[pos:pos + len(v)]
        pos += len(v)


def n_chunks(total: int, chunk_bytes: int) -> int:
    return (total + chunk_bytes - 1) // chunk_bytes


def chunk_range(i: int, total: int, chunk_bytes: int) -> tuple[int, int]:
    return i * chunk_bytes, min(total, (i + 1) * chunk_bytes)


def as_extents(items: Sequence) -> list[Extent]:
    """Extents from wire tuples ``[region, block, count]``."""
    return [Extent(int(r), int(b), int(c)) for r, b, c in items]
