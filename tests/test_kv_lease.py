"""The sender's lease on KV whose receive is not posted yet (send_kv ``lease_s`` -> KV_BEGIN
``post_wait_ms``), a receive for a transfer whose sender already gave up, and the receiver's cap
on a matched prefix (post_recv ``max_skip_blocks``). Real agents for sites A and B.
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import engine_pair, metric
from pdd_wire.engine import protocol as p
from pdd_wire.engine.hashes import chain_hashes
from pdd_wire.errors import EngineRequestError, ErrorCode
from support.agents import run_agents, two_site_toml

MiB = 1 << 20


def short_unposted_wait(tomls: dict) -> dict:
    """Both agents hold an unposted KV_BEGIN 0.2 s unless its sender asks for longer."""
    return {k: v.replace("[transfer]\n", "[transfer]\nunposted_wait_s = 0.2\n") if k != "ports" else v
            for k, v in tomls.items()}


async def setup(engines, tmp, n=8):
    return await engine_pair(engines, tmp, n * MiB, MiB)


async def test_the_senders_lease_outlasts_the_receivers_unposted_wait(tmp_sock_dir, engines):
    async with run_agents(short_unposted_wait(two_site_toml(tmp_sock_dir))) as agents:
        P, D, src, dst, rp, rd = await setup(engines, tmp_sock_dir)
        await P.send_kv("r1", [rp.blocks(0, 4)], to=["B"], lease_s=60)
        async with asyncio.timeout(10):
            while "r1" not in agents["B"].kv.unposted:
                await asyncio.sleep(0.005)
        # Held for the lease, not the receiver's unposted_wait_s: past four of those it still waits.
        await asyncio.sleep(0.8)
        assert "r1" in agents["B"].kv.unposted
        assert agents["A"].describe()["pinned_blocks"]["send"] == 4
        await D.post_recv("r1", [rd.blocks(0, 4)], from_site="A")
        assert isinstance(await D.wait("r1", timeout=10), p.KvReceived)
        assert isinstance(await P.wait("r1", timeout=10), p.KvSent)
        assert bytes(dst.buf[:4 * MiB]) == bytes(src.buf[:4 * MiB])
        assert agents["A"].describe()["pinned_blocks"]["send"] == 0


async def test_a_receive_after_the_lease_ran_out_fails_at_once_with_not_posted(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        P, D, src, dst, rp, rd = await setup(engines, tmp_sock_dir)
        await P.send_kv("r2", [rp.blocks(0, 2)], to=["B"], lease_s=0.3)
        ev = await P.wait("r2", timeout=10)
        assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.NOT_POSTED, ev
        assert agents["A"].describe()["pinned_blocks"]["send"] == 0
        with pytest.raises(EngineRequestError) as exc:
            await D.post_recv("r2", [rd.blocks(0, 2)], from_site="A")
        assert exc.value.code == ErrorCode.NOT_POSTED
        assert agents["B"].describe()["posted_receives"] == 0
        # Sent again (a retry): the memory of the given-up transfer is gone, the post matches.
        await P.send_kv("r2", [rp.blocks(0, 2)], to=["B"], lease_s=30)
        async with asyncio.timeout(10):
            while "r2" not in agents["B"].kv.unposted:
                await asyncio.sleep(0.005)
        await D.post_recv("r2", [rd.blocks(0, 2)], from_site="A")
        assert isinstance(await D.wait("r2", timeout=10), p.KvReceived)


async def test_a_receive_for_an_aborted_send_fails_at_once(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        P, D, src, dst, rp, rd = await setup(engines, tmp_sock_dir)
        await P.send_kv("r3", [rp.blocks(0, 2)], to=["B"], lease_s=60)
        async with asyncio.timeout(10):
            while "r3" not in agents["B"].kv.unposted:
                await asyncio.sleep(0.005)
        await P.abort("r3", "client gone")
        async with asyncio.timeout(10):
            while "r3" in agents["B"].kv.unposted:
                await asyncio.sleep(0.005)
        with pytest.raises(EngineRequestError) as exc:
            await D.post_recv("r3", [rd.blocks(0, 2)], from_site="A")
        assert exc.value.code == ErrorCode.TRANSFER_CANCELLED


async def test_a_matched_prefix_longer_than_the_receiver_allows_is_sent_whole(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        P, D, src, dst, rp, rd = await setup(engines, tmp_sock_dir, n=16)
        hashes = chain_hashes(list(range(6 * 16)), 16, model="m")
        assert await D.kv_stored([rd.blocks(0, 4)], hashes[:4]) == 4  # B's node holds 4 leading blocks
        # The engine itself counts only 2 of them as its own hit: at most 2 may be left out.
        tx0 = metric(agents["A"], "pddwire_bytes_total", peer="B/b1", lane="bulk", direction="tx")
        await D.post_recv("r4", [rd.blocks(8, 6)], from_site="A", max_skip_blocks=2)
        [sent] = await P.send_kv("r4", [rp.blocks(0, 6)], to=["B"], block_hashes=hashes)
        ev = await D.wait("r4", timeout=10)
        assert isinstance(ev, p.KvReceived) and ev.reused_blocks == 0 and ev.bytes == 6 * MiB, ev
        assert bytes(dst.buf[8 * MiB:14 * MiB]) == bytes(src.buf[:6 * MiB])
        done = await P.wait("r4", timeout=10)  # A counts bytes as they are acknowledged
        # Sent again whole as a new transfer on the wire, but told under the id send_kv answered.
        assert isinstance(done, p.KvSent) and done.transfer_id == sent["transfer_id"], (done, sent)
        assert metric(agents["A"], "pddwire_bytes_total", peer="B/b1", lane="bulk", direction="tx") - tx0 == 6 * MiB
        # Reusing nothing, r4's lease (its query's) is gone: the blocks are not held for it.
        assert ("A/a1", "r4") not in agents["B"].inventory.leases
        assert all(agents["B"].inventory.blocks[h].leases == 0 for h in hashes[:4])
        # Within the cap: the 4 held blocks are not sent.
        await D.post_recv("r5", [rd.blocks(8, 6)], from_site="A", max_skip_blocks=4)
        await P.send_kv("r5", [rp.blocks(0, 6)], to=["B"], block_hashes=hashes)
        ev = await D.wait("r5", timeout=10)
        assert isinstance(ev, p.KvReceived) and ev.reused_blocks == 4 and ev.bytes == 2 * MiB, ev
        with pytest.raises(EngineRequestError) as exc:
            await D.post_recv("r6", [rd.blocks(8, 6)], max_skip_blocks=-1)
        assert exc.value.code == ErrorCode.BAD_REQUEST


def test_a_given_up_record_past_its_time_counts_for_nothing():
    """Requests given up are kept per site for ``ttl``: one past its time (not pruned yet) does not
    shadow another site's live one, and expired records go at the next record of any site."""
    from pdd_wire.desk.given_up import GivenUp

    g = GivenUp(per_site=2, ttl=10.0)
    g.add("A", "r", ErrorCode.NOT_POSTED, "A gave up", now=0.0)
    g.add("B", "r", ErrorCode.TRANSFER_CANCELLED, "B cancelled", now=5.0)
    rec = g.take("r", ["B", "A"], now=12.0)
    assert rec is not None and rec[1] == "B cancelled", rec  # A's (expired) was later in the order
    g.add("C", "q", ErrorCode.NOT_POSTED, "C", now=30.0)  # prunes what expired, every site
    assert set(g.sites) == {"C"}
    for i in range(3):
        g.add("C", f"s{i}", ErrorCode.NOT_POSTED, "y" * 1000, now=30.0)
    assert list(g.sites["C"]) == ["s1", "s2"] and len(g.sites["C"]["s2"][1]) == 256  # per site; reason clipped
