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
import time
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from conftest import until
from pdd_wire.engine.client import EngineClient
from pdd_wire.router import Router, loads
from pdd_wire.router import handoff as handoff_mod
from pdd_wire.router import server as server_mod
from pdd_wire.router.core import Req
from pdd_wire.router.handoff import Handoff
from pdd_wire.router.output import CollectSink, Output
from pdd_wire.router.server import UPSTREAM_KEEPALIVE_S
from pdd_wire.router.upstream import Trace, lax_bool, lax_int
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


@pytest.mark.parametrize("fault", [{"stall_at": 6}, {"stall_at": 0}, {"answer_gate": "never"}])
async def test_a_silent_rld_is_a_failed_one(agents, http, fault):
    """RLD goes silent before the switch -- after 6 tokens, after its headers, or before them --
    for ``handoff.rld_silent_s``: MD takes the output over from where RLD left it, as for any
    RLD failure (``rld_failed``), instead of the client waiting for ``request.deadline_s``."""
    script = Script(answer_gate=asyncio.Event()) if "answer_gate" in fault else Script(**fault)
    k = fault.get("stall_at", 0)
    async with fakes(MODEL, RLD=script) as (P, RLD, MD), \
            router(agents, P, RLD, MD, deadline_s=60, min_rld_tokens=30, rld_silent_s=0.5) as r:
        got = await stream(http, r.url, body())
        assert outcomes(r) == {"rld_failed": 1}
        assert sample(r, "pddwire_router_fallbacks_total", kind="rld_failed") == 1
        assert sample(r, "pddwire_router_output_tokens_total", pool="RLD") == k
        assert sample(r, "pddwire_router_requests_total", outcome="ok") == 1
    same_stream(got, await single(body()))
    assert MD.streams()[0].body["prompt"] == PROMPT + OUT[:k]


async def test_rld_silence_is_no_failure_where_md_cannot_take_over(agents, http):
    """MD's warm request failed (RLD keeps the request): RLD pausing past ``rld_silent_s`` is only
    slow, and finishes the output (bounded by the deadline alone)."""
    go = asyncio.Event()
    async with fakes(MODEL, RLD=Script(hold={6: go}), MD=Script(warm_ok=False)) as (P, RLD, MD), \
            router(agents, P, RLD, MD, deadline_s=60, min_rld_tokens=30, rld_silent_s=0.3) as r:
        chunks = await _paused(r, http, lambda: sample(r, "pddwire_router_fallbacks_total", kind="md_failed") == 1,
                               "MD failed", go, "md_failed")
    same_stream(chunks, await single(body()))


@pytest.mark.parametrize("pos", [4, 6])
async def test_the_router_not_reading_rld_at_its_cap_is_not_rld_silence(agents, http, pos):
    """At ``max_rld_tokens`` the router reads no more of RLD until MD holds the KV: MD's warm
    request held past ``rld_silent_s`` is no failure of RLD's; the switch happens."""
    gate = asyncio.Event()
    async with fakes(MODEL, MD=Script(warm_gate=gate)) as (P, RLD, MD), \
            router(agents, P, RLD, MD, pos=pos, deadline_s=60, rld_silent_s=0.3) as r:
        chunks = await _paused(r, http, lambda: sample(r, "pddwire_router_output_tokens_total", pool="RLD") == pos,
                               "RLD at its cap", gate, "switched")
    same_stream(chunks, await single(body()))


async def _paused(r: Router, http: aiohttp.ClientSession, reached, what: str, release: asyncio.Event,
                  outcome: str) -> list[dict]:
    """A streamed request, paused once ``reached`` holds for over 3 x ``rld_silent_s`` (0.3 s;
    longer on a loaded machine) until ``release``; it ends ``outcome``, no RLD failure counted."""
    got = asyncio.ensure_future(stream(http, r.url, body()))
    await until(reached, 20, what)
    await asyncio.sleep(1.0)
    release.set()
    chunks = await got
    assert outcomes(r) == {outcome: 1}
    assert sample(r, "pddwire_router_fallbacks_total", kind="rld_failed") == 0
    return chunks


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


async def test_max_tokens_null_is_16(agents, http):
    """vLLM 0.32 reads ``max_tokens: null`` on /v1/completions as absent, 16
    (``normalize_null_max_tokens``): after a switch at 3, MD is asked the 13 left."""
    async with fakes(MODEL) as (P, RLD, MD), router(agents, P, RLD, MD, pos=3) as r:
        got = await stream(http, r.url, body(max_tokens=None))
        assert outcomes(r) == {"switched": 1}
    assert flat(got)["ids"] == OUT[:16] and MD.streams()[0].body["max_tokens"] == 13
    same_stream(got, await single(body(max_tokens=None)))


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
    """P-MD: MD sends ``[DONE]`` and keeps its connection open; the deadline then passes while the
    router reads what follows it. The client's stream ends at that ``[DONE]``: no error event, no
    second one; the request is answered (``ok``), not a deadline."""
    async with fakes(MODEL, MD=Script(done_then_stall=True)) as (P, RLD, MD), \
            router(agents, P, RLD, MD, ask_agent=False, deadline_s=0.5) as r:
        got = await stream(http, r.url, body())
        await until(lambda: sample(r, "pddwire_router_requests_total") == 1, 10, "the request counted")
        assert sample(r, "pddwire_router_requests_total", outcome="ok") == 1
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


# ---------------------------------------------------------------------------------- fields as vLLM reads them
# pydantic's lax mode, as vLLM 0.32's request models read a field (checked with pydantic 2 in .venv-vllm).
INTS = [(16, 16), (16.0, 16), (-16.0, -16), (True, 1), (False, 0), ("16", 16), (" 16 ", 16), ("\t16\n", 16),
        ("\xa016", 16), ("16.0", 16), ("16.00", 16), ("+16", 16), ("-16", -16), ("1_6", 16), ("1_6.0", 16),
        ("0016", 16), (2**70, 2**70), (9.2e18, 9200000000000000000)]
NOT_INTS = [16.5, "1e1", "0x10", "abc", [1], None, {}, "16.", ".5", "", " ", "1__6", "_16", "16_", "16.0_0", "+-1",
            "- 16", "16 0", "\u0661\u0666", "\x1c16", "inf", float("inf"), float("nan"), 1e20, 2.0**63, -(2.0**63)]
BOOLS = [(True, True), (False, False), (0, False), (1, True), (0.0, False), (1.0, True), ("true", True),
         ("TRUE", True), ("yes", True), ("oN", True), ("t", True), ("1", True), ("false", False), ("no", False),
         ("off", False), ("f", False), ("n", False), ("0", False)]
NOT_BOOLS = [2, 1.5, " true ", "True ", "", "2", None, [], {}]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


async def test_ints_and_bools_are_read_as_vllm_reads_them():
    for v, want in INTS:
        assert (lax_int(v), type(lax_int(v))) == (want, int), v
    for v, want in BOOLS:
        assert lax_bool(v) is want, v
    for bad, read in [(v, lax_int) for v in NOT_INTS] + [(v, lax_bool) for v in NOT_BOOLS]:
        with pytest.raises(ValueError):
            read(bad)


@pytest.mark.parametrize(("extra", "n"), [
    ({"max_tokens": "16"}, 16), ({"max_tokens": " 16 "}, 16), ({"max_tokens": "16.0"}, 16), ({"max_tokens": 16.0}, 16),
    ({"max_tokens": "+16"}, 16), ({"max_tokens": "1_6"}, 16), ({"max_tokens": True}, 1),
    ({"max_tokens": "20", "min_tokens": "12", "n": "1", "stream": "true", "return_token_ids": "yes",
      "stream_options": {"include_usage": "0"}}, 20)])
async def test_the_router_computes_with_what_vllm_reads(agents, http, extra, n):
    """P-RLD-MD, the switch at 8, on values vLLM reads as ints and bools: the router reads them
    the same (not a 500 mid-stream): n tokens, MD asked for the rest (``min_tokens`` less 8)."""
    async with fakes(MODEL) as (P, RLD, MD), router(agents, P, RLD, MD, pos=8) as r:
        got = await stream(http, r.url, body(**extra))
        assert outcomes(r) == ({"switched": 1} if n > 8 else {"rld_finished": 1})
    assert flat(got)["ids"] == OUT[:n] and flat(got)["usage"] == []
    assert [(q.body["max_tokens"], q.body.get("min_tokens")) for q in MD.streams()] == \
        ([(n - 8, 4 if "min_tokens" in extra else None)] if n > 8 else [])


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"max_tokens": 16.5}, "max_tokens"), ("/v1/completions", {"max_tokens": "1e1"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": "0x10"}, "max_tokens"), ("/v1/completions", {"max_tokens": "abc"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": [1]}, "max_tokens"), ("/v1/completions", {"min_tokens": None}, "min_tokens"),
    ("/v1/completions", {"n": None}, "n"), ("/v1/completions", {"stream": "maybe"}, "stream"),
    ("/v1/completions", {"stream_options": "yes"}, "stream_options"),
    ("/v1/completions", {"stream_options": [1]}, "stream_options"),
    ("/v1/completions", {"stream_options": {"include_usage": "sure"}}, "stream_options.include_usage"),
    ("/v1/completions", {"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"max_completion_tokens": "1e1"}, "max_completion_tokens"),
    ("/v1/chat/completions", {"stream_options": 3}, "stream_options")])
async def test_a_value_vllm_refuses_is_the_routers_400(agents, http, path, extra, param):
    """What vLLM refuses with a 400, the router refuses before any upstream request (no
    pipeline; not counted), naming the field."""
    b = body(**extra) if path == "/v1/completions" else {**CHAT, "stream": True, **extra}
    async with fakes(MODEL) as (P, RLD, MD), router(agents, P, RLD, MD) as r:
        async with http.post(f"{r.url}{path}", json=b) as resp:
            assert resp.status == 400
            err = (await resp.json())["error"]
        assert sample(r, "pddwire_router_requests_total") == 0
    assert (err["type"], err["param"], err["code"]) == ("BadRequestError", param, 400) and param in err["message"]
    assert P.requests == RLD.requests == MD.requests == []


async def test_the_body_goes_upstream_as_it_came(agents, http):
    """vLLM checks ``stream_options`` against ``stream`` as sent: ``"stream": "false"`` with
    stream options passes there (a string is true), then reads as False. The router decides with
    the value read (a whole answer, not SSE) and sends the body as it came, so MD accepts it."""
    b = body(stream="false", stream_options={"include_usage": True}, max_tokens="5")
    async with fakes(MODEL) as (P, RLD, MD), router(agents, P, RLD, MD, ask_agent=False) as r:
        async with http.post(f"{r.url}/v1/completions", json=b) as resp:
            assert resp.status == 200, await resp.text()
            got = await resp.json()
        assert sample(r, "pddwire_router_requests_total", outcome="ok") == 1
    assert got["choices"][0]["token_ids"] == OUT[:5]
    (dec,) = MD.requests
    assert (dec.raw["stream"], dec.raw["max_tokens"], dec.raw["stream_options"]) == \
        ("false", "5", {"include_usage": True})


async def test_logprob_token_ids_go_where_logprobs_go(agents, http):
    """vLLM refuses ``logprob_token_ids`` without ``logprobs``: P's prefill and MD's warm request,
    which drop logprobs, drop it too; RLD's stream and MD's continuation keep both."""
    b = body(logprobs=1, logprob_token_ids=[15, 16])
    async with fakes(MODEL) as (P, RLD, MD), router(agents, P, RLD, MD, pos=8) as r:
        got = await stream(http, r.url, b)
        assert outcomes(r) == {"switched": 1}
    assert flat(got)["ids"] == OUT
    (pre,) = P.requests
    (warm,) = [q for q in MD.requests if q.kind == "warm"]
    assert all(not {"logprobs", "top_logprobs", "logprob_token_ids"} & set(q.body) for q in (pre, warm))
    assert [(q.body["logprobs"], q.body["logprob_token_ids"]) for q in (*RLD.streams(), *MD.streams())] == \
        [(1, [15, 16])] * 2


async def test_chat_with_top_logprobs(agents, http):
    """Chat's ``top_logprobs`` needs ``logprobs: true`` (vLLM's 400 otherwise): P's prefill drops
    both, MD gets both, the client MD's logprobs."""
    b = {**CHAT, "max_tokens": 5, "logprobs": True, "top_logprobs": 2}
    async with fakes(MODEL) as (P, RLD, MD), router(agents, P, RLD, MD, ask_agent=False) as r:
        async with http.post(f"{r.url}/v1/chat/completions", json=b) as resp:
            assert resp.status == 200, await resp.text()
            got = (await resp.json())["choices"][0]
        assert sample(r, "pddwire_router_requests_total", outcome="ok") == 1
    ((pre,), (dec,)) = P.requests, MD.requests
    assert pre.kind == "prefill" and not {"logprobs", "top_logprobs"} & set(pre.body)
    assert (dec.body["logprobs"], dec.body["top_logprobs"]) == (True, 2) and dec.body["kv_transfer_params"]
    assert got["message"]["content"] == "f g\u00e9" and len(got["logprobs"]["content"]) == 5


# ---------------------------------------------------------------------------------- bounded (2)
async def test_v1_models_passes_over_a_member_that_never_answers(agents, http):
    """P accepts the connection and never answers: after ``request.connect_s`` the router asks
    MD, whose answer is the client's; with MD gone, 503 naming the silent member."""
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the router closes the connection
        writer.close()

    silent = await asyncio.start_server(hold, "127.0.0.1", 0)
    mute = SimpleNamespace(url=f"http://127.0.0.1:{silent.sockets[0].getsockname()[1]}")
    try:
        async with FakeVllm("MD", MODEL) as MD, router(agents, mute, mute, MD, connect_s=0.3) as r:
            t0 = time.monotonic()
            async with http.get(f"{r.url}/v1/models") as resp:
                assert resp.status == 200 and (await resp.json())["data"][0]["id"] == "tiny"
            assert 0.3 <= time.monotonic() - t0 < 5
            r.pools.remove("MD", MD.url)
            async with http.get(f"{r.url}/v1/models") as resp:
                assert resp.status == 503
                message = (await resp.json())["error"]["message"]
            assert message == f"{mute.url}: no answer within 0.3 s (request.connect_s)"
    finally:
        silent.close()


async def test_an_error_for_a_client_that_stopped_reading_is_bounded(agents, monkeypatch):
    """P-MD: MD's first event carries a long prompt's ids (200 KB), then MD stalls; the client
    reads nothing but keeps its connection open (small socket buffers at both ends, so that the
    event fills them). The deadline passes, and the error event cannot be written either: after
    ``FAIL_WRITE_S`` the router aborts the connection (what it had not sent is dropped, the
    socket closed), and the request ends (``deadline``)."""
    monkeypatch.setattr(server_mod, "FAIL_WRITE_S", 0.3)
    long = Model([10] * 50_000, OUT)
    loop = asyncio.get_running_loop()
    async with fakes(long, MD=Script(stall_at=1)) as (P, RLD, MD), \
            router(agents, P, RLD, MD, ask_agent=False, deadline_s=2) as r:
        prepare = web.StreamResponse.prepare

        async def small_buffer(self: web.StreamResponse, request: web.BaseRequest):
            sock = request.transport.get_extra_info("socket") if request.transport else None
            if sock is not None and sock.getsockname()[1] == r.port:  # the router's end, not a fake's
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            return await prepare(self, request)

        monkeypatch.setattr(web.StreamResponse, "prepare", small_buffer)
        with socket.socket() as c:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            c.setblocking(False)
            await loop.sock_connect(c, ("127.0.0.1", r.port))
            payload = json.dumps(body(prompt=long.prompt)).encode()
            await loop.sock_sendall(c, b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: "
                                       b"application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
            assert await asyncio.wait_for(loop.sock_recv(c, 12), 10) == b"HTTP/1.1 200"  # the stream started
            await until(lambda: sample(r, "pddwire_router_requests_total", outcome="deadline") == 1, 10)
            got = b""  # what the kernel held for it, then the end: the rest was dropped, not kept for it
            while chunk := await asyncio.wait_for(loop.sock_recv(c, 1 << 16), 5):
                got += chunk
            assert len(got) < 100_000 and b"[DONE]" not in got
        assert MD.streams()[0].closed_by_client


async def test_a_handoff_that_ended_is_counted_once_if_cancelled_while_closing(agents, monkeypatch):
    """The output ended (``switched``); while the handoff waits for the MD requests it closed,
    the request is cancelled (a client that hangs up at its ``[DONE]``): the handoff is counted
    once, as it ended."""
    closing, release = asyncio.Event(), asyncio.Event()

    async def slow_to_close() -> bool:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            closing.set()
            await release.wait()
            raise
        return False

    async def warm_ok(*_args) -> bool:
        return True

    async def switched(self: Handoff) -> str:
        self.outcome, self.absorb = "switched", asyncio.ensure_future(slow_to_close())
        await asyncio.sleep(0)  # the absorb request is under way
        return "the response"

    monkeypatch.setattr(handoff_mod, "warm_ok", warm_ok)
    monkeypatch.setattr(Handoff, "_run", switched)
    async with fakes(MODEL) as (P, RLD, MD), router(agents, P, RLD, MD, mode="one-shot") as r:
        core = r._core
        assert core is not None
        req = Req(None, "/v1/completions", body(), "rtr-closing", Trace("P-RLD-MD"))  # type: ignore[arg-type]
        h = Handoff(core, req, Output(core, req, CollectSink()), r.pools.pick("RLD"), r.pools.pick("MD"), {})
        task = asyncio.ensure_future(h.run())
        await asyncio.wait_for(closing.wait(), 5)
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert outcomes(r) == {"switched": 1}


# ---------------------------------------------------------------------------------- the router's own faults
@pytest.mark.parametrize("answer", [{"reason": "wan_over_budget"}, {"pipeline": "P-XX", "reason": "x"},
                                    {"pipeline": "P-RLD-MD", "reason": "x", "prefix_hit_tokens": "many"}, ["P-MD"],
                                    {"pipeline": "P-MD", "reason": "x", "prefix_hit_tokens": -1},
                                    {"pipeline": "P-MD", "reason": "x", "prefix_hit_tokens": 10 ** 6}])
async def test_a_malformed_agent_answer_is_a_failed_choice(agents, http, monkeypatch, answer):
    """P's agent answers what the router cannot act on: fallback ``choice_failed``, P-MD."""
    async def choose_pipeline(self, request_id: str, **_kw):
        return answer

    monkeypatch.setattr(EngineClient, "choose_pipeline", choose_pipeline)
    async with fakes(MODEL) as (P, RLD, MD), router(agents, P, RLD, MD) as r:
        got = await stream(http, r.url, body())
        assert sample(r, "pddwire_router_fallbacks_total", kind="choice_failed") == 1
        assert sample(r, "pddwire_router_pipeline_choices_total", pipeline="P-MD", reason="choice_failed") == 1
    assert flat(got)["ids"] == OUT and RLD.requests == []


async def test_a_lookup_error_of_the_routers_own_is_not_an_upstream_failure(agents, http, monkeypatch):
    """A KeyError in the router's code is its own fault (500, ``router_internal_error``, outcome
    ``error``), not a 502; a pool without a member is the 502 that names it."""
    def broken(self, req, params) -> None:
        raise KeyError("pipeline")

    async with fakes(MODEL) as (P, RLD, MD), router(agents, P, RLD, MD, ask_agent=False) as r:
        with monkeypatch.context() as m:
            m.setattr(Router, "_wan", broken)
            async with http.post(f"{r.url}/v1/completions", json=body(stream=False)) as resp:
                assert resp.status == 500 and "KeyError" in (await resp.json())["error"]["message"]
        r.pools.remove("MD", MD.url)
        async with http.post(f"{r.url}/v1/completions", json=body(stream=False)) as resp:
            assert resp.status == 502
            assert (await resp.json())["error"]["message"] == "upstream failed: pool MD has no member"
        assert [sample(r, "pddwire_router_requests_total", outcome=o) for o in ("error", "upstream_failed")] == [1, 1]
