"""The router: an OpenAI-compatible HTTP front (aiohttp) over unmodified ``vllm serve`` instances.

A request a user would send to ``vllm serve`` is sent here unchanged. The router runs it as P-MD,
the way vLLM's own P/D proxies do: it asks a prefill instance (pool P) for the prompt with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}`` (P's PddWireConnector
sends the prompt's KV through the agents), then sends the user's request to a main-decode
instance (pool MD) with the ``kv_transfer_params`` prefill returned, unchanged, and relays MD's
answer, streamed (SSE, event by event) or not. Each pool member is picked least-loaded (requests
in flight through this router).

Bounded: every request ends by ``request.deadline_s``; a client that goes away cancels its
handler, which closes the upstream connections (vLLM aborts a request whose client is gone).
A client gone after prefill sent its KV but before MD was asked leaves a short drain request
to MD (``max_tokens=1``) so that the KV pinned for it is consumed and freed now rather than when
its lease runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..config import parse_hostport
from .config import Member, RouterConfig

log = structlog.get_logger("pdd_wire.router")

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2)
_STREAM = web.RequestKey("pdd_stream", web.StreamResponse)  # the client's stream, once started
_DRAIN_S = 30.0  # a drain request (see the module doc) gives up after this


class RouterMetrics:
    """The router's Prometheus metrics, in a registry of its own (``/metrics``)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pddwire_router_requests", "Requests by endpoint, pipeline and outcome",
                                ["endpoint", "pipeline", "outcome"], registry=r)
        self.ttft = Histogram("pddwire_router_ttft_seconds", "Time to the first output token (streamed requests)",
                              ["pipeline"], buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("pddwire_router_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, one sample per streamed request",
                              ["pipeline"], buckets=_TPOT_BUCKETS, registry=r)
        self.latency = Histogram("pddwire_router_request_seconds", "Whole request, arrival to last byte",
                                 ["pipeline"], buckets=_TTFT_BUCKETS, registry=r)
        self.output_tokens = Counter("pddwire_router_output_tokens", "Output tokens relayed, by pool that made them",
                                     ["pool"], registry=r)
        self.pipelines = Counter("pddwire_router_pipeline_choices", "Pipeline chosen per request, with its reason",
                                 ["pipeline", "reason"], registry=r)
        self.fallbacks = Counter("pddwire_router_fallbacks", "Requests that left their pipeline's path, by kind",
                                 ["kind"], registry=r)
        self.inflight = Gauge("pddwire_router_inflight", "Requests in flight per pool member",
                              ["pool", "member"], registry=r)
        self.drains = Counter("pddwire_router_drains", "Drain requests sent for KV a gone client left",
                              ["outcome"], registry=r)


@dataclass(eq=False)
class Upstream:
    """A pool member at run time."""

    pool: str
    member: Member
    inflight: int = 0

    @property
    def url(self) -> str:
        return self.member.url.rstrip("/")


@dataclass
class Pool:
    name: str
    members: list[Upstream]
    _turn: itertools.count = field(default_factory=itertools.count)

    def pick(self) -> Upstream:
        """The member with the fewest requests in flight; ties go round-robin."""
        start = next(self._turn) % len(self.members)
        ring = self.members[start:] + self.members[:start]
        return min(ring, key=lambda u: u.inflight)


class UpstreamError(Exception):
    """A vLLM server answered with an error status: relayed to the client as it came."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.body, self.content_type = status, body, content_type


def _error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    """An error body shaped like vLLM's (``{"error": {...}}``)."""
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                             status=status)


def _is_token_event(ev: dict) -> int:
    """Output tokens in one streamed chunk (completions or chat): the token ids when vLLM returns
    them, else 1 for a chunk that carries text."""
    n = 0
    for c in ev.get("choices") or ():
        ids = c.get("token_ids")
        if ids:
            n += len(ids)
            continue
        text = c.get("text")
        if text is None:
            text = (c.get("delta") or {}).get("content")
        if text:
            n += 1
    return n


class _Trace:
    """Per-request timing for the metrics."""

    def __init__(self, pipeline: str) -> None:
        self.pipeline = pipeline
        self.t0 = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0

    def saw(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
        self.last = now
        self.tokens += n


class Router:
    """``Router(cfg)``; ``await start()`` binds ``cfg.listen.address`` (port 0: see ``port``);
    ``await stop()``."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.pools = {name: Pool(name, [Upstream(name, m) for m in getattr(cfg.pools, name)])
                      for name in ("P", "RLD", "MD")}
        self.metrics = RouterMetrics()
        self.port = 0
        self._http: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task] = set()
        self._decoder = msgspec.json.Decoder()

    # ------------------------------------------------------------------ life cycle
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self) -> "Router":
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=self.cfg.request.connect_s),
            connector=aiohttp.TCPConnector(limit=0))
        # handler_cancellation: a client that goes away cancels its handler, which closes the
        # upstream connections it holds (vLLM then aborts those requests).
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        host, port = parse_hostport(self.cfg.listen.address, "listen.address")
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log.info("router_listening", address=f"{host}:{self.port}",
                 pools={k: [u.url for u in p.members] for k, p in self.pools.items()})
        return self

    @property
    def url(self) -> str:
        host, _ = parse_hostport(self.cfg.listen.address, "listen.address")
        return f"http://{host}:{self.port}"

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()

    async def __aenter__(self) -> "Router":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    @contextlib.contextmanager
    def _using(self, u: Upstream):
        u.inflight += 1
        g = self.metrics.inflight.labels(pool=u.pool, member=u.url)
        g.inc()
        try:
            yield u
        finally:
            u.inflight -= 1
            g.dec()

    # ------------------------------------------------------------------ small endpoints
    async def _models(self, request: web.Request) -> web.Response:
        members = self.pools["P"].members + self.pools["MD"].members
        last = "no pool member answered"
        for u in members:
            try:
                async with self._http.get(f"{u.url}/v1/models") as r:
                    body = await r.read()
                    if r.status == 200:
                        return web.Response(body=body, status=200, content_type="application/json")
                    last = f"{u.url}: HTTP {r.status}"
            except (aiohttp.ClientError, OSError) as exc:
                last = f"{u.url}: {exc}"
        return _error(503, last, "ServiceUnavailableError")

    async def _healthz(self, request: web.Request) -> web.Response:
        async def probe(u: Upstream) -> bool:
            try:
                async with asyncio.timeout(self.cfg.request.connect_s):
                    async with self._http.get(f"{u.url}/health") as r:
                        return r.status == 200
            except (aiohttp.ClientError, OSError, TimeoutError):
                return False

        ups = [u for p in self.pools.values() for u in p.members]
        ok = await asyncio.gather(*(probe(u) for u in ups))
        members = {f"{u.pool} {u.url}": h for u, h in zip(ups, ok)}
        healthy = all(any(h for u, h in zip(ups, ok) if u.pool == name) for name in ("P", "MD"))
        return web.json_response({"ok": healthy, "members": members}, status=200 if healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(self.metrics.registry))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp

    # ------------------------------------------------------------------ the OpenAI endpoints
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/chat/completions")

    async def _serve(self, request: web.Request, path: str) -> web.StreamResponse:
        try:
            body = await request.json(loads=self._decoder.decode)
        except (ValueError, msgspec.DecodeError) as exc:
            return _error(400, f"the body is not JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        rid = f"rtr-{uuid.uuid4().hex[:16]}"
        pipeline = "P-MD"
        self.metrics.pipelines.labels(pipeline=pipeline, reason="ask_agent_off").inc()
        trace = _Trace(pipeline)
        out: web.StreamResponse | None = None
        outcome = "error"
        try:
            async with asyncio.timeout(self.cfg.request.deadline_s):
                out = await self._p_md(request, path, body, rid, trace)
            outcome = "ok" if out.status == 200 else f"http_{out.status}"
            return out
        except UpstreamError as exc:
            outcome = f"http_{exc.status}"
            return web.Response(body=exc.body, status=exc.status, content_type=exc.content_type)
        except TimeoutError:
            outcome = "deadline"
            log.warning("router_deadline", request_id=rid, deadline_s=self.cfg.request.deadline_s)
            return await self._fail(request, 504, f"deadline of {self.cfg.request.deadline_s} s passed",
                                    "TimeoutError")
        except (aiohttp.ClientError, OSError) as exc:
            outcome = "upstream_failed"
            log.warning("router_upstream_failed", request_id=rid, error=repr(exc))
            return await self._fail(request, 502, f"upstream failed: {exc}", "BadGatewayError")
        except asyncio.CancelledError:
            outcome = "client_gone"
            raise
        finally:
            self.metrics.requests.labels(endpoint=path, pipeline=pipeline, outcome=outcome).inc()
            self.metrics.latency.labels(pipeline=pipeline).observe(time.monotonic() - trace.t0)
            if trace.first is not None:
                self.metrics.ttft.labels(pipeline=pipeline).observe(trace.first - trace.t0)
                if trace.tokens > 1:
                    self.metrics.tpot.labels(pipeline=pipeline).observe(
                        (trace.last - trace.first) / (trace.tokens - 1))

    async def _fail(self, request: web.Request, status: int, message: str, kind: str) -> web.StreamResponse:
        """An error for the client: a JSON error before the stream started, else a last SSE
        event with the error and ``[DONE]`` (what vLLM sends when a stream fails)."""
        resp = request.get(_STREAM)
        if resp is None:
            return _error(status, message, kind)
        with contextlib.suppress(ConnectionError, RuntimeError):
            err = msgspec.json.encode({"error": {"message": message, "type": kind, "param": None, "code": status}})
            await resp.write(b"data: " + err + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
        return resp

    # ------------------------------------------------------------------ P-MD
    def _prefill_body(self, body: dict, params: dict) -> dict:
        pre = {**body, "max_tokens": 1, "n": 1, "stream": False, "kv_transfer_params": params}
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        for k in ("stream_options", "min_tokens"):
            pre.pop(k, None)
        return pre

    async def _prefill(self, path: str, body: dict, rid: str, *, send_to: list[str] | None = None) -> dict | None:
        """Ask P for the prompt's KV; the ``kv_transfer_params`` it returned (None: P is
        unreachable, and decode computes the prompt)."""
        params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "pdd_request_id": rid}
        if send_to:
            params["send_to"] = send_to
        if self.cfg.request.prefill_lease_s is not None:
            params["lease_s"] = self.cfg.request.prefill_lease_s
        with self._using(self.pools["P"].pick()) as P:
            try:
                async with self._http.post(f"{P.url}{path}", json=self._prefill_body(body, params)) as r:
                    data = await r.read()
                    if r.status != 200:
                        raise UpstreamError(r.status, data, r.content_type or "application/json")
            except (aiohttp.ClientError, OSError) as exc:
                self.metrics.fallbacks.labels(kind="prefill_unreachable").inc()
                log.warning("router_fallback", request_id=rid, kind="prefill_unreachable", member=P.url,
                            error=repr(exc))
                return None
        got = self._decoder.decode(data).get("kv_transfer_params") or {}
        if not got.get("do_remote_prefill"):
            self.metrics.fallbacks.labels(kind="kv_not_sent").inc()
            log.warning("router_fallback", request_id=rid, kind="kv_not_sent", reason=got.get("pdd_error"))
        return got

    async def _p_md(self, request: web.Request, path: str, body: dict, rid: str,
                    trace: _Trace) -> web.StreamResponse:
        params = await self._prefill(path, body, rid)
        dec = {**body, "kv_transfer_params": params} if params is not None else body
        md_started = False
        try:
            with self._using(self.pools["MD"].pick()) as MD:
                md_started = True
                return await self._relay(request, MD, path, dec, trace)
        finally:
            if not md_started and params and params.get("do_remote_prefill"):
                self._spawn(self._drain(path, dec, rid))

    async def _drain(self, path: str, dec: dict, rid: str) -> None:
        """Consume the KV prefill sent for a request whose client is gone (see the module doc)."""
        body = {**self._prefill_body(dec, dec["kv_transfer_params"])}
        outcome = "failed"
        try:
            async with asyncio.timeout(_DRAIN_S):
                with self._using(self.pools["MD"].pick()) as MD:
                    async with self._http.post(f"{MD.url}{path}", json=body) as r:
                        await r.read()
                        outcome = "ok" if r.status == 200 else f"http_{r.status}"
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning("router_drain_failed", request_id=rid, error=repr(exc))
        self.metrics.drains.labels(outcome=outcome).inc()

    async def _relay(self, request: web.Request, up: Upstream, path: str, body: dict,
                     trace: _Trace) -> web.StreamResponse:
        """Send ``body`` to ``up`` and relay its answer: SSE event by event, or whole."""
        async with self._http.post(f"{up.url}{path}", json=body) as r:
            if r.status != 200:
                raise UpstreamError(r.status, await r.read(), r.content_type or "application/json")
            if not body.get("stream"):
                data = await r.read()
                with contextlib.suppress(msgspec.DecodeError, AttributeError, TypeError):
                    n = int((self._decoder.decode(data).get("usage") or {}).get("completion_tokens") or 0)
                    self.metrics.output_tokens.labels(pool=up.pool).inc(n)
                return web.Response(body=data, status=200, content_type="application/json")
            out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                          "Cache-Control": "no-cache"})
            await out.prepare(request)
            request[_STREAM] = out
            n0 = trace.tokens
            async for event in _sse_events(r.content):
                if event.startswith(b"data: {"):
                    with contextlib.suppress(msgspec.DecodeError, AttributeError, TypeError):
                        trace.saw(_is_token_event(self._decoder.decode(event[6:])))
                await out.write(event)
            self.metrics.output_tokens.labels(pool=up.pool).inc(trace.tokens - n0)
            await out.write_eof()
            return out


async def _sse_events(content: aiohttp.StreamReader):
    """The SSE events of a stream (vLLM ends each with a blank line, ``\\n\\n``), each with its
    terminator, bytes as they came; any length (no line limit)."""
    buf = bytearray()
    async for chunk in content.iter_any():
        buf += chunk
        while (i := buf.find(b"\n\n")) >= 0:
            yield bytes(buf[:i + 2])
            del buf[:i + 2]
    if buf.strip():
        yield bytes(buf)
