"""What ``pdd-wire router`` adds to each streamed token, against ``vllm serve`` direct, in one run.

Two real agents (sites A and B, loopback), a prefill ``vllm serve`` (kv_producer) and a main
decode ``vllm serve`` (kv_consumer) on the tiny local Llama (``scripts/vllm-env``), and the router
in front. The same P-MD work is streamed two ways, alternating rounds:

- direct: the client asks P itself (``do_remote_decode``, ``max_tokens=1``) and streams MD's
  answer straight from MD;
- through the router: the same request to the router, which does the same and relays MD's SSE.

Per request, the time per output token after the first (first to last token arrival at the
client, over the tokens after the first; single gaps are not used: the client often reads several
events in one read, more so through a relay, which would make single gaps meaningless). Figure
``router_token_overhead_p99_ms``: the p99 of that through the router minus the p99 direct (what
the relay adds per token at the tail); its baseline is the direct p99 itself. Also
``router_token_overhead_p50_ms``. A 2-core machine shared with the engines: compare within the
run, not with real hardware.

    python -m pdd_tools.bench_router [--quick] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from pdd_wire import config as cfgmod
from pdd_wire import log
from pdd_wire.agent import Agent
from pdd_wire.router import Router, loads

from .bench_vllm import agent_toml, prompt_for
from .vllm.serve import (
    VllmServer,
    complete,
    completion_body,
    connector_config,
    free_port,
    missing,
)

OUT_TOKENS = 64
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


def _p(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


async def measure(quick: bool = False) -> list[dict]:
    why = missing()
    if why:
        raise SystemExit(f"bench_router needs the vLLM venv ({why}): run scripts/vllm-env")
    tmp = Path(tempfile.mkdtemp(prefix="pdw-bench-router-"))
    pa, pb = free_port(), free_port()
    agents = [Agent(cfgmod.loads(agent_toml(tmp, "A", "a1", pa, "B", "b1", pb))),
              Agent(cfgmod.loads(agent_toml(tmp, "B", "b1", pb, "A", "a1", pa)))]
    servers: list[VllmServer] = []
    direct: list[float] = []  # per request: seconds per token after the first
    routed: list[float] = []
    try:
        for a in agents:
            await a.start()
        P = VllmServer("P", tmp / "P.log", cpu="0", kv=connector_config("kv_producer", f"{tmp}/A.sock", send_to=["B"]))
        MD = VllmServer("MD", tmp / "MD.log", cpu="1", kv=connector_config("kv_consumer", f"{tmp}/B.sock"))
        servers = [P, MD]
        await asyncio.gather(*(s.start() for s in servers))
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
    finally:
        await asyncio.gather(*(s.stop() for s in servers), return_exceptions=True)
        for a in agents:
            await a.shutdown(0)
        shutil.rmtree(tmp, ignore_errors=True)
    note = (f"{len(routed)} requests each way, {CONCURRENCY} concurrent streams of {OUT_TOKENS} tokens, "
            "P-MD both ways, rounds alternating")
    rows = []
    for q in (50, 99):
        dq, rq = _p(direct, q) * 1e3, _p(routed, q) * 1e3
        rows.append({"figure": f"router_token_overhead_p{q}_ms", "value": round(rq - dq, 3), "unit": "ms",
                     "baseline": f"direct p{q} time per output token", "baseline_value": round(dq, 3),
                     "note": f"p{q} time per output token through the router {rq:.3f} ms, direct {dq:.3f} ms; "
                             f"{note}"})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds instead of 16")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    args = ap.parse_args(argv)
    log.configure("warning", "console", stream=sys.stderr)  # stdout: the figures only
    rows = asyncio.run(measure(args.quick))
    if args.json:
        print(json.dumps({r["figure"]: {k: v for k, v in r.items() if k != "figure"} for r in rows}, indent=1))
    else:
        for r in rows:
            print(f"{r['figure']:32} {r['value']:>9} {r['unit']:3} {r['note']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
