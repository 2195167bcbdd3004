"""``pdd-wire router`` P-RLD-MD with a one-shot handoff, over real ``vllm serve`` instances.

    client -> Router -> P   (vllm serve, kv_producer, node A/a1)  sends the KV to RLD and MD
                     -> RLD (vllm serve, kv_consumer, node A/a2)  streams at once
                     -> MD  (vllm serve, kv_consumer, prefix caching, node B/b1)

The agents' policy sends every request P-RLD-MD (a TTFT budget of 0). RLD streams; once MD
answers the prompt with P's KV (``max_tokens=1``), RLD is stopped at position m and MD continues
from the prompt and the m emitted tokens. The user's stream must be a single server's greedy
stream: every position once, in order, one id, one ending. ``handoff.min_rld_tokens`` and
``max_rld_tokens`` force the switch at chosen positions (0, inside a block, past a block).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from pdd_tools.vllm.serve import (
    VllmServer,
    complete,
    completion_body,
    connector_config,
    missing,
    tokens,
)
from pdd_wire.router import Router, loads
from support.agents import cluster_toml, free_port, run_agents
from test_router_vllm import prompt_for, sample
from test_vllm_serve import Cluster

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

N = 96  # tokens generated per request: room for a clean text boundary in the tiny model's output


class Pdd:
    def __init__(self, tmp: Path, agents: dict, P: VllmServer, RLD: VllmServer, MD: VllmServer,
                 http: aiohttp.ClientSession) -> None:
        self.tmp, self.agents, self.P, self.RLD, self.MD, self.http = tmp, agents, P, RLD, MD, http
        # Cluster.settled checks every agent and two vLLMs: one for RLD, one for MD.
        self._checks = [Cluster(tmp, agents, P, RLD, None, http), Cluster(tmp, agents, P, MD, None, http)]

    async def baseline(self, prompt: list[int], n: int = N) -> dict:
        """A single server's greedy answer (P, no KV transfer)."""
        return await complete(self.http, self.P.url, completion_body(prompt, n))

    async def settled(self) -> None:
        for c in self._checks:
            await c.settled()

    def router(self, *, pos: int | None = None, rld: str | None = None, **handoff) -> Router:
        """A router over P, RLD and MD; ``rld``: another RLD URL, named without site or node (P
        then sends the KV to MD only)."""
        rld_member = f'url = "{rld}"' if rld else f'url = "{self.RLD.url}"\nsite = "A"\nnode = "a2"'
        h = dict(handoff)
        if pos is not None:
            h |= {"min_rld_tokens": pos, "max_rld_tokens": pos}
        lines = "".join(f"{k} = {v}\n" for k, v in h.items())
        return Router(loads(f"""
[listen]
address = "127.0.0.1:0"
[[pools.P]]
url = "{self.P.url}"
engine_socket = "{self.tmp}/a1.sock"
site = "A"
node = "a1"
[[pools.RLD]]
{rld_member}
[[pools.MD]]
url = "{self.MD.url}"
site = "B"
node = "b1"
[handoff]
{lines}"""))


async def stream(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[list[dict], list[bytes]]:
    async with http.post(f"{url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        raw = (await r.read()).split(b"\n\n")
    assert raw[-1] == b"" and raw[-2] == b"data: [DONE]" and b"data: [DONE]" not in raw[:-2]
    return [json.loads(e[6:]) for e in raw[:-2]], raw


def check_one_stream(chunks: list[dict], base: dict, n: int = N) -> None:
    """One server's stream: the same tokens and text, one id, one ending, at the end."""
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or ()]
    assert ids == tokens(base)
    assert "".join(ch.get("text") or "" for c in chunks for ch in c["choices"]) == base["choices"][0]["text"]
    assert len({c["id"] for c in chunks}) == 1
    ends = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    assert ends == ["length"] and chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pdd():
    why = missing()
    if why:
        pytest.fail(f"the vLLM venv is needed for this test ({why}): run scripts/vllm-env", pytrace=False)
    tmp = Path(tempfile.mkdtemp(prefix="pdw-router-pdd-"))
    policy = "[policy.pipeline]\nttft_budget_s = 0\n"  # every request P-RLD-MD
    tomls = cluster_toml(tmp, [("A", "a1"), ("A", "a2"), ("B", "b1")], streams=2, extra=policy)
    servers: list[VllmServer] = []
    async with run_agents(tomls) as agents, aiohttp.ClientSession() as http:
        try:
            P = VllmServer("P", tmp / "P.log", cpu="0",
                           kv=connector_config("kv_producer", f"{tmp}/a1.sock", lease_s=30.0))
            RLD = VllmServer("RLD", tmp / "RLD.log", cpu="1", failure_policy="recompute",
                             kv=connector_config("kv_consumer", f"{tmp}/a2.sock", recv_slack_s=2.0))
            MD = VllmServer("MD", tmp / "MD.log", cpu="1", prefix_caching=True, failure_policy="recompute",
                            kv=connector_config("kv_consumer", f"{tmp}/b1.sock", recv_slack_s=2.0))
            servers = [P, RLD, MD]
            t0 = time.monotonic()
            await asyncio.gather(*(s.start() for s in servers))
            print(f"vLLM servers ready in {time.monotonic() - t0:.1f} s")
            yield Pdd(tmp, agents, P, RLD, MD, http)
        finally:
            await asyncio.gather(*(s.stop() for s in servers), return_exceptions=True)
            for s in servers:
                print(f"--- {s.name} log tail ---\n{s.tail(15)}")
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("pos", [0, 5, 40])
async def test_the_handoff_at_a_chosen_position_gives_one_servers_stream(pdd, pos):
    """Forced at position 0 (MD makes every token), 5 (inside the first block of output) and 40
    (past a block boundary of prompt + output) or the first clean text boundary after it (RLD's
    last 5 tokens each whole text; the tiny model's text is mostly byte tokens): the stream is a
    single server's."""
    prompt = prompt_for(pos + 1, 75)
    base = await pdd.baseline(prompt)
    wire_rld0, wire_md0 = await pdd.RLD.wire_tokens(pdd.http), await pdd.MD.wire_tokens(pdd.http)
    async with pdd.router(pos=pos) as router:
        chunks, _ = await stream(pdd.http, router.url, completion_body(prompt, N))
        check_one_stream(chunks, base)
        assert sample(router, "pddwire_router_pipeline_choices_total", pipeline="P-RLD-MD") == 1
        assert sample(router, "pddwire_router_handoffs_total", mode="one-shot", outcome="switched") == 1
        m = sample(router, "pddwire_router_output_tokens_total", pool="RLD")
        assert pos <= m < N
        assert sample(router, "pddwire_router_output_tokens_total", pool="MD") == N - m
        assert sample(router, "pddwire_router_handoff_stall_seconds_count", mode="one-shot") == 1
    # MD took the prompt's KV from the wire (P sent it to RLD and MD); RLD did too when it was
    # not stopped before its first token.
    assert await pdd.MD.wire_tokens(pdd.http) - wire_md0 == len(prompt)
    if m:
        assert await pdd.RLD.wire_tokens(pdd.http) - wire_rld0 == len(prompt)
    await pdd.settled()


async def test_token_ids_stay_out_of_the_stream_unless_asked(pdd):
    """The router asks RLD and MD for token ids (it continues from them); a client that did not
    ask gets the stream without them, as from vllm serve."""
    prompt = prompt_for(21, 60)
    base = await pdd.baseline(prompt)
    body = {k: v for k, v in completion_body(prompt, N).items() if k != "return_token_ids"}
    async with pdd.router(pos=7) as router:
        chunks, _ = await stream(pdd.http, router.url, body)
        assert sample(router, "pddwire_router_handoffs_total", outcome="switched") == 1
    assert all("token_ids" not in ch and "prompt_token_ids" not in ch for c in chunks for ch in c["choices"])
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == base["choices"][0]["text"]
    await pdd.settled()


async def test_unforced_handoffs_under_concurrency_give_the_single_server_streams(pdd):
    """No forcing: each request switches whenever MD holds its KV (or RLD finishes first). Six at
    once: every stream is the single server's, RLD's and MD's tokens add up."""
    prompts = [prompt_for(300 + i, 40 + 23 * i) for i in range(6)]
    bases = [await pdd.baseline(pr) for pr in prompts]
    async with pdd.router() as router:
        outs = await asyncio.gather(*(stream(pdd.http, router.url, completion_body(pr, N)) for pr in prompts))
        for (chunks, _), base in zip(outs, bases):
            check_one_stream(chunks, base)
        ended = {o: sample(router, "pddwire_router_handoffs_total", outcome=o)
                 for o in ("switched", "rld_finished", "md_failed", "md_not_ready")}
        assert ended["switched"] + ended["rld_finished"] == 6 and ended["md_failed"] == ended["md_not_ready"] == 0
        assert (sample(router, "pddwire_router_output_tokens_total", pool="RLD")
                + sample(router, "pddwire_router_output_tokens_total", pool="MD")) == 6 * N
    await pdd.settled()


async def test_requests_the_handoff_cannot_splice_run_p_md(pdd):
    """Not streamed: P-MD (fallback counted), the single server's answer."""
    prompt = prompt_for(22, 50)
    base = await pdd.baseline(prompt)
    async with pdd.router() as router:
        async with pdd.http.post(f"{router.url}/v1/completions", json=completion_body(prompt, N)) as r:
            assert tokens(await r.json()) == tokens(base)
        assert sample(router, "pddwire_router_fallbacks_total", kind="p_rld_md_not_streamed") == 1
        assert sample(router, "pddwire_router_output_tokens_total", pool="MD") == N
    await pdd.settled()


async def test_a_client_gone_mid_handoff_leaves_nothing_held(pdd):
    prompt = prompt_for(23, 80)
    async with pdd.router(pos=3) as router:
        body = completion_body(prompt, 400, stream=True)
        async with pdd.http.post(f"{router.url}/v1/completions", json=body) as r:
            assert r.status == 200
            got = 0
            async for _ in r.content.iter_any():
                got += 1
                if got >= 8:
                    break
            r.close()
        await pdd.settled()  # no request left in P, RLD or MD; nothing pinned at any agent
        async with asyncio.timeout(30):
            while sample(router, "pddwire_router_requests_total", outcome="client_gone") < 1:
                await asyncio.sleep(0.05)


async def test_rld_failing_before_its_first_token_leaves_the_output_to_md(pdd):
    """RLD refuses the connection: MD, once it holds the KV, makes every token (fallback
    ``rld_failed``); the stream is still a single server's."""
    prompt = prompt_for(24, 70)
    base = await pdd.baseline(prompt)
    async with pdd.router(rld=f"http://127.0.0.1:{free_port()}") as router:
        chunks, _ = await stream(pdd.http, router.url, completion_body(prompt, N))
        check_one_stream(chunks, base)
        assert sample(router, "pddwire_router_fallbacks_total", kind="rld_failed") == 1
        assert sample(router, "pddwire_router_handoffs_total", outcome="rld_failed") == 1
        assert sample(router, "pddwire_router_output_tokens_total", pool="RLD") == 0
        assert sample(router, "pddwire_router_output_tokens_total", pool="MD") == N
    await pdd.settled()


async def test_md_not_ready_in_time_leaves_the_request_on_rld(pdd):
    """MD cannot hold the KV within a 1 ms ``md_ready_s``: RLD keeps the request to its end,
    MD's request is closed (its receive cancelled), nothing is left anywhere."""
    prompt = prompt_for(25, 70)
    base = await pdd.baseline(prompt)
    async with pdd.router(md_ready_s=0.001) as router:
        chunks, _ = await stream(pdd.http, router.url, completion_body(prompt, N))
        check_one_stream(chunks, base)
        assert sample(router, "pddwire_router_fallbacks_total", kind="md_not_ready") == 1
        ended = {o: sample(router, "pddwire_router_handoffs_total", outcome=o)
                 for o in ("switched", "rld_finished", "md_not_ready")}
        assert ended == {"switched": 0, "rld_finished": 0, "md_not_ready": 1}
        assert sample(router, "pddwire_router_output_tokens_total", pool="RLD") == N
        assert sample(router, "pddwire_router_output_tokens_total", pool="MD") == 0
    await pdd.settled()


async def test_md_down_leaves_the_request_on_rld(pdd):
    """Last in this module: MD's server is stopped. MD's request fails before any switch, RLD
    keeps the request to its end (fallback ``md_failed``), the stream is a single server's. P's
    KV for MD waits out its lease (30 s) at the agents, then nothing is pinned anywhere."""
    prompt = prompt_for(26, 70)
    base = await pdd.baseline(prompt)
    await pdd.MD.stop()
    async with pdd.router() as router:
        chunks, _ = await stream(pdd.http, router.url, completion_body(prompt, N))
        check_one_stream(chunks, base)
        assert sample(router, "pddwire_router_fallbacks_total", kind="md_failed") == 1
        assert sample(router, "pddwire_router_handoffs_total", outcome="md_failed") == 1
        assert sample(router, "pddwire_router_output_tokens_total", pool="RLD") == N
    await pdd._checks[0].settled()  # every agent, P and RLD (MD is gone)
