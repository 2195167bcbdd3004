"""lz4 on the WAN leg: compressed chunks land byte-identical, are checked after decoding, and
``transfer.compress = "auto"`` turns compression on only where it raises goodput.

The KV is the real sample in tests/data (bf16 K/V of the tiny Llama), tiled to the transfer size.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from conftest import metric
from pdd_wire import EngineClient, SharedMemory
from pdd_wire.engine import protocol as p
from support.agents import relayed_toml, run_agents, two_site_toml
from support.netagents import NetAgents

MiB = 1 << 20
SAMPLE = (Path(__file__).parent / "data" / "kv_llama_tiny_bf16.bin").read_bytes()


def kv(mem: SharedMemory) -> None:
    reps = -(-mem.size // len(SAMPLE))
    mem.buf[:] = (SAMPLE * reps)[:mem.size]


def with_compress(tomls: dict, mode: str) -> dict:
    return {k: (v.replace("[transfer]\n", f'[transfer]\ncompress = "{mode}"\n') if k in "AB" else v)
            for k, v in tomls.items()}


async def move(a: EngineClient, b: EngineClient, rid: str, size: int, src: SharedMemory, dst: SharedMemory):
    ra = await a.register(src, block_bytes=MiB)
    rb = await b.register(dst, block_bytes=MiB)
    await b.post_recv(rid, [rb.blocks(0, size // MiB)])
    await a.send_kv(rid, [ra.blocks(0, size // MiB)], to=["B"])
    ev = await b.wait(rid, timeout=30)
    assert isinstance(ev, p.KvReceived), ev
    assert isinstance(await a.wait(rid, timeout=10), p.KvSent)
    assert bytes(dst.buf) == bytes(src.buf)


async def test_compressed_chunks_land_byte_identical(tmp_sock_dir, engines):
    async with run_agents(with_compress(two_site_toml(tmp_sock_dir), "on")) as agents:
        a = await engines.connect(tmp_sock_dir / "A.sock")
        b = await engines.connect(tmp_sock_dir / "B.sock")
        src, dst = engines.memory(32 * MiB), engines.memory(32 * MiB)
        kv(src)
        await move(a, b, "z1", 32 * MiB, src, dst)
        await asyncio.sleep(0.5)  # a heartbeat publishes the figures
        assert metric(agents["A"], "pddwire_compressed_chunks", peer="B/b1") == 8
        assert metric(agents["A"], "pddwire_compression_bytes_saved", peer="B/b1") > 0
        assert metric(agents["A"], "pddwire_compression_ratio", peer="B/b1") > 1.05
        assert metric(agents["B"], "pddwire_bytes_total", peer="A/a1", lane="bulk", direction="rx") == 32 * MiB


async def test_a_flipped_byte_in_a_compressed_chunk_is_caught_and_resent(tmp_sock_dir, engines):
    async with relayed_toml(tmp_sock_dir) as (relay, tomls):
        relay.flip_byte_at(3 * MiB + 4321, direction="c2s", min_conn_bytes=MiB)
        async with run_agents(with_compress(tomls, "on")) as agents:
            a = await engines.connect(tmp_sock_dir / "A.sock")
            b = await engines.connect(tmp_sock_dir / "B.sock")
            src, dst = engines.memory(64 * MiB), engines.memory(64 * MiB)
            kv(src)
            await move(a, b, "z2", 64 * MiB, src, dst)
            assert relay.flips_done == 1
            assert metric(agents["B"], "pddwire_checksum_failures_total", peer="A/a1") == 1
            assert metric(agents["A"], "pddwire_retransmits_total", peer="B/b1", reason="checksum") == 1


async def test_auto_leaves_compression_off_on_a_fast_link(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:  # compress = "auto" is the default
        a = await engines.connect(tmp_sock_dir / "A.sock")
        b = await engines.connect(tmp_sock_dir / "B.sock")
        src, dst = engines.memory(64 * MiB), engines.memory(64 * MiB)
        kv(src)
        for i in range(3):
            await move(a, b, f"f{i}", 64 * MiB, src, dst)
        await asyncio.sleep(0.5)
        s = agents["A"].sessions["B/b1"]
        assert s.lz.est.samples >= 3  # it measured lz4 on real chunks...
        assert metric(agents["A"], "pddwire_compression_on", peer="B/b1") == 0  # ...and stayed off
        assert metric(agents["A"], "pddwire_compressed_chunks", peer="B/b1") == 0


@pytest.mark.root
async def test_auto_turns_compression_on_over_a_slow_wan():
    async with NetAgents("pddwz", rate_bps=100_000_000, transfer='compress = "auto"') as net:
        a = await EngineClient(net.socket("A"), "a").connect()
        b = await EngineClient(net.socket("B"), "b").connect()
        src, dst = SharedMemory(16 * MiB), SharedMemory(16 * MiB)
        try:
            kv(src)
            for i in range(4):
                await move(a, b, f"s{i}", 16 * MiB, src, dst)
                dst.buf[:] = bytes(dst.size)
                await asyncio.sleep(0.3)
            st = await net.status("A")
            link = st["peers"][0]
            assert link["compression"]["on"], link
            assert link["compression"]["chunks"] > 0 and link["compression"]["ratio"] > 1.05
        finally:
            await a.close()
            await b.close()
            src.close()
            dst.close()
