"""Same-site peers move KV over UCX (shared memory here), the WAN peer over TCP, from one send."""

import asyncio

import pytest

from conftest import fill_random, same_bytes, wait_rx_chunks
from pdd_wire.engine import protocol as p
from pdd_wire.errors import ErrorCode
from support.agents import cluster_toml, run_agents

pytestmark = pytest.mark.ucx

MiB = 1 << 20
NODES = [("A", "a1"), ("A", "a2"), ("B", "b1")]  # prefill, relay decode, main decode


async def wait_ucx(agent, peer: str) -> None:
    async with asyncio.timeout(15):
        while not agent.sessions[peer].over_ucx:
            await asyncio.sleep(0.01)


async def test_dual_path_local_over_ucx_wan_over_tcp(tmp_sock_dir, engines):
    async with run_agents(cluster_toml(tmp_sock_dir, NODES, local_transport="ucx"), wait_up=False) as ag:
        await wait_ucx(ag["a1"], "A/a2")
        await wait_ucx(ag["a2"], "A/a1")
        local, wan = ag["a1"].sessions["A/a2"], ag["a1"].sessions["B/b1"]
        async with asyncio.timeout(15):
            while not (wan.is_up and len(wan.links) == wan.streams):
                await asyncio.sleep(0.01)
        assert not local.links  # no TCP bulk connections to the same-site peer
        prefill = await engines.connect(tmp_sock_dir / "a1.sock", "prefill")
        rld = await engines.connect(tmp_sock_dir / "a2.sock", "rld")
        md = await engines.connect(tmp_sock_dir / "b1.sock", "md")
        size = 64 * MiB
        src, d_rld, d_md = engines.memory(size), engines.memory(size), engines.memory(size)
        await fill_random(src)
        r_src = await prefill.register(src, block_bytes=MiB)
        r_rld, r_md = await rld.register(d_rld, block_bytes=MiB), await md.register(d_md, block_bytes=MiB)
        for i in range(3):
            rid = f"req{i}"
            await rld.post_recv(rid, [r_rld.blocks(0, 64)])
            await md.post_recv(rid, [r_md.blocks(0, 64)])
            await prefill.send_kv(rid, [r_src.blocks(0, 64)], to=["A/a2", "B/b1"])
            a, b = await asyncio.gather(rld.wait(rid, timeout=60), md.wait(rid, timeout=60))
            assert isinstance(a, p.KvReceived) and isinstance(b, p.KvReceived), (a, b)
            assert {(await prefill.wait(rid, timeout=10)).peer for _ in range(2)} == {"A/a2", "B/b1"}
        assert await same_bytes(d_rld.buf, src.buf) and await same_bytes(d_md.buf, src.buf)
        assert local.data.describe()["ucx"]["bytes_sent"] >= 3 * size  # the local copy really went over UCX
        assert local.describe()["data_path"] == "ucx" and wan.describe()["data_path"] == "tcp"


async def test_withdrawn_post_gets_nothing_over_ucx(tmp_sock_dir, engines):
    async with run_agents(cluster_toml(tmp_sock_dir, NODES[:2], local_transport="ucx"), wait_up=False) as ag:
        await wait_ucx(ag["a1"], "A/a2")
        await wait_ucx(ag["a2"], "A/a1")
        rld = await engines.connect(tmp_sock_dir / "a2.sock", "rld")
        dst = engines.memory(8 * MiB)
        r = await rld.register(dst, block_bytes=MiB)
        await rld.post_recv("x", [r.blocks(0, 8)])
        prefill = await engines.connect(tmp_sock_dir / "a1.sock", "prefill")
        src = engines.memory(8 * MiB)
        await fill_random(src)
        rs = await prefill.register(src, block_bytes=MiB)
        await rld.abort("x")  # the post is withdrawn before any KV came
        await prefill.send_kv("x", [rs.blocks(0, 8)], to=["A/a2"])
        ev = await prefill.wait("x", timeout=30)
        assert isinstance(ev, p.TransferFailed)
        assert not any(dst.buf[:])


async def test_abort_mid_transfer_over_ucx_freezes_the_posted_blocks(tmp_sock_dir, engines):
    """An engine's abort during a UCX transfer: once abort returns, nothing more lands."""
    async with run_agents(cluster_toml(tmp_sock_dir, NODES[:2], local_transport="ucx",
                                       extra="[transfer]\ncredit_bytes = 16777216\n"), wait_up=False) as ag:
        await wait_ucx(ag["a1"], "A/a2")
        await wait_ucx(ag["a2"], "A/a1")
        prefill = await engines.connect(tmp_sock_dir / "a1.sock", "prefill")
        rld = await engines.connect(tmp_sock_dir / "a2.sock", "rld")
        size = 512 * MiB
        src, dst = engines.memory(size), engines.memory(size)
        await fill_random(src)
        rs, rd = await prefill.register(src, block_bytes=MiB), await rld.register(dst, block_bytes=MiB)
        await rld.post_recv("big", [rd.blocks(0, 512)])
        await prefill.send_kv("big", [rs.blocks(0, 512)], to=["A/a2"])
        await wait_rx_chunks(ag["a2"], "A/a1", 2)
        await rld.abort("big")
        snapshot = await asyncio.to_thread(lambda: bytes(dst.buf))
        ev = await prefill.wait("big", timeout=30)
        assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.TRANSFER_CANCELLED, ev
        await asyncio.sleep(0.5)  # anything still in flight would land now
        assert await asyncio.to_thread(lambda: bytes(dst.buf) == snapshot)
        assert not ag["a2"].sessions["A/a1"].inn
