"""The router bounds its requests in flight (``request.max_inflight``, docs/router.md "API"): one
more is answered 503 at once, naming the limit, with ``Retry-After``, no upstream asked; what is
in flight goes on; a slot is given back however its request ends (answered, the client gone,
its handler cancelled); ``/healthz``, ``/metrics`` and ``/v1/models`` answer while it is full.

A real router (``ask_agent = false``: P-MD) over one small aiohttp app that plays P (prefill
answered at once) and MD (its answer held until the test releases it). No timing is asserted:
every wait is bounded and generous.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping

import aiohttp
import msgspec
from aiohttp import web

from conftest import until
from pdd_wire.router import Router
from pdd_wire.router import config as rcfg
from pdd_wire.router.core import MAX_DRAINING
from pdd_wire.router.limit import UPSTREAM_PER_REQUEST, Inflight, Shared, upstream_limit
from pdd_wire.router.metrics import RouterMetrics
from support.http import serving

WAIT_S = 30.0


class Engine:
    """P and MD in one app: a prefill (``do_remote_decode``) is answered at once; a decode waits
    for ``release`` (streamed: after its first event)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.prefills = 0
        self.decodes = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            self.prefills += 1
            return web.json_response({"choices": [{"text": "x", "finish_reason": "length"}],
                                      "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "p"}})
        self.decodes += 1
        if not body.get("stream"):
            await self.release.wait()
            return web.json_response({"choices": [{"text": " hello world", "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "text": " hello"}]}\n\n')
        await self.release.wait()
        await resp.write(b'data: {"choices": [{"index": 0, "text": " world", "finish_reason": "length"}]}\n\n'
                         b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@contextlib.asynccontextmanager
async def _setup(max_inflight: int = 2, body_s: float = 30.0):
    engine = Engine()
    async with serving(engine.app()) as url:
        cfg = rcfg.RouterConfig(listen=rcfg.Listen(address="127.0.0.1:0"),
                                request=rcfg.Request(deadline_s=120, connect_s=10, max_inflight=max_inflight,
                                                     body_s=body_s),
                                pools=rcfg.Pools(P=[rcfg.Member(url=url, site="A")],
                                                 MD=[rcfg.Member(url=url, site="B")]),
                                choice=rcfg.Choice(ask_agent=False))
        router = await Router(rcfg.validate(cfg)).start()
        try:
            yield router, engine
        finally:
            engine.release.set()
            await router.stop()


def _inflight(router: Router) -> float | None:
    return router.metrics.registry.get_sample_value("pddwire_router_requests_inflight")


def _refused(router: Router, endpoint: str) -> float:
    return router.metrics.registry.get_sample_value("pddwire_router_requests_refused_total",
                                                    {"endpoint": endpoint}) or 0.0


async def _ask(s: aiohttp.ClientSession, router: Router, path: str = "/v1/completions", *,
               stream: bool = False) -> tuple[int, str, Mapping[str, str]]:
    body = {"model": "m", "max_tokens": 2, "stream": stream}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    async with asyncio.timeout(WAIT_S), s.post(f"{router.url}{path}", json=body) as r:
        return r.status, await r.text(), r.headers


async def test_past_the_limit_a_request_is_refused_at_once_and_those_in_flight_go_on():
    async with _setup() as (router, engine), aiohttp.ClientSession() as s:
        held = [asyncio.ensure_future(_ask(s, router, stream=True)),
                asyncio.ensure_future(_ask(s, router, "/v1/chat/completions"))]
        await until(lambda: engine.decodes == 2, WAIT_S, "both requests at MD")
        assert _inflight(router) == 2
        # Answered while the two are held: the refusal waits for nothing.
        for path in ("/v1/completions", "/v1/chat/completions"):
            status, text, headers = await _ask(s, router, path, stream=True)
            assert status == 503 and headers["Retry-After"] == "1", (status, text)
            err = msgspec.json.decode(text)["error"]
            assert err["type"] == "ServiceUnavailableError" and err["code"] == 503, err
            assert "2 requests in flight" in err["message"] and "request.max_inflight" in err["message"], err
        assert (engine.prefills, engine.decodes) == (2, 2)  # no upstream asked for the refused ones
        assert _refused(router, "/v1/completions") == 1 and _refused(router, "/v1/chat/completions") == 1
        # What is not a completion answers while the router is full.
        async with asyncio.timeout(WAIT_S):
            async with s.get(f"{router.url}/healthz") as r:
                assert r.status == 200 and (await r.json())["ok"]
            async with s.get(f"{router.url}/v1/models") as r:
                assert r.status == 200 and (await r.json())["data"][0]["id"] == "m"
            async with s.get(f"{router.url}/metrics") as r:
                page = await r.text()
        assert r.status == 200 and "pddwire_router_requests_inflight 2.0" in page
        assert 'pddwire_router_requests_refused_total{endpoint="/v1/completions"} 1.0' in page
        assert not any(t.done() for t in held)  # untouched by the refusals
        engine.release.set()
        (s1, t1, _), (s2, t2, _) = await asyncio.gather(*held)
        assert s1 == 200 and " hello" in t1 and t1.rstrip().endswith("data: [DONE]"), t1
        assert s2 == 200 and msgspec.json.decode(t2)["choices"][0]["text"] == " hello world", t2
        await until(lambda: _inflight(router) == 0, WAIT_S, "every slot given back")
        # The slots are back: new requests are served.
        for stream in (False, True):
            status, text, _ = await _ask(s, router, stream=stream)
            assert status == 200, (status, text)
        assert _refused(router, "/v1/completions") == 1


async def test_a_client_gone_mid_stream_gives_its_slot_back():
    async with _setup() as (router, engine), aiohttp.ClientSession() as s:
        stays = asyncio.ensure_future(_ask(s, router, stream=True))
        async with aiohttp.ClientSession() as gone:
            r = await gone.post(f"{router.url}/v1/completions",
                                json={"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True})
            async with asyncio.timeout(WAIT_S):
                assert r.status == 200 and (await r.content.readline()).startswith(b"data: ")
            await until(lambda: engine.decodes == 2, WAIT_S, "both requests at MD")
            assert (await _ask(s, router))[0] == 503  # full
            r.close()  # the client hangs up mid-stream: its handler is cancelled
        await until(lambda: _inflight(router) == 1, WAIT_S, "the gone client's slot given back")
        after = asyncio.ensure_future(_ask(s, router, stream=True))
        await until(lambda: engine.decodes == 3, WAIT_S, "a new request accepted in the freed slot")
        engine.release.set()
        for status, text, _ in await asyncio.gather(stays, after):
            assert status == 200 and text.rstrip().endswith("data: [DONE]"), (status, text)
        await until(lambda: _inflight(router) == 0, WAIT_S, "every slot given back")


async def test_a_trickled_body_is_408_and_gives_its_slot_back():
    """A client that sends its headers and then a byte of its body holds the one slot only for
    ``request.body_s``: then 408 naming it, its connection closed, and the slot serves the next."""
    async with _setup(max_inflight=1, body_s=0.5) as (router, engine), aiohttp.ClientSession() as s:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        try:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")
            await until(lambda: _inflight(router) == 1, WAIT_S, "the trickling request in its slot")
            async with asyncio.timeout(WAIT_S):
                answer = await reader.read()  # to the end: the router closes the connection
        finally:
            writer.close()
        head, _, text = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer
        assert b"request.body_s" in text and b"0.5 s" in text, answer
        await until(lambda: _inflight(router) == 0, WAIT_S, "the slot given back")
        engine.release.set()
        status, text, _ = await _ask(s, router)
        assert status == 200, (status, text)
        assert engine.decodes == 1  # the trickled request reached no upstream


async def test_a_cancelled_or_failing_handler_gives_its_slot_back():
    """The slot is given back in a ``finally``: a handler cancelled (what aiohttp does when the
    client goes) or raising leaves the count where it was."""
    metrics = RouterMetrics()
    limit = Inflight(1, metrics, deadline_s=60, grace_s=3)
    entered = asyncio.Event()

    async def forever(request, path):
        entered.set()
        await asyncio.Event().wait()

    async def fails(request, path):
        raise KeyError("the router's own")

    task = asyncio.ensure_future(limit.run(None, "/v1/completions", forever))  # type: ignore[arg-type]
    async with asyncio.timeout(WAIT_S):
        await entered.wait()
    refused = await limit.run(None, "/v1/completions", forever)  # type: ignore[arg-type]
    assert limit.count == 1 and refused.status == 503 and refused.headers["Retry-After"] == "1"
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert limit.count == 0 and metrics.registry.get_sample_value("pddwire_router_requests_inflight") == 0
    try:
        await limit.run(None, "/v1/completions", fails)  # type: ignore[arg-type]
    except KeyError:
        pass
    assert limit.count == 0


async def test_a_client_that_does_not_read_a_whole_answer_loses_its_connection_not_a_slot():
    """A whole answer is written within its request's slot: a client that takes none of it has
    its connection aborted after ``grace_s`` (past its deadline), and the slot comes back."""
    limit = Inflight(1, RouterMetrics(), deadline_s=0.5, grace_s=0.5)

    async def big(request, path):
        return web.Response(body=b"x" * (64 << 20))  # far over the socket buffers

    async def handler(request: web.Request) -> web.StreamResponse:
        return await limit.run(request, "/big", big)

    app = web.Application()
    app.router.add_get("/big", handler)
    async with serving(app) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET /big HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await until(lambda: limit.count == 1, WAIT_S, "the request in flight")
        await until(lambda: limit.count == 0, WAIT_S, "the slot back from a client that reads nothing")
        writer.close()


async def test_overlapping_calls_share_one_run():
    """What /healthz and /v1/models ask upstream: one round however many callers overlap; a
    caller that goes away does not end it for the others; the next call runs it again."""
    runs, gate = [], asyncio.Event()

    async def probe() -> int:
        runs.append(1)
        await gate.wait()
        return len(runs)

    shared = Shared(probe)
    callers = [asyncio.ensure_future(shared()) for _ in range(10)]
    await until(lambda: runs, WAIT_S, "the round started")
    callers[0].cancel()
    gate.set()
    assert await asyncio.gather(*callers[1:]) == [1] * 9 and len(runs) == 1
    assert await shared() == 2
    await shared.close()


async def test_a_shared_run_that_fails_fails_every_caller_once():
    """A round that raises gives every caller of it that error; the next call runs it afresh."""
    runs, gate = [], asyncio.Event()

    async def probe() -> int:
        runs.append(1)
        await gate.wait()
        if len(runs) == 1:
            raise ConnectionError("the member went away")
        return len(runs)

    shared = Shared(probe)
    callers = [asyncio.ensure_future(shared()) for _ in range(5)]
    await until(lambda: runs, WAIT_S, "the round started")
    gate.set()
    got = await asyncio.gather(*callers, return_exceptions=True)
    assert all(isinstance(e, ConnectionError) for e in got) and len(runs) == 1, got
    assert await shared() == 2
    await shared.close()


async def test_the_running_routers_pool_holds_what_its_requests_in_flight_can():
    """The connector the router really uses is capped, and above what ``max_inflight`` requests
    (two connections each) and the warm requests left draining hold at once."""
    async with _setup(max_inflight=3) as (router, _):
        limit = router.http.connector.limit
    assert limit == upstream_limit(3) >= UPSTREAM_PER_REQUEST * 3 + MAX_DRAINING
