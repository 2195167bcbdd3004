"""A relayed decode stream that goes silent mid-stream has failed (``request.stream_silent_s``,
docs/router.md "Failures"): P-MD's MD (and P-RLD's RLD) sends its first tokens, then nothing,
its connection open -- a hung engine, a WAN path that drops without a reset. The client gets an
error event and one ``[DONE]`` after ``stream_silent_s``, not at ``request.deadline_s``, and the
upstream request is closed (vLLM aborts it). The wait for the first event is not bounded by it:
a queued request, or one whose prompt's KV is still crossing the WAN, is only slow.

A real router (``ask_agent = false``: every request P-MD) over scripted ``vllm serve`` fakes
(support.fake_vllm). No timing is asserted: the deadline is far past every limit used.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import pytest_asyncio

from conftest import until
from pdd_wire.router import Router
from support.fake_vllm import Model, Script, fakes
from support.routers import p_md_router

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [10, 11, 12, 13, 14]
OUT = [15 + i % 10 for i in range(20)]
MODEL = Model(PROMPT, OUT)
DEADLINE_S = 60


@pytest_asyncio.fixture(loop_scope="module")
async def http():
    async with aiohttp.ClientSession() as s:
        yield s


def router(P, MD, stream_silent_s: float) -> Router:
    return p_md_router(P.url, MD.url, deadline_s=DEADLINE_S, stream_silent_s=stream_silent_s)


def body() -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": len(OUT), "temperature": 0,
            "return_token_ids": True, "stream": True}


async def events(http: aiohttp.ClientSession, url: str) -> list[bytes]:
    async with http.post(f"{url}/v1/completions", json=body()) as r:
        assert r.status == 200, await r.text()
        raw = (await r.read()).split(b"\n\n")
    assert raw[-1] == b"" and raw[-2] == b"data: [DONE]" and b"data: [DONE]" not in raw[:-2], raw[-3:]
    return raw[:-2]


def outcome(r: Router) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for m in r.metrics.registry.collect() for s in m.samples
            if s.name == "pddwire_router_requests_total" and s.value}


def ids(evs: list[bytes]) -> list[int]:
    return [t for e in evs if e.startswith(b"data: {\"id\"")
            for c in json.loads(e[6:])["choices"] for t in c.get("token_ids") or []]


@pytest.mark.parametrize("k", [1, 6])
async def test_a_stream_silent_mid_stream_fails_and_is_closed(http, k):
    """MD stalls after k tokens: the client has those k, then a 502 error event naming the
    key, then one ``[DONE]``; the request counts ``upstream_failed``; the router closed MD's
    stream (vLLM aborts such a request)."""
    async with fakes(MODEL, MD=Script(stall_at=k)) as (P, RLD, MD), router(P, MD, 0.5) as r:
        got = await asyncio.wait_for(events(http, r.url), DEADLINE_S / 2)
        assert ids(got) == OUT[:k]
        err = json.loads(got[-1][6:])["error"]
        assert err["code"] == 502 and "stream_silent_s" in err["message"] and "MD member" in err["message"], err
        assert outcome(r) == {"upstream_failed": 1}
        [s] = MD.streams()
        await asyncio.wait_for(s.ended.wait(), 10)
        assert s.closed_by_client and s.sent == OUT[:k]


async def test_the_first_event_is_waited_for_and_a_pause_under_the_limit_is_no_failure(http):
    """MD's first event comes after 3 x ``stream_silent_s`` (queued, KV on its way), and a later
    pause shorter than it: the whole answer, ``ok``."""
    first, later = asyncio.Event(), asyncio.Event()
    async with fakes(MODEL, MD=Script(hold={0: first, 5: later})) as (P, RLD, MD), \
            router(P, MD, 2.0) as r:
        got = asyncio.ensure_future(events(http, r.url))
        await asyncio.sleep(6.0)
        first.set()
        await until(lambda: MD.streams() and len(MD.streams()[0].sent) >= 5, 20, "MD's first 5 tokens")
        await asyncio.sleep(0.2)  # well under the limit, however loaded the machine
        later.set()
        evs = await asyncio.wait_for(got, DEADLINE_S / 2)
        assert ids(evs) == OUT
        assert outcome(r) == {"ok": 1}


async def test_a_stream_silent_after_its_done_is_no_failure(http):
    """MD sends the whole answer and ``[DONE]``, then holds its connection open, silent: the
    client's answer ends 1 s after its ``[DONE]`` (what follows is read that long) -- not after
    ``stream_silent_s`` (here longer than the wait), nor at the deadline -- and the request is
    ``ok``, not ``upstream_failed``."""
    async with fakes(MODEL, MD=Script(done_then_stall=True)) as (P, RLD, MD), router(P, MD, 40) as r:
        got = await asyncio.wait_for(events(http, r.url), 20)
        assert ids(got) == OUT
        await until(lambda: outcome(r) != {}, 10, "the request counted")
        assert outcome(r) == {"ok": 1}
