"""Memory an engine cannot pull away from its agent, and registration that does not stop the agent.

A registered memfd must be sealed against shrinking (F_SEAL_SHRINK): otherwise an engine that
shrinks it under the agent's mapping kills the agent with SIGBUS at its next access. And
registering pages the region in on a worker thread, so the event loop keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import tempfile

import pytest

from conftest import fill_random, same_bytes
from pdd_wire.engine import protocol as p
from pdd_wire.errors import EngineRequestError, ErrorCode
from pdd_wire.memory import HostRegion, SharedMemory, register_async
from support.agents import run_agents, two_site_toml

MiB = 1 << 20


def test_shared_memory_is_sealed_against_shrinking_and_may_grow():
    with SharedMemory(4 * MiB) as mem:
        assert fcntl.fcntl(mem.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
        with pytest.raises(PermissionError):
            os.ftruncate(mem.fd, MiB)
        os.ftruncate(mem.fd, 8 * MiB)  # growing cannot hurt a mapping of the first 4 MiB
        assert os.fstat(mem.fd).st_size == 8 * MiB


async def test_the_agent_refuses_memory_the_engine_could_shrink(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir), sites=("A",), wait_up=False):
        ea = await engines.connect(tmp_sock_dir / "A.sock", "prefill")
        unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
        sealable_but_open = os.memfd_create("no-seal-yet", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        with tempfile.TemporaryFile() as f:
            for fd in (unsealed, sealable_but_open, f.fileno()):
                os.ftruncate(fd, 4 * MiB)
                with pytest.raises(EngineRequestError) as ei:
                    await ea.register(fd, size=4 * MiB, block_bytes=MiB)
                assert ei.value.code == ErrorCode.MEMORY_NOT_SEALED and "F_SEAL_SHRINK" in str(ei.value)
        os.close(unsealed)
        os.close(sealable_but_open)
        # The same engine goes on registering sealed memory.
        mem = engines.memory(4 * MiB)
        r = await ea.register(mem, block_bytes=MiB)
        assert r.region >= 1


async def test_an_engine_that_tries_to_shrink_its_pool_cannot_kill_the_agent(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as ag:
        ea = await engines.connect(tmp_sock_dir / "A.sock", "prefill")
        eb = await engines.connect(tmp_sock_dir / "B.sock", "decode")
        src, dst = engines.memory(16 * MiB), engines.memory(16 * MiB)
        await fill_random(src)
        ra = await ea.register(src, block_bytes=MiB)
        rb = await eb.register(dst, block_bytes=MiB)
        # A buggy adapter frees its pool by truncating the memfd: the seal refuses it, so the
        # pages the agents map stay, and the transfer into and out of them lands.
        for mem in (src, dst):
            with pytest.raises(PermissionError):
                os.ftruncate(mem.fd, 0)
        await eb.post_recv("r", [rb.blocks(0, 16)])
        await ea.send_kv("r", [ra.blocks(0, 16)], to=["B"])
        assert isinstance(await eb.wait("r", timeout=30), p.KvReceived)
        assert await same_bytes(dst.buf, src.buf)
        assert all(a.ready.is_set() and not a.stopping for a in ag.values())


async def test_registration_pages_in_off_the_event_loop():
    """While a 256 MiB region is paged in, the loop keeps running other coroutines (with
    MAP_POPULATE inside mmap() it ran nothing until the whole region was in)."""
    mem = SharedMemory(256 * MiB)
    try:
        region = HostRegion(1, os.dup(mem.fd), mem.size, MiB, owner=None)
        ticks = 0
        reg = asyncio.create_task(register_async(region, lambda: False))
        while not reg.done():
            ticks += 1
            await asyncio.sleep(0)
        assert await reg is region and not region.closed
        assert ticks > 1
        region.view()[-1:] = b"\x01"  # mapped, writable to the last byte, and shared with the engine
        assert mem.buf[-1] == 1
        region.close()
        # A region whose engine went away while it was paged in is closed, and refused.
        region = HostRegion(2, os.dup(mem.fd), mem.size, MiB, owner=None)
        with pytest.raises(EngineRequestError) as ei:
            await register_async(region, lambda: True)
        assert ei.value.code == ErrorCode.SHUTTING_DOWN and region.closed
    finally:
        mem.close()


def test_populate_faults_every_page_in():
    mem = SharedMemory(64 * MiB)
    try:
        region = HostRegion(1, os.dup(mem.fd), mem.size, MiB, owner=None)
        assert region.populate(slice_bytes=8 * MiB) is True
        # Every page of the memfd is now allocated: its blocks on disk/shm cover the whole size.
        assert os.fstat(mem.fd).st_blocks * 512 >= mem.size
        region.close()
    finally:
        mem.close()
