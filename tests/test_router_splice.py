"""The router's splice, exactly once, on every path, against scripted ``vllm serve`` stand-ins.

    client -> Router -> P   (support.fake_vllm: vLLM 0.32's response shapes) -> agent A (real)
                     -> RLD (fake)                                            -> agent B (real)
                     -> MD  (fake)

P's agent (real, in-process, a TTFT budget of 0) chooses P-RLD-MD for every request. The fakes
replay a scripted greedy output (a prompt plus m of its tokens continues from m, as an engine's
greedy output would) with DecodeStream's detokenizer, logprobs offsets as vLLM counts them, and
faults: error events, ``abort`` endings, undecodable and unterminated events, cuts, stalls,
events of several tokens. Every answer the client gets is compared with a single fake
server's answer to the same request: token ids, text, logprobs, usage, fingerprint, one id,
one ending, one ``[DONE]``. Fast (no vLLM) and deterministic: where order matters, the fakes
wait on events the test sets.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import tempfile
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from conftest import until
from pdd_wire.router import Router, loads
from pdd_wire.router.server import UPSTREAM_KEEPALIVE_S
from support.agents import run_agents, two_site_toml
from support.fake_vllm import EOS, FINGERPRINT, FakeVllm, Model, Script, fakes

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [10, 11, 12, 13, 14]  # "abcde"
# f, space, g, é in two tokens, h, </s>, i, € in two tokens, j, then letters: clean boundaries
# (one whole-text token) after 1, 2, 3, 5, 6, 8, 10, 11, ...; none after 4 (inside é), 7 (</s>
# has no text), 9 (inside €).
OUT = [15, 40, 16, 50, 51, 17, EOS, 18, 60, 61, 19] + [20 + i % 10 for i in range(29)]
N = len(OUT)
MODEL = Model(PROMPT, OUT)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def agents():
    tmp = Path(tempfile.mkdtemp(prefix="pdw-splice-"))
    try:
        async with run_agents(two_site_toml(tmp, streams=1, extra="[policy.pipeline]\nttft_budget_s = 0\n")):
            yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest_asyncio.fixture(loop_scope="module")
async def http():
    async with aiohttp.ClientSession() as s:
        yield s


VLLM_KEEPALIVE_S = 5.0  # vLLM's default (vllm/envs.py VLLM_HTTP_TIMEOUT_KEEP_ALIVE)


def router(tmp: Path, P: FakeVllm, RLD: FakeVllm, MD: FakeVllm, *, pos: int | None = None, deadline_s: float = 30,
           ask_agent: bool = True, connect_s: float = 5, rld_seqs: int = 4, policy: str = "", **handoff) -> Router:
    if pos is not None:
        handoff |= {"min_rld_tokens": pos, "max_rld_tokens": pos}
    lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in handoff.items())
    return Router(loads(f"""
[listen]
address = "127.0.0.1:0"
[request]
deadline_s = {deadline_s}
connect_s = {connect_s}
[[pools.P]]
url = "{P.url}"
engine_socket = "{tmp}/A.sock"
site = "A"
[[pools.RLD]]
url = "{RLD.url}"
site = "A"
max_num_seqs = {rld_seqs}
[[pools.MD]]
url = "{MD.url}"
site = "B"
[choice]
ask_agent = {json.dumps(ask_agent)}
block_tokens = 4
timeout_s = 10
[rld_load]
interval_s = 0.01
[handoff]
{lines}
[handoff.policy]
{policy}
"""))


def body(**extra) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": N, "temperature": 0, "return_token_ids": True,
            "stream": True, **extra}


def sample(router: Router, name: str, **labels) -> float:
    return sum(s.value for m in router.metrics.registry.collect() for s in m.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def outcomes(router: Router) -> dict[str, float]:
    got: dict[str, float] = {}
    for m in router.metrics.registry.collect():
        for s in m.samples:
            if s.name == "pddwire_router_handoffs_total" and s.value:
                got[s.labels["outcome"]] = got.get(s.labels["outcome"], 0) + s.value
    return got


async def stream(http: aiohttp.ClientSession, url: str, b: dict) -> list[dict]:
    """The chunks of one streamed answer, which ends with exactly one ``[DONE]``."""
    async with http.post(f"{url}/v1/completions", json=b) as r:
        assert r.status == 200, await r.text()
        raw = (await r.read()).split(b"\n\n")
    assert raw[-1] == b"" and raw[-2] == b"data: [DONE]" and b"data: [DONE]" not in raw[:-2], raw[-3:]
    return [json.loads(e[6:]) for e in raw[:-2]]


async def single(b: dict) -> list[dict] | dict:
    """A single server's answer to the same request (its stream's chunks, or its body)."""
    async with FakeVllm("single", MODEL) as one, aiohttp.ClientSession() as http:
        if b.get("stream"):
            return await stream(http, one.url, b)
        async with http.post(f"{one.url}/v1/completions", json=b) as r:
            return await r.json()


def choices(chunks: list[dict]) -> list[dict]:
    return [c for ev in chunks for c in ev["choices"]]


def flat(chunks: list[dict]) -> dict:
    """What a client reads from a stream, whichever way vLLM grouped it into events."""
    cs = choices(chunks)
    lp = [c["logprobs"] for c in cs if c.get("logprobs")]
    return {"ids": [t for c in cs for t in c.get("token_ids") or ()], "text": "".join(c["text"] for c in cs),
            "ends": [c["finish_reason"] for c in cs if c["finish_reason"]],
            "offsets": [o for x in lp for o in x["text_offset"]], "tokens": [t for x in lp for t in x["tokens"]],
            "usage": [ev["usage"] for ev in chunks if ev.get("usage")],
            "fingerprints": [(bool(ev["choices"]), ev["system_fingerprint"]) for ev in chunks
                             if "system_fingerprint" in ev],
            "prompt_ids": [c["prompt_token_ids"] for c in cs if c.get("prompt_token_ids") is not None]}


def same_stream(got: list[dict], base: list[dict]) -> None:
    """One server's stream: everything a client reads equal, one id and created, the ending last."""
    g, b = flat(got), flat(base)
    for k in ("ids", "text", "ends", "offsets", "tokens", "fingerprints", "prompt_ids"):
        assert g[k] == b[k], k
    assert [{k: v for k, v in u.items() if k != "prompt_tokens_details"} for u in g["usage"]] == \
        [{k: v for k, v in u.items() if k != "prompt_tokens_details"} for u in b["usage"]]
    assert len({ev["id"] for ev in got}) == 1 and len({ev["created"] for ev in got}) == 1
    last = [ev for ev in got if ev["choices"]][-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert all(set(c) == set(choices(base)[0]) for c in choices(got))  # vLLM's fields, no more


# ---------------------------------------------------------------------------------- the splice
@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("ids", [True, False])
async def test_a_switch_gives_one_servers_stream(agents, http, usage, ids):
    """Forced at 7 (after </s>: no text, so not clean), the switch comes at 8: the client reads
    one server's stream, logprobs' offsets counted by token strings across the splice (``</s>``
    and the split ``é`` make them differ from the text's length), the fingerprint on the ending
    chunk or, with ``include_usage``, on the usage chunk, usage as one request's, token ids only
    when asked, ``prompt_token_ids`` once."""
    b = body(logprobs=1, return_token_ids=ids, stream_interval=3,
             **({"stream_options": {"include_usage": True}} if usage else {}))
    async with fakes(MODEL) as (P, RLD, MD), router(agents, P, RLD, MD, pos=7) as r:
        got = await stream(http, r.url, b)
        assert outcomes(r) == {"switched": 1}
        assert sample(r, "pddwire_router_output_tokens_total", pool="RLD") == 8
        assert sample(r, "pddwire_router_handoff_deferrals_total") == 1
    same_stream(got, await single(b))
    assert flat(got)["usage"] == ([{"prompt_tokens": 5, "total_tokens": 5 + N, "completion_tokens": N,
                                    "prompt_tokens_details": {"cached_tokens": 5}}] if usage else [])
    # What each upstream was asked: P's prefill and MD's warm request without logprobs (vLLM would
    # skip the prefix cache and the KV), one token per event (no stream_interval), MD's
    # continuation from the prompt plus the 8 ids relayed.
    (pre,) = P.requests
    (warm,) = [q for q in MD.requests if q.kind == "warm"]
    (cont,) = MD.streams()
    assert pre.kind == "prefill" and not {"logprobs", "prompt_logprobs", "stream_interval"} & set(pre.body)
    assert not {"logprobs", "prompt_logprobs", "stream_interval"} & set(warm.body)
    assert "stream_interval" not in RLD.streams()[0].body and "stream_interval" not in cont.body
    assert cont.body["prompt"] == PROMPT + OUT[:8] and cont.body["max_tokens"] == N - 8


async def test_a_non_streamed_request_gets_one_servers_body(agents, http):
    b = body(logprobs=1, stream=False)
    async with fakes(MODEL) as (P, RLD, MD), router(agents, P, RLD, MD, pos=7) as r:
        async with http.post(f"{r.url}/v1/completions", json=b) as resp:
            got = await resp.json()
        assert outcomes(r) == {"switched": 1}
    base = await single(b)
    assert isinstance(base, dict) and got.keys() == base.keys()
    assert got["choices"][0].keys() == base["choices"][0].keys()
    for k in ("text", "token_ids", "logprobs", "finish_reason", "prompt_token_ids"):
        assert got["choices"][0][k] == base["choices"][0][k], k
    assert got["system_fingerprint"] == FINGERPRINT and got["usage"]["completion_tokens"] == N


async def test_catch_up_absorbs_to_a_block_boundary_then_switches(agents, http):
    """Forced catch-up at 8 with 4-token blocks: one absorb round of the prompt plus 7 tokens
    (5 + 7 = 3 blocks), ``max_tokens=1``, no KV params; then the switch at 8."""
    async with fakes(MODEL) as (P, RLD, MD), router(agents, P, RLD, MD, pos=8, mode="catch-up",
                                                   policy="catchup_gap_tokens = 0") as r:
        got = await stream(http, r.url, body())
        assert outcomes(r) == {"switched": 1}
        assert sample(r, "pddwire_router_catchup_absorbed_tokens_total") == 7
    (absorb,) = [q for q in MD.requests if q.kind == "whole"]
    assert absorb.body["prompt"] == PROMPT + OUT[:7] and absorb.body["max_tokens"] == 1
    assert "kv_transfer_params" not in absorb.body
    assert MD.streams()[0].body["prompt"] == PROMPT + OUT[:8]
    same_stream(got, await single(body()))


async def test_events_of_several_tokens_never_give_a_clean_boundary(agents, http):
    """RLD's events carry two tokens each after the first four (vLLM merges outputs when its
    stream falls behind): a switch due at 4 never finds one whole-text token, RLD finishes
    (``no_clean_boundary``, not ``rld_finished``; every deferral counted)."""
    rld = Script(events=[1, 1, 1, 1] + [2] * 20)
    async with fakes(MODEL, RLD=rld) as (P, RLD, MD), router(agents, P, RLD, MD, pos=4) as r:
        got = await stream(http, r.url, body())
        assert outcomes(r) == {"no_clean_boundary": 1}
        assert sample(r, "pddwire_router_handoff_deferrals_total") == 1 + (N - 4) // 2 - 1
        assert sample(r, "pddwire_router_output_tokens_total", pool="RLD") == N
    same_stream(got, await single(body()))


# ---------------------------------------------------------------------------------- RLD failing
@pytest.mark.parametrize("fault", [
    {"error_at": 6}, {"abort_at": 5}, {"abort_at": 6, "abort_empty": True}, {"garbage_at": 6},
    {"cut_at": 6}, {"cut_inside_at": 6}, {"error_at": 4}])
async def test_rld_failing_mid_stream_leaves_the_output_to_md(agents, http, fault):
    """An error event, an ``abort`` ending (its token relayed, its ending not), an event that
    does not parse, a cut, half an event: MD continues from where RLD left it; the client never
    sees the failure. At 4 (inside é) the failure cannot wait for a clean boundary: MD's text
    misses the é (counted), the token ids are exact."""
    k = fault["abort_at"] + (0 if fault.get("abort_empty") else 1) if "abort_at" in fault else \
        next(iter(fault.values()))
    async with fakes(MODEL, RLD=Script(**fault)) as (P, RLD, MD), router(agents, P, RLD, MD, min_rld_tokens=30) as r:
        got = await stream(http, r.url, body())
        assert outcomes(r) == {"rld_failed": 1}
        assert sample(r, "pddwire_router_fallbacks_total", kind="rld_failed") == 1
        assert sample(r, "pddwire_router_output_tokens_total", pool="RLD") == k
        assert sample(r, "pddwire_router_unclean_splices_total") == (k == 4)
        assert sample(r, "pddwire_router_requests_total", outcome="ok") == 1
    base = await single(body())
    if k == 4:
        assert flat(got)["ids"] == flat(base)["ids"] and flat(got)["text"] == flat(base)["text"].replace("é", "")
    else:
        same_stream(got, base)
    assert MD.streams()[0].body["prompt"] == PROMPT + OUT[:k]


@pytest.mark.parametrize("at", [0, 6])
async def test_rld_failing_while_md_failed_ends_in_one_error(agents, http, at):
    """MD's warm request failed (RLD keeps the request), then RLD sends an error event: nothing
    can continue. Before the stream started the client gets a 502; after, an error event and
    one ``[DONE]``. One handoff outcome (``failed``), counted ``upstream_failed``."""
    go = asyncio.Event()
    rld = Script(error_at=at, hold={at: go})
    async with fakes(MODEL, RLD=rld, MD=Script(warm_ok=False)) as (P, RLD, MD), \
            router(agents, P, RLD, MD, min_rld_tokens=30) as r:
        async def ask() -> tuple[int, bytes]:
            async with http.post(f"{r.url}/v1/completions", json=body()) as resp:
                return resp.status, await resp.read()

        answer = asyncio.ensure_future(ask())
        await until(lambda: sample(r, "pddwire_router_fallbacks_total", kind="md_failed") == 1)
        go.set()  # RLD's error comes once RLD keeps the request
        status, raw = await answer
        assert outcomes(r) == {"failed": 1}
        assert sample(r, "pddwire_router_requests_total", outcome="upstream_failed") == 1
    if at == 0:
        assert status == 502 and json.loads(raw)["error"]["code"] == 502
        return
    events = raw.split(b"\n\n")
    assert status == 200 and events[-2:] == [b"data: [DONE]", b""] and events.count(b"data: [DONE]") == 1
    err = json.loads(events[-3][6:])
    assert err["error"]["code"] == 502 and "error event" in err["error"]["message"]
    assert [t for ev in events[:-3] for c in json.loads(ev[6:])["choices"] for t in c["token_ids"]] == OUT[:6]


async def test_rld_refusing_the_request_is_the_clients_answer(agents, http):
    """``max_tokens: 0``: RLD answers vLLM's 400, relayed as it came (not 16 tokens from MD)."""
    async with fakes(MODEL) as (P, RLD, MD), router(agents, P, RLD, MD) as r:
        async with http.post(f"{r.url}/v1/completions", json=body(max_tokens=0)) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "max_tokens"
        assert MD.streams() == [] and outcomes(r) == {"failed": 1}
        assert sample(r, "pddwire_router_requests_total", outcome="http_400") == 1


async def test_max_tokens_null_runs_to_the_end_of_the_context(agents, http):
    async with fakes(MODEL) as (P, RLD, MD), router(agents, P, RLD, MD, pos=3) as r:
        got = await stream(http, r.url, body(max_tokens=None))
    assert flat(got)["ids"] == OUT and MD.streams()[0].body["max_tokens"] is None


# ---------------------------------------------------------------------------------- MD failing
@pytest.mark.parametrize("fault", [{"error_at": 12}, {"abort_at": 12}, {"cut_at": 12}, {"stall_at": 12}])
async def test_md_failing_after_the_switch_hands_the_output_back(agents, http, fault):
    """After a switch at 8, MD sends an error event, ends ``abort``, is cut, or goes silent
    (``handoff.continue_s``): RLD continues from where MD left it, the client reads one server's
    stream."""
    k = 13 if "abort_at" in fault else 12
    async with fakes(MODEL, MD=Script(**fault)) as (P, RLD, MD), \
            router(agents, P, RLD, MD, pos=8, continue_s=0.3) as r:
        got = await stream(http, r.url, body())
        assert outcomes(r) == {"switched": 1}
        assert sample(r, "pddwire_router_fallbacks_total", kind="md_failed_after_switch") == 1
        assert [sample(r, "pddwire_router_output_tokens_total", pool=p) for p in ("RLD", "MD")] == [N - k + 8, k - 8]
    same_stream(got, await single(body()))
    assert RLD.streams()[1].body["prompt"] == PROMPT + OUT[:k]


async def test_every_engine_failing_after_the_switch_ends_in_one_error(agents, http):
    """MD fails at 12, the hand-back to RLD at 14, to P at 16: an error event, one [DONE]."""
    scripts = {"MD": Script(error_at=12), "RLD": Script(error_at=14), "P": Script(error_at=16)}
    async with fakes(MODEL, **scripts) as (P, RLD, MD), router(agents, P, RLD, MD, pos=8) as r:
        async with http.post(f"{r.url}/v1/completions", json=body()) as resp:
            events = (await resp.read()).split(b"\n\n")
        assert outcomes(r) == {"failed": 1}
    assert events[-2:] == [b"data: [DONE]", b""] and events.count(b"data: [DONE]") == 1
    assert "error" in json.loads(events[-3][6:])
    assert [t for ev in events[:-3] for c in json.loads(ev[6:])["choices"] for t in c["token_ids"]] == OUT[:16]


@pytest.mark.parametrize("usage", [False, True])
async def test_a_cut_after_the_ending_is_the_end(agents, http, usage):
    """MD's stream is cut after its ending chunk, before its usage chunk and ``[DONE]``: the
    output is whole (no hand-back), the fingerprint-less ending relayed, and the usage the
    client asked for counted by the router."""
    b = body(**({"stream_options": {"include_usage": True}} if usage else {}))
    async with fakes(MODEL, MD=Script(cut_after_end=True)) as (P, RLD, MD), router(agents, P, RLD, MD, pos=8) as r:
        got = await stream(http, r.url, b)
        assert outcomes(r) == {"switched": 1} and sample(r, "pddwire_router_fallbacks_total") == 0
    assert flat(got)["ids"] == OUT and flat(got)["ends"] == ["length"]
    assert flat(got)["usage"] == ([{"prompt_tokens": 5, "total_tokens": 5 + N, "completion_tokens": N}] if usage
                                  else [])


# ---------------------------------------------------------------------------------- bounded
async def test_the_deadline_mid_handoff_ends_the_stream_once_and_closes_md(agents, http):
    """MD stalls after the switch (``continue_s`` longer than the deadline): the deadline ends
    the stream with an error event and one ``[DONE]``; MD's request is closed."""
    async with fakes(MODEL, MD=Script(stall_at=10)) as (P, RLD, MD), \
            router(agents, P, RLD, MD, pos=8, deadline_s=1.0, continue_s=60) as r:
        async with http.post(f"{r.url}/v1/completions", json=body()) as resp:
            events = (await resp.read()).split(b"\n\n")
        assert outcomes(r) == {"cancelled": 1}
        assert sample(r, "pddwire_router_requests_total", outcome="deadline") == 1
    assert events[-2:] == [b"data: [DONE]", b""] and events.count(b"data: [DONE]") == 1
    assert json.loads(events[-3][6:])["error"]["code"] == 504
    (cont,) = MD.streams()
    await asyncio.wait_for(cont.ended.wait(), 5)
    assert cont.closed_by_client


async def test_nothing_follows_done(agents, http):
    """P-MD: MD sends ``[DONE]`` and keeps its connection open; the deadline then passes. The
    client's stream ends at that ``[DONE]``: no error event, no second one."""
    async with fakes(MODEL, MD=Script(done_then_stall=True)) as (P, RLD, MD), \
            router(agents, P, RLD, MD, ask_agent=False, deadline_s=0.5) as r:
        got = await stream(http, r.url, body())
        assert sample(r, "pddwire_router_requests_total", outcome="deadline") == 1
    assert flat(got)["ids"] == OUT and "error" not in got[-1]


async def test_a_connect_timeout_is_an_upstream_failure_not_the_deadline(agents, http):
    """MD's listen queue is full: connecting times out after ``request.connect_s`` (aiohttp's
    ConnectionTimeoutError is a TimeoutError): 502 ``upstream_failed``, not 504."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fill = [socket.socket() for _ in range(3)]
    for s in fill:
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
    try:
        async with FakeVllm("P", MODEL) as P, FakeVllm("RLD", MODEL) as RLD:
            MD = FakeVllm("MD", MODEL)
            MD.url = f"http://127.0.0.1:{port}"
            async with router(agents, P, RLD, MD, ask_agent=False, connect_s=0.2) as r:
                async with http.post(f"{r.url}/v1/completions", json=body()) as resp:
                    assert resp.status == 502
                assert sample(r, "pddwire_router_requests_total", outcome="upstream_failed") == 1
    finally:
        for s in (*fill, srv):
            s.close()


async def test_a_client_gone_mid_handoff_closes_every_upstream_request(agents, http):
    async with fakes(MODEL, MD=Script(stall_at=10)) as (P, RLD, MD), \
            router(agents, P, RLD, MD, pos=8, continue_s=60) as r:
        async with http.post(f"{r.url}/v1/completions", json=body()) as resp:
            await until(lambda: len(MD.streams()) == 1 and len(MD.streams()[0].sent) == 2)
            resp.close()
        await asyncio.wait_for(MD.streams()[0].ended.wait(), 5)
        assert MD.streams()[0].closed_by_client
        await until(lambda: outcomes(r) == {"cancelled": 1})
        assert sample(r, "pddwire_router_requests_total", outcome="client_gone") == 1
        assert all(u.inflight == 0 for u in r.pools)


async def test_a_warm_request_left_to_finish_is_counted(agents, http):
    """RLD finishes before MD holds the KV: the warm request is left to finish (P's KV delivered,
    MD's cache filled), shown in ``pddwire_router_draining`` and counted when MD answers."""
    gate = asyncio.Event()
    async with fakes(MODEL, MD=Script(warm_gate=gate)) as (P, RLD, MD), router(agents, P, RLD, MD) as r:
        got = await stream(http, r.url, body())
        assert outcomes(r) == {"rld_finished": 1} and flat(got)["ids"] == OUT
        assert sample(r, "pddwire_router_draining") == 1
        gate.set()
        await until(lambda: sample(r, "pddwire_router_drains_total", outcome="answered") == 1)
        assert sample(r, "pddwire_router_draining") == 0


# ---------------------------------------------------------------------------------- the mode
async def test_the_mode_counts_this_request_in_rlds_load(agents, http):
    """``auto``, RLD with one slot: the first scrape (sent as the request starts) finds RLD idle;
    RLD's first token waits for it. The mode waits for a figure read after that first token,
    which counts this request: busy, one-shot (``rld_busy``), not catch-up."""
    rld, decided = FakeVllm("RLD", MODEL), asyncio.Event()
    rld.script = Script(hold={0: rld.scraped, 10: decided})  # RLD runs the request until the mode is chosen
    async with FakeVllm("P", MODEL) as P, rld as RLD, FakeVllm("MD", MODEL) as MD, \
            router(agents, P, RLD, MD, rld_seqs=1, min_rld_tokens=5, policy="catchup_gap_tokens = 2") as r:
        answer = asyncio.ensure_future(stream(http, r.url, body()))
        await until(lambda: sample(r, "pddwire_router_handoff_modes_total") == 1)
        decided.set()
        got = await answer
        assert sample(r, "pddwire_router_handoff_modes_total", mode="one-shot", reason="rld_busy") == 1
        assert RLD.scrapes >= 2 and outcomes(r) == {"switched": 1}
    same_stream(got, await single(body()))


@pytest.mark.parametrize(("extra", "why"), [
    ({"truncate_prompt_tokens": 3}, "truncate_prompt_tokens"), ({"bad_words": ["fg"]}, "output_matched"),
    ({"skip_special_tokens": False, "spaces_between_special_tokens": False}, "special_tokens")])
async def test_fields_a_splice_would_change_run_p_md(agents, http, extra, why):
    async with fakes(MODEL) as (P, RLD, MD), router(agents, P, RLD, MD) as r:
        got = await stream(http, r.url, body(**extra))
        assert sample(r, "pddwire_router_fallbacks_total", kind=f"p_rld_md_{why}") == 1
    assert flat(got)["ids"] == OUT and RLD.requests == []


async def test_an_idle_upstream_connection_is_closed_before_vllm_closes_it(tmp_path):
    """The router's upstream connections to ``vllm serve``: an idle one is closed by the router
    before vLLM's HTTP server closes it (5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so a completion is
    never sent on a connection the server is closing at that moment (ServerDisconnectedError).
    A server that notes the client port of each request (as vLLM, it keeps idle connections
    for 5 s): two requests in a row share a connection; after the router's keep-alive, idle, the
    next one comes on a new connection, well before the server would have closed the old one."""
    assert UPSTREAM_KEEPALIVE_S < VLLM_KEEPALIVE_S / 2  # room for a loaded host's scheduling delays
    ports: list[int] = []

    async def models(request: web.Request) -> web.Response:
        ports.append(request.transport.get_extra_info("peername")[1])
        return web.json_response({"data": []})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, keepalive_timeout=VLLM_KEEPALIVE_S)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    vllm = SimpleNamespace(url=url)
    r0 = router(tmp_path, vllm, vllm, vllm)
    await r0.start()
    try:
        for pause in (0, 0, UPSTREAM_KEEPALIVE_S + 0.5):
            await asyncio.sleep(pause)
            async with r0.http.get(f"{url}/v1/models") as r:
                assert r.status == 200
                await r.read()
        assert ports[0] == ports[1] != ports[2], ports
    finally:
        await r0.stop()
        await runner.cleanup()
