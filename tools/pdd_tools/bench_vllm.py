"""vLLM P -> D through pdd-wire against one vLLM server, in the same run (figures, not tests).

Two real agents (sites A and B, loopback TCP), a prefill ``vllm serve`` (kv_producer) and a decode
``vllm serve`` (kv_consumer, prefix caching) with PddWireConnector, the tiny local Llama of the
vLLM venv (``scripts/vllm-env``), and a stock P/D proxy (pdd_tools/vllm/serve.py). Figures:

- ``vllm_single_ttft_p50`` / ``vllm_single_output_tokens_per_s``: 32 concurrent streamed requests
  to one server (the prefill server, asked without KV transfer);
- ``vllm_pd_ttft_p50`` / ``vllm_pd_output_tokens_per_s``: the same 32 through the proxy (prefill,
  KV over the agents, decode streams);
- ``vllm_drc_wan_bytes_reduction``: turn 2 of 8 two-turn conversations, whole prompts' KV bytes
  over the KV bytes that crossed (decode's prefix cache holds turn 1).

On a 2-core machine both engines share the cores with the client: the figures compare the two
setups in one run; they say nothing about real hardware.

    python -m pdd_tools.bench_vllm [--quick] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from pdd_wire import config as cfgmod
from pdd_wire.agent import Agent

from .harness import free_port
from .vllm.serve import (
    BLOCK,
    VOCAB,
    Proxy,
    VllmServer,
    complete,
    completion_body,
    connector_config,
    missing,
    running,
    tokens,
    vllm_session,
)

CONCURRENCY = 32
OUT_TOKENS = 64
KV_BYTES_PER_BLOCK = 2 * 2 * BLOCK * 64 * 4  # tiny Llama: 2 layers x [2 heads, 32 tokens, 2x32] fp32


def agent_toml(tmp: Path, site: str, node: str, port: int, other: str, onode: str, oport: int) -> str:
    return f"""
site = "{site}"
node = "{node}"
[listen]
wan = "127.0.0.1:{port}"
admin = "127.0.0.1:0"
engine_socket = "{tmp}/{site}.sock"
[[peers]]
site = "{other}"
node = "{onode}"
address = "127.0.0.1:{oport}"
streams = 2
[transfer]
chunk_bytes = 262144
"""


def prompt_for(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


async def streamed(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, output tokens) of one streamed greedy completion."""
    body = completion_body(prompt, OUT_TOKENS, stream=True)
    t0 = time.monotonic()
    ttft, n = None, 0
    async with http.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status} from {url}: {await r.text()}")
        async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            got = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
            if got and ttft is None:
                ttft = time.monotonic() - t0
            n += got
    return ttft if ttft is not None else float("nan"), n


async def load(http: aiohttp.ClientSession, url: str, prompts: list[list[int]]) -> tuple[float, float]:
    """(median TTFT, output tokens per second) of the prompts, all at once."""
    t0 = time.monotonic()
    res = await asyncio.gather(*(streamed(http, url, pr) for pr in prompts))
    wall = time.monotonic() - t0
    return statistics.median(r[0] for r in res), sum(r[1] for r in res) / wall


async def run(quick: bool = False) -> dict:
    why = missing()
    if why:
        raise SystemExit(f"bench_vllm needs the vLLM venv ({why}): run scripts/vllm-env")
    tmp = Path(tempfile.mkdtemp(prefix="pdw-bench-vllm-"))
    pa, pb = free_port(), free_port()
    agents = [Agent(cfgmod.loads(agent_toml(tmp, "A", "a1", pa, "B", "b1", pb))),
              Agent(cfgmod.loads(agent_toml(tmp, "B", "b1", pb, "A", "a1", pa)))]
    figures: dict = {}
    P = VllmServer("P", tmp / "P.log", cpu="0",
                   kv=connector_config("kv_producer", f"{tmp}/A.sock", send_to=["B"]))
    D = VllmServer("D", tmp / "D.log", cpu="1", prefix_caching=True, failure_policy="recompute",
                   kv=connector_config("kv_consumer", f"{tmp}/B.sock"))
    async with running(tmp, agents, [P, D]):
        n = 8 if quick else CONCURRENCY
        prompts = [prompt_for(i, 64 + 8 * (i % 8)) for i in range(n)]
        async with vllm_session() as http, Proxy(P.url, D.url) as proxy:
            await load(http, P.url, prompts[:2])  # warm both paths once
            await load(http, proxy.url, prompts[:2])
            ttft1, tps1 = await load(http, P.url, prompts)
            ttft2, tps2 = await load(http, proxy.url, prompts)
            figures |= {"vllm_single_ttft_p50": round(ttft1, 4), "vllm_single_output_tokens_per_s": round(tps1, 1),
                        "vllm_pd_ttft_p50": round(ttft2, 4), "vllm_pd_output_tokens_per_s": round(tps2, 1),
                        "vllm_concurrency": n}
            # DRC: the second turns of two-turn conversations.
            B = agents[1]
            whole = crossed = 0
            for c in range(2 if quick else 8):
                turn1 = prompt_for(1000 + c, 70)
                out1 = await complete(http, proxy.url, completion_body(turn1, 32))
                turn2 = turn1 + tokens(out1) + prompt_for(2000 + c, 40)
                rx0 = B.metrics.registry.get_sample_value(
                    "pddwire_bytes_total", {"peer": "A/a1", "lane": "bulk", "direction": "rx"}) or 0.0
                await complete(http, proxy.url, completion_body(turn2, 32))
                rx = (B.metrics.registry.get_sample_value(
                    "pddwire_bytes_total", {"peer": "A/a1", "lane": "bulk", "direction": "rx"}) or 0.0) - rx0
                whole += math.ceil(len(turn2) / BLOCK) * KV_BYTES_PER_BLOCK
                crossed += rx
            figures["vllm_drc_wan_bytes_reduction"] = round(whole / crossed, 3) if crossed else None
    return figures


async def add_figures(figs, quick: bool) -> None:
    """``scripts/bench --only vllm``: :func:`run`'s figures with their baselines (needs the vLLM
    venv that scripts/vllm-env builds)."""
    why = missing()
    if why:
        print(f"# vllm figures left out: {why} (run scripts/vllm-env)", file=sys.stderr, flush=True)
        return
    f = await run(quick)
    n = f["vllm_concurrency"]
    figs.add("vllm_pd_ttft_p50", f["vllm_pd_ttft_p50"], "s", "one vllm serve", f["vllm_single_ttft_p50"],
             note=f"{n} concurrent streamed requests through a stock P/D proxy; both engines share 2 cores here")
    figs.add("vllm_pd_output_tokens_per_s", f["vllm_pd_output_tokens_per_s"], "tok/s", "one vllm serve",
             f["vllm_single_output_tokens_per_s"], note=f"{n} concurrent, the same prompts")
    if f.get("vllm_drc_wan_bytes_reduction") is not None:
        figs.add("vllm_drc_wan_bytes_reduction", f["vllm_drc_wan_bytes_reduction"], "x",
                 note="second turns of two-turn conversations: whole prompts' KV bytes / KV bytes that crossed")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 requests, 2 conversations")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    args = ap.parse_args(argv)
    figures = asyncio.run(run(args.quick))
    if args.json:
        print(json.dumps(figures))
    else:
        for k, v in figures.items():
            print(f"{k} {v}")


if __name__ == "__main__":
    main()
