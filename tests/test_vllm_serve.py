"""vLLM as it is deployed: ``vllm serve`` prefill and decode OpenAI servers with PddWireConnector,
two real agents, and a stock P/D proxy that forwards prefill's ``kv_transfer_params`` unchanged.

    client -> Proxy -> P  (vllm serve, kv_producer, KV staged as for a CUDA KV cache)  -> agent A
                    -> D  (python -m vllm...api_server, kv_consumer,  -> agent B
                           --max-num-seqs 2, a small KV cache, prefix caching, recompute on failure)

Every output is compared, token id for token id, with the greedy output of a single server (P,
asked without KV transfer); vLLM's own count of prompt tokens by source
(``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``) shows that decode's prompt
came from the wire. After each test nothing is left: no blocks pinned by either agent,
no KV block allocated in either vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from conftest import metric
from pdd_tools.vllm.serve import (
    BLOCK,
    VOCAB,
    Proxy,
    VllmServer,
    complete,
    completion_body,
    connector_config,
    missing,
    tokens,
    vllm_session,
)
from support.agents import BESIDE_VLLM_DEAD_AFTER_S, run_agents, two_site_toml

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

N = 32  # tokens generated per request
# Prefill's lease (connector config). The 32 concurrent requests queue at D (2 at a time): on
# a slow 2-core machine (CI) the last were admitted over 30 s after their prefill, whose KV was
# dropped by then (NOT_POSTED; D recomputed). The tests of leases running out set their own.
LEASE_S = 120.0
MAX_PINNED = 200  # prefill's max_pinned_blocks: above what the other tests hold at once
SLACK_S = 2.0  # decode's receive waits this beyond what is left of the lease
NICE = 10  # the vLLM servers' niceness: below the in-process agents (and router) under test


def prompt_for(seed: int, length: int = 75) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


class Cluster:
    def __init__(self, tmp: Path, agents: dict, P: VllmServer, D: VllmServer, proxy: Proxy,
                 http: aiohttp.ClientSession) -> None:
        self.tmp, self.agents, self.P, self.D, self.proxy, self.http = tmp, agents, P, D, proxy, http
        self._base: dict[tuple, list[int]] = {}
        self.D2: VllmServer | None = None  # test_vllm_serve's staging decode, idle otherwise

    async def baseline(self, prompt: list[int], n: int = N) -> list[int]:
        """A single server's greedy output (P, no KV transfer)."""
        key = (tuple(prompt), n)
        if key not in self._base:
            self._base[key] = tokens(await complete(self.http, self.P.url, completion_body(prompt, n)))
        return self._base[key]

    async def via_proxy(self, prompt: list[int], max_tokens: int = N, **extra) -> dict:
        return await complete(self.http, self.proxy.url, completion_body(prompt, max_tokens, **extra))

    def kv_bytes(self, prompt: list[int]) -> int:
        """Bytes of a prompt's KV in these engines: 2 layers x [2 heads, 32 tokens, 64] fp32 a block."""
        return math.ceil(len(prompt) / BLOCK) * 2 * (2 * BLOCK * 64 * 4)

    async def settled(self, timeout: float = 60) -> None:
        """Until nothing is held: no pinned blocks at either agent, no request or KV block in
        either vLLM (a bounded wait: a finished request's blocks are freed a step later)."""
        last = None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    pinned = {k: a.describe()["pinned_blocks"] for k, a in self.agents.items()}
                    vl = {}
                    for s in (self.P, self.D):
                        m = await s.metrics(self.http)
                        vl[s.name] = (m.get("vllm:kv_cache_usage_perc", -1), m.get("vllm:num_requests_running", -1),
                                      m.get("vllm:num_requests_waiting", -1))
                    last = (pinned, vl)
                    if (all(v == 0 for p in pinned.values() for v in p.values())
                            and all(v == (0, 0, 0) for v in vl.values())):
                        break
                    await asyncio.sleep(0.2)
        except TimeoutError:
            raise AssertionError(f"still held after {timeout}s: {last}") from None
        for a in self.agents.values():
            assert a.describe()["stranded_blocks"] == 0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    why = missing()
    if why:
        pytest.fail(f"the vLLM venv is needed for this test ({why}): run scripts/vllm-env", pytrace=False)
    tmp = Path(tempfile.mkdtemp(prefix="pdw-vserve-"))
    tomls = two_site_toml(tmp, streams=2, chunk=64 << 10, dead_after_s=BESIDE_VLLM_DEAD_AFTER_S)
    servers: list[VllmServer] = []
    async with run_agents(tomls) as agents, vllm_session() as http:
        try:
            # P as users type it (vllm serve); D through the module entry point. P stages its KV
            # (staging: the KV-on-CUDA path's code, here on CPU tensors; the zero-copy send is
            # tests/test_vllm_adapter.py's), D receives zero-copy.
            P = VllmServer("P", tmp / "P.log", cpu="0", cli=True, nice=NICE,
                           kv=connector_config("kv_producer", f"{tmp}/A.sock", send_to=["B"], lease_s=LEASE_S,
                                                 max_pinned_blocks=MAX_PINNED, staging=True, staging_mb=16))
            # D: 40 blocks of KV cache and 2 sequences at a time: requests queue for admission.
            D = VllmServer("D", tmp / "D.log", cpu="1", cli=False, max_num_seqs=2, kv_cache_bytes=40 * BLOCK * 1024,
                           nice=NICE, prefix_caching=True, failure_policy="recompute",
                           kv=connector_config("kv_consumer", f"{tmp}/B.sock", recv_slack_s=SLACK_S))
            # D2: test_decode_receiving_through_staging_as_for_a_cuda_kv_cache's second decode,
            # started with them: one server starting alone leaves a core idle (its start-up is
            # single-threaded imports, 55 s on its own vs about 20 s more beside P and D).
            D2 = VllmServer("D2", tmp / "D2.log", cpu="1", cli=True, nice=NICE, max_num_seqs=4,
                            kv_cache_bytes=40 * BLOCK * 1024,
                            kv=connector_config("kv_consumer", f"{tmp}/B.sock", staging=True, staging_mb=4))
            servers = [P, D, D2]
            t0 = time.monotonic()
            await asyncio.gather(*(s.start() for s in servers))
            print(f"vLLM servers ready in {time.monotonic() - t0:.1f} s")
            async with Proxy(P.url, D.url) as proxy:
                c = Cluster(tmp, agents, P, D, proxy, http)
                c.D2 = D2
                yield c
        finally:
            await asyncio.gather(*(s.stop() for s in servers), return_exceptions=True)
            for s in servers:
                print(f"--- {s.name} log tail ---\n{s.tail(15)}")
    shutil.rmtree(tmp, ignore_errors=True)


def settles_after_each_test(name: str):
    """An autouse fixture: after each test using fixture ``name`` (a Cluster or a Pdd), passed or
    failed, nothing is left running or pinned (its ``settled()``): a failed test's requests and
    the KV it left pinned until its lease are not the next test's. ``_settles = ...`` in a module."""
    @pytest_asyncio.fixture(autouse=True, loop_scope="module")
    async def _settles(request):
        c = request.getfixturevalue(name) if name in request.fixturenames else None
        yield
        if c is not None:
            await c.settled()
    return _settles


_settles = settles_after_each_test("cluster")


async def test_stock_proxy_pd_gives_the_single_server_output(cluster):
    prompt = prompt_for(1)
    base = await cluster.baseline(prompt)
    assert len(set(base)) > 8  # a varied stream: equality means something
    rx0 = metric(cluster.agents["B"], "pddwire_bytes_total", peer="A/a1", lane="bulk", direction="rx")
    wire0 = await cluster.D.wire_tokens(cluster.http)
    out = await cluster.via_proxy(prompt)
    params = cluster.proxy.log[-1]["prefill"]
    # What prefill returned, and the proxy forwarded untouched: vLLM's P/D params plus the name.
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["pdd_request_id"].startswith("vllm-") and params["num_tokens"] == len(prompt)
    assert params["remote_site"] == "A" and params["lease_s"] == LEASE_S and "send_to" not in params
    assert tokens(out) == base
    rx = metric(cluster.agents["B"], "pddwire_bytes_total", peer="A/a1", lane="bulk", direction="rx") - rx0
    assert rx == cluster.kv_bytes(prompt)
    # Decode's whole prompt came from the wire (vLLM's count; its usage.cached_tokens reports
    # prefill's own cache hits in P/D, as vLLM's P/D connectors do).
    assert await cluster.D.wire_tokens(cluster.http) - wire0 == len(prompt)
    await cluster.settled()



async def test_producer_fields_never_make_decode_send(cluster):
    """The older parameter form forwarded unchanged, ``send_to`` included: the consumer-only
    decode loads the KV and sends nothing."""
    prompt = prompt_for(2)
    base = await cluster.baseline(prompt)
    B = cluster.agents["B"]
    tx0 = metric(B, "pddwire_bytes_total", peer="A/a1", lane="bulk", direction="tx")
    wire0 = await cluster.D.wire_tokens(cluster.http)
    pre = await complete(cluster.http, cluster.P.url, completion_body(
        prompt, 1, kv_transfer_params={"pdd_request_id": "legacy-1", "send_to": ["B"]}))
    params = pre["kv_transfer_params"]
    assert params == {"pdd_request_id": "legacy-1", "num_tokens": len(prompt), "send_to": ["B"]}
    out = await complete(cluster.http, cluster.D.url, completion_body(prompt, N, kv_transfer_params=params))
    assert tokens(out) == base
    assert await cluster.D.wire_tokens(cluster.http) - wire0 == len(prompt)
    assert metric(B, "pddwire_bytes_total", peer="A/a1", lane="bulk", direction="tx") == tx0
    await cluster.settled()

async def test_32_concurrent_requests_through_the_proxy(cluster):
    prompts = [prompt_for(100 + i, 40 + 3 * i) for i in range(32)]
    bases = [await cluster.baseline(pr) for pr in prompts]
    wire0 = await cluster.D.wire_tokens(cluster.http)
    outs = await asyncio.gather(*(cluster.via_proxy(pr) for pr in prompts))
    assert [tokens(o) for o in outs] == bases
    assert await cluster.D.wire_tokens(cluster.http) - wire0 == sum(len(pr) for pr in prompts)
    await cluster.settled()


async def test_a_transfer_never_sent_fails_within_the_lease_and_decode_recomputes(cluster):
    prompt = prompt_for(3)
    base = await cluster.baseline(prompt)
    expired0 = metric(cluster.agents["B"], "pddwire_leases_expired_total", kind="post")
    # What a prefill would have returned, for a transfer that never comes: a 3 s lease.
    params = {"do_remote_prefill": True, "do_remote_decode": False, "pdd_request_id": "never-sent-1",
              "num_tokens": len(prompt), "remote_site": "A", "lease_s": 3.0, "lease_started": time.time()}
    wire0 = await cluster.D.wire_tokens(cluster.http)
    async with asyncio.timeout(60):  # a bound far below post_ttl_s (300 s), not a speed check
        out = await complete(cluster.http, cluster.D.url, completion_body(prompt, N, kv_transfer_params=params))
    assert metric(cluster.agents["B"], "pddwire_leases_expired_total", kind="post") == expired0 + 1
    assert tokens(out) == base  # recomputed (kv_load_failure_policy)
    assert await cluster.D.wire_tokens(cluster.http) == wire0
    await cluster.settled()


async def test_a_receive_after_the_senders_lease_ran_out_fails_at_once(cluster):
    prompt = prompt_for(4)
    base = await cluster.baseline(prompt)
    A = cluster.agents["A"]
    np0 = metric(A, "pddwire_transfers_total", peer="B/b1", direction="out", outcome="not_posted")
    pre = await complete(cluster.http, cluster.P.url, completion_body(
        prompt, 1, kv_transfer_params={"do_remote_decode": True, "lease_s": 1.0}))
    params = pre["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["lease_s"] == 1.0
    async with asyncio.timeout(30):  # prefill's agent gives up after the 1 s lease
        while metric(A, "pddwire_transfers_total", peer="B/b1", direction="out", outcome="not_posted") == np0:
            await asyncio.sleep(0.05)
    await cluster.settled()  # prefill's blocks are free again
    wire0 = await cluster.D.wire_tokens(cluster.http)
    out = await complete(cluster.http, cluster.D.url, completion_body(prompt, N, kv_transfer_params=params))
    assert tokens(out) == base
    assert await cluster.D.wire_tokens(cluster.http) == wire0
    await cluster.settled()


async def test_decode_under_kv_pressure_every_request_completes_from_the_wire_or_named_failure(cluster):
    """16 requests at once on a decode that admits 2 at a time, 128 tokens each, with a 1 s
    lease: the later ones are usually admitted after prefill gave up. Each one either loads its
    prompt from the wire or its transfer ends NOT_POSTED (a named code) and decode, told at once,
    recomputes; all outputs match, nothing stays pinned."""
    prompts = [prompt_for(200 + i, 70) for i in range(16)]
    bases = await asyncio.gather(*(cluster.baseline(pr, 128) for pr in prompts))
    A = cluster.agents["A"]
    np0 = metric(A, "pddwire_transfers_total", peer="B/b1", direction="out", outcome="not_posted")
    done0 = metric(A, "pddwire_transfers_total", peer="B/b1", direction="out", outcome="done")
    wire0 = await cluster.D.wire_tokens(cluster.http)

    async def one(pr):
        pre = await complete(cluster.http, cluster.P.url, completion_body(
            pr, 1, kv_transfer_params={"do_remote_decode": True, "lease_s": 1.0}))
        return await complete(cluster.http, cluster.D.url, completion_body(
            pr, 128, kv_transfer_params=pre["kv_transfer_params"]))

    outs = await asyncio.gather(*(one(pr) for pr in prompts))
    assert [tokens(o) for o in outs] == bases
    await cluster.settled()
    not_posted = metric(A, "pddwire_transfers_total", peer="B/b1", direction="out", outcome="not_posted") - np0
    done = metric(A, "pddwire_transfers_total", peer="B/b1", direction="out", outcome="done") - done0
    print(f"KV pressure: {done:.0f} of 16 from the wire, {not_posted:.0f} NOT_POSTED (recomputed)")
    assert done + not_posted == 16
    assert await cluster.D.wire_tokens(cluster.http) - wire0 == done * 70  # each delivered prompt was used



async def test_prefill_holds_at_most_max_pinned_blocks_for_decode(cluster):
    """60 prefills of 5 blocks each whose decode never comes: prefill holds at most
    max_pinned_blocks for them; the others answer do_remote_prefill false with the reason (their
    decode computes the prompt). When the leases run out, nothing is held."""
    prompts = [prompt_for(300 + i, 130) for i in range(60)]
    outs = await asyncio.gather(*(complete(cluster.http, cluster.P.url, completion_body(
        pr, 1, kv_transfer_params={"do_remote_decode": True, "lease_s": 5.0})) for pr in prompts))
    params = [o["kv_transfer_params"] for o in outs]
    sent = [q for q in params if q["do_remote_prefill"]]
    refused = [q for q in params if not q["do_remote_prefill"]]
    assert len(sent) * 5 <= MAX_PINNED and refused
    assert all("max_pinned_blocks" in q["pdd_error"] for q in refused)
    print(f"max_pinned_blocks {MAX_PINNED}: {len(sent)} sends held, {len(refused)} refused")
    await cluster.settled()

async def test_parallel_sampling_n2_on_decode(cluster):
    """n = 2 (seeded sampling; greedy allows n = 1 only): the two children share prefill's
    transfer; one loads it, the other waits for it and then uses decode's prefix cache."""
    prompt = prompt_for(5)
    sampling = {"n": 2, "temperature": 1.0, "seed": 7}
    base = await complete(cluster.http, cluster.P.url, completion_body(prompt, N, **sampling))
    wire0 = await cluster.D.wire_tokens(cluster.http)
    out = await cluster.via_proxy(prompt, **sampling)
    assert sorted(tokens(out, i) for i in range(2)) == sorted(tokens(base, i) for i in range(2))
    assert tokens(out, 0) != tokens(out, 1)
    assert await cluster.D.wire_tokens(cluster.http) - wire0 >= len(prompt)
    await cluster.settled()


async def test_client_disconnecting_mid_stream_frees_everything(cluster):
    prompt = prompt_for(6)
    body = completion_body(prompt, 400, stream=True)
    async with cluster.http.post(f"{cluster.proxy.url}/v1/completions", json=body) as r:
        assert r.status == 200
        got = 0
        async for _ in r.content.iter_any():
            got += 1
            if got >= 3:
                break
        r.close()  # the client goes away mid-stream
    await cluster.settled()
    # and the servers still serve
    out = await cluster.via_proxy(prompt)
    assert tokens(out) == await cluster.baseline(prompt)
    await cluster.settled()



async def test_client_gone_while_decode_waits_for_its_kv_frees_everything(cluster):
    """A decode request whose KV is still to come (posted, the sender not there yet) and whose
    client goes away: vLLM aborts it, the receive is cancelled, its blocks are freed."""
    prompt = prompt_for(9)
    B = cluster.agents["B"]
    params = {"do_remote_prefill": True, "do_remote_decode": False, "pdd_request_id": "late-kv-1",
              "num_tokens": len(prompt), "remote_site": "A", "lease_s": 60.0, "lease_started": time.time()}
    body = completion_body(prompt, N, stream=True, kv_transfer_params=params)

    async def client():
        async with cluster.http.post(f"{cluster.D.url}/v1/completions", json=body) as r:
            async for _ in r.content.iter_any():
                pass

    task = asyncio.create_task(client())
    async with asyncio.timeout(30):
        while "late-kv-1" not in B.posts:  # decode admitted it and posted its receive
            await asyncio.sleep(0.02)
    task.cancel()  # the client goes away
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await cluster.settled()
    assert "late-kv-1" not in B.posts

async def test_second_turn_of_a_conversation_ships_only_the_new_blocks(cluster):
    """Decode's prefix cache feeds its agent's inventory: turn 2 (turn 1's prompt and answer,
    then a new message) crosses without the blocks decode already holds; its output is still
    the single server's."""
    A, B = cluster.agents["A"], cluster.agents["B"]
    turn1 = prompt_for(7, 70)
    out1 = await cluster.via_proxy(turn1)
    assert tokens(out1) == await cluster.baseline(turn1)
    await cluster.settled()
    turn2 = turn1 + tokens(out1) + prompt_for(8, 40)
    base2 = await cluster.baseline(turn2)
    rx0 = metric(B, "pddwire_bytes_total", peer="A/a1", lane="bulk", direction="rx")
    saved0 = metric(A, "pddwire_prefix_bytes_saved_total", peer="B/b1")
    wire0 = await cluster.D.wire_tokens(cluster.http)
    out2 = await cluster.via_proxy(turn2)
    assert tokens(out2) == base2
    # Decode computed KV for turn 1's prompt and all but the last answer token: those full
    # blocks are in its prefix cache, and only turn 2's other blocks cross.
    held = (len(turn1) + N - 1) // BLOCK
    whole = cluster.kv_bytes(turn2)
    rx = metric(B, "pddwire_bytes_total", peer="A/a1", lane="bulk", direction="rx") - rx0
    assert rx == whole - held * cluster.kv_bytes([0] * BLOCK)
    assert metric(A, "pddwire_prefix_bytes_saved_total", peer="B/b1") - saved0 == whole - rx
    assert await cluster.D.wire_tokens(cluster.http) - wire0 == len(turn2) - held * BLOCK
    print(f"turn 2: {rx} of {whole} KV bytes crossed ({whole / rx:.2f}x less)")
    await cluster.settled()


async def test_gpu_check_byte_path_on_cpu_tensors():
    """scripts/gpu-check's staging path (the connector's KV-on-CUDA path) run on CPU tensors:
    blocks cross agent to agent byte-identical. (The CUDA run itself needs a GPU.)"""
    import json
    import subprocess

    from pdd_tools.vllm.serve import ROOT, venv

    cmd = [str(ROOT / "scripts" / "gpu-check"), "--device", "cpu", "--layers", "3", "--blocks", "16",
           "--block-kib", "16", "--rounds", "2"]
    res = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=120,
                                  env={**os.environ, "PYTHON": str(venv() / "bin" / "python")})
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["identical"] is True and out["bytes_per_transfer"] == 3 * 16 * 16384


async def test_decode_receiving_through_staging_as_for_a_cuda_kv_cache(cluster):
    """A second decode that stages what it receives (the KV-on-CUDA path's code, on CPU tensors:
    the agent writes the staging blocks, the worker copies them into vLLM's cache on arrival):
    the output is still the single server's, the prompt came from the wire."""
    D2 = cluster.D2
    assert D2 is not None
    prompts = [prompt_for(400 + i, 50 + 20 * i) for i in range(3)]
    bases = [await cluster.baseline(pr) for pr in prompts]
    wire0 = await D2.wire_tokens(cluster.http)
    async with Proxy(cluster.P.url, D2.url) as proxy:
        outs = await asyncio.gather(*(complete(cluster.http, proxy.url, completion_body(pr, N)) for pr in prompts))
    assert [tokens(o) for o in outs] == bases
    assert await D2.wire_tokens(cluster.http) - wire0 == sum(len(pr) for pr in prompts)
    await cluster.settled()
