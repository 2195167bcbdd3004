"""Benchmarks between two real ``pdd-wired`` processes on loopback, with baselines measured in
the same run (iperf3 for goodput). Figures print as lines, or with ``--json`` one object per
line: ``figure``, ``value``, ``unit`` and, where a baseline exists, ``baseline``,
``baseline_value``, ``ratio``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import statistics
import sys
import time

from pdd_wire.engine import protocol as p
from pdd_wire.engine.client import EngineClient
from pdd_wire.memory import SharedMemory
from pdd_wire.stats import percentile

from . import bench_goodput
from .harness import AgentPair, metric_value

MiB = 1 << 20
# Figure groups of --only, in the order they run; every one by default.
GROUPS = ("goodput", "ucx", "probe", "compress", "register", "vllm", "router", "fleet", "latency", "prefix",
          "handoff", "wan", "flood")
# Groups whose figures live in a module of their own (``add_figures(figs, quick)``), imported only
# when asked for (several need the vLLM venv or etcd): group -> (module, what its step line says).
_MODULE_GROUPS = {
    "register": ("bench_register", "memory pools paged in while the agent keeps serving"),
    "vllm": ("bench_vllm", "P -> D through the agents against one vllm serve"),
    "router": ("bench_router", "per-token overhead against vllm serve direct, the one-shot and catch-up "
               "handoff stalls, then PDD's TTFT against plain PD through it (the demo's run, smaller)"),
    "fleet": ("bench_fleet", "100 and 1,000 members registered and watched on one etcd"),
    "wan": ("bench_wan", "per-transfer overhead, 4 MiB goodput, transfers over a 40 ms RTT link"),
    "flood": ("bench_flood", "a peer's round trips while another peer writes bursts of PINGs, or of costly frames"),
}


class Figures:
    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.rows: list[dict] = []
        self.t0 = time.monotonic()

    def step(self, what: str) -> None:
        """A progress line on a terminal (stderr) as a group starts; nothing with --json or in CI."""
        if not self.as_json and sys.stderr.isatty():
            print(f"# [{time.monotonic() - self.t0:5.0f} s] {what} ...", file=sys.stderr, flush=True)

    def add(self, figure: str, value: float, unit: str, baseline: str | None = None,
            baseline_value: float | None = None, note: str = "") -> None:
        row = {"figure": figure, "value": round(value, 4), "unit": unit}
        if baseline is not None and baseline_value:
            row |= {"baseline": baseline, "baseline_value": round(baseline_value, 4),
                    "ratio": round(value / baseline_value, 3)}
        if note:
            row["note"] = note
        self.rows.append(row)
        if self.as_json:
            print(json.dumps(row), flush=True)
        else:
            extra = f"   {row['ratio']:.2f}x {baseline} ({baseline_value:.3f} {unit})" if "ratio" in row else ""
            print(f"{figure:32s} {value:10.3f} {unit:5s}{extra}{'   ' + note if note else ''}", flush=True)


async def _handoff_latency(ep: EngineClient, er: EngineClient, em: EngineClient, mode: str, reps: int,
                           behind: int = 100) -> tuple[list[float], list[int]]:
    """MD ready (its first extend event, sent as the KV lands) to ownership passed (MD told to
    start), in ms, with MD ``behind`` tokens behind RLD; RLD decodes a token every 20 ms. Extends
    cost nothing here: the figure is the protocol's and the agents' own time."""
    from .sim import MdSim, RldSim, check_stream

    src, dst = SharedMemory(MiB), SharedMemory(MiB)
    try:
        ra = await ep.register(src, block_bytes=MiB)
        rb = await em.register(dst, block_bytes=MiB)
        await er.set_load(0.95 if mode == "one-shot" else 0.1)
        out, positions = [], []
        for i in range(reps + 1):
            rid = f"handoff-{mode}-{i}-{time.monotonic_ns()}"
            n = behind + 20
            await em.post_recv(rid, [rb.blocks(0, 1)], from_site="A")
            md = MdSim(em, rid, "A", n_tokens=n)
            await md.start()
            rld = RldSim(er, rid, "B", n_tokens=n, step_s=0.02, hold_at=behind, burst_to_hold=True)
            tasks = [asyncio.ensure_future(rld.run(60)), asyncio.ensure_future(md.run(60))]
            await asyncio.wait_for(rld.held.wait(), 30)
            rld.release_hold()
            await ep.send_kv(rid, [ra.blocks(0, 1)], to=["B"])
            await asyncio.gather(*tasks)
            await ep.wait(rid, timeout=30)
            await em.wait(rid, timeout=30)
            check_stream(rid, n, rld.emitted, md.emitted)
            if rld.done.mode != mode:
                raise RuntimeError(f"asked for {mode}, the agent chose {rld.done.mode}")
            if i:  # the first one warms up
                out.append((md.started_at - md.first_extend_at) * 1e3)
                positions.append(md.position)
        await ep.deregister(ra)
        await em.deregister(rb)
        return out, positions
    finally:
        src.close()
        dst.close()


async def _shaper_figures(figs: "Figures") -> None:
    """Round trips through ``pdd_tools.shaper`` set to 20 ms each way (loopback, 1-byte echo)."""
    from .shaper import Shaper

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):  # the shaper resets it as the figure ends
            while data := await reader.read(1 << 16):
                writer.write(data)
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    async with server, Shaper(target=server.sockets[0].getsockname()[:2], delay_ms=20) as sh:
        reader, writer = await asyncio.open_connection(*sh.address)
        rtts = []
        for _ in range(20):
            t0 = time.perf_counter()
            writer.write(b"x")
            await reader.readexactly(1)
            rtts.append((time.perf_counter() - t0) * 1e3)
        writer.close()
    figs.add("shaper_rtt_20ms_each_way", percentile(rtts, 50), "ms",
             note=f"20 round trips, min {min(rtts):.2f} max {max(rtts):.2f} ms (40 ms added)")


async def _probe_figures(figs: "Figures", quick: bool) -> None:
    """``pdd-wire probe`` against a veth WAN shaped by tbf to 1 Gbit/s between two network
    namespaces (root only): how far its goodput is from the configured rate."""
    from .harness import ADMIN, NetnsAgents

    if os.geteuid() != 0:
        print("# probe figures left out: network namespaces need root", file=sys.stderr)
        return
    rate_bps = 1_000_000_000
    async with NetnsAgents("pddwb", rate_bps=rate_bps, admin=True, streams=4) as net:
        out = await asyncio.to_thread(net.run_in, "A", [
            sys.executable, "-c", "import sys; from pdd_wire.cli import tool_main; sys.exit(tool_main(sys.argv[1:]))",
            "probe", "--site", "B", "--admin", ADMIN, "--seconds", "4" if quick else "8", "--json"])
        if out.returncode != 0:
            raise RuntimeError(f"pdd-wire probe failed: {out.stderr}")
        res = json.loads(out.stdout)
    rate = rate_bps / 8
    n = str(res["streams"])
    for k, bps in res["goodput_Bps"].items():
        figs.add(f"probe_goodput_{k}_stream{'s' if k != '1' else ''}", bps * 8 / 1e9, "Gbit/s", "tbf rate",
                 rate_bps / 1e9, note="veth between two namespaces; tbf counts frames, so TCP payload tops out "
                                      "at ~0.957 of the rate")
    figs.add("probe_rate_error", abs(res["goodput_Bps"][n] - rate) / rate, "fraction",
             note=f"|{n}-stream probe goodput - 1 Gbit/s| / 1 Gbit/s; rtt p50 {res['rtt_ms']['p50']} ms, "
                  f"loss {res['loss']}")


def inventory_tracking(capacity_tokens: int, n_requests: int = 3000, warmup: int = 1000,
                       block_tokens: int = 16) -> dict:
    """Does MD's prefix inventory hold what P's prefix cache holds? Both pipelines end at MD, so
    MD stores every turn it serves (prompt and answer) while P stores the prompts it prefills;
    a prefix P holds but MD lacks must cross the WAN although P did not compute it.

    A pure simulation over ``pdd_tools.trace`` (multi-turn conversations, PDD's hit mix): each
    side is a :class:`pdd_wire.desk.inventory.Inventory` of ``capacity_tokens`` with LRU eviction,
    fed in arrival order (anomalous requests finish on RLD: P stores them, MD never sees them).
    Token streams are per conversation (system prompts are not shared here). Measured after
    ``warmup`` requests: MD's matched prefix over P's, in tokens."""
    import collections
    import itertools

    from pdd_wire.desk.inventory import Inventory
    from pdd_wire.engine.hashes import chain_hashes

    from .trace import generate

    reqs = generate(n_requests=n_requests)
    cap = capacity_tokens // block_tokens

    class Side:
        def __init__(self) -> None:
            self.inv, self.lru = Inventory(), collections.OrderedDict()
            self.slots = itertools.count()  # a fresh cache block for each block stored

        def match(self, hashes: list[int]) -> int:
            k = self.inv.match(hashes)
            for h in hashes[:k]:
                self.lru.move_to_end(h)
            return k

        def store(self, hashes: list[int]) -> None:
            new = [h for h in hashes if h not in self.inv.blocks]
            self.inv.stored(self, new, [(0, next(self.slots)) for _ in new])
            for h in hashes:
                self.lru[h] = None
                self.lru.move_to_end(h)
            while len(self.lru) > cap:
                old, _ = self.lru.popitem(last=False)
                self.inv.evict([old])

    P, MD = Side(), Side()
    p_hit = md_hit = lacked = 0
    for i, r in enumerate(reqs):
        key = f"conversation-{r.conversation}" if r.conversation >= 0 else r.rid
        prompt = chain_hashes(list(range(r.input_tokens)), block_tokens, model=key)
        kp, km = P.match(prompt), MD.match(prompt)
        if i >= warmup and not r.anomalous:
            p_hit += kp
            md_hit += km
            lacked += max(0, kp - km)
        P.store(prompt)
        if not r.anomalous:
            MD.store(chain_hashes(list(range(r.input_tokens + r.output_tokens)), block_tokens, model=key))
    return {"tracking": md_hit / p_hit if p_hit else 1.0, "lacked_share": lacked / p_hit if p_hit else 0.0,
            "p_hit_blocks": p_hit, "md_hit_blocks": md_hit}


async def _prefix_figures(figs: "Figures", pair: AgentPair, ea: EngineClient, eb: EngineClient, quick: bool) -> None:
    """WAN bytes with MD's prefix inventory at PDD's hit mix, against shipping whole prompts.

    Each request is a conversation turn: MD's engine already holds (``kv_stored``) the first
    ``hit x n`` blocks of its prompt's chain; P sends the prompt with ``block_hashes``. The mix:
    78% of requests hit 95-99.5% of their prompt, the rest spread over 0-90% (skewed high),
    for a mean near 90%. KV scaled to 4 KiB/token (64 KiB blocks of 16 tokens), prompts of
    1-8 K tokens."""
    import random

    from pdd_wire.engine.hashes import chain_hashes

    rng = random.Random(7)
    block, btok, maxb = 64 << 10, 16, 512
    src, cache, dst = SharedMemory(maxb * block), SharedMemory(maxb * block), SharedMemory(maxb * block)
    try:
        src.buf[:] = os.urandom(src.size)
        ra = await ea.register(src, block_bytes=block)
        rc = await eb.register(cache, block_bytes=block)
        rd = await eb.register(dst, block_bytes=block)
        before = metric_value(pair.metrics("A"), "pddwire_bytes_total", peer=pair.dest, lane="bulk", direction="tx")
        whole = 0
        hits = []
        n_req = 60 if quick else 200
        t0 = time.perf_counter()
        for i in range(n_req):
            n = rng.randint(1024, 8192) // btok
            hit = rng.uniform(0.95, 0.995) if rng.random() < 0.78 else 0.9 * (1 - rng.random() ** 2)
            k = int(hit * n)
            hashes = chain_hashes(list(range(n * btok)), btok, model=f"conversation-{i}")
            if k:
                await eb.kv_stored([rc.blocks(0, k)], hashes[:k])
            rid = f"prefix-{i}"
            await eb.post_recv(rid, [rd.blocks(0, n)])
            await ea.send_kv(rid, [ra.blocks(0, n)], to=[pair.dest], block_hashes=hashes)
            ev = await eb.wait(rid, timeout=60)
            if not isinstance(ev, p.KvReceived):
                raise RuntimeError(f"prefix bench transfer failed: {ev}")
            if bytes(dst.buf[ev.reused_blocks * block:n * block]) != bytes(src.buf[ev.reused_blocks * block:n * block]):
                raise RuntimeError("the suffix landed wrong")
            await ea.wait(rid, timeout=60)
            await eb.prefix_release(rid)
            if k:
                await eb.kv_evict(hashes[:k])
            whole += n * block
            hits.append(ev.reused_blocks / n)
        elapsed = time.perf_counter() - t0
        sent = metric_value(pair.metrics("A"), "pddwire_bytes_total", peer=pair.dest, lane="bulk",
                            direction="tx") - before
        mean_hit = statistics.fmean(hits)
        above = sum(h > 0.95 for h in hits) / len(hits)
        figs.add("wan_bytes_reduction", whole / sent, "x",
                 note=f"{n_req} requests, whole prompts {whole / 1e9:.2f} GB, "
                 f"sent {sent / 1e9:.3f} GB; matched prefix mean {mean_hit:.1%}, {above:.0%} of requests above 95%")
        figs.add("prefix_effective_goodput", whole / elapsed / 1e9, "GB/s",
                 note="prompt KV made available at MD per second (reused + sent), one request at a time")
        for label, cap in (("ample", 1 << 20), ("tight", 256 << 10)):
            tr = await asyncio.to_thread(inventory_tracking, cap)
            figs.add(f"md_inventory_tracking_{label}", tr["tracking"], "x",
                     note=f"MD's matched prefix / P's, both LRU caches of {cap >> 10}K tokens, 3000 trace requests "
                          f"(1000 warm-up); share of P's hits that MD lacked: {tr['lacked_share']:.2%}")
    finally:
        for mem in (src, cache, dst):
            mem.close()


async def _compress_figures(figs: "Figures", quick: bool) -> None:
    """lz4 on real KV (pdd_tools.bench_compress), then measured through the agents: goodput of
    the same bf16 KV over a tbf-shaped veth WAN with ``transfer.compress`` off and auto."""
    from . import bench_compress
    from .harness import NetnsAgents

    data = bench_compress.default_data()
    for row in await asyncio.to_thread(bench_compress.run, data, 5 if quick else 20, 1.0):
        figs.add(row["figure"], row["value"], row["unit"], note=row.get("note", ""))
    if os.geteuid() != 0:
        print("# lz4 goodput through the agents left out: network namespaces need root", file=sys.stderr)
        return
    sample = (data / "kv_llama_tiny_bf16.bin").read_bytes()
    size = 16 * MiB if quick else 32 * MiB
    for mbit in (100, 1000):
        rates = {}
        for mode in ("off", "auto"):
            async with NetnsAgents(f"pddwc{mbit % 1000}", rate_bps=mbit * 1_000_000,
                                   transfer=f'compress = "{mode}"') as net:
                async with EngineClient(net.socket("A"), "a") as ea, EngineClient(net.socket("B"), "b") as eb:
                    src, dst = SharedMemory(size), SharedMemory(size)
                    try:
                        src.buf[:] = (sample * (size // len(sample) + 1))[:size]
                        ra = await ea.register(src, block_bytes=MiB)
                        rb = await eb.register(dst, block_bytes=MiB)
                        best = 0.0
                        for i in range(3):  # the first one teaches auto the ratio
                            t0 = time.perf_counter()
                            await eb.post_recv(f"c{i}", [rb.blocks(0, size // MiB)])
                            await ea.send_kv(f"c{i}", [ra.blocks(0, size // MiB)], to=["B"])
                            if not isinstance(await eb.wait(f"c{i}", timeout=120), p.KvReceived):
                                raise RuntimeError("compress bench transfer failed")
                            best = max(best, size / (time.perf_counter() - t0))
                            await ea.wait(f"c{i}", timeout=30)
                            await asyncio.sleep(0.3)  # a heartbeat: auto decides
                        rates[mode] = best
                    finally:
                        src.close()
                        dst.close()
        figs.add(f"lz4_agent_goodput_{mbit}Mbit", rates["auto"] * 8 / 1e9, "Gbit/s", "compress off",
                 rates["off"] * 8 / 1e9, note=f"bf16 KV (real sample), tbf {mbit} Mbit/s veth, transfer.compress "
                                               "auto vs off, best of 3")


async def _run(args) -> int:
    figs = Figures(args.json)
    groups = set(filter(None, args.only.split(","))) or set(GROUPS)
    if groups - set(GROUPS):
        print(f"unknown --only group(s): {', '.join(sorted(groups - set(GROUPS)))}; known: {', '.join(GROUPS)}",
              file=sys.stderr)
        return 2
    quick = args.quick
    base = None
    if "goodput" in groups:
        figs.step("goodput baselines: iperf3 and a bare Python pipe")
        base = bench_goodput.baselines(figs, quick)
    if "ucx" in groups:
        figs.step("ucx: bare ucxx, then two agents of one site")
        from . import bench_ucx_agents

        await bench_ucx_agents.add_figures(figs, quick)
    if "probe" in groups:
        figs.step("probe: the delay relay, then probes over a tbf-shaped veth")
        await _shaper_figures(figs)
        await _probe_figures(figs, quick)
    if "compress" in groups:
        figs.step("compress: lz4 on real KV, then through the agents")
        await _compress_figures(figs, quick)
    for group, (module, what) in _MODULE_GROUPS.items():
        if group in groups:
            figs.step(f"{group}: {what}")
            await importlib.import_module(f".{module}", __package__).add_figures(figs, quick)
    if "latency" in groups:
        figs.step("latency: what a bulk thread's writes cost its main loop")
        await asyncio.to_thread(importlib.import_module(".bench_gil", __package__).add_figures, figs, quick)
    if not groups & {"goodput", "latency", "handoff", "prefix"}:
        return 0
    async with AgentPair() as pair:
        async with EngineClient(pair.sockets["A"], "bench-A") as ea, EngineClient(pair.sockets["B"], "bench-B") as eb:
            if "goodput" in groups:
                figs.step("goodput: KV between two agents, interleaved with the bare pipe")
                await bench_goodput.goodput_figures(figs, pair, ea, eb, base, quick)
            if "latency" in groups:
                figs.step("latency: token IDs, idle and under load")
                await bench_goodput.latency_figures(figs, pair, ea, eb, quick)
            if "prefix" in groups:
                figs.step("prefix: the decode-side inventory")
                await _prefix_figures(figs, pair, ea, eb, quick)
            if "handoff" in groups:
                figs.step("handoff: one-shot and catch-up")
                async with EngineClient(pair.sockets["A"], "bench-RLD") as er:
                    for mode, name in (("one-shot", "oneshot"), ("catch-up", "catchup")):
                        ms, pos = await _handoff_latency(ea, er, eb, mode, 10 if quick else 30)
                        rtt = metric_value(pair.metrics("A"), "pddwire_control_rtt_seconds_sum", peer="B/b1") / max(
                            1, metric_value(pair.metrics("A"), "pddwire_control_rtt_seconds_count", peer="B/b1"))
                        figs.add(f"handoff_{name}_100_ms", statistics.median(ms), "ms",
                                 note=f"median of {len(ms)}, p90 {percentile(ms, 90):.2f} ms; MD 100 tokens behind at "
                                      f"ready, commit at {statistics.median(pos):.0f}; RLD 20 ms/token, extends "
                                      f"free; control RTT {rtt * 1e3:.2f} ms")
    return 0


def run_bench(args) -> int:
    import uvloop

    from pdd_wire import log

    # stdout is the figures only (a JSON line each with --json): log lines of the harness (the
    # network namespaces' "sites up") go to stderr; a group may lower the level for itself.
    log.configure("info", "console", stream=sys.stderr)
    return uvloop.run(_run(args))
