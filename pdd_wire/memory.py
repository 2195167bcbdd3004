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

import asyncio
import bisect
import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import EngineRequestError, ErrorCode
from .placement import pin_quietly

HOST_FD = "host-fd"
KINDS = (HOST_FD,)

#: Seals a registered memfd must carry: an engine that could shrink it under the agent's mapping
#: would kill the agent with SIGBUS at its next access. Growing is harmless (the agent maps only
#: ``size`` bytes), and further seals are the engine's business, so neither is required.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+
# Per madvise call: the GIL is free throughout, the process's mm lock only between calls, and an
# mmap() on the main thread (Python's allocator) waits for the call in progress. Measured here
# (8 GiB, a VM paging in at 0.3-0.7 GiB/s): 64 MiB slices stalled the loop 1.1 s, 2 MiB 42 ms.
POPULATE_SLICE = 2 << 20
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


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
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            # Sealed against shrinking: the agent that maps it can then never be left with pages
            # that vanished under it (SIGBUS). Growing stays allowed.
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
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
            check_sealed(fd)
            st = os.fstat(fd)
            if st.st_size < size:
                raise EngineRequestError(f"fd is {st.st_size} bytes, smaller than the declared size {size}",
                                         ErrorCode.OUT_OF_BOUNDS)
            # Mapped without MAP_POPULATE: that faults every page in inside mmap(), holding the
            # GIL (1 GiB froze the agent 1.4 s). populate() pages it in by slices instead.
            try:
                mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:
                # The engine's fd, not the agent, is at fault: opened read-only, sealed against
                # writes (F_SEAL_WRITE, F_SEAL_FUTURE_WRITE) or of a kind that cannot be mapped
                # shared. Other failures (ENOMEM) are the agent's and stay INTERNAL.
                if exc.errno in (errno.EACCES, errno.EPERM, errno.EINVAL):
                    raise EngineRequestError(f"the fd cannot be mapped for reading and writing: {exc.strerror}",
                                             ErrorCode.BAD_REQUEST) from exc
                raise
        finally:
            os.close(fd)
        self._map: mmap.mmap | None = mapping
        self._view = memoryview(mapping)

    def view(self) -> memoryview:
        return self._view

    def populate(self, slice_bytes: int = POPULATE_SLICE) -> bool:
        """Fault every page in now (so transfers do not take 16384 minor faults per 64 MiB on
        the bulk path), by ``madvise(MADV_POPULATE_WRITE)`` over ``slice_bytes`` at a time.
        Blocking: run it on a worker thread; each call is a ctypes call, which releases the GIL.
        False if the kernel cannot (before 5.14): the pages then fault in on first use."""
        mapping = self._map
        if self.closed or mapping is None:
            return False
        anchor = ctypes.c_char.from_buffer(mapping)  # an export: the mapping cannot go meanwhile
        try:
            base = ctypes.addressof(anchor)
            for off in range(0, self.size, slice_bytes):
                if self.closed:
                    return False
                if _libc.madvise(base + off, min(slice_bytes, self.size - off), MADV_POPULATE_WRITE) != 0:
                    err = ctypes.get_errno()
                    if err in (errno.EINVAL, errno.ENOSYS):
                        return False
                    raise EngineRequestError(f"cannot page the region in: {os.strerror(err)}",
                                             ErrorCode.OUT_OF_BOUNDS)
            return True
        finally:
            del anchor

    async def populate_async(self, cpus: frozenset[int] = frozenset()) -> bool:
        """:meth:`populate` on a thread of its own, placed on ``cpus`` when given (the agent's
        ``cpus.bulk``): the event loop keeps serving meanwhile. Not niced: inside madvise the
        thread holds the mm lock the main thread's mmap() waits for, so a low priority would let a
        busy host park the lock holder (priority inversion)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(fn, value) -> None:
            if not done.done():
                fn(value)

        def run() -> None:
            result: object
            fn: Callable[[Any], None]
            pin_quietly(cpus)
            try:
                result, fn = self.populate(), done.set_result
            except BaseException as exc:
                result, fn = exc, done.set_exception
            try:
                loop.call_soon_threadsafe(settle, fn, result)
            except RuntimeError:
                pass  # the loop is gone (agent stopped): nobody waits

        threading.Thread(target=run, name=f"pdd-populate-{self.region_id}", daemon=True).start()
        return await done

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self._view.release()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a chunk in flight still holds a slice; unmapped when it lets go
        self._map = None


async def register_async(region: HostRegion, abandoned, *, cpus: frozenset[int] = frozenset()) -> HostRegion:
    """Page ``region`` in on a worker thread (on ``cpus``, when given) while the event loop keeps
    serving (heartbeats, tokens, other engines' transfers); the register request answers when it
    is done. Closed, and refused, if ``abandoned()`` says its engine or the agent went away
    meanwhile."""
    try:
        await region.populate_async(cpus)
        if abandoned():
            raise EngineRequestError("the engine or the agent went away while its region was paged in",
                                     ErrorCode.SHUTTING_DOWN)
    except BaseException:
        region.close()
        raise
    return region


def check_sealed(fd: int) -> None:
    """Refuse an fd the engine could shrink under the agent's mapping (proto/engine.md)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # not a memfd (or created without MFD_ALLOW_SEALING)
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise EngineRequestError(
            "the fd must be a memfd sealed against shrinking (memfd_create with MFD_ALLOW_SEALING, then "
            "fcntl F_ADD_SEALS F_SEAL_SHRINK; pdd_wire.memory.SharedMemory does it): an fd the engine can "
            "shrink would crash the agent", ErrorCode.MEMORY_NOT_SEALED)


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
            if e.count < 1:  # an empty (or negative) run is a malformed request, not an address out of range
                raise EngineRequestError(f"extent [{e.region}, {e.block}, {e.count}]: count must be >= 1",
                                         ErrorCode.BAD_REQUEST)
            if e.block < 0 or e.block + e.count > r.n_blocks:
                raise EngineRequestError(
                    f"blocks {e.block}..{e.block + e.count - 1} are outside region {e.region} "
                    f"(0..{r.n_blocks - 1})", ErrorCode.OUT_OF_BOUNDS)
            off, ln = e.block * r.block_bytes, e.count * r.block_bytes
            if segs and segs[-1][0] is r and segs[-1][1] + segs[-1][2] == off:
                segs[-1] = (r, segs[-1][1], segs[-1][2] + ln)  # merge contiguous runs
            else:
                segs.append((r, off, ln))
        assert block_bytes is not None  # there is at least one extent
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
