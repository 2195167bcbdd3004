"""vLLM as it is deployed: ``vllm serve`` prefill and decode OpenAI servers with PddWireConnector,
two real agents, and a stock P/D proxy that forwards prefill's ``kv_transfer_params`` unchanged.

    client -> Proxy -> P  (vllm serve, kv_producer, KV staged as for a CUDA KV cache)  -> agent A
                    -> D  (python -m vllm...api_server, kv_consumer,  -> agent B
                           --max-num-seqs 2, a small KV cache, prefix caching, recompute on failure)

Every output is compared, token id for token id, with the greedy output of a single server (P,
asked without KV transfer); vLLM's own count of prompt tokens by source
(``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``) shows that decode's prompt
came from the wire. After each test nothing is left: no blocks pinned by either agent,
no KV block allocated in either vLLM. What clients and agents may do to a running vLLM is here
too: bad ``kv_transfer_params``, a transfer name used twice, a peer's abort, an agent restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import re
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
from pdd_wire import EngineClient
from pdd_wire import config as cfgmod
from pdd_wire.agent import Agent
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
        self.tomls: dict = {}  # the agents' configs (a test restarts them)

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
                c.D2, c.tomls = D2, tomls
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


async def test_bad_kv_transfer_params_never_stop_the_engine(cluster):
    """kv_transfer_params come from any HTTP client. A bad field is named in prefill's answer
    (not sent: do_remote_prefill false, pdd_error), and decode given bad params computes the
    prompt at once (the reason logged); both servers stay up, and the next P/D request moves
    its KV. (Before: ``"lease_s": "abc"`` ended prefill's EngineCore.)"""
    prompt = prompt_for(20)
    base = await cluster.baseline(prompt)
    P, D, http = cluster.P, cluster.D, cluster.http
    wire0 = await D.wire_tokens(http)
    refused = []
    for params, why in [
        ({"do_remote_decode": True, "lease_s": "abc"}, "lease_s must be a number of seconds, got 'abc'"),
        ({"do_remote_decode": True, "lease_s": 0}, "lease_s must be in (0, 604800] seconds, got 0"),
        ({"do_remote_decode": True, "deadline_s": 1e308}, "deadline_s must be in (0, 604800]"),
        ({"do_remote_decode": True, "send_to": ["B", 7]}, "send_to must name destinations as non-empty strings"),
        ({"do_remote_decode": True, "pdd_request_id": 42}, "pdd_request_id must be a string, got 42"),
        ({"do_remote_decode": True, "pdd_request_id": "x" * 300}, "pdd_request_id must be 1..256 bytes, got 300"),
    ]:
        out = await complete(http, P.url, completion_body(prompt, 1, kv_transfer_params=params))
        kv = out["kv_transfer_params"]
        assert kv["do_remote_prefill"] is False and kv["pdd_error"].startswith(f"kv_transfer_params: {why}"), kv
        assert tokens(out) == base[:1]
        refused.append(kv)
    assert refused[-2]["pdd_request_id"].startswith("vllm-")  # not the bad name it was given
    # What prefill refused, forwarded to decode as a proxy does: computed there, at once.
    async with asyncio.timeout(30):  # far below the agent's post_ttl_s (300 s) a receive would wait
        out = await complete(http, D.url, completion_body(prompt, N, kv_transfer_params=refused[0]))
    assert tokens(out) == base
    # The older form says it too, and a consumer given that does not wait for KV.
    pre = await complete(http, P.url, completion_body(
        prompt, 1, kv_transfer_params={"pdd_request_id": "legacy-bad", "send_to": ["B"], "lease_s": "x"}))
    legacy = pre["kv_transfer_params"]
    assert legacy["pdd_request_id"] == "legacy-bad" and "lease_s must be" in legacy["pdd_error"], legacy
    bad_decode = [legacy,
                  {"do_remote_prefill": True, "pdd_request_id": "bad-d-1", "num_tokens": "abc"},
                  {"do_remote_prefill": True, "pdd_request_id": "bad-d-2", "lease_s": 60, "lease_started": "now"},
                  {"do_remote_prefill": True, "pdd_request_id": ["bad-d-3"]},
                  {"do_remote_prefill": True, "pdd_request_id": "bad-d-4", "remote_site": 7, "lease_s": 60}]
    for params in bad_decode:
        async with asyncio.timeout(30):
            out = await complete(http, D.url, completion_body(prompt, N, kv_transfer_params=params))
        assert tokens(out) == base, params
    assert await D.wire_tokens(http) == wire0  # every prompt above was computed by decode itself
    log = D.log.read_text(errors="replace")
    assert "kv_transfer_params: num_tokens must be a non-negative integer, got 'abc'" in log
    assert "kv_transfer_params: lease_started must be a wall-clock time" in log
    assert P.proc.returncode is None and D.proc.returncode is None
    # One destination given as a string is one destination, not characters; and the servers
    # still move KV (new prompts: decode's prefix cache holds the one above now).
    one, other = prompt_for(21), prompt_for(24)
    pre = await complete(http, P.url, completion_body(one, 1, kv_transfer_params={"do_remote_decode": True,
                                                                                   "send_to": "B"}))
    assert pre["kv_transfer_params"]["do_remote_prefill"] is True, pre["kv_transfer_params"]
    out = await complete(http, D.url, completion_body(one, N, kv_transfer_params=pre["kv_transfer_params"]))
    assert tokens(out) == await cluster.baseline(one)
    out = await cluster.via_proxy(other)
    assert tokens(out) == await cluster.baseline(other)
    assert await D.wire_tokens(http) - wire0 == len(one) + len(other)
    await cluster.settled()


async def test_a_pdd_request_id_in_flight_on_prefill_is_refused_to_another_request(cluster):
    """Two sends under one name would be one transfer at the agents, and the first one's
    completion was lost (its blocks held in prefill forever). The second request with a name in
    flight is not sent (pdd_error says why); once the first's KV is delivered the name is free.
    ``n = 2`` with a name: one child sends, the other is refused, nothing is left held."""
    P, D, http = cluster.P, cluster.D, cluster.http
    p1, p2 = prompt_for(22), prompt_for(23)
    params = {"do_remote_decode": True, "pdd_request_id": "dup-1", "lease_s": 60.0}
    first = (await complete(http, P.url, completion_body(p1, 1, kv_transfer_params=params)))["kv_transfer_params"]
    assert first["do_remote_prefill"] is True and first["pdd_request_id"] == "dup-1"
    # The first one's KV waits at decode's agent for its receive: the name is in flight.
    second = (await complete(http, P.url, completion_body(p2, 1, kv_transfer_params=params)))["kv_transfer_params"]
    assert second["do_remote_prefill"] is False and "'dup-1' is in use" in second["pdd_error"], second
    wire0 = await D.wire_tokens(http)
    out = await complete(http, D.url, completion_body(p1, N, kv_transfer_params=first))
    assert tokens(out) == await cluster.baseline(p1)
    assert await D.wire_tokens(http) - wire0 == len(p1)
    await cluster.settled()  # delivered: prefill's blocks are free, and so is the name
    again = (await complete(http, P.url, completion_body(p2, 1, kv_transfer_params=params)))["kv_transfer_params"]
    assert again["do_remote_prefill"] is True, again
    out = await complete(http, D.url, completion_body(p2, N, kv_transfer_params=again))
    assert tokens(out) == await cluster.baseline(p2)
    await cluster.settled()
    # n = 2 on prefill with a name: the children share it. Nobody receives (a 1 s lease).
    sampling = {"n": 2, "temperature": 1.0, "seed": 3}
    await complete(http, P.url, completion_body(p1, 1, **sampling, kv_transfer_params={
        "do_remote_decode": True, "pdd_request_id": "dup-n2", "lease_s": 1.0}))
    assert "'dup-n2' is in use by another request in flight" in P.log.read_text(errors="replace")
    await cluster.settled()  # the sent child's lease ran out; nothing is held


async def test_a_prefill_side_abort_ends_decodes_wait_at_once(cluster):
    """An engine on prefill's site aborts a request whose KV decode waits for, before any
    transfer claimed decode's receive: decode's agent drops the post and tells decode only
    ``aborted``. That fails the load (decode recomputes) at once, not at the end of the lease
    (before: decode waited for it, 60 s here; with no lease, the agent's post_ttl_s)."""
    prompt = prompt_for(33)
    base = await cluster.baseline(prompt)
    B, D, http = cluster.agents["B"], cluster.D, cluster.http
    params = {"do_remote_prefill": True, "do_remote_decode": False, "pdd_request_id": "peer-abort-1",
              "num_tokens": len(prompt), "remote_site": "A", "lease_s": 60.0, "lease_started": time.time()}
    wire0 = await D.wire_tokens(http)
    task = asyncio.create_task(complete(http, D.url, completion_body(prompt, N, kv_transfer_params=params)))
    async with asyncio.timeout(30):
        while "peer-abort-1" not in B.posts:
            await asyncio.sleep(0.02)
    async with EngineClient(f"{cluster.tmp}/A.sock", "test-prefill") as eng:
        await eng.abort("peer-abort-1", "the client went away")
    async with asyncio.timeout(30):
        out = await task
    assert tokens(out) == base
    assert await D.wire_tokens(http) == wire0
    assert "aborted at A/a1: the client went away" in D.log.read_text(errors="replace")
    await cluster.settled()


async def _restart(cluster: Cluster, grace_s: float | None = None) -> None:
    """Stop both agents (a shutdown event to each engine, then the close) and start new ones
    on the same sockets and ports, as a systemd restart does."""
    olds = list(cluster.agents.items())
    await asyncio.gather(*(a.shutdown(grace_s) for _, a in olds))
    for site, _ in olds:
        a = Agent(cfgmod.loads(cluster.tomls[site]))
        await a.start()
        cluster.agents[site] = a  # the fixture's dict: its teardown stops the new ones
    async with asyncio.timeout(30):
        for a in cluster.agents.values():
            for sess in a.sessions.values():
                while not (sess.is_up and len(sess.links) == sess.streams):
                    await asyncio.sleep(0.02)


def _with_regions(agent: Agent) -> list[str]:
    return [e["name"] for e in agent.describe()["engines"] if e["regions"]]


async def test_an_agent_restart_ends_what_was_pending_and_kv_moves_again(cluster):
    """Both agents restart while prefill holds a send (its KV waiting for decode's receive) and
    decode waits for KV that would come within its 60 s lease: the receive fails at once (decode
    recomputes: the single server's output, well before the lease), the send ends (prefill's
    blocks freed). The workers reconnect and register their KV caches with the new agents, and
    the next P/D request moves its KV, with no vLLM restart."""
    P, D, http = cluster.P, cluster.D, cluster.http
    p1, p2 = prompt_for(30), prompt_for(31)
    base2 = await cluster.baseline(p2)
    sent = (await complete(http, P.url, completion_body(p1, 1, kv_transfer_params={
        "do_remote_decode": True, "lease_s": 60.0})))["kv_transfer_params"]
    assert sent["do_remote_prefill"] is True
    waiting = {"do_remote_prefill": True, "do_remote_decode": False, "pdd_request_id": "restart-late-1",
               "num_tokens": len(p2), "remote_site": "A", "lease_s": 60.0, "lease_started": time.time()}
    decode = asyncio.create_task(complete(http, D.url, completion_body(p2, N, kv_transfer_params=waiting)))
    async with asyncio.timeout(30):
        while "restart-late-1" not in cluster.agents["B"].posts:  # decode posted it and waits
            await asyncio.sleep(0.02)
    assert (await P.metrics(http))["vllm:kv_cache_usage_perc"] > 0  # the send's blocks, held
    wire0 = await D.wire_tokens(http)
    t0 = time.monotonic()
    await _restart(cluster)
    async with asyncio.timeout(40):  # the lease would have held it 60 s
        out = await decode
    print(f"decode's receive failed with the agent; its request ended {time.monotonic() - t0:.1f} s "
          "after the restart began")
    assert tokens(out) == base2
    await cluster.settled()  # prefill's blocks are free: its send ended with the old agent
    # Prefill's send ended through the agent (its shutdown refused it) and prefill went idle: its
    # worker may not step again before this, so it has said only that the agent is stopping.
    assert re.search("lost the agent|is shutting down", P.log.read_text(errors="replace"))
    assert "lost the agent" in D.log.read_text(errors="replace")  # decode steps while it waits
    A, B = cluster.agents["A"], cluster.agents["B"]
    async with asyncio.timeout(30):  # the workers registered again (D2 too), prefill's scheduler is back
        while not (len(_with_regions(A)) == 1 and len(_with_regions(B)) == 2
                   and any("-scheduler#" in e["name"] for e in A.describe()["engines"])):
            await asyncio.sleep(0.05)
    # A worker's word that its agent is gone stands 1 s (connector.DOWN_REPORT_S) while vLLM
    # is idle, and prefill's worker last said it a moment after the restart.
    await asyncio.sleep(1.2)
    rx0 = metric(B, "pddwire_bytes_total", peer="A/a1", lane="bulk", direction="rx")
    prompt = prompt_for(32)
    out = await cluster.via_proxy(prompt)
    assert cluster.proxy.log[-1]["prefill"]["do_remote_prefill"] is True, cluster.proxy.log[-1]
    assert tokens(out) == await cluster.baseline(prompt)
    assert await D.wire_tokens(http) - wire0 == len(prompt)
    assert metric(B, "pddwire_bytes_total", peer="A/a1", lane="bulk", direction="rx") - rx0 == \
        cluster.kv_bytes(prompt)
    await cluster.settled()
    for server in (P, D):  # no engine died on the way (a raise in a connector hook ends EngineCore)
        assert "EngineCore encountered" not in server.log.read_text(errors="replace"), server.url
