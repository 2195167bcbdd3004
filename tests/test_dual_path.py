"""One send, several destinations: the relay decoder in the same site and the main decoder across
the WAN get the same blocks, each completes on its own, and the sender hears about each."""

import asyncio

from conftest import fill_random, same_bytes
from pdd_wire.engine import protocol as p
from support.agents import cluster_toml, run_agents

MiB = 1 << 20


async def test_dual_path_delivers_byte_identical_to_both_receivers(tmp_sock_dir, engines):
    nodes = [("A", "a1"), ("A", "a2"), ("B", "b1")]  # prefill, relay decode, main decode
    async with run_agents(cluster_toml(tmp_sock_dir, nodes)) as ag:
        assert set(ag) == {"a1", "a2", "b1"}
        prefill = await engines.connect(tmp_sock_dir / "a1.sock", "prefill")
        rld = await engines.connect(tmp_sock_dir / "a2.sock", "rld")
        md = await engines.connect(tmp_sock_dir / "b1.sock", "md")
        src = engines.memory(64 * MiB)
        await fill_random(src)
        dst_rld, dst_md = engines.memory(64 * MiB), engines.memory(64 * MiB)
        r_src = await prefill.register(src, block_bytes=MiB)
        r_rld = await rld.register(dst_rld, block_bytes=MiB)
        r_md = await md.register(dst_md, block_bytes=MiB)
        await rld.post_recv("req", [r_rld.blocks(0, 64)], from_site="A")
        await md.post_recv("req", [r_md.blocks(0, 64)], from_site="A")
        sends = await prefill.send_kv("req", [r_src.blocks(0, 64)], to=["A/a2", "B"])
        assert [s["to"] for s in sends] == ["A/a2", "B/b1"]
        got_rld, got_md = await asyncio.gather(rld.wait("req", timeout=60), md.wait("req", timeout=60))
        assert isinstance(got_rld, p.KvReceived) and isinstance(got_md, p.KvReceived)
        assert await same_bytes(dst_rld.buf, src.buf) and await same_bytes(dst_md.buf, src.buf)
        # One event per destination on the sending side, each naming its peer.
        sent = {(await prefill.wait("req", timeout=10)).peer, (await prefill.wait("req", timeout=10)).peer}
        assert sent == {"A/a2", "B/b1"}


async def test_one_destination_failing_does_not_fail_the_other(tmp_sock_dir, engines):
    nodes = [("A", "a1"), ("A", "a2"), ("B", "b1")]
    async with run_agents(cluster_toml(tmp_sock_dir, nodes)):
        prefill = await engines.connect(tmp_sock_dir / "a1.sock", "prefill")
        rld = await engines.connect(tmp_sock_dir / "a2.sock", "rld")
        md = await engines.connect(tmp_sock_dir / "b1.sock", "md")
        src, d1, d2 = engines.memory(8 * MiB), engines.memory(8 * MiB), engines.memory(8 * MiB)
        await fill_random(src)
        r_src = await prefill.register(src, block_bytes=MiB)
        r1 = await rld.register(d1, block_bytes=MiB)
        r2 = await md.register(d2, block_bytes=MiB)
        await rld.post_recv("q", [r1.blocks(0, 8)])
        await md.post_recv("q", [r2.blocks(0, 4)])  # wrong size: this destination is refused
        await prefill.send_kv("q", [r_src.blocks(0, 8)], to=["A/a2", "B/b1"])
        assert isinstance(await rld.wait("q", timeout=30), p.KvReceived)
        failed = await md.wait("q", timeout=30)
        assert isinstance(failed, p.TransferFailed) and failed.direction == "in"
        events = [await prefill.wait("q", timeout=10) for _ in range(2)]
        by_peer = {e.peer: type(e) for e in events}
        assert by_peer == {"A/a2": p.KvSent, "B/b1": p.TransferFailed}
        assert await same_bytes(d1.buf, src.buf)
