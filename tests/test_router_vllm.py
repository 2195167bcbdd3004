"""``pdd-wire router`` in front of real ``vllm serve`` instances: P-MD.

    client -> Router -> P  (vllm serve, kv_producer) -> agent A
                     -> MD (vllm serve, kv_consumer, prefix caching) -> agent B

Requests are sent to the router exactly as to ``vllm serve``; every output is compared, token id
for token id (chat: text), with the greedy output of a single server (P, asked directly without
KV transfer), and vLLM's own count of prompt tokens taken from the connector shows that MD's
prompt came over the wire. After each test nothing is held: no blocks pinned by either agent, no
request or KV block in either vLLM (``Cluster.settled`` of tests/test_vllm_serve.py).
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import pytest_asyncio

from conftest import metric
from pdd_tools.vllm.serve import (
    BLOCK,
    VOCAB,
    VllmServer,
    complete,
    completion_body,
    connector_config,
    missing,
    tokens,
    vllm_session,
)
from pdd_wire.router import Router, loads
from support.agents import BESIDE_VLLM_DEAD_AFTER_S, run_agents, two_site_toml
from test_vllm_serve import NICE, Cluster, settles_after_each_test

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

N = 24  # tokens generated per request
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def prompt_for(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def router_toml(P: VllmServer, MD: VllmServer, tmp: Path, *, deadline_s: float = 120.0,
                prefill_lease_s: float | None = None) -> str:
    lease = "" if prefill_lease_s is None else f"prefill_lease_s = {prefill_lease_s}\n"
    return f"""
[listen]
address = "127.0.0.1:0"
[request]
deadline_s = {deadline_s}
{lease}[[pools.P]]
url = "{P.url}"
engine_socket = "{tmp}/A.sock"
site = "A"
[[pools.MD]]
url = "{MD.url}"
engine_socket = "{tmp}/B.sock"
site = "B"
[choice]
kv_bytes_per_token = 1024
block_tokens = {BLOCK}
prefix_salt = "tiny-llama/torch.float32"
timeout_s = 10
"""


def sample(router: Router, name: str, **labels) -> float:
    """A router metric's sample, summed over the labels not given."""
    return sum(s.value for m in router.metrics.registry.collect() for s in m.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def counted_by_label(router: Router, *names: str) -> dict:
    """Every non-zero sample of these router counters, by labels: what an assertion on one of
    them shows when it fails (which mode, reason or fallback was counted instead)."""
    return {f"{s.name}{s.labels}": s.value for m in router.metrics.registry.collect() for s in m.samples
            if s.name in names and s.value}


class RouterCluster(Cluster):
    router: Router

    def sample(self, name: str, **labels) -> float:
        return sample(self.router, name, **labels)

    async def via_router(self, body: dict, path: str = "/v1/completions") -> dict:
        async with self.http.post(f"{self.router.url}{path}", json=body) as r:
            data = await r.json(content_type=None)
            assert r.status == 200, data
            return data

    async def stream(self, url: str, body: dict, path: str = "/v1/completions") -> tuple[list[dict], list[bytes]]:
        """A streamed request: its chunks (decoded) and its raw SSE events."""
        async with self.http.post(f"{url}{path}", json={**body, "stream": True}) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            raw = (await r.read()).split(b"\n\n")
        assert raw[-1] == b"" and raw[-2] == b"data: [DONE]"
        events = [e for e in raw if e]
        return [json.loads(e[6:]) for e in events[:-1]], events


def stream_tokens(chunks: list[dict]) -> list[int]:
    return [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or ()]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    why = missing()
    if why:
        pytest.fail(f"the vLLM venv is needed for this test ({why}): run scripts/vllm-env", pytrace=False)
    tmp = Path(tempfile.mkdtemp(prefix="pdw-router-"))
    (tmp / "chat.jinja").write_text(CHAT_TEMPLATE)
    # The agents' pipeline policy: P-MD while the KV crosses within 5 s; the anomalous-traffic
    # filter takes prompts of 250 tokens or more with under 8 output tokens (scaled to the tiny model).
    policy = "[policy.pipeline]\nttft_budget_s = 5\nanomaly_min_input_tokens = 250\nanomaly_max_output_tokens = 8\n"
    tomls = two_site_toml(tmp, streams=2, chunk=64 << 10, extra=policy, dead_after_s=BESIDE_VLLM_DEAD_AFTER_S)
    servers: list[VllmServer] = []
    async with run_agents(tomls) as agents, vllm_session() as http:
        try:
            P = VllmServer("P", tmp / "P.log", cpu="0", nice=NICE,
                           kv=connector_config("kv_producer", f"{tmp}/A.sock", send_to=["B"], lease_s=30.0))
            MD = VllmServer("MD", tmp / "MD.log", cpu="1", nice=NICE, prefix_caching=True, failure_policy="recompute",
                            kv=connector_config("kv_consumer", f"{tmp}/B.sock", recv_slack_s=2.0))
            servers = [P, MD]
            for s in servers:
                s.cmd += ["--chat-template", str(tmp / "chat.jinja")]
            t0 = time.monotonic()
            await asyncio.gather(*(s.start() for s in servers))
            print(f"vLLM servers ready in {time.monotonic() - t0:.1f} s")
            async with Router(loads(router_toml(P, MD, tmp))) as router:
                c = RouterCluster(tmp, agents, P, MD, None, http)
                c.router = router
                yield c
        finally:
            await asyncio.gather(*(s.stop() for s in servers), return_exceptions=True)
            for s in servers:
                print(f"--- {s.name} log tail ---\n{s.tail(15)}")
    shutil.rmtree(tmp, ignore_errors=True)


_settles = settles_after_each_test("cluster")


@pytest.mark.parametrize("length", [5, 75, 300])
async def test_p_md_gives_the_single_server_output_streamed_and_not(cluster, length):
    prompt = prompt_for(length, length)
    base = await cluster.baseline(prompt, N)
    assert len(set(base)) > 5  # a varied stream: equality means something
    wire0 = await cluster.D.wire_tokens(cluster.http)
    out = await cluster.via_router(completion_body(prompt, N))
    assert tokens(out) == base
    # MD's whole prompt came from the wire (vLLM's own count) ...
    assert await cluster.D.wire_tokens(cluster.http) - wire0 == len(prompt)
    chunks, _ = await cluster.stream(cluster.router.url, completion_body(prompt, N))
    assert stream_tokens(chunks) == base
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # ... and the second time only the last partial block: MD's prefix cache held the rest (DRC).
    assert await cluster.D.wire_tokens(cluster.http) - wire0 == len(prompt) + len(prompt) % BLOCK
    await cluster.settled()


async def test_the_stream_is_the_servers_stream(cluster):
    """Relayed SSE events are MD's as they came: the same tokens, text, fields and ending as a
    single server's stream for the same request (how vLLM groups tokens into events depends on
    timing, so events are compared flattened)."""
    prompt = prompt_for(7, 40)
    direct, _ = await cluster.stream(cluster.P.url, completion_body(prompt, N))
    routed, _ = await cluster.stream(cluster.router.url, completion_body(prompt, N))

    def flat(chunks):
        chs = [ch for c in chunks for ch in c["choices"]]
        return ([t for ch in chs for t in ch.get("token_ids") or ()], "".join(ch.get("text") or "" for ch in chs),
                [ch["finish_reason"] for ch in chs if ch.get("finish_reason")],
                {k for c in chunks for k in c} | {k for ch in chs for k in ch})

    assert flat(routed) == flat(direct)
    assert len({c["id"] for c in routed}) == 1
    await cluster.settled()


async def test_chat_completions_streamed_and_not(cluster):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there, how are the blocks today"}],
            "max_tokens": N, "temperature": 0, "ignore_eos": True}
    async with cluster.http.post(f"{cluster.P.url}/v1/chat/completions", json=body) as r:
        direct = (await r.json())["choices"][0]["message"]["content"]
    assert len(direct) > 8
    wire0 = await cluster.D.wire_tokens(cluster.http)
    out = await cluster.via_router(body, "/v1/chat/completions")
    assert out["choices"][0]["message"]["content"] == direct
    # max_completion_tokens (what OpenAI's clients send now) is honoured on both legs too
    alt = {k: v for k, v in body.items() if k != "max_tokens"} | {"max_completion_tokens": N}
    chunks, _ = await cluster.stream(cluster.router.url, alt, "/v1/chat/completions")
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == direct
    assert await cluster.D.wire_tokens(cluster.http) - wire0 >= 2 * 10  # the prompts came over the wire
    await cluster.settled()


async def test_concurrent_mixed_requests(cluster):
    prompts = [prompt_for(200 + i, 20 + 17 * i) for i in range(10)]
    bases = [await cluster.baseline(pr, N) for pr in prompts]

    async def one(i: int, pr: list[int]) -> list[int]:
        if i % 2:
            return stream_tokens((await cluster.stream(cluster.router.url, completion_body(pr, N)))[0])
        return tokens(await cluster.via_router(completion_body(pr, N)))

    wire0 = await cluster.D.wire_tokens(cluster.http)
    outs = await asyncio.gather(*(one(i, pr) for i, pr in enumerate(prompts)))
    assert outs == bases
    assert await cluster.D.wire_tokens(cluster.http) - wire0 == sum(len(pr) for pr in prompts)
    await cluster.settled()


async def test_a_client_gone_mid_stream_leaves_nothing_held(cluster):
    prompt = prompt_for(6, 60)
    gone0 = cluster.sample("pddwire_router_requests_total", endpoint="/v1/completions", outcome="client_gone")
    body = completion_body(prompt, 400, stream=True)
    async with cluster.http.post(f"{cluster.router.url}/v1/completions", json=body) as r:
        assert r.status == 200
        got = 0
        async for _ in r.content.iter_any():
            got += 1
            if got >= 3:
                break
        r.close()  # the client goes away mid-stream
    await cluster.settled()  # MD aborted it (no request running), 0 pinned at either agent
    async with asyncio.timeout(30):
        while cluster.sample("pddwire_router_requests_total", endpoint="/v1/completions",
                             outcome="client_gone") == gone0:
            await asyncio.sleep(0.05)
    assert all(u.inflight == 0 for u in cluster.router.pools)
    # and it still serves
    out = await cluster.via_router(completion_body(prompt, N))
    assert tokens(out) == await cluster.baseline(prompt, N)
    await cluster.settled()


async def test_models_healthz_and_metrics(cluster):
    async with cluster.http.get(f"{cluster.router.url}/v1/models") as r:
        assert r.status == 200
        assert [m["id"] for m in (await r.json())["data"]] == ["tiny"]
    async with cluster.http.get(f"{cluster.router.url}/healthz") as r:
        h = await r.json()
        assert r.status == 200 and h["ok"] is True and len(h["members"]) == 2 and all(h["members"].values())
    prompt = prompt_for(8, 33)
    n0 = cluster.sample("pddwire_router_ttft_seconds_count")
    c0 = cluster.sample("pddwire_router_pipeline_choices_total")
    t0 = cluster.sample("pddwire_router_output_tokens_total", pool="MD")
    await cluster.stream(cluster.router.url, completion_body(prompt, N))
    async with cluster.http.get(f"{cluster.router.url}/metrics") as r:
        text = await r.text()
    assert "pddwire_router_time_per_output_token_seconds_count" in text
    assert cluster.sample("pddwire_router_ttft_seconds_count") == n0 + 1
    assert cluster.sample("pddwire_router_pipeline_choices_total") == c0 + 1
    assert cluster.sample("pddwire_router_output_tokens_total", pool="MD") == t0 + N
    await cluster.settled()


async def test_an_upstream_error_is_relayed_as_vllm_gave_it(cluster):
    """MD refuses the request (its max_tokens is past --max-model-len) after P's prefill (one
    token) sent it the KV: the client gets MD's error as vLLM gave it; P's KV, never received,
    waits out the lease the router asks of P (2 s here, so that the test does not wait 30)."""
    body = completion_body(prompt_for(9, 20), 10_000)  # past --max-model-len
    async with cluster.http.post(f"{cluster.P.url}/v1/completions", json=body) as r:
        direct = (r.status, (await r.json())["error"]["message"])
    async with Router(loads(router_toml(cluster.P, cluster.D, cluster.tmp, prefill_lease_s=2.0))) as router:
        async with cluster.http.post(f"{router.url}/v1/completions", json=body) as r:
            assert (r.status, (await r.json())["error"]["message"]) == direct
        assert direct[0] == 400
        async with cluster.http.post(f"{router.url}/v1/completions", data=b"{not json") as r:
            assert r.status == 400 and "not JSON" in (await r.json())["error"]["message"]
    await cluster.settled()


async def test_the_deadline_ends_a_request_and_its_upstream_requests(cluster):
    """A deadline no request can meet (1 ms): the client gets 504 and nothing is left running."""
    async with Router(loads(router_toml(cluster.P, cluster.D, cluster.tmp, deadline_s=0.001))) as short:
        for stream in (False, True):
            body = completion_body(prompt_for(10, 50), 400, stream=stream)
            async with cluster.http.post(f"{short.url}/v1/completions", json=body) as r:
                assert r.status == 504
                assert "deadline" in (await r.json())["error"]["message"]
        assert sample(short, "pddwire_router_requests_total", endpoint="/v1/completions", outcome="deadline") == 2
    await cluster.settled()


async def test_each_pipeline_is_p_agents_choice(cluster):
    """P's agent chooses from its live link estimate. Before it knows the link's goodput (no
    transfer here is big enough to measure it) it predicts an unbounded WAN time: P-RLD-MD, which
    runs as P-MD here, with no RLD pool (a fallback, counted). Once a probe measured the link, the KV fits the
    budget: P-MD. The second time, the block hashes the router sends find the prompt's full
    blocks in MD's prefix inventory."""
    A = cluster.agents["A"]
    prompt = prompt_for(11, 100)
    base = await cluster.baseline(prompt, N)
    rldmd0 = cluster.sample("pddwire_router_pipeline_choices_total", pipeline="P-RLD-MD", reason="wan_over_budget")
    nserved0 = cluster.sample("pddwire_router_fallbacks_total", kind="p_rld_md_no_rld_member")
    assert A.peers.session_for("B").link_figures().bandwidth_Bps == 0
    assert tokens(await cluster.via_router(completion_body(prompt, N))) == base
    assert cluster.sample("pddwire_router_pipeline_choices_total", pipeline="P-RLD-MD",
                          reason="wan_over_budget") == rldmd0 + 1
    assert cluster.sample("pddwire_router_fallbacks_total", kind="p_rld_md_no_rld_member") == nserved0 + 1

    # MD's connector reports what its prefix cache holds with its next step: any request runs one.
    await complete(cluster.http, cluster.D.url, completion_body(prompt_for(15, 10), 2))
    await A.probe("B", 0.5)  # what `pdd-wire probe` does: the link's goodput is now known
    assert A.peers.session_for("B").link_figures().bandwidth_Bps > 0
    agent0 = metric(A, "pddwire_pipeline_choices_total", pipeline="P-MD", reason="wan_within_budget")
    held0 = cluster.sample("pddwire_router_prompt_tokens_total", source="md_prefix")
    assert tokens(await cluster.via_router(completion_body(prompt, N))) == base
    assert metric(A, "pddwire_pipeline_choices_total", pipeline="P-MD", reason="wan_within_budget") == agent0 + 1
    assert cluster.sample("pddwire_router_pipeline_choices_total", pipeline="P-MD", reason="wan_within_budget") >= 1
    assert cluster.sample("pddwire_router_prompt_tokens_total", source="md_prefix") - held0 == 3 * BLOCK
    assert cluster.sample("pddwire_router_fallbacks_total", kind="choice_failed") == 0
    await cluster.settled()


async def test_the_anomalous_filter_finishes_long_input_short_output_in_site_a(cluster):
    """300 input tokens, 4 output tokens: P-RLD. With no RLD pool P finishes it: nothing goes to
    MD, nothing crosses the WAN."""
    prompt = prompt_for(12, 300)
    base = await cluster.baseline(prompt, 4)
    wire0 = await cluster.D.wire_tokens(cluster.http)
    md0 = cluster.sample("pddwire_router_output_tokens_total", pool="MD")
    p0 = cluster.sample("pddwire_router_output_tokens_total", pool="P")
    out = await cluster.via_router(completion_body(prompt, 4))
    chunks, _ = await cluster.stream(cluster.router.url, completion_body(prompt, 4))
    assert tokens(out) == stream_tokens(chunks) == base
    assert cluster.sample("pddwire_router_pipeline_choices_total", pipeline="P-RLD",
                          reason="anomalous_long_input_short_output") == 2
    assert cluster.sample("pddwire_router_output_tokens_total", pool="P") - p0 == 8
    assert cluster.sample("pddwire_router_output_tokens_total", pool="MD") == md0
    assert await cluster.D.wire_tokens(cluster.http) == wire0
    await cluster.settled()


async def test_batched_prompts_go_to_md_whole(cluster):
    """Several prompts in one request would share one transfer name: MD computes them."""
    prompts = [prompt_for(13, 30), prompt_for(14, 50)]
    bases = [await cluster.baseline(pr, N) for pr in prompts]
    out = await cluster.via_router(completion_body(prompts, N))
    assert [tokens(out, i) for i in range(2)] == bases
    assert cluster.sample("pddwire_router_pipeline_choices_total", pipeline="MD", reason="batched_prompts") == 1
    await cluster.settled()
