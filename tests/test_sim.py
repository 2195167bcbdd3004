"""The simulated engines at scale (pdd_tools.sim: cost model, KV pool, PrefillSim,
DecodeSim) and the trace they replay (pdd_tools.trace).

The engine tests drive real agents (in-process, real sockets, real shared memory) for the three
nodes PDD has: prefill a1 and relay decode a2 in site A, main decode b1 in site B. Every request's
output is checked with ``check_stream`` (each position emitted exactly once, in order, with the
model's token) and every KV block's stamp is checked where it lands.
"""

from __future__ import annotations

import asyncio
import statistics

import pytest

from conftest import until
from pdd_tools import trace as tracemod
from pdd_tools.sim import GPU_A, GPU_B, ChipProfile, DecodeSim, KvPool, PrefillSim, check_stream, token_at
from pdd_wire.engine.client import RegionHandle
from support.agents import cluster_toml, run_agents

MiB = 1 << 20
KVB = 1024  # bytes per token in these tests
BLOCK = 16 * KVB
NODES = [("A", "a1"), ("A", "a2"), ("B", "b1")]
FAST = ChipProfile("test", prefill_tokens_per_s=200_000, step_base_s=0.004, step_per_seq_s=0.0002, max_batch=8,
                   prefill_overhead_s=0.001)


# ----------------------------------------------------------------------------- cost model
def test_cost_model_prefill_and_decode_times():
    chip = ChipProfile("x", prefill_tokens_per_s=10_000, step_base_s=0.02, step_per_seq_s=0.001, max_batch=64,
                       prefill_overhead_s=0.005)
    assert chip.prefill_s(0) == pytest.approx(0.005)
    assert chip.prefill_s(10_000) == pytest.approx(1.005)
    assert chip.step_s(0) == 0.0
    assert chip.step_s(1) == pytest.approx(0.021)
    assert chip.step_s(10) == pytest.approx(0.030)
    assert chip.step_s(10, extend_tokens=100) == pytest.approx(0.040)  # the extend rides in the step
    assert chip.step_s(0, extend_tokens=100) == pytest.approx(0.030)  # an extend alone still reads the weights
    # Batching: per-sequence speed falls, chip throughput rises.
    tps = [chip.decode_tokens_per_s(b) for b in (1, 8, 32, 64)]
    assert tps == sorted(tps) and tps[-1] > 10 * tps[0]
    assert chip.decode_tokens_per_s(0) == 0.0


def test_chip_profiles_differ_and_validate():
    # GPU-A (prefill, relay decode): more compute; GPU-B (main decode): faster per sequence, bigger batch.
    assert GPU_A.prefill_s(20_000) < GPU_B.prefill_s(20_000)
    assert GPU_B.decode_tokens_per_s(32) > GPU_A.decode_tokens_per_s(32)
    assert GPU_B.max_batch > GPU_A.max_batch
    for bad in (dict(prefill_tokens_per_s=0), dict(step_base_s=-1), dict(max_batch=0), dict(step_per_seq_s=-0.1)):
        kw = dict(name="bad", prefill_tokens_per_s=1.0, step_base_s=0.01, step_per_seq_s=0.0, max_batch=1) | bad
        with pytest.raises(ValueError):
            ChipProfile(**kw)


# ----------------------------------------------------------------------------- KV pool
async def test_kv_pool_first_fit_fragments_merges_and_serves_waiters_in_order():
    pool = KvPool(16 * BLOCK, BLOCK)
    try:
        pool.region = RegionHandle(7, pool.mem.size, BLOCK)  # the handle an agent would give back
        a = pool.try_alloc(4)
        b = pool.try_alloc(4)
        c = pool.try_alloc(4)
        assert (a, b, c) == ([(7, 0, 4)], [(7, 4, 4)], [(7, 8, 4)])
        pool.release(a)
        pool.release(c)
        assert pool.free_blocks == 12
        d = pool.try_alloc(10)  # no 10-block hole: pieces in address order
        assert d == [(7, 0, 4), (7, 8, 6)] and pool.free_blocks == 2
        assert pool.try_alloc(3) is None
        w1 = asyncio.ensure_future(pool.alloc(6))
        w2 = asyncio.ensure_future(pool.alloc(1))  # fits now, but waits its turn behind w1
        await asyncio.sleep(0)
        assert not w1.done() and not w2.done()
        pool.release(b)  # 6 free: w1's, in two pieces; nothing left for w2
        got1 = await asyncio.wait_for(w1, 1)
        assert got1 == [(7, 4, 4), (7, 14, 2)]
        await asyncio.sleep(0)
        assert not w2.done()
        pool.release(d)
        got2 = await asyncio.wait_for(w2, 1)
        assert got2 == [(7, 0, 1)]
        for ext in (got1, got2):
            pool.release(ext)
        assert pool.free_blocks == 16 and pool._free == [[0, 16]]  # merged back into one hole
        assert pool.peak_used == 16
        with pytest.raises(ValueError):
            await pool.alloc(17)
        # Stamps: (request, block index) at the start of each block, checked where the KV lands.
        ext = pool.try_alloc(5)
        pool.stamp("req-1", ext)
        assert pool.verify("req-1", ext) == 0
        assert pool.verify("req-2", ext) == 5
        assert pool.verify("req-1", list(reversed(ext))) == 0  # one extent: same order
        pool.mem.buf[ext[0][1] * BLOCK] ^= 0xFF
        assert pool.verify("req-1", ext) == 1
    finally:
        pool.close()


# ----------------------------------------------------------------------------- engines + agents
class Cluster:
    def __init__(self, tmp, engines):
        self.tmp = tmp
        self.engines = engines

    async def start(self, chip: ChipProfile = FAST) -> "Cluster":
        e = self.engines
        pc = await e.connect(self.tmp / "a1.sock", "prefill")
        rc = await e.connect(self.tmp / "a2.sock", "rld")
        mc = await e.connect(self.tmp / "b1.sock", "md")
        self.pools = [KvPool(32 * MiB, BLOCK), KvPool(32 * MiB, BLOCK), KvPool(32 * MiB, BLOCK)]
        self.prefill = await PrefillSim(pc, self.pools[0], chip, kv_bytes_per_token=KVB).start()
        self.rld = await DecodeSim(rc, self.pools[1], chip, role="RLD", peer="B/b1", kv_bytes_per_token=KVB).start()
        self.md = await DecodeSim(mc, self.pools[2], chip, role="MD", peer="A/a2", kv_bytes_per_token=KVB).start()
        return self

    async def close(self):
        for x in (self.prefill, self.rld, self.md):
            await x.close()
        for pool in self.pools:
            pool.close()

    async def request(self, rid: str, pipeline: str, n: int, kv_tokens: int, md_after: int = 0):
        """One request through ``pipeline``; returns (job, rld seq or None, md seq or None).
        ``md_after``: MD posts only once RLD has emitted that many tokens (MD that far behind
        whatever the machine's speed)."""
        rs = ms = None
        if pipeline in ("P-RLD-MD", "P-RLD"):
            rs = await self.rld.submit(rid, n, kv_tokens, handoff=pipeline == "P-RLD-MD")
        if pipeline != "P-RLD" and not md_after:
            ms = await self.md.submit(rid, n, kv_tokens, handoff=pipeline == "P-RLD-MD")
        to = {"P-MD": ["B/b1"], "P-RLD-MD": ["A/a2", "B/b1"], "P-RLD": ["A/a2"]}[pipeline]
        job = self.prefill.submit(rid, kv_tokens, to)
        if md_after:  # MD posts late: its KV waits for the post, RLD decodes meanwhile
            assert rs is not None
            await until(lambda: len(rs.emitted) >= md_after, 30, f"RLD emitting {md_after} tokens")
            ms = await self.md.submit(rid, n, kv_tokens, handoff=True)
        waits = [job.done] + [s.result for s in (rs, ms) if s is not None]
        await asyncio.wait_for(asyncio.gather(*waits), 30)
        return job, rs, ms


@pytest.fixture
async def cluster(tmp_sock_dir, engines, request):
    extra = getattr(request, "param", "")
    async with run_agents(cluster_toml(tmp_sock_dir, NODES, extra=extra)):
        c = await Cluster(tmp_sock_dir, engines).start()
        try:
            yield c
        finally:
            await c.close()


def _result(engine, seq):
    r = engine.result_of(seq)
    assert r["errors"] == [], r["errors"]
    return r


async def test_p_md_request_kv_crosses_and_md_emits_every_token(cluster):
    job, _, ms = await cluster.request("pmd-1", "P-MD", n=40, kv_tokens=3000)
    assert job.failed == {} and set(job.sent) == {"B/b1"} and job.bytes == 3000 * KVB
    r = _result(cluster.md, ms)
    assert ms.bad_blocks == 0 and ms.kv_at is not None and r["first_at"] == ms.admitted_at
    check_stream("pmd-1", 40, ms.emitted)
    assert ms.generated == 39  # position 0 is prefill's token
    assert cluster.pools[0].free_blocks == cluster.pools[0].n_blocks  # P freed its KV once sent
    assert cluster.pools[2].free_blocks == cluster.pools[2].n_blocks


async def test_p_rld_md_dual_path_rld_emits_first_then_md_takes_over(cluster):
    job, rs, ms = await cluster.request("prm-1", "P-RLD-MD", n=120, kv_tokens=4000)
    assert set(job.sent) == {"A/a2", "B/b1"}  # one send_kv, both destinations
    rr, mr = _result(cluster.rld, rs), _result(cluster.md, ms)
    assert rs.bad_blocks == 0 and ms.bad_blocks == 0
    check_stream("prm-1", 120, rs.emitted, ms.emitted)
    assert rr["first_at"] is not None and mr["first_at"] is None  # the user's first token came from RLD
    assert rr["owner"] == mr["owner"] == "MD" and rr["position"] == mr["position"] >= 1
    assert ms.extends >= 1 and ms.extend_tokens >= rr["position"] - 1
    assert rr["mode"] in ("one-shot", "catch-up")


async def test_p_rld_request_finishes_on_rld_alone(cluster):
    job, rs, _ = await cluster.request("x-1", "P-RLD", n=12, kv_tokens=20000)
    assert set(job.sent) == {"A/a2"}
    _result(cluster.rld, rs)
    check_stream("x-1", 12, rs.emitted)
    assert rs.done is None and not rs.handoff


@pytest.mark.parametrize("cluster", ["[policy.handoff]\ncatchup_gap_tokens = 4\n"], indirect=True, ids=["gap4"])
async def test_catch_up_when_md_is_far_behind_and_rld_has_headroom(cluster):
    # MD posts once RLD has emitted 80 tokens (far above the gap of 4), so RLD is at least 80
    # tokens ahead when MD's KV lands, whatever the machine's speed; RLD is idle.
    _, rs, ms = await cluster.request("cu-1", "P-RLD-MD", n=400, kv_tokens=500, md_after=80)
    rr = _result(cluster.rld, rs)
    _result(cluster.md, ms)
    check_stream("cu-1", 400, rs.emitted, ms.emitted)
    assert rr["mode"] == "catch-up" and rr["owner"] == "MD" and rr["position"] >= 80
    assert ms.extends >= 2  # several small extends, not one stall


async def test_many_requests_batched_with_load_reported(cluster):
    pipes = ["P-MD", "P-RLD-MD", "P-MD", "P-RLD", "P-RLD-MD", "P-MD"] * 3
    outs = await asyncio.gather(*(cluster.request(f"m-{i}", p, n=30 + 7 * i, kv_tokens=200 + 300 * i)
                                  for i, p in enumerate(pipes)))
    for i, (job, rs, ms) in enumerate(outs):
        sides = [s.emitted for s in (rs, ms) if s is not None]
        check_stream(f"m-{i}", 30 + 7 * i, *sides)
        assert job.failed == {}
        for eng, s in ((cluster.rld, rs), (cluster.md, ms)):
            if s is not None:
                _result(eng, s)
    assert cluster.md.max_batch_seen > 1 and cluster.md.batch_sum / cluster.md.steps > 1  # batched steps
    assert cluster.rld.load_reports >= 2 and cluster.md.load_reports >= 2  # set_load as the batch changed
    assert cluster.rld.max_batch_seen <= FAST.max_batch
    assert cluster.md.errors == [] and cluster.rld.errors == [] and cluster.prefill.errors == []
    assert all(p.free_blocks == p.n_blocks for p in cluster.pools)


async def test_step_time_follows_the_cost_model(cluster):
    # One local request of 51 tokens on MD: 50 decode steps of step_s(1) each.
    chip = FAST
    _, _, ms = await cluster.request("t-1", "P-MD", n=51, kv_tokens=64)
    took = ms.finished_at - ms.admitted_at
    assert took >= 50 * chip.step_s(1) * 0.95  # the cost model's time is spent (an upper bound would time the box)


# ----------------------------------------------------------------------------- trace
def test_token_model_is_shared():
    assert token_at("r", 3) == token_at("r", 3) != token_at("r", 4)


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_trace_hit_distribution_is_pdds(seed):
    reqs = tracemod.generate(n_requests=2000, seed=seed)
    s = tracemod.stats(reqs)
    assert 0.87 <= s["mean_hit"] <= 0.93  # PDD: about 90% on average
    assert 0.70 <= s["frac_hit_above_95"] <= 0.80  # PDD: 70-80% of requests above 95%
    assert 0.02 <= s["anomalous_fraction"] <= 0.06  # PDD: roughly 3-4%
    assert s["top10pct_share_of_bytes"] >= 0.6  # a few low-hit requests carry most of the bytes
    assert 4.5 <= s["rate_per_s"] <= 8.0  # the asked 6/s, give or take the conversations' burstiness
    for r in reqs:
        assert 0 <= r.prefix_hit_tokens < r.input_tokens and r.output_tokens >= 1
        if r.anomalous:
            assert r.input_tokens >= 16384 and r.output_tokens < 80 and r.prefix_hit_tokens == 0
        else:
            assert r.output_tokens >= 96 and r.input_tokens <= 24576
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs) and reqs[0].arrival_s >= 0


def test_demo_trace_has_the_shape_too():
    s = tracemod.stats(tracemod.generate())  # what scripts/demo replays
    assert s["requests"] == 240
    assert 0.87 <= s["mean_hit"] <= 0.93 and 0.70 <= s["frac_hit_above_95"] <= 0.80
    assert 0.02 <= s["anomalous_fraction"] <= 0.06


def test_trace_is_multi_turn():
    reqs = tracemod.generate(n_requests=1000, seed=3)
    convs: dict[int, list] = {}
    for r in reqs:
        if r.conversation >= 0:
            convs.setdefault(r.conversation, []).append(r)
    turns = [len(v) for v in convs.values()]
    assert statistics.mean(turns) > 3 and max(turns) >= 10
    for v in convs.values():  # each turn's prompt extends the last one, whose prefix MD holds
        for prev, cur in zip(v, v[1:]):
            assert cur.turn == prev.turn + 1 and cur.arrival_s > prev.arrival_s
            assert cur.input_tokens > prev.input_tokens + prev.output_tokens
            # ... unless MD evicted it: then only the system prompt (or nothing) hits
            assert cur.prefix_hit_tokens == prev.input_tokens + prev.output_tokens or \
                cur.prefix_hit_tokens in (0, *tracemod.TraceConfig().system_prompts)


def test_trace_is_deterministic_by_seed():
    a = tracemod.generate(n_requests=300, seed=11)
    b = tracemod.generate(n_requests=300, seed=11)
    c = tracemod.generate(n_requests=300, seed=12)
    assert a == b and a != c
    assert [tracemod.Request.from_json(r.to_json()) for r in a] == a
    with pytest.raises(ValueError):
        tracemod.generate(n_requests=0)
