"""What ``pdd-wire router`` adds to each streamed token, against ``vllm serve`` direct, in one run.

Two real agents (sites A and B, loopback), a prefill ``vllm serve`` (kv_producer) and a main
decode ``vllm serve`` (kv_consumer) on the tiny local Llama (``scripts/vllm-env``), and the router
in front. The same P-MD work is streamed two ways, alternating rounds:

- direct: the client asks P itself (``do_remote_decode``, ``max_tokens=1``) and streams MD's
  answer straight from MD;
- through the router: the same request to the router, which does the same and relays MD's SSE.

``router_handoff_stall_oneshot_p50_ms``/``_p99_ms`` and ``router_handoff_stall_catchup_p50_ms``/
``_p99_ms`` (``--only handoff``; a third ``vllm serve`` and agent): P-RLD-MD requests (the
agents' TTFT budget is 0) handed from RLD to MD, one-shot and catch-up (:func:`measure_handoff`);
the stall between RLD's last token and MD's first as the router measures it, against the time
per output token of the same streams.

``router_pdd_ttft_p50``/``_p99`` (``--only pdd``): ``scripts/demo --engine vllm`` at a smaller
scale, PDD's TTFT against plain PD's p50/p99 in the same run (:func:`measure_pdd`).

Per request, the time per output token after the first (first to last token arrival at the
client, over the tokens after the first; single gaps are not used: the client often reads several
events in one read, more so through a relay, which would make single gaps meaningless). Figure
``router_token_overhead_p99_ms``: the p99 of that through the router minus the p99 direct (what
the relay adds per token at the tail); its baseline is the direct p99 itself. Also
``router_token_overhead_p50_ms``. A 2-core machine shared with the engines: compare within the
run, not with real hardware.

    python -m pdd_tools.bench_router [--quick] [--json] [--only overhead|handoff|pdd]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import structlog.testing

from pdd_wire import config as cfgmod
from pdd_wire import log
from pdd_wire.agent import Agent
from pdd_wire.router import Router, loads
from pdd_wire.stats import percentile

from .bench_vllm import agent_toml, prompt_for
from .harness import free_port
from .vllm.serve import (
    BLOCK,
    VllmServer,
    complete,
    completion_body,
    connector_config,
    missing,
    running,
)

if TYPE_CHECKING:
    from .demo import DemoConfig, RunResult

OUT_TOKENS = 64
# Handoff: long enough that MD holds the KV before RLD is done (the tiny model decodes a token
# in about a millisecond); prompts of 48..96 tokens, within the servers' 512-token context.
HANDOFF_OUT_TOKENS = 384
CONCURRENCY = 4


async def _tpot(http: aiohttp.ClientSession, url: str, body: dict) -> float:
    """Seconds per streamed token after the first, of one request, at the client."""
    times: list[float] = []
    async with http.post(f"{url}/v1/completions", json={**body, "stream": True}) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status} from {url}: {await r.text()}")
        buf = b""
        async for chunk in r.content.iter_any():
            now = time.monotonic()
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                if ev.startswith(b"data: {"):
                    got = sum(len(c.get("token_ids") or []) for c in json.loads(ev[6:]).get("choices", []))
                    times += [now] * got
    return (times[-1] - times[0]) / (len(times) - 1)


async def _direct(http: aiohttp.ClientSession, P: str, MD: str, prompt: list[int]) -> float:
    pre = await complete(http, P, completion_body(prompt, 1, kv_transfer_params={"do_remote_decode": True}))
    return await _tpot(http, MD, completion_body(prompt, OUT_TOKENS, kv_transfer_params=pre["kv_transfer_params"]))


async def measure(quick: bool = False) -> list[dict]:
    why = missing()
    if why:
        raise SystemExit(f"bench_router needs the vLLM venv ({why}): run scripts/vllm-env")
    tmp = Path(tempfile.mkdtemp(prefix="pdw-bench-router-"))
    pa, pb = free_port(), free_port()
    agents = [Agent(cfgmod.loads(agent_toml(tmp, "A", "a1", pa, "B", "b1", pb))),
              Agent(cfgmod.loads(agent_toml(tmp, "B", "b1", pb, "A", "a1", pa)))]
    direct: list[float] = []  # per request: seconds per token after the first
    routed: list[float] = []
    P = VllmServer("P", tmp / "P.log", cpu="0", kv=connector_config("kv_producer", f"{tmp}/A.sock", send_to=["B"]))
    MD = VllmServer("MD", tmp / "MD.log", cpu="1", kv=connector_config("kv_consumer", f"{tmp}/B.sock"))
    async with running(tmp, agents, [P, MD]):
        cfg = loads(f'[listen]\naddress = "127.0.0.1:0"\n[[pools.P]]\nurl = "{P.url}"\n'
                    f'[[pools.MD]]\nurl = "{MD.url}"\n[choice]\nask_agent = false\n')
        async with aiohttp.ClientSession() as http, Router(cfg) as router:
            rounds = 3 if quick else 16
            for i in range(rounds + 1):  # round 0 warms both paths and is not counted
                prompts = [prompt_for(100 * i + j, 48 + 16 * j) for j in range(CONCURRENCY)]
                d = await asyncio.gather(*(_direct(http, P.url, MD.url, pr) for pr in prompts))
                r = await asyncio.gather(*(_tpot(http, router.url, completion_body(pr, OUT_TOKENS))
                                           for pr in prompts))
                if i:
                    direct += d
                    routed += r
    return overhead_rows(direct, routed)


def overhead_rows(direct: list[float], routed: list[float]) -> list[dict]:
    """The overhead figures from per-request seconds per token, direct and through the router:
    the router's percentile minus direct's, direct's as the baseline."""
    note = (f"{len(routed)} requests each way, {CONCURRENCY} concurrent streams of {OUT_TOKENS} tokens, "
            "P-MD both ways, rounds alternating")
    rows = []
    for q in (50, 99):
        dq, rq = percentile(direct, q) * 1e3, percentile(routed, q) * 1e3
        rows.append({"figure": f"router_token_overhead_p{q}_ms", "value": round(rq - dq, 3), "unit": "ms",
                     "baseline": f"direct p{q} time per output token", "baseline_value": round(dq, 3),
                     "note": f"p{q} time per output token through the router {rq:.3f} ms, direct {dq:.3f} ms; "
                             f"{note}"})
    return rows


def _three_nodes(tmp: Path) -> dict[str, str]:
    """Agents A/a1 (P), A/a2 (RLD) and B/b1 (MD), each a peer of the others, loopback TCP; A/a1
    chooses P-RLD-MD for every request (a TTFT budget of 0)."""
    nodes = [("A", "a1"), ("A", "a2"), ("B", "b1")]
    ports = {n: free_port() for _, n in nodes}
    out = {}
    for site, node in nodes:
        peers = "".join(f'[[peers]]\nsite = "{s}"\nnode = "{n}"\naddress = "127.0.0.1:{ports[n]}"\nstreams = 2\n'
                        for s, n in nodes if n != node)
        out[node] = (f'site = "{site}"\nnode = "{node}"\n[listen]\nwan = "127.0.0.1:{ports[node]}"\n'
                     f'admin = "127.0.0.1:0"\nengine_socket = "{tmp}/{node}.sock"\n{peers}'
                     f"[transfer]\nchunk_bytes = 262144\n[policy.pipeline]\nttft_budget_s = 0\n")
    return out


MODES = ("one-shot", "catch-up")
HANDOFF_AT = 96  # RLD emits at least this many before MD may take over, in both modes


async def measure_handoff(quick: bool = False) -> list[dict]:
    """P-RLD-MD handoffs, one-shot and catch-up (each forced: one router per mode on the same
    servers, rounds alternating): the stall between RLD's last token and MD's first, as the router
    measures it, against the time per output token of the same streams. RLD emits at least
    ``HANDOFF_AT`` tokens in both modes: one-shot then has MD extend over all of them, catch-up
    absorbs them in rounds first (whole blocks) and switches once at most
    ``catchup_gap_tokens`` (64) are left."""
    why = missing()
    if why:
        raise SystemExit(f"bench_router needs the vLLM venv ({why}): run scripts/vllm-env")
    tmp = Path(tempfile.mkdtemp(prefix="pdw-bench-handoff-"))
    agents = [Agent(cfgmod.loads(t)) for t in _three_nodes(tmp).values()]
    tpot: dict[str, list[float]] = {m: [] for m in MODES}
    P = VllmServer("P", tmp / "P.log", cpu="0", kv=connector_config("kv_producer", f"{tmp}/a1.sock"))
    RLD = VllmServer("RLD", tmp / "RLD.log", cpu="1", kv=connector_config("kv_consumer", f"{tmp}/a2.sock"))
    MD = VllmServer("MD", tmp / "MD.log", cpu="1", prefix_caching=True,
                    kv=connector_config("kv_consumer", f"{tmp}/b1.sock"))
    async with running(tmp, agents, [P, RLD, MD]):
        def cfg(mode: str):
            return loads(f'[listen]\naddress = "127.0.0.1:0"\n'
                         f'[[pools.P]]\nurl = "{P.url}"\nengine_socket = "{tmp}/a1.sock"\nsite = "A"\nnode = "a1"\n'
                         f'[[pools.RLD]]\nurl = "{RLD.url}"\nsite = "A"\nnode = "a2"\n'
                         f'[[pools.MD]]\nurl = "{MD.url}"\nsite = "B"\nnode = "b1"\n'
                         f"[choice]\nblock_tokens = {BLOCK}\n"
                         f'[handoff]\nmode = "{mode}"\nmin_rld_tokens = {HANDOFF_AT}\n')

        async with aiohttp.ClientSession() as http, Router(cfg("one-shot")) as one, \
                Router(cfg("catch-up")) as catch:
            routers = {"one-shot": one, "catch-up": catch}
            rounds = 3 if quick else 12
            with structlog.testing.capture_logs() as logs:
                for i in range(rounds + 1):  # round 0 warms every path and is not counted
                    for mode, router in routers.items():
                        prompts = [prompt_for(500 + 100 * i + j, 48 + 16 * j) for j in range(CONCURRENCY)]
                        n0 = len(logs)
                        r = await asyncio.gather(*(_tpot(http, router.url, completion_body(pr, HANDOFF_OUT_TOKENS))
                                                   for pr in prompts))
                        if i:
                            tpot[mode] += r
                        else:
                            del logs[n0:]
            switched = {m: sample_total(r, "pddwire_router_handoffs_total", outcome="switched", mode=m)
                        for m, r in routers.items()}
    return stall_rows(logs, tpot, switched)


def stall_rows(logs: list[dict], tpot: dict[str, list[float]], switched: dict[str, float]) -> list[dict]:
    """The handoff-stall figures per mode from the router's ``router_handoff_stall`` log events
    (planned switches only: after RLD failed, MD's receive of the KV is in the stall too),
    against the p50/p99 time per output token of the same streams."""
    events = [e for e in logs if e.get("event") == "router_handoff_stall" and e.get("outcome") == "switched"]
    stalls = {m: [e["stall_ms"] for e in events if e.get("mode") == m] for m in MODES}
    rounds_seen = [e.get("rounds") or 0 for e in events if e.get("mode") == "catch-up"]
    rows = []
    for mode in MODES:
        if not stalls[mode]:
            raise SystemExit(f"bench_router: no request was handed over {mode} (RLD finished every one first)")
        note = (f"{len(stalls[mode])} {mode} handoffs of {len(tpot[mode])} requests ({int(switched[mode])} switched "
                f"in all, warm-up included); {CONCURRENCY} concurrent streams of {HANDOFF_OUT_TOKENS} tokens, "
                f"P-RLD-MD, handoff.mode forced, RLD emits at least {HANDOFF_AT}; rounds alternating with the "
                "other mode")
        if mode == "catch-up" and rounds_seen:
            note += f"; absorb rounds per switch: {min(rounds_seen)}-{max(rounds_seen)}"
        name = mode.replace("-", "")
        for q in (50, 99):
            sq, tq = percentile(stalls[mode], q), percentile(tpot[mode], q) * 1e3
            rows.append({"figure": f"router_handoff_stall_{name}_p{q}_ms", "value": round(sq, 3), "unit": "ms",
                         "baseline": f"p{q} time per output token", "baseline_value": round(tq, 3),
                         "note": f"RLD's last token to MD's first at the router; {note}"})
    return rows


async def measure_pdd(quick: bool = False) -> list[dict]:
    """``router_pdd_ttft_p99`` (and p50): ``scripts/demo --engine vllm``'s two runs at a smaller
    scale (the same stack, trace shape and link; fewer requests), PDD's TTFT against plain PD's
    in the same run."""
    from .demo import DemoConfig, tiny, vllm_runner

    n = 16 if quick else 40
    with tempfile.TemporaryDirectory(prefix="pdw-bench-pdd-") as tmp:
        cfg = DemoConfig(engine="vllm", out=tmp, requests=n, rate=tiny.RATE, seed=1, link_mbit=tiny.LINK_MBIT,
                         rtt_ms=tiny.RTT_MS, prefix="pddvb", ttft_budget_s=tiny.TTFT_BUDGET_S, quiet=True)
        figures, results = await vllm_runner.run(cfg)
    return pdd_rows(figures, results, cfg)


def pdd_rows(figures: dict, results: dict[str, RunResult], cfg: DemoConfig) -> list[dict]:
    """``router_pdd_ttft_p50``/``_p99`` from the demo's two runs (its ``figures.json`` shape):
    PDD's TTFT, plain PD's of the same run as the baseline; a run with a failure (a mismatch with
    the single server's tokens, an error) gives no figure."""
    failures = [f for r in results.values() for f in r.failures]
    if failures:
        raise SystemExit(f"bench_router: the demo run failed: {failures[:3]}")
    pd, pdd = figures["pd"], figures["pdd"]
    note = (f"scripts/demo --engine vllm --requests {cfg.requests}: {cfg.requests} requests of the trace each run, "
            f"WAN {cfg.link_mbit:g} Mbit/s RTT {cfg.rtt_ms:g} ms ({figures['link']['where']}); PDD pipelines "
            + ", ".join(f"{k} {v}" for k, v in pdd["pipelines"].items())
            + f", handoffs {pdd['handoffs']}, RLD's share {pdd['rld_share']}; tokens = one server's in both runs")
    return [{"figure": f"router_pdd_ttft_{q}", "value": pdd[f"ttft_{q}_s"], "unit": "s",
             "baseline": f"plain PD (P-MD only) TTFT {q}, same stack and trace", "baseline_value": pd[f"ttft_{q}_s"],
             "note": note} for q in ("p50", "p99")]


def sample_total(router: Router, name: str, **labels) -> float:
    return sum(s.value for m in router.metrics.registry.collect() for s in m.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def add_figures(figs, quick: bool) -> None:
    """``scripts/bench --only router`` (needs the vLLM venv that scripts/vllm-env builds)."""
    why = missing()
    if why:
        print(f"# router figures left out: {why} (run scripts/vllm-env)", file=sys.stderr, flush=True)
        return
    # The agents and the router run in this process: their logs go to stderr, never into the
    # figures on stdout (--json); info, for the handoff stalls read from the router's log lines.
    log.configure("info", "console", stream=sys.stderr)
    for measurement in (measure, measure_handoff, measure_pdd):  # each one's figures as it ends
        for row in await measurement(quick):
            figs.add(row["figure"], row["value"], row["unit"], row.get("baseline"), row.get("baseline_value"),
                     note=row.get("note", ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds instead of 16")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    ap.add_argument("--only", choices=("overhead", "handoff", "pdd"), help="one of the three measurements")
    args = ap.parse_args(argv)
    log.configure("info", "console", stream=sys.stderr)  # stdout: the figures only
    rows = []
    if args.only in (None, "overhead"):
        rows += asyncio.run(measure(args.quick))
    if args.only in (None, "handoff"):
        rows += asyncio.run(measure_handoff(args.quick))
    if args.only in (None, "pdd"):
        rows += asyncio.run(measure_pdd(args.quick))
    for r in rows:
        if r.get("baseline_value"):
            r["ratio"] = round(r["value"] / r["baseline_value"], 3)
    if args.json:
        print(json.dumps({r["figure"]: {k: v for k, v in r.items() if k != "figure"} for r in rows}, indent=1))
    else:
        for r in rows:
            print(f"{r['figure']:32} {r['value']:>9} {r['unit']:3} {r['note']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
