"""A site's engines, in a process of their own (``python -m pdd_tools.demo --site-engines SPEC``):
the simulated engines of that site's nodes, driven over stdin/stdout by the demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path

from .config import MD_PEER, RLD_PEER, MiB


async def connect_engine(path: str, name: str, timeout: float = 30.0):
    from pdd_wire.engine.client import EngineClient
    from pdd_wire.errors import TransportError

    deadline = time.monotonic() + timeout
    while True:
        try:
            return await EngineClient(path, name).connect()
        except TransportError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def peers_up(clients, timeout: float = 40.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        ok = True
        for c in clients:
            st = await c.status()
            ok &= all(p["up"] and (p["bulk_streams_up"] == p["bulk_streams"] or p["data_path"] == "ucx")
                      for p in st["peers"])
        if ok:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the agents' peers are not up after {timeout:.0f} s")
        await asyncio.sleep(0.1)


def agent_samples(admin: str) -> list:
    """An agent's metrics (its admin ``host:port``), as prometheus_client samples."""
    import urllib.request

    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=5) as r:
        return samples_of(r.read().decode())


def samples_of(text: str) -> list:
    from prometheus_client.parser import text_string_to_metric_families

    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def site_figures(samples: list, site: str) -> dict:
    """WAN bytes (this node and peers of the other site), KV bytes sent there, and the handoff
    and pipeline counters, from one agent's metrics."""
    out: dict = {"wan_bytes": 0, "wan_kv_bytes_tx": 0, "wan_bytes_tx": 0, "handoff_modes": {}, "handoffs": {},
                 "pipelines": {}}
    for s in samples:
        peer = s.labels.get("peer", "")
        if s.name == "pddwire_bytes_total" and peer and not peer.startswith(f"{site}/"):
            out["wan_bytes"] += int(s.value)
            if s.labels.get("direction") == "tx":
                out["wan_bytes_tx"] += int(s.value)
                if s.labels.get("lane") == "bulk":
                    out["wan_kv_bytes_tx"] += int(s.value)
        elif s.name == "pddwire_handoff_modes_total" and s.value:
            out["handoff_modes"][f"{s.labels['mode']}/{s.labels['reason']}"] = int(s.value)
        elif s.name == "pddwire_handoffs_total" and s.value:
            key = f"{s.labels['role']}:{s.labels['mode']}/{s.labels['reason']}"
            out["handoffs"][key] = int(s.value)
        elif s.name == "pddwire_pipeline_choices_total" and s.value:
            out["pipelines"][f"{s.labels['pipeline']}/{s.labels['reason']}"] = int(s.value)
    return out


class _Out:
    def __init__(self) -> None:
        self.f = sys.stdout.buffer

    def send(self, msg: dict) -> None:
        self.f.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
        self.f.flush()


async def _site_main(spec: dict) -> int:
    from ..sim import BLOCK_TOKENS, GPU_A, GPU_B, DecodeSim, KvPool, PrefillSim

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=16 * MiB)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = _Out()
    site, kvb = spec["site"], spec["kv_bytes_per_token"]
    block = kvb * BLOCK_TOKENS
    nodes = spec["nodes"]
    clients, pools, engines = [], [], []
    tasks: set[asyncio.Task] = set()
    watch = None
    try:
        if site == "A":
            pc = await connect_engine(nodes["P"]["socket"], "prefill-sim")
            rc = await connect_engine(nodes["RLD"]["socket"], "rld-sim")
            clients += [pc, rc]
            pp = KvPool(spec["pool_mib"]["P"] * MiB, block, "prefill-kv")
            rp = KvPool(spec["pool_mib"]["RLD"] * MiB, block, "rld-kv")
            pools += [pp, rp]
            prefill = await PrefillSim(pc, pp, GPU_A, kv_bytes_per_token=kvb).start()
            rld = await DecodeSim(rc, rp, GPU_A, role="RLD", peer=MD_PEER, kv_from="A",
                                  kv_bytes_per_token=kvb).start()
            engines += [prefill, rld]
        else:
            mc = await connect_engine(nodes["MD"]["socket"], "md-sim")
            clients.append(mc)
            mp = KvPool(spec["pool_mib"]["MD"] * MiB, block, "md-kv")
            pools.append(mp)
            md = await DecodeSim(mc, mp, GPU_B, role="MD", peer=RLD_PEER, kv_from="A", kv_bytes_per_token=kvb).start()
            engines.append(md)
        await peers_up(clients)
        out.send({"ev": "ready"})

        async def serve_a(cmd: dict) -> None:
            rid, pipe = cmd["request_id"], cmd["pipeline"]
            seq = None
            if pipe in ("P-RLD-MD", "P-RLD"):
                seq = await rld.submit(rid, cmd["n"], cmd["kv_tokens"], handoff=pipe == "P-RLD-MD")
            to = {"P-MD": [MD_PEER], "P-RLD-MD": [RLD_PEER, MD_PEER], "P-RLD": [RLD_PEER]}[pipe]
            job = prefill.submit(rid, cmd["kv_tokens"], to)
            await job.done
            out.send({"ev": "prefill", "request_id": rid, "submitted_at": job.submitted_at,
                      "started_at": job.started_at, "computed_at": job.computed_at, "done_at": job.done_at,
                      "sent": job.sent, "failed": job.failed})
            if seq is not None:
                await seq.result
                out.send({"ev": "done", "side": "RLD", **rld.result_of(seq)})

        async def serve_b(cmd: dict) -> None:
            seq = await md.submit(cmd["request_id"], cmd["n"], cmd["kv_tokens"], handoff=cmd["pipeline"] == "P-RLD-MD")
            await seq.result
            out.send({"ev": "done", "side": "MD", **md.result_of(seq)})

        async def serve(cmd: dict) -> None:
            try:
                await (serve_a if site == "A" else serve_b)(cmd)
            except Exception as exc:  # reported, the run goes on
                out.send({"ev": "error", "request_id": cmd["request_id"], "side": "RLD" if site == "A" else "MD",
                          "error": f"{type(exc).__name__}: {exc}"})

        # An engine connection that ends (its agent died) ends this process: the demo sees it at once.
        watch = asyncio.ensure_future(asyncio.wait([e.events_task for e in engines],
                                                   return_when=asyncio.FIRST_COMPLETED))
        while True:
            next_line = asyncio.ensure_future(reader.readline())
            await asyncio.wait({next_line, watch}, return_when=asyncio.FIRST_COMPLETED)
            if watch.done():
                next_line.cancel()
                dead = [e for e in engines if e.events_task.done()]
                why = [repr(e.events_task.exception()) if not e.events_task.cancelled() else "cancelled"
                       for e in dead]
                print(f"site {site}: an engine lost its agent: {why}", file=sys.stderr)
                return 1
            line = next_line.result()
            if not line:
                return 0
            cmd = json.loads(line)
            if cmd["op"] == "req":
                t = asyncio.create_task(serve(cmd))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            elif cmd["op"] == "finish":
                break
        figures = {}
        for role, n in nodes.items():
            samples = await asyncio.to_thread(agent_samples, n["admin"])
            figures[role] = site_figures(samples, site)
        eng = {}
        for e, pool in zip(engines, pools):
            name = "P" if isinstance(e, PrefillSim) else e.role
            d = {"busy_s": round(e.busy_s, 3), "pool_peak_mib": round(pool.peak_used * pool.block_bytes / MiB, 1),
                 "errors": e.errors}
            if isinstance(e, DecodeSim):
                d.update(steps=e.steps, tokens_generated=e.tokens_generated, max_batch=e.max_batch_seen,
                         mean_batch=round(e.batch_sum / e.steps, 2) if e.steps else 0, load_reports=e.load_reports)
            eng[name] = d
        out.send({"ev": "stats", "site": site, "agents": figures, "engines": eng})
        return 0
    finally:
        for t in (*tasks, *([watch] if watch is not None else [])):
            t.cancel()
        await asyncio.gather(*tasks, *([watch] if watch is not None else []), return_exceptions=True)
        for e in engines:
            await e.close()
        for c in clients:
            await c.close()
        for pool in pools:
            pool.close()


def main(argv: list[str]) -> int:
    from pdd_wire import log

    ap = argparse.ArgumentParser(prog="python -m pdd_tools.demo")
    ap.add_argument("--site-engines", required=True, metavar="SPEC", help="JSON spec written by the demo")
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.site_engines).read_text())
    log.configure("warning", "console")
    import uvloop

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        return uvloop.run(_site_main(spec))
    except (KeyboardInterrupt, SystemExit):
        return 0
