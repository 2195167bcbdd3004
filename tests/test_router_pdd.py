"""``pdd-wire router`` P-RLD-MD (one-shot and catch-up handoff) and P-RLD over real ``vllm serve``.

    client -> Router -> P   (vllm serve, kv_producer, node A/a1)  sends the KV to RLD and MD
                     -> RLD (vllm serve, kv_consumer, prefix caching, node A/a2)  streams at once
                     -> MD  (vllm serve, kv_consumer, prefix caching, node B/b1)
                     -> MD2 (vllm serve, kv_consumer, prefix caching, node B/b2)  a second MD

The agents' policy sends every request P-RLD-MD (a TTFT budget of 0), except long input with
short output (the anomalous filter, scaled down: 250 tokens in, under 8 out), which is P-RLD.
RLD streams; once MD answers the prompt with P's KV (``max_tokens=1``), RLD is stopped at
position m and MD continues from the prompt and the m emitted tokens (one-shot), or first
absorbs RLD's tokens into its prefix cache in rounds (catch-up). The user's stream must be a
single server's greedy stream: every position once, in order, one id, one ending.
``handoff.min_rld_tokens`` and ``max_rld_tokens`` force the switch at chosen positions.

MD2 is SIGKILLed by the test that kills MD during a handoff (no later test uses it), and RLD by
the last test.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import time
import warnings
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from conftest import until
from pdd_tools.vllm.serve import (
    BLOCK,
    VllmServer,
    complete,
    completion_body,
    connector_config,
    missing,
    tokens,
    vllm_session,
)
from pdd_wire.router import Router, loads
from pdd_wire.router.config import Member
from support.agents import BESIDE_VLLM_DEAD_AFTER_S, cluster_toml, free_port, run_agents
from test_router_vllm import counted_by_label, prompt_for, sample
from test_vllm_serve import NICE, Cluster, settles_after_each_test

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

N = 96  # tokens generated per request: room for a clean text boundary in the tiny model's output
SALT = "tiny-llama/torch.float32"
# What a failed assertion on one handoff counter shows of the others (which came instead)
OUTCOMES = ("pddwire_router_handoffs_total", "pddwire_router_handoff_modes_total", "pddwire_router_fallbacks_total",
            "pddwire_router_rld_load_scrapes_total", "pddwire_router_pipeline_choices_total")


class Pdd:
    def __init__(self, tmp: Path, agents: dict, P: VllmServer, RLD: VllmServer, MD: VllmServer,
                 MD2: VllmServer, http: aiohttp.ClientSession) -> None:
        self.tmp, self.agents, self.P, self.RLD, self.MD, self.MD2, self.http = tmp, agents, P, RLD, MD, MD2, http

    async def baseline(self, prompt: list[int], n: int = N, **extra) -> dict:
        """A single server's greedy answer (P, no KV transfer)."""
        return await complete(self.http, self.P.url, completion_body(prompt, n, **extra))

    async def settled(self) -> None:
        """No request or KV block left in any live vLLM, nothing pinned at any agent."""
        for D in (self.RLD, self.MD, self.MD2):
            if alive(D) and alive(self.P):
                await Cluster(self.tmp, self.agents, self.P, D, None, self.http).settled()

    def router(self, *, pos: int | None = None, rld: str | None = None, md: VllmServer | str | None = None,
               md2: bool = False, rld_seqs: int = 64, policy: dict | None = None, lease_s: float = 30.0,
               **handoff) -> Router:
        """A router over P, RLD and MD (``md``: that server, or a URL, instead, at B/b2; ``md2``:
        MD2 as a second MD member); ``rld``: another RLD URL instead, without site or node (P then
        sends the KV to MD only): put in the pool at run time, as the config requires a site."""
        rld_member = f'url = "{self.RLD.url}"\nsite = "A"\nnode = "a2"'
        mds = [(self.MD.url, "b1")] if md is None else [(md if isinstance(md, str) else md.url, "b2")]
        if md2:
            mds.append((self.MD2.url, "b2"))
        md_members = "".join(f'[[pools.MD]]\nurl = "{u}"\nsite = "B"\nnode = "{n}"\n' for u, n in mds)
        h = {"absorb_s": 60.0, **handoff}  # as connect_s: MD slow to absorb is not what these tests check
        if pos is not None:
            h |= {"min_rld_tokens": pos, "max_rld_tokens": pos}
        lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in h.items())
        plines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in (policy or {}).items())
        r = Router(loads(f"""
[listen]
address = "127.0.0.1:0"
[request]
deadline_s = 120
prefill_lease_s = {lease_s}
connect_s = 30  # correctness checks, not speed ones: a loaded 2-core machine may take seconds
[[pools.P]]
url = "{self.P.url}"
engine_socket = "{self.tmp}/a1.sock"
site = "A"
node = "a1"
[[pools.RLD]]
{rld_member}
max_num_seqs = {rld_seqs}
{md_members}
[choice]
block_tokens = {BLOCK}
prefix_salt = "{SALT}"
timeout_s = 10  # a correctness check, not a speed one: on this loaded machine the agents
                # (in-process, on the test's loop) may take seconds to answer 16 at once
[rld_load]
interval_s = 0.05
timeout_s = 30  # a correctness check: a scrape of vLLM's /metrics may take seconds here
[handoff]
{lines}
[handoff.policy]
{plines}"""))
        if rld:
            r.pools.remove("RLD", self.RLD.url)
            r.pools.add("RLD", Member(url=rld, max_num_seqs=rld_seqs))
        return r


def alive(s: VllmServer) -> bool:
    return s.proc is not None and s.proc.returncode is None


async def kill(s: VllmServer) -> None:
    """SIGKILL the server's whole process group (API server and engine core)."""
    assert s.proc is not None
    os.killpg(s.proc.pid, signal.SIGKILL)
    await s.proc.wait()


async def stream_killing(pdd: Pdd, router: Router, body: dict, victim: VllmServer, pool: str, after: int) -> list[dict]:
    """A streamed request during which ``victim`` is SIGKILLed once the router has relayed
    ``after`` tokens from ``pool``: the chunks the client got (one ``[DONE]``, at the end), once
    the router counted the request."""
    before = sample(router, "pddwire_router_requests_total")
    async with pdd.http.post(f"{router.url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status == 200
        buf = b""
        async for data in r.content.iter_any():
            buf += data
            if alive(victim) and sample(router, "pddwire_router_output_tokens_total", pool=pool) >= after:
                await kill(victim)
    raw = buf.split(b"\n\n")
    assert not alive(victim)
    assert raw[-1] == b"" and raw[-2] == b"data: [DONE]" and b"data: [DONE]" not in raw[:-2]
    await counted(router, before)
    return [json.loads(e[6:]) for e in raw[:-2]]


async def counted(router: Router, before: float) -> None:
    """Until the router counted a request more than ``before`` (``requests_total``): its handler
    has ended, and with it the request's other counts (a stream's handoff outcome is counted
    after its last byte went out)."""
    await until(lambda: sample(router, "pddwire_router_requests_total") > before, 30, "the router counting the request")


async def stream(http: aiohttp.ClientSession, to: Router | str, body: dict) -> tuple[list[dict], list[bytes]]:
    """A streamed request to a server's URL or to a router (then returned once the router
    counted it)."""
    url = to.url if isinstance(to, Router) else to
    before = sample(to, "pddwire_router_requests_total") if isinstance(to, Router) else 0.0
    async with http.post(f"{url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        raw = (await r.read()).split(b"\n\n")
    assert raw[-1] == b"" and raw[-2] == b"data: [DONE]" and b"data: [DONE]" not in raw[:-2]
    if isinstance(to, Router):
        await counted(to, before)
    return [json.loads(e[6:]) for e in raw[:-2]], raw


def check_one_stream(chunks: list[dict], base: dict, n: int = N, *, text: bool = True) -> None:
    """One server's stream: the same tokens and text, one id and created, the prompt's ids once
    (in the first event), one ending, at the end."""
    assert all("error" not in c for c in chunks), chunks
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or ()]
    assert ids == tokens(base)
    if text:
        assert "".join(ch.get("text") or "" for c in chunks for ch in c["choices"]) == base["choices"][0]["text"]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    prompts = [ch["prompt_token_ids"] for c in chunks for ch in c["choices"] if ch.get("prompt_token_ids") is not None]
    assert prompts == [base["choices"][0]["prompt_token_ids"]] and chunks[0]["choices"][0]["prompt_token_ids"]
    ends = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    assert ends == ["length"] and chunks[-1]["choices"][0]["finish_reason"] == "length"


def switch_point(chunks: list[dict], pos: int, n: int = N) -> int | None:
    """Where a switch forced at ``pos`` (``min_rld_tokens = max_rld_tokens = pos``) happens: at
    0, or after the first event ending at or past ``pos`` that is one token of whole text (the
    router relays RLD's events as they came, so the client's events up to the switch are RLD's);
    None: none came before the end (RLD finishes: ``no_clean_boundary``)."""
    if pos == 0:
        return 0
    m = 0
    for ch in (ch for c in chunks for ch in c["choices"]):
        ids, text = ch.get("token_ids") or [], ch.get("text") or ""
        m += len(ids)
        if ids and pos <= m < n and len(ids) == 1 and text and "\ufffd" not in text:
            return m
    return None


def cached_at_switch(L: int, m: int, absorbed: int) -> int:
    """Prompt tokens MD's prefix cache gives its continuation (prompt + m emitted): the full
    blocks of the prompt (loaded from P) and of what it absorbed, never the last token."""
    return min(max(L // BLOCK, (L + absorbed) // BLOCK), (L + m - 1) // BLOCK) * BLOCK


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pdd():
    why = missing()
    if why:
        pytest.fail(f"the vLLM venv is needed for this test ({why}): run scripts/vllm-env", pytrace=False)
    tmp = Path(tempfile.mkdtemp(prefix="pdw-router-pdd-"))
    # Every request P-RLD-MD, except the anomalous filter's (scaled to the tiny model).
    policy = "[policy.pipeline]\nttft_budget_s = 0\nanomaly_min_input_tokens = 250\nanomaly_max_output_tokens = 8\n"
    tomls = cluster_toml(tmp, [("A", "a1"), ("A", "a2"), ("B", "b1"), ("B", "b2")], streams=2, extra=policy,
                         dead_after_s=BESIDE_VLLM_DEAD_AFTER_S)
    servers: list[VllmServer] = []
    async with run_agents(tomls) as agents, vllm_session() as http:
        try:
            P = VllmServer("P", tmp / "P.log", cpu="0", nice=NICE,
                           kv=connector_config("kv_producer", f"{tmp}/a1.sock", lease_s=30.0))

            def decode(name: str, cpu: str, node: str) -> VllmServer:
                return VllmServer(name, tmp / f"{name}.log", cpu=cpu, nice=NICE, prefix_caching=True,
                                  failure_policy="recompute",
                                  kv=connector_config("kv_consumer", f"{tmp}/{node}.sock", recv_slack_s=2.0))

            RLD, MD, MD2 = decode("RLD", "1", "a2"), decode("MD", "1", "b1"), decode("MD2", "0", "b2")
            # The connector's debug lines (what vLLM's scheduler asked, what was posted) for
            # test_md_is_the_member_holding_the_longest_prefix's warning, should MD2 be late.
            MD2.env["VLLM_LOGGING_LEVEL"] = "DEBUG"
            servers = [P, RLD, MD, MD2]
            t0 = time.monotonic()
            await asyncio.gather(*(s.start() for s in servers))
            print(f"vLLM servers ready in {time.monotonic() - t0:.1f} s")
            yield Pdd(tmp, agents, P, RLD, MD, MD2, http)
        finally:
            await asyncio.gather(*(s.stop() for s in servers), return_exceptions=True)
            for s in servers:
                print(f"--- {s.name} log tail ---\n{s.tail(15)}")
    shutil.rmtree(tmp, ignore_errors=True)


_settles = settles_after_each_test("pdd")


@pytest.mark.parametrize(("mode", "pos"), [("one-shot", 0), ("one-shot", 5), ("one-shot", 21), ("one-shot", 40),
                                           ("catch-up", 0), ("catch-up", 21), ("catch-up", 40)])
async def test_the_handoff_at_a_chosen_position_gives_one_servers_stream(pdd, mode, pos):
    """Forced at position 0 (MD makes every token), 5 (inside the prompt's last block), 21 (at a
    block boundary: 75 + 21 = 3 blocks) and 40 (inside the next block), or the first clean text
    boundary after it (RLD's last token one event of whole text; the tiny model's text is mostly
    byte tokens): the stream is a single server's. Catch-up absorbs up to the last block boundary
    before the switch (forced, the round runs at the position); MD's continuation then takes
    every full block it absorbed from its prefix cache: its extend is the rest (vLLM's usage)."""
    L = 75
    prompt = prompt_for(pos + 1 + (100 if mode == "catch-up" else 0), L)
    base = await pdd.baseline(prompt)
    wire_rld0, wire_md0 = await pdd.RLD.wire_tokens(pdd.http), await pdd.MD.wire_tokens(pdd.http)
    async with pdd.router(pos=pos, mode=mode, policy={"catchup_gap_tokens": 2}) as router:
        chunks, _ = await stream(pdd.http, router, completion_body(prompt, N))
        check_one_stream(chunks, base)
        assert sample(router, "pddwire_router_pipeline_choices_total", pipeline="P-RLD-MD") == 1
        decided = sample(router, "pddwire_router_handoff_modes_total", mode=mode, reason="configured")
        m = sample(router, "pddwire_router_output_tokens_total", pool="RLD")
        switched = switch_point(chunks, pos)
        if switched is None and not decided:
            # MD was not ready before RLD's end (its warm request behind on a loaded machine): the
            # mode is chosen only once MD holds the KV, so none was, and RLD finished the output.
            assert m == N and sum(sample(router, "pddwire_router_handoffs_total", outcome=o)
                                  for o in ("rld_finished", "md_not_ready")) == 1
        else:
            assert decided == 1
            if switched is None:  # vLLM merged every RLD event past pos (it does when behind): RLD finished
                assert m == N and sample(router, "pddwire_router_handoffs_total", outcome="no_clean_boundary") == 1
                assert sample(router, "pddwire_router_handoff_deferrals_total") >= 1
            else:
                assert sample(router, "pddwire_router_handoffs_total", mode=mode, outcome="switched") == 1
                assert m == switched and sample(router, "pddwire_router_output_tokens_total", pool="MD") == N - m
                assert sample(router, "pddwire_router_handoff_stall_seconds_count", mode=mode) == 1
            absorbed = sample(router, "pddwire_router_catchup_absorbed_tokens_total")
            rounds = sample(router, "pddwire_router_catchup_rounds_sum")
            if mode == "catch-up" and pos:
                # one round at the position (21, or past it where one event carried several tokens),
                # up to the last block boundary
                assert absorbed >= 21 and (L + absorbed) % BLOCK == 0
                assert switched is None or (rounds == 1 and absorbed <= m)
            elif mode == "catch-up":
                assert rounds == absorbed == 0
            else:
                assert absorbed == 0 and sample(router, "pddwire_router_catchup_rounds_count") == 0
            if switched is not None:
                extend = sample(router, "pddwire_router_handoff_extend_tokens_sum", mode=mode)
                assert extend == L + m - cached_at_switch(L, int(m), int(absorbed))
            assert sample(router, "pddwire_router_rld_share_sum") == pytest.approx(m / N)
    # MD took the prompt's KV from the wire (P sent it to RLD and MD); RLD did too when it was
    # not stopped before its first token.
    assert await pdd.MD.wire_tokens(pdd.http) - wire_md0 == len(prompt)
    if m:
        assert await pdd.RLD.wire_tokens(pdd.http) - wire_rld0 == len(prompt)
    await pdd.settled()


@pytest.mark.parametrize("mode", ["one-shot", "catch-up"])
async def test_p_rld_md_gives_the_single_server_output_streamed_and_not(pdd, mode):
    """Prompts of 5, 75 and 300 tokens, each streamed and not (a non-streamed request is run
    from the streams and answered whole: the single server's body, field for field)."""
    for length in (5, 75, 300):
        prompt = prompt_for(1000 + length + (1 if mode == "catch-up" else 0), length)
        base = await pdd.baseline(prompt)
        async with pdd.router(pos=24, mode=mode, policy={"catchup_gap_tokens": 2}) as router:
            chunks, _ = await stream(pdd.http, router, completion_body(prompt, N))
            check_one_stream(chunks, base)
            async with pdd.http.post(f"{router.url}/v1/completions", json=completion_body(prompt, N)) as r:
                assert r.status == 200
                whole = await r.json()
            assert sample(router, "pddwire_router_handoffs_total", mode=mode) == 2, counted_by_label(router, *OUTCOMES)
        assert whole.keys() == base.keys() and whole["choices"][0].keys() == base["choices"][0].keys()
        assert whole["object"] == base["object"] and whole["model"] == base["model"]
        for k in ("text", "token_ids", "finish_reason", "stop_reason", "prompt_token_ids", "logprobs"):
            assert whole["choices"][0][k] == base["choices"][0][k], k
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert whole["usage"][k] == base["usage"][k], k
    await pdd.settled()


async def test_token_ids_stay_out_of_the_stream_unless_asked(pdd):
    """The router asks RLD and MD for token ids (it continues from them) and for usage; a client
    that asked neither gets the stream without them, as from vllm serve; one that asked for
    usage gets it counted as one request's."""
    prompt = prompt_for(21, 60)
    base = await pdd.baseline(prompt)
    body = {k: v for k, v in completion_body(prompt, N).items() if k != "return_token_ids"}
    direct, _ = await stream(pdd.http, pdd.P.url, body)
    async with pdd.router(pos=7) as router:
        chunks, _ = await stream(pdd.http, router, body)
        with_usage, _ = await stream(pdd.http, router, {**body, "stream_options": {"include_usage": True}})
        assert sample(router, "pddwire_router_handoffs_total", outcome="switched") \
            + sample(router, "pddwire_router_handoffs_total", outcome="no_clean_boundary") == 2
    # vllm serve's own fields: token ids null (unasked), no usage, the fingerprint on the ending
    assert {k for c in chunks for k in c} == {k for c in direct for k in c}
    assert all(ch["token_ids"] is None and ch["prompt_token_ids"] is None for c in chunks for ch in c["choices"])
    assert all("usage" not in c or c["usage"] is None for c in chunks)
    has_fp = [c.get("system_fingerprint") is not None for c in chunks]
    assert has_fp == [False] * (len(chunks) - 1) + [direct[-1].get("system_fingerprint") is not None]
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == base["choices"][0]["text"]
    usage = with_usage[-1]["usage"]
    assert with_usage[-1]["choices"] == [] and len([c for c in with_usage if c.get("usage")]) == 1
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (60, N)
    await pdd.settled()


async def test_logprobs_across_the_switch_are_one_servers(pdd):
    """``logprobs: 2`` with ``ignore_eos`` (a special token then comes as a token with no text),
    streamed and not, switched at 24 or the next clean boundary: each token's string and
    ``text_offset`` as a single server counts them (vLLM's running offset: the last one plus its
    token's length, not the text's), the logprobs equal to float noise."""
    prompt = prompt_for(29, 60)
    base = (await pdd.baseline(prompt, logprobs=2))["choices"][0]["logprobs"]
    async with pdd.router(pos=24) as router:
        chunks, _ = await stream(pdd.http, router, completion_body(prompt, N, logprobs=2))
        async with pdd.http.post(f"{router.url}/v1/completions", json=completion_body(prompt, N, logprobs=2)) as r:
            assert r.status == 200
            whole = (await r.json())["choices"][0]["logprobs"]
        assert sample(router, "pddwire_router_handoffs_total") == 2
    lps = [ch["logprobs"] for c in chunks for ch in c["choices"] if ch.get("logprobs")]
    streamed = {k: [x for lp in lps for x in lp[k]] for k in ("text_offset", "tokens", "token_logprobs")}
    for got in (streamed, whole):
        assert got["text_offset"] == base["text_offset"] and got["tokens"] == base["tokens"]
        assert got["token_logprobs"] == pytest.approx(base["token_logprobs"], abs=1e-3)
    await pdd.settled()


async def test_the_mode_follows_rlds_live_load(pdd):
    """``handoff.mode = "auto"``: RLD's load from its own /metrics (running + waiting over its
    max_num_seqs), read after RLD started this request, decides once MD holds the KV and the
    gap is above ``catchup_gap_tokens``: declared with one sequence, RLD running another
    client's long request (500 tokens, in the same batch: it outlasts this request's first 24
    whatever the machine's speed) is busy (one-shot, ``rld_busy``); with 64 it has headroom
    (catch-up, ``rld_headroom``). 400 tokens, not N, so that MD is ready before RLD ends alone
    (with the 70-token prompt, near the tiny model's 512-token context). Where MD still is not
    (RLD made them all before MD held the KV or RLD's load was read: ``undecided``; in four
    full suites here the 64-seq leg came out so twice, once at 300 tokens, once at 400),
    nothing was decided and the request ended on RLD, as it should: that try says nothing of
    the mode, and the case is tried again (warned), up to five times."""
    n = 400
    for seqs, mode, reason in ((1, "one-shot", "rld_busy"), (64, "catch-up", "rld_headroom")):
        prompt = prompt_for(30 + seqs, 70)
        base = await pdd.baseline(prompt, n)
        tries = []
        while len(tries) < 5:
            async with pdd.http.post(f"{pdd.RLD.url}/v1/completions",
                                     json=completion_body(prompt_for(39, 8), 500, stream=True)) as other:
                await other.content.readline()  # running on RLD
                async with pdd.router(rld_seqs=seqs, min_rld_tokens=24, policy={"catchup_gap_tokens": 8}) as router:
                    chunks, _ = await stream(pdd.http, router, completion_body(prompt, n))
                    check_one_stream(chunks, base, n)
                    counts = counted_by_label(router, *OUTCOMES, "pddwire_router_draining",
                                              "pddwire_router_drains_total")
                    undecided = sample(router, "pddwire_router_handoffs_total", mode="undecided")
                    if not undecided:
                        assert sample(router, "pddwire_router_handoff_modes_total", mode=mode, reason=reason) == 1, \
                            counts
                        assert sample(router, "pddwire_router_rld_load_scrapes_total", outcome="ok") >= 1
                        assert sample(router, "pddwire_router_handoffs_total", mode=mode) == 1
                    else:  # RLD ended first: nothing decided, nothing counted but that ending
                        assert sample(router, "pddwire_router_handoffs_total", mode="undecided",
                                      outcome="rld_finished") == 1, counts
                        assert not sample(router, "pddwire_router_handoff_modes_total"), counts
                other.close()  # vLLM aborts it
            await pdd.settled()
            tries.append(counts)
            if not undecided:
                break
            # draining (or a drain counted): MD was not ready when RLD ended; neither: RLD's load was unread.
            warnings.warn(f"{seqs} seqs: RLD made all {n} tokens before the mode was decided; trying again. "
                          f"{counts}", stacklevel=1)
        else:
            pytest.fail(f"RLD made all {n} tokens before the mode was decided in 5 tries of {seqs} seqs: {tries}")


async def test_md_is_the_member_holding_the_longest_prefix(pdd):
    """Two MD members: the prompt's first 96 tokens are in MD2's prefix cache (a request to MD2
    left them there; its connector reported them to agent b2 with its next step). The choice
    asks P's agent for both members: MD2 holds 3 blocks, MD none, so MD2 gets the request (the
    least-loaded rule alone, both idle, takes them in turn).

    In 2 of 8 full suites here and in one CI run, and in none of 8 runs of this module or of the
    vLLM tests alone (2026-12-02), MD2 did not post its receive for the routed request within the
    router's md_ready_s (30 s; 60 s when tried): the router fell back (``md_not_ready``), RLD made
    every token, and P's KV to b2 was refused as unposted. That ending is the product's right one
    for a late MD, and the choice (what this test is about) was made; so such a try is checked as
    that fallback, warned with MD2's pdd-wire log lines for it (the connector's debug lines: what
    vLLM's scheduler asked and what was posted) and tried again with another prompt, up to 3 times.
    The cause is not found yet: the warning in the next run that shows it is what to read."""
    for attempt in range(3):
        prompt = prompt_for(40 + 2 * attempt, 110)
        base = await pdd.baseline(prompt)
        await complete(pdd.http, pdd.MD2.url, completion_body(prompt[:96] + [5], 1))
        await complete(pdd.http, pdd.MD2.url, completion_body(prompt_for(41 + 2 * attempt, 8), 1))  # the report's step
        done2 = (await pdd.MD2.metrics(pdd.http)).get("vllm:request_success_total", 0)
        done1 = (await pdd.MD.metrics(pdd.http)).get("vllm:request_success_total", 0)
        log_at = pdd.MD2.log.stat().st_size
        async with pdd.router(md2=True, pos=0) as router:
            chunks, _ = await stream(pdd.http, router, completion_body(prompt, N))
            check_one_stream(chunks, base)
            assert sample(router, "pddwire_router_prompt_tokens_total", source="md_prefix") == 96
            counts = counted_by_label(router, *OUTCOMES)
            switched = sample(router, "pddwire_router_handoffs_total", outcome="switched")
            if not switched:  # MD2 late: the request stayed on RLD, as it should
                assert sample(router, "pddwire_router_fallbacks_total", kind="md_not_ready") == 1, counts
                assert sample(router, "pddwire_router_output_tokens_total", pool="RLD") == N, counts
                assert sample(router, "pddwire_router_output_tokens_total", pool="MD") == 0, counts
        if switched:
            assert switched == 1, counts
            # MD2 answered the warm request and the continuation; MD nothing.
            assert (await pdd.MD2.metrics(pdd.http)).get("vllm:request_success_total", 0) - done2 == 2
            assert (await pdd.MD.metrics(pdd.http)).get("vllm:request_success_total", 0) == done1
            await pdd.settled()
            return
        await pdd.settled()  # MD2's late request ended too, nothing held
        with open(pdd.MD2.log, errors="replace") as f:
            f.seek(log_at)
            lines = [ln.rstrip() for ln in f if "pdd-wire" in ln or "ERROR" in ln][-40:]
        warnings.warn(f"MD2 did not post its receive in time (try {attempt + 1} of 3): {counts}; "
                      "MD2's log:\n" + "\n".join(lines), stacklevel=1)
    pytest.fail("MD2 did not post its receive in time in 3 tries (see the warnings)")


async def test_the_anomalous_filter_finishes_on_an_rld_member(pdd):
    """300 tokens in, 4 out: P-RLD. P's KV goes to the RLD member (same site), RLD decodes;
    nothing to MD, nothing over the WAN."""
    prompt = prompt_for(50, 300)
    base = await pdd.baseline(prompt, 4)
    wire_rld0, wire_md0 = await pdd.RLD.wire_tokens(pdd.http), await pdd.MD.wire_tokens(pdd.http)
    async with pdd.router() as router:
        out = await complete(pdd.http, router.url, completion_body(prompt, 4))
        assert tokens(out) == tokens(base)
        assert sample(router, "pddwire_router_pipeline_choices_total", pipeline="P-RLD",
                      reason="anomalous_long_input_short_output") == 1
        assert sample(router, "pddwire_router_output_tokens_total", pool="RLD") == 4
        assert sample(router, "pddwire_router_wan_kv_bytes_sum") == 0
    assert await pdd.RLD.wire_tokens(pdd.http) - wire_rld0 == 300
    assert await pdd.MD.wire_tokens(pdd.http) == wire_md0
    await pdd.settled()


async def test_sixteen_concurrent_mixed_requests(pdd):
    """16 at once, streamed and not, 20 to 300 prompt tokens, two MD members, the mode from
    RLD's load (catch-up with headroom): every answer is the single server's, RLD's and MD's
    tokens add up, nothing is left anywhere."""
    prompts = [prompt_for(400 + i, 20 + 19 * i) for i in range(16)]
    bases = [await pdd.baseline(pr, 48) for pr in prompts]
    async with pdd.router(md2=True, policy={"catchup_gap_tokens": 4}) as router:
        async def one(i: int, pr: list[int]) -> list[int]:
            if i % 2:
                chunks, _ = await stream(pdd.http, router, completion_body(pr, 48))
                return [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or ()]
            return tokens(await complete(pdd.http, router.url, completion_body(pr, 48)))

        outs = await asyncio.gather(*(one(i, pr) for i, pr in enumerate(prompts)))
        assert outs == [tokens(b) for b in bases]
        await counted(router, 15)  # all 16 ended (their outcomes counted)
        # Each request P-RLD-MD, with one handoff outcome, unless its choice took longer than
        # choice.timeout_s (then P-MD: a fallback, the same answer).
        ended = {o: sample(router, "pddwire_router_handoffs_total", outcome=o)
                 for o in ("switched", "rld_finished", "no_clean_boundary", "md_failed", "md_not_ready",
                           "rld_failed", "failed", "cancelled")}
        chosen = sample(router, "pddwire_router_pipeline_choices_total", pipeline="P-RLD-MD")
        assert ended["switched"] + ended["rld_finished"] + ended["no_clean_boundary"] == chosen, ended
        assert chosen + sample(router, "pddwire_router_fallbacks_total", kind="choice_failed") == 16
        assert (sample(router, "pddwire_router_output_tokens_total", pool="RLD")
                + sample(router, "pddwire_router_output_tokens_total", pool="MD")) == 16 * 48
        assert all(u.inflight == 0 for u in router.pools)
    await pdd.settled()


async def test_requests_the_handoff_cannot_splice_run_p_md(pdd):
    """With ``handoff.non_streamed = false``, and for a penalty counting output tokens (which
    a continuation would count as prompt): P-MD, the fallback counted, the single server's
    answer."""
    prompt = prompt_for(22, 50)
    base = await pdd.baseline(prompt)
    pen = await pdd.baseline(prompt, presence_penalty=0.5)
    async with pdd.router(non_streamed=False) as router:
        assert tokens(await complete(pdd.http, router.url, completion_body(prompt, N))) == tokens(base)
        chunks, _ = await stream(pdd.http, router, completion_body(prompt, N, presence_penalty=0.5))
        check_one_stream(chunks, pen)
        assert sample(router, "pddwire_router_fallbacks_total", kind="p_rld_md_not_streamed") == 1
        assert sample(router, "pddwire_router_fallbacks_total", kind="p_rld_md_penalties") == 1
        assert sample(router, "pddwire_router_output_tokens_total", pool="MD") == 2 * N
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
        assert all(u.inflight == 0 for u in router.pools)


async def test_rld_failing_before_its_first_token_leaves_the_output_to_md(pdd):
    """RLD refuses the connection: MD, once it holds the KV, makes every token (fallback
    ``rld_failed``: P-MD); the stream is still a single server's."""
    prompt = prompt_for(24, 70)
    base = await pdd.baseline(prompt)
    async with pdd.router(rld=f"http://127.0.0.1:{free_port()}") as router:
        chunks, _ = await stream(pdd.http, router, completion_body(prompt, N))
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
        chunks, _ = await stream(pdd.http, router, completion_body(prompt, N))
        check_one_stream(chunks, base)
        assert sample(router, "pddwire_router_fallbacks_total", kind="md_not_ready") == 1
        ended = {o: sample(router, "pddwire_router_handoffs_total", outcome=o)
                 for o in ("switched", "rld_finished", "md_not_ready")}
        assert ended == {"switched": 0, "rld_finished": 0, "md_not_ready": 1}
        assert sample(router, "pddwire_router_output_tokens_total", pool="RLD") == N
        assert sample(router, "pddwire_router_output_tokens_total", pool="MD") == 0
    await pdd.settled()


async def test_md_killed_after_the_switch_hands_the_output_back_to_rld(pdd):
    """MD2 (the MD member here) is SIGKILLed while it streams, after a switch at 0 (always a
    clean boundary), once it has made 5 tokens: RLD continues from where MD2 left it
    (``md_failed_after_switch``); the client sees the single server's token ids, one ending.
    MD2 stays down."""
    prompt = prompt_for(27, 70)
    n = 400
    base = await pdd.baseline(prompt, n)
    # md_ready_s 60: MD2 holding the KV late is another test's (a loaded 2-core machine once
    # took over the default 30 s to have MD2 post its receive); this one needs the switch.
    async with pdd.router(md=pdd.MD2, pos=0, md_ready_s=60.0) as router:
        chunks = await stream_killing(pdd, router, completion_body(prompt, n), pdd.MD2, "MD", 5)
        check_one_stream(chunks, base, n, text=sample(router, "pddwire_router_unclean_splices_total") == 0)
        assert sample(router, "pddwire_router_fallbacks_total", kind="md_failed_after_switch") == 1
        assert sample(router, "pddwire_router_handoffs_total", outcome="switched") == 1
        by = {p: sample(router, "pddwire_router_output_tokens_total", pool=p) for p in ("RLD", "MD")}
        assert by["MD"] >= 5 and by["RLD"] >= 1 and by["RLD"] + by["MD"] == n
    await pdd.settled()


async def test_md_down_leaves_the_request_on_rld(pdd):
    """MD's server is down (nothing listens at its URL; P still sends its KV to agent b2): MD's
    warm request fails before any switch, RLD keeps the request to its end (fallback
    ``md_failed``), the stream is a single server's."""
    prompt = prompt_for(26, 70)
    base = await pdd.baseline(prompt)
    async with pdd.router(md=f"http://127.0.0.1:{free_port()}", lease_s=3.0) as router:
        chunks, _ = await stream(pdd.http, router, completion_body(prompt, N))
        check_one_stream(chunks, base)
        assert sample(router, "pddwire_router_fallbacks_total", kind="md_failed") == 1
        assert sample(router, "pddwire_router_handoffs_total", outcome="md_failed") == 1
        assert sample(router, "pddwire_router_output_tokens_total", pool="RLD") == N
    # P's KV for MD2 waits out its lease (3 s, asked by the router) at the agents; then nothing is
    # pinned anywhere.
    await Cluster(pdd.tmp, pdd.agents, pdd.P, pdd.RLD, None, pdd.http).settled(timeout=90)


async def test_rld_killed_mid_stream_leaves_the_output_to_md(pdd):
    """Last in this module: RLD is SIGKILLed while it streams, once it has made 20 tokens (MD may
    not take over before the output's end, so RLD is the streamer until it dies): MD, holding the
    KV, continues from where RLD left it (``rld_failed``); the client sees the single server's
    token ids, one ending."""
    prompt = prompt_for(28, 70)
    n = 400
    base = await pdd.baseline(prompt, n)
    async with pdd.router(min_rld_tokens=n) as router:
        chunks = await stream_killing(pdd, router, completion_body(prompt, n), pdd.RLD, "RLD", 20)
        check_one_stream(chunks, base, n, text=sample(router, "pddwire_router_unclean_splices_total") == 0)
        assert sample(router, "pddwire_router_fallbacks_total", kind="rld_failed") == 1
        assert sample(router, "pddwire_router_handoffs_total", outcome="rld_failed") == 1
        m = sample(router, "pddwire_router_output_tokens_total", pool="RLD")
        assert 20 <= m < n and sample(router, "pddwire_router_output_tokens_total", pool="MD") == n - m
    await Cluster(pdd.tmp, pdd.agents, pdd.P, pdd.MD, None, pdd.http).settled(timeout=90)
