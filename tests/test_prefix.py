"""The decode-side prefix inventory: only the missing suffix of a prompt's KV crosses the WAN.

Real agents for sites A (prefill) and B (main decode); B's engine reports the blocks it holds
by chained hash, A's sends name the hashes of theirs.
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import fill_random, metric
from pdd_wire.desk.inventory import Inventory
from pdd_wire.engine import protocol as p
from pdd_wire.engine.hashes import chain_hashes
from support.agents import run_agents, two_site_toml

MiB = 1 << 20


def test_chain_hashes_cover_the_whole_prefix():
    a = chain_hashes(list(range(64)), 16, model="m")
    assert len(a) == 4 and len(set(a)) == 4
    assert chain_hashes(list(range(70)), 16, model="m") == a  # a partial last block has no hash
    b = chain_hashes([99] + list(range(1, 64)), 16, model="m")
    assert all(x != y for x, y in zip(a, b))  # one token changed: every later hash changes
    assert chain_hashes(list(range(64)), 16, model="other")[0] != a[0]
    assert chain_hashes(list(range(64)), 32, model="m")[0] != a[0]
    with pytest.raises(ValueError):
        chain_hashes([1], 0)


def test_inventory_match_lease_evict_expire():
    inv = Inventory()
    eng = object()
    h = chain_hashes(list(range(160)), 16)
    inv.stored(eng, h[:6], [(1, i) for i in range(6)])
    assert inv.match(h) == 6 and inv.match([12345] + h) == 0
    k, _ = inv.lease("r1", h, now=0.0, ttl=10.0)
    assert k == 6 and inv.places("r1") == [(1, 0, 6)]
    ev, kept, broken = inv.evict(h[4:6])
    assert ev == [] and kept == h[4:6] and broken == []
    assert inv.release("r1") and inv.evict(h[5:6]) == ([h[5]], [], [])
    k, _ = inv.lease("r2", h, now=0.0, ttl=1.0)
    assert k == 5
    ev, kept, broken = inv.evict(h[0:1], force=True)
    assert ev == [h[0]] and broken == ["r2"] and inv.places("r2") == []
    inv.lease("r3", h[1:], now=0.0, ttl=1.0)
    assert inv.expire(0.5) == [] and inv.expire(1.0) == ["r2", "r3"]
    assert all(b.leases == 0 for b in inv.blocks.values())
    assert inv.forget_owner(eng) == [] and not inv.blocks and not inv.at
    # A place reused for another block drops the old hash, and breaks a lease on it.
    inv.stored(eng, h[:2], [(1, 0), (1, 1)])
    inv.lease("r4", h, now=0.0, ttl=10.0)
    assert inv.stored(eng, [777], [(1, 1)]) == ["r4"]
    assert inv.match(h) == 1 and len(inv.blocks) == 2 and len(inv.at) == 2


async def setup(engines, tmp, n=16):
    P = await engines.connect(tmp / "A.sock", "prefill")
    M = await engines.connect(tmp / "B.sock", "md")
    src, dst = engines.memory(n * MiB), engines.memory(n * MiB)
    await fill_random(src)
    await fill_random(dst)  # MD's cache: what it holds is its own business
    rp = await P.register(src, block_bytes=MiB)
    rm = await M.register(dst, block_bytes=MiB)
    return P, M, src, dst, rp, rm


async def test_only_the_missing_suffix_crosses_and_lands_byte_identical(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        P, M, src, dst, rp, rm = await setup(engines, tmp_sock_dir, n=32)
        hashes = chain_hashes(list(range(12 * 16)), 16, model="tiny")  # a 12-block prompt
        # Turn 1 left blocks 0..9 of this conversation in MD's cache (region blocks 0..9).
        assert await M.kv_stored([rm.blocks(0, 10)], hashes[:10]) == 10
        before = metric(agents["A"], "pddwire_bytes_total", peer="B/b1", lane="bulk", direction="tx")
        # Turn 2: MD posts room for the whole prompt (blocks 16..27); P sends its 12 blocks.
        await M.post_recv("t2", [rm.blocks(16, 12)], from_site="A")
        await P.send_kv("t2", [rp.blocks(0, 12)], to=["B"], block_hashes=hashes)
        ev = await M.wait("t2", timeout=10)
        assert isinstance(ev, p.KvReceived) and ev.reused_blocks == 10 and ev.reused == [(rm.region, 0, 10)]
        assert ev.bytes == 2 * MiB
        assert isinstance(await P.wait("t2", timeout=10), p.KvSent)
        sent = metric(agents["A"], "pddwire_bytes_total", peer="B/b1", lane="bulk", direction="tx") - before
        assert sent == 2 * MiB
        assert bytes(dst.buf[26 * MiB:28 * MiB]) == bytes(src.buf[10 * MiB:12 * MiB])  # the suffix landed
        assert metric(agents["A"], "pddwire_prefix_bytes_saved_total", peer="B/b1") == 10 * MiB
        # The lease holds the reused blocks against a polite eviction until the engine is done.
        assert (await M.kv_evict(hashes[:2]))["kept"] == hashes[:2]
        assert await M.prefix_release("t2")
        assert (await M.kv_evict(hashes[:2]))["evicted"] == hashes[:2]
        # A request whose prefix MD does not hold (any more) gets every block.
        await M.post_recv("t3", [rm.blocks(16, 12)], from_site="A")
        await P.send_kv("t3", [rp.blocks(0, 12)], to=["B"], block_hashes=hashes)
        ev = await M.wait("t3", timeout=10)
        assert ev.reused_blocks == 0 and ev.bytes == 12 * MiB
        assert bytes(dst.buf[16 * MiB:28 * MiB]) == bytes(src.buf[:12 * MiB])


async def test_a_broken_lease_falls_back_to_shipping_every_block(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        P, M, src, dst, rp, rm = await setup(engines, tmp_sock_dir, n=256)
        hashes = chain_hashes(list(range(200 * 16)), 16)
        await M.kv_stored([rm.blocks(0, 8)], hashes[:8])
        await M.post_recv("b1", [rm.blocks(8, 200)], from_site="A")
        await P.send_kv("b1", [rp.blocks(0, 200)], to=["B"], block_hashes=hashes)
        async with asyncio.timeout(10):  # the suffix is on its way
            while not [t for t in agents["B"].sessions["A/a1"].inn.values() if t.request_id == "b1"]:
                await asyncio.sleep(0.001)
        res = await M.kv_evict(hashes[:8], force=True)  # the engine needed the memory after all
        assert res["evicted"] == hashes[:8]
        ev = await M.wait("b1", timeout=30)
        assert isinstance(ev, p.KvReceived) and ev.reused_blocks == 0 and ev.bytes == 200 * MiB, ev
        assert isinstance(await P.wait("b1", timeout=10), p.KvSent)
        assert bytes(dst.buf[8 * MiB:208 * MiB]) == bytes(src.buf[:200 * MiB])
        assert metric(agents["B"], "pddwire_prefix_leases_broken_total") == 1
        assert metric(agents["A"], "pddwire_retransmits_total", peer="B/b1", reason="prefix_lost") > 0


async def test_leases_expire_and_engine_loss_empties_the_inventory(tmp_sock_dir, engines):
    tomls = two_site_toml(tmp_sock_dir)
    tomls["B"] = tomls["B"].replace("[transfer]\n", "[transfer]\nprefix_lease_s = 0.3\n")
    async with run_agents(tomls) as agents:
        P, M, src, dst, rp, rm = await setup(engines, tmp_sock_dir)
        hashes = chain_hashes(list(range(8 * 16)), 16)
        await M.kv_stored([rm.blocks(0, 4)], hashes[:4])
        res = await P.choose_pipeline("e1", to="B", input_tokens=8 * 16, expected_output_tokens=1000,
                                      kv_bytes_per_token=MiB // 16, block_hashes=hashes, block_tokens=16)
        assert res["prefix_source"] == "inventory" and res["prefix_hit_tokens"] == 4 * 16
        assert (await M.kv_evict(hashes[:1]))["kept"] == hashes[:1]  # leased by the lookup
        async with asyncio.timeout(5):
            while not (await M.kv_evict(hashes[:1]))["evicted"]:
                await asyncio.sleep(0.1)
        assert metric(agents["B"], "pddwire_leases_expired_total", kind="prefix") >= 1
        await M.close()
        async with asyncio.timeout(5):
            while agents["B"].inventory.blocks:
                await asyncio.sleep(0.01)


async def test_the_pipeline_prediction_is_checked_against_the_real_wan_time(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        P, M, src, dst, rp, rm = await setup(engines, tmp_sock_dir)
        await agents["A"].probe("B", seconds=0.6)  # a bandwidth figure to predict with
        res = await P.choose_pipeline("w1", to="B", input_tokens=16 * 16, prefix_hit_tokens=0,
                                      expected_output_tokens=1000, kv_bytes_per_token=MiB // 16)
        assert res["predicted_wan_s"] > 0
        await M.post_recv("w1", [rm.blocks(0, 16)])
        await P.send_kv("w1", [rp.blocks(0, 16)], to=["B"])
        await P.wait("w1", timeout=10)
        assert metric(agents["A"], "pddwire_wan_prediction_ratio_count") == 1


def test_md_inventory_tracks_prefill_cache_on_the_trace():
    """Both pipelines end at MD, so MD's inventory holds what P's cache holds (and the answers,
    which P never computed): with room for the working set MD lacks none of P's hits."""
    from pdd_tools.bench import inventory_tracking

    tr = inventory_tracking(1 << 20, n_requests=600, warmup=200)
    assert tr["lacked_share"] == 0 and tr["tracking"] >= 1.0 and tr["p_hit_blocks"] > 0
    tight = inventory_tracking(64 << 10, n_requests=600, warmup=200)
    assert tight["p_hit_blocks"] < tr["p_hit_blocks"]  # eviction shows up on both sides
