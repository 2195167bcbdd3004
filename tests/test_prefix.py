"""The decode-side prefix inventory: only the missing suffix of a prompt's KV crosses the WAN.

Real agents for sites A (prefill) and B (main decode); B's engine reports the blocks it holds
by chained hash, A's sends name the hashes of theirs.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from conftest import fill_random, metric, until
from pdd_tools.shaper import Shaper
from pdd_wire.desk.inventory import Inventory
from pdd_wire.engine import protocol as p
from pdd_wire.engine.hashes import chain_hashes
from support.agents import cluster_toml, free_port, run_agents, two_site_toml

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
    k, _ = inv.lease("A/a1", "r1", h, now=0.0, ttl=10.0)
    r1 = inv.get(("A/a1", "r1"))
    assert k == 6 and r1 is not None and inv.places(r1) == [(1, 0, 6)]
    ev, kept, broken = inv.evict(h[4:6])
    assert ev == [] and kept == h[4:6] and broken == []
    assert inv.release(("A/a1", "r1")) is r1 and inv.evict(h[5:6]) == ([h[5]], [], [])
    assert inv.places(r1) == []  # released: it describes nothing any more
    k, _ = inv.lease("A/a1", "r2", h, now=0.0, ttl=1.0)
    r2 = inv.get(("A/a1", "r2"))
    assert k == 5 and r2 is not None
    ev, kept, broken = inv.evict(h[0:1], force=True)
    assert ev == [h[0]] and broken == [r2] and inv.places(r2) == []
    inv.lease("A/a1", "r3", h[1:], now=0.0, ttl=1.0)
    assert inv.expire(0.5) == [] and [x.request_id for x in inv.expire(1.0)] == ["r2", "r3"]
    assert all(b.leases == 0 for b in inv.blocks.values())
    assert inv.forget_owner(eng) == [] and not inv.blocks and not inv.at
    # A place reused for another block drops the old hash, and breaks a lease on it.
    inv.stored(eng, h[:2], [(1, 0), (1, 1)])
    inv.lease("A/a1", "r4", h, now=0.0, ttl=10.0)
    assert [x.request_id for x in inv.stored(eng, [777], [(1, 1)])] == ["r4"]
    assert inv.match(h) == 1 and len(inv.blocks) == 2 and len(inv.at) == 2


def test_leases_are_per_peer_and_report_what_they_drop():
    """Two peers' leases for one request id stand side by side; a peer's next query for the
    request replaces only its own lease; a peer over its share (``max_leases`` leases,
    ``max_lease_blocks`` blocks) drops its own oldest, never another peer's, and what is dropped
    is returned; a query that matches nothing takes no lease."""
    inv = Inventory(max_leases=3)
    eng = object()
    x, y = chain_hashes(list(range(64)), 16, model="x"), chain_hashes(list(range(64)), 16, model="y")
    inv.stored(eng, x + y, [(1, i) for i in range(8)])
    assert inv.lease("A/a1", "r", x, now=0.0, ttl=10.0) == (4, [])
    a = inv.get(("A/a1", "r"))
    assert inv.lease("C/c1", "r", y[:3], now=0.0, ttl=10.0) == (3, [])  # another peer: A's lease stands
    c = inv.get(("C/c1", "r"))
    assert a is not None and c is not None and inv.current(a) and inv.current(c)
    assert inv.places(a) == [(1, 0, 4)] and inv.places(c) == [(1, 4, 3)]
    assert inv.for_request("r") == [a, c]
    k, dropped = inv.lease("A/a1", "r", x[:2], now=0.0, ttl=10.0)  # A asks again: its old lease goes
    assert k == 2 and dropped == [a] and not inv.current(a) and inv.places(a) == []
    a2 = inv.get(("A/a1", "r"))
    assert a2 is not None and inv.places(a2) == [(1, 0, 2)] and inv.current(c)
    assert inv.lease("A/a1", "s", x, now=0.0, ttl=10.0) == (4, [])
    assert inv.lease("A/a1", "t", x, now=0.0, ttl=10.0) == (4, [])  # A's 3rd: within its share
    k, dropped = inv.lease("A/a1", "u", x, now=0.0, ttl=10.0)  # A's 4th: A's oldest goes, C's stays
    assert dropped == [a2] and not inv.current(a2) and inv.current(c)
    assert sorted(inv.leases) == [("A/a1", "s"), ("A/a1", "t"), ("A/a1", "u"), ("C/c1", "r")]
    assert inv.blocks[x[0]].leases == 3 and inv.blocks[y[0]].leases == 1
    assert inv.lease("C/c1", "none", [12345], now=0.0, ttl=10.0) == (0, [])  # matched nothing: no lease
    assert ("C/c1", "none") not in inv.leases and inv.by_peer["C/c1"] == {"r": None}
    # Blocks: a peer's leases hold at most max_lease_blocks together; over it, its oldest go.
    inv = Inventory(max_leases=100, max_lease_blocks=6)
    inv.stored(eng, x + y, [(1, i) for i in range(8)])
    assert inv.lease("C/c1", "q", y, now=0.0, ttl=10.0) == (4, [])
    assert inv.lease("A/a1", "r", x, now=0.0, ttl=10.0) == (4, [])
    r = inv.get(("A/a1", "r"))
    k, dropped = inv.lease("A/a1", "s", x[:3], now=0.0, ttl=10.0)  # 4 + 3 > 6: A's "r" goes
    assert k == 3 and dropped == [r] and inv.peer_blocks == {"A/a1": 3, "C/c1": 4}
    k, dropped = inv.lease("A/a1", "big", x + y, now=0.0, ttl=10.0)  # 8 held: one lease holds 6 at most
    assert k == 6 and [d.request_id for d in dropped] == ["s"] and inv.peer_blocks == {"A/a1": 6, "C/c1": 4}
    for key in list(inv.leases):
        inv.release(key)
    assert inv.by_peer == {} and inv.peer_blocks == {} and inv.holders == {}


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


@contextlib.asynccontextmanager
async def matched_in_flight(tmp, engines, extra: str = ""):
    """Sites A (prefill, dialing B through a relay), B (main decode) and C (another peer of B).
    B holds A's chain ``hx`` (blocks 0..9) and C's chain ``hy`` (blocks 10..21). A sends request
    "r" (12 blocks, ``hx``); B matches 10 of them; the relay is paused and B's engine posts, so
    the transfer is matched with its lease and held in flight (no byte of it has crossed) until
    the test resumes the relay (yielded)."""
    ports = {n: free_port() for n in ("a1", "b1", "c1")}
    async with Shaper(target=("127.0.0.1", ports["b1"])) as relay:
        tomls = cluster_toml(tmp, [("A", "a1"), ("B", "b1"), ("C", "c1")], ports=ports,
                             dial={("a1", "b1"): relay.port}, extra=extra)
        async with run_agents({"A": tomls["a1"], "B": tomls["b1"], "C": tomls["c1"]},
                              sites=("A", "B", "C")) as agents:
            P = await engines.connect(tmp / "a1.sock", "prefill")
            M = await engines.connect(tmp / "b1.sock", "md")
            Q = await engines.connect(tmp / "c1.sock", "other")
            src, dst = engines.memory(16 * MiB), engines.memory(32 * MiB)
            await fill_random(src)
            await fill_random(dst)
            rp = await P.register(src, block_bytes=MiB)
            rm = await M.register(dst, block_bytes=MiB)
            hx = chain_hashes(list(range(12 * 16)), 16, model="x")
            hy = chain_hashes(list(range(12 * 16)), 16, model="y")
            assert await M.kv_stored([rm.blocks(0, 10)], hx[:10]) == 10
            assert await M.kv_stored([rm.blocks(10, 12)], hy) == 22
            await P.send_kv("r", [rp.blocks(0, 12)], to=["B"], block_hashes=hx, lease_s=30)
            kv = agents["B"].kv
            await until(lambda: "A/a1" in kv.unposted.get("r", {}), what="A's KV_BEGIN waits for its post")
            assert kv.unposted["r"]["A/a1"].begin.skip_blocks == 10
            relay.pause()
            try:
                await M.post_recv("r", [rm.blocks(16, 12)], from_site="A")
                t = [t for t in agents["B"].sessions["A/a1"].inn.values() if t.request_id == "r"]
                assert len(t) == 1 and t[0].reused_blocks == 10 and t[0].lease is not None
                yield relay, agents, P, M, Q, src, dst, rm, hy
            finally:
                relay.resume()


async def test_another_peers_prefix_query_for_the_same_request_leaves_a_matched_transfer_alone(
        tmp_sock_dir, engines):
    """C asks B about request id "r" too (any peer may name any id), with a chain B holds more
    of, while A's matched transfer for "r" is in flight: A's lease stands, and B's engine learns
    A's prefix blocks -- not C's."""
    async with matched_in_flight(tmp_sock_dir, engines) as (relay, agents, P, M, Q, src, dst, rm, hy):
        res = await Q.choose_pipeline("r", to="B", input_tokens=12 * 16, expected_output_tokens=100,
                                      kv_bytes_per_token=MiB // 16, block_hashes=hy, block_tokens=16)
        assert res["prefix_source"] == "inventory" and res["prefix_hit_tokens"] == 12 * 16
        inv = agents["B"].inventory
        assert {k for k in inv.leases if k[1] == "r"} == {("A/a1", "r"), ("C/c1", "r")}
        relay.resume()
        ev = await M.wait("r", timeout=30)
        assert isinstance(ev, p.KvReceived) and ev.peer == "A/a1", ev
        assert ev.reused_blocks == 10 and ev.reused == [(rm.region, 0, 10)] and ev.bytes == 2 * MiB, ev
        assert isinstance(await P.wait("r", timeout=10), p.KvSent)
        assert bytes(dst.buf[26 * MiB:28 * MiB]) == bytes(src.buf[10 * MiB:12 * MiB])
        assert metric(agents["B"], "pddwire_prefix_leases_broken_total") == 0


async def test_another_peers_lookups_leave_a_matched_lease_alone(tmp_sock_dir, engines):
    """Each peer holds its own share of B's leases (4 x max_transfers = 8): C's lookups, three
    times that many, drop only C's own oldest, never the lease A's in-flight transfer was matched
    with, which lands with its reused blocks."""
    async with matched_in_flight(tmp_sock_dir, engines, extra="[transfer]\nmax_transfers = 2\n") as (
            relay, agents, P, M, Q, src, dst, rm, hy):
        for i in range(24):
            await Q.choose_pipeline(f"q{i}", to="B", input_tokens=2 * 16, expected_output_tokens=100,
                                    kv_bytes_per_token=MiB // 16, block_hashes=hy[:2], block_tokens=16)
        leases = agents["B"].inventory.leases
        assert ("A/a1", "r") in leases and len([k for k in leases if k[0] == "C/c1"]) == 8
        relay.resume()
        ev = await M.wait("r", timeout=30)
        assert isinstance(ev, p.KvReceived) and ev.peer == "A/a1", ev
        assert ev.reused_blocks == 10 and ev.reused == [(rm.region, 0, 10)] and ev.bytes == 2 * MiB, ev
        assert isinstance(await P.wait("r", timeout=10), p.KvSent)
        assert bytes(dst.buf[26 * MiB:28 * MiB]) == bytes(src.buf[10 * MiB:12 * MiB])
        assert metric(agents["B"], "pddwire_prefix_leases_broken_total") == 0


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
        # A bandwidth figure to predict with; 2 s, so that each of its two 1 s measuring windows holds
        # acknowledgements though this process may not run for a few hundred ms (a loaded machine).
        await agents["A"].probe("B", seconds=2)
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


async def test_a_prefix_query_keeps_to_the_peers_max_body(tmp_sock_dir, engines):
    """B takes control bodies of at most 4 KiB (``limits.max_body``, its floor). A's send of a
    600-block prompt asks about as many leading hashes as fit B's limit -- not all 599, which B
    would refuse with FRAME_TOO_LARGE, dropping the session's connections -- and reuses what B
    holds of them."""
    n, blk = 600, 4096
    tomls = two_site_toml(tmp_sock_dir)
    tomls["B"] += "\n[limits]\nmax_body = 4096\n"
    async with run_agents(tomls) as agents:
        P = await engines.connect(tmp_sock_dir / "A.sock", "prefill")
        M = await engines.connect(tmp_sock_dir / "B.sock", "md")
        src, dst = engines.memory(n * blk), engines.memory(2 * n * blk)
        await fill_random(src)
        rp = await P.register(src, block_bytes=blk)
        rm = await M.register(dst, block_bytes=blk)
        hashes = chain_hashes(list(range(n * 4)), 4, model="tiny")
        assert await M.kv_stored([rm.blocks(0, n)], hashes) == n  # B holds the whole prompt
        fit = (4096 - 64 - len(b"long")) // 9
        await M.post_recv("long", [rm.blocks(n, n)], from_site="A")
        await P.send_kv("long", [rp.blocks(0, n)], to=["B"], block_hashes=hashes)
        ev = await M.wait("long", timeout=30)
        assert isinstance(ev, p.KvReceived) and ev.reused_blocks == fit, ev
        assert isinstance(await P.wait("long", timeout=10), p.KvSent)
        assert bytes(dst.buf[(n + fit) * blk:2 * n * blk]) == bytes(src.buf[fit * blk:n * blk])
        assert metric(agents["B"], "pddwire_errors_total", code="FRAME_TOO_LARGE") == 0
        assert metric(agents["A"], "pddwire_reconnects_total", peer="B/b1") == 0


async def test_a_query_that_repeats_a_hash_matches_nothing(tmp_sock_dir, engines):
    """A chain never repeats a hash; a query that does (a long lease of one block, which every
    forced eviction would scan) is answered matched 0 and leases nothing."""
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        P, M, src, dst, rp, rm = await setup(engines, tmp_sock_dir)
        hashes = chain_hashes(list(range(4 * 16)), 16, model="tiny")
        assert await M.kv_stored([rm.blocks(0, 4)], hashes) == 4
        ask = dict(to="B", input_tokens=4 * 16, expected_output_tokens=10, kv_bytes_per_token=MiB // 16,
                   block_tokens=16)
        assert (await P.choose_pipeline("dup", block_hashes=[hashes[0]] * 3, **ask))["prefix_hit_tokens"] == 0
        assert ("A/a1", "dup") not in agents["B"].inventory.leases
        assert (await P.choose_pipeline("ok", block_hashes=hashes[:3], **ask))["prefix_hit_tokens"] == 48
