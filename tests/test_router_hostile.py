"""A fleet record's engine URL may name anything: the router keeps itself bounded whatever is
there (docs/router.md, "API"). Found by a hostile fleet member: a URL naming the router itself
turned one request into 10,000 (until the router ran out of file descriptors), and a 200 answer
that is not JSON, or a huge one, was the router's own 500 after reading it all.

A real router (no agents: ``ask_agent = false``) and small aiohttp servers as the members.
"""

from __future__ import annotations

import contextlib

import aiohttp
import pytest
from aiohttp import web

from pdd_wire.router import Router
from pdd_wire.router import upstream as upstream_mod
from support.agents import free_port
from support.http import serving
from support.routers import p_md_router

PROMPT = "hello there"


def _router(p: str, md: str, port: int = 0) -> Router:
    return p_md_router(p, md, port=port, deadline_s=10, connect_s=2)


@contextlib.asynccontextmanager
async def _member(answer: bytes):
    """An 'engine' answering every POST with 200 and ``answer``."""
    async def any_post(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, status=200, content_type="application/json")

    app = web.Application()
    app.router.add_post("/{tail:.*}", any_post)
    async with serving(app) as url:
        yield url


async def _complete(router: Router) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.post(f"{router.url}/v1/completions",
                                                    json={"model": "m", "prompt": PROMPT, "max_tokens": 4}) as r:
        return r.status, await r.text()


async def test_an_engine_url_naming_the_router_is_refused_not_looped():
    """The router marks what it forwards; a marked request is refused 508 (LoopDetected) rather
    than routed again: the user gets that answer, and the router made one upstream request."""
    port = free_port()
    router = await _router(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}", port).start()
    try:
        status, text = await _complete(router)
        assert status == 508 and "points at a router" in text, (status, text)
    finally:
        await router.stop()


@pytest.mark.parametrize("answer", [b"<html>not a completion</html>", b"null", b"[1, 2]", b'"x"'])
async def test_a_prefill_answer_that_is_not_a_json_object_is_a_bad_gateway(answer):
    async with _member(answer) as url:
        router = await _router(url, url).start()
        try:
            status, text = await _complete(router)
            assert status == 502 and "BadGatewayError" in text and "answered 200 with" in text, (status, text)
        finally:
            await router.stop()


async def test_an_answer_over_the_limit_is_a_bad_gateway_not_the_routers_memory(monkeypatch):
    monkeypatch.setattr(upstream_mod, "MAX_UPSTREAM_BODY", 1 << 20)
    async with _member(b" " * (2 << 20)) as url:
        router = await _router(url, url).start()
        try:
            status, text = await _complete(router)
            assert status == 502 and "over the router's" in text, (status, text)
        finally:
            await router.stop()


async def test_a_request_body_nested_too_deep_is_a_400_not_the_routers_500():
    """About 2 KB of '[' raised RecursionError out of the JSON decoder: aiohttp's 500 and a
    traceback per request. It is the client's 400 now."""
    async with _member(b"{}") as url:
        router = await _router(url, url).start()
        try:
            body, headers = b"[" * 2000 + b"]" * 2000, {"content-type": "application/json"}
            async with aiohttp.ClientSession() as s, s.post(f"{router.url}/v1/completions", data=body,
                                                            headers=headers) as r:
                assert r.status == 400 and "not JSON" in await r.text(), (r.status, await r.text())
        finally:
            await router.stop()
