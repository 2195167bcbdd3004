"""The router: an OpenAI-compatible HTTP front (aiohttp) over unmodified ``vllm serve`` instances.

A request a user would send to ``vllm serve`` is sent here unchanged. P's agent chooses its
pipeline (:mod:`.choice`): P-MD, the way vLLM's own P/D proxies do it (prefill on a P member
with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``, whose
PddWireConnector sends the prompt's KV through the agents; then the user's request to an MD
member with the params prefill returned, its answer relayed as it came); P-RLD (finished in
site A); or P-RLD-MD, RLD streaming at once and handing the output to MD (:mod:`.handoff`).

Bounded: at most ``request.max_inflight`` requests in flight (one more: 503 at once, :mod:`.limit`),
and so the upstream connections; every request ends by ``request.deadline_s``; a client that
goes away cancels its handler, which closes every upstream connection it holds. docs/router.md
has the whole story.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any, Self

import aiohttp
import msgspec
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..config import parse_hostport
from .choice import Chooser
from .config import RouterConfig
from .continuation import unfit
from .core import SSE_HEADERS, Core, Req
from .handoff import Handoff
from .limit import Inflight, Shared, upstream_limit
from .load import LoadReader
from .metrics import RouterMetrics
from .output import DONE_SENT, STREAM, ClientGone, CollectSink, Output, SegmentFailed, StreamSink
from .pools import NoMember, Pools, Upstream
from .upstream import (
    LOGPROBS,
    BadField,
    Trace,
    UpstreamError,
    check_fields,
    dest,
    error_of,
    error_response,
    paced_events,
    read_capped,
    sse_events,
    token_count,
)

log = structlog.get_logger("pdd_wire.router")


#: Upstream connections idle this long are closed by the router itself. vLLM's HTTP server closes
#: an idle one after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); with aiohttp's default of 15 s, a request
#: sent on a pooled connection just as vLLM closes it fails (ServerDisconnectedError), and a
#: completion cannot be sent again.
UPSTREAM_KEEPALIVE_S = 2.0
#: An error written to a client after its request failed (the deadline passed, an upstream
#: failed): a client that stopped reading but keeps its connection open is cut off after this.
FAIL_WRITE_S = 3.0

#: Set on every request the router sends upstream. A record's engine URL may name anything, the
#: router itself included: one user request would then come back for ever (each forwarded copy
#: forwarding again: 10,000 connections in 9 s, until the router ran out of file descriptors).
FORWARDED_HEADER = "x-pdd-wire-forwarded"
#: A non-streamed answer relayed whole: prompt logprobs of a 128k-token prompt are far over the
#: 64 MiB the router reads of what it parses, and are the user's to have.
RELAY_MAX_BODY = 1 << 30
#: After a relayed stream's ``[DONE]`` (the client has its whole answer), the rest of the upstream body is
#: read this long at most, to keep the connection for the next request.
AFTER_DONE_S = 1.0


@web.middleware
async def _no_loops(request: web.Request, handler):
    """A request a pdd-wire router forwarded is not routed again: 508, naming the cause."""
    if FORWARDED_HEADER in request.headers and request.path.startswith("/v1/"):
        return error_response(508, "this request was forwarded by a pdd-wire router: an engine URL in the fleet "
                                   "(or the router's config) points at a router, not at vllm serve",
                              "LoopDetectedError")
    return await handler(request)


class Router:
    """``Router(cfg)``; ``await start()`` binds ``cfg.listen.address`` (port 0: see ``port``);
    ``await stop()``. ``pools`` is live: add and remove members while it runs."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.metrics = RouterMetrics()
        self.pools = Pools.from_config(cfg.pools, self.metrics.inflight, self._member_changed)
        self.port = 0
        self._http: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._decoder = msgspec.json.Decoder()
        self._core: Core | None = None
        self._chooser: Chooser | None = None
        self._loads: LoadReader | None = None
        self._closing: set[asyncio.Task] = set()  # agent connections of removed P members
        self._inflight = Inflight(cfg.request.max_inflight, self.metrics, cfg.request.deadline_s, FAIL_WRITE_S)
        self._health = Shared(self._probe_all)  # concurrent /healthz calls share one round of probes
        self._model_list = Shared(self._first_models)  # and /v1/models one walk of the members

    # ------------------------------------------------------------------ life cycle
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20, middlewares=[_no_loops])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self) -> Self:
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=self.cfg.request.connect_s),
            headers={FORWARDED_HEADER: "1"},  # an engine URL that is a router's is refused there (_no_loops)
            # Capped where legitimate use never reaches (a cap it reached would fail load, and
            # /healthz, with connect timeouts at its edge): requests in flight are bounded
            # (request.max_inflight) and each holds at most two upstream connections; warm requests
            # left to finish are bounded (MAX_DRAINING), and /healthz, /v1/models and RLD's load
            # scrapes are one per member at most (limit.upstream_limit).
            connector=aiohttp.TCPConnector(limit=upstream_limit(self.cfg.request.max_inflight),
                                           keepalive_timeout=UPSTREAM_KEEPALIVE_S))
        self._loads = LoadReader(self.cfg.rld_load, self._http, self.metrics)
        self._core = Core(self.cfg, self._http, self.pools, self.metrics, self._loads, self._decoder)
        self._chooser = Chooser(self._core)
        # handler_cancellation: a client that goes away cancels its handler, which closes the
        # upstream connections it holds (vLLM then aborts those requests).
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        host, port = parse_hostport(self.cfg.listen.address, "listen.address")
        try:
            await self._runner.setup()
            await web.TCPSite(self._runner, host, port).start()
        except BaseException:  # (the address in use): what was set up is closed, not left to the GC
            with contextlib.suppress(Exception):  # the start's own error is the one to tell
                await self.stop()
            raise
        self.port = self._runner.addresses[0][1]
        log.info("router_listening", address=f"{host}:{self.port}",
                 pools={r: [u.url for u in self.pools.members(r)] for r in ("P", "RLD", "MD")})
        if self.cfg.pools.RLD and self.cfg.handoff.mode != "one-shot" and not self.cfg.choice.block_tokens:
            log.warning("router_config_warning", key="choice.block_tokens",
                        detail="0: catch-up's absorb rounds are not cut at vLLM's block boundaries, so MD's "
                               "prefix cache keeps only their full blocks (pddwire_router_catchup_absorbed_"
                               "tokens_total counts every token sent); set it to vLLM's --block-size")
        return self

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            raise RuntimeError("the router is not started")
        return self._http

    @property
    def url(self) -> str:
        host, _ = parse_hostport(self.cfg.listen.address, "listen.address")
        return f"http://{host}:{self.port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self._health.close()
        await self._model_list.close()
        if self._chooser is not None:
            await self._chooser.close()
        if self._loads is not None:
            await self._loads.close()
        if self._core is not None:
            await self._core.close_drains()
        await asyncio.gather(*self._closing, return_exceptions=True)
        if self._http is not None:
            await self._http.close()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def _member_changed(self, role: str, u: Upstream, added: bool) -> None:
        log.info("router_member_" + ("added" if added else "removed"), pool=role, member=u.url)
        if added:
            return
        if role == "RLD" and self._loads is not None:
            self._loads.forget(u)
        if role == "P" and self._chooser is not None:
            t = asyncio.get_running_loop().create_task(self._chooser.forget(u))
            self._closing.add(t)
            t.add_done_callback(self._closing.discard)

    # ------------------------------------------------------------------ small endpoints
    async def _models(self, request: web.Request) -> web.Response:
        status, body = await self._model_list()
        if status == 200:
            return web.Response(body=body, status=200, content_type="application/json")
        return error_response(503, body.decode(), "ServiceUnavailableError")

    async def _first_models(self) -> tuple[int, bytes]:
        """The first member's 200 answer to ``/v1/models`` (P, then MD), else 503 and the last failure."""
        last = "no pool member answered"
        limit = self.cfg.request.connect_s  # each member's whole answer: one that hangs is passed over
        for u in self.pools.members("P") + self.pools.members("MD"):
            try:
                async with asyncio.timeout(limit), self.http.get(f"{u.url}/v1/models") as r:
                    body = await read_capped(r)
                    if r.status == 200:
                        return 200, body
                    last = f"{u.url}: HTTP {r.status}"
            except TimeoutError:
                last = f"{u.url}: no answer within {limit} s (request.connect_s)"
            except (aiohttp.ClientError, OSError) as exc:
                last = f"{u.url}: {exc}"
            except UpstreamError:
                last = f"{u.url}: an answer over the router's limit"
        return 503, last.encode()

    async def _healthz(self, request: web.Request) -> web.Response:
        healthy, members = await self._health()
        return web.json_response({"ok": healthy, "members": members}, status=200 if healthy else 503)

    async def _probe_all(self) -> tuple[bool, dict[str, bool]]:
        async def probe(u: Upstream) -> bool:
            try:
                async with asyncio.timeout(self.cfg.request.connect_s):
                    async with self.http.get(f"{u.url}/health") as r:
                        return r.status == 200
            except (aiohttp.ClientError, OSError, TimeoutError):
                return False

        ups = list(self.pools)
        ok = await asyncio.gather(*(probe(u) for u in ups))
        members = {f"{u.pool} {u.url}": h for u, h in zip(ups, ok)}
        healthy = all(any(h for u, h in zip(ups, ok) if u.pool == name) for name in ("P", "MD"))
        return healthy, members

    async def _metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(self.metrics.registry))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp

    # ------------------------------------------------------------------ the OpenAI endpoints
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._inflight.run(request, "/v1/completions", self._serve)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._inflight.run(request, "/v1/chat/completions", self._serve)

    async def _serve(self, request: web.Request, path: str) -> web.StreamResponse:
        ends = asyncio.get_running_loop().time() + self.cfg.request.deadline_s  # the body's time counts
        limit = min(self.cfg.request.body_s, self.cfg.request.deadline_s)
        try:
            async with asyncio.timeout(limit):  # a trickled body holds a slot (request.max_inflight)
                body = await request.json(loads=self._decoder.decode)
        except TimeoutError:
            log.info("router_body_timeout", path=path, body_s=limit)
            resp = error_response(408, f"the request body did not arrive within {limit:g} s (request.body_s)",
                                  "RequestTimeoutError")
            resp.force_close()  # no keep-alive (aiohttp drains what still comes, holding no slot)
            return resp
        except (ValueError, msgspec.DecodeError, RecursionError) as exc:  # (nested too deep: a 2 KB body)
            return error_response(400, f"the body is not JSON: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object")
        try:
            read = check_fields(path, body)
        except BadField as exc:
            return error_response(400, str(exc), param=exc.param)
        assert self._chooser is not None
        req = Req(request, path, body, f"rtr-{uuid.uuid4().hex[:16]}", Trace("none"), read=read)
        trace, rid = req.trace, req.rid
        outcome = "error"
        deadline = asyncio.timeout_at(ends)
        try:
            async with deadline:
                await self._chooser.choose(req)
                out = await self._run(req)
            outcome = "ok" if out.status == 200 else f"http_{out.status}"
            return out
        except UpstreamError as exc:
            outcome = f"http_{exc.status}"
            if request.get(STREAM) is None:  # vLLM's error, as it gave it
                return web.Response(body=exc.body, status=exc.status, content_type=exc.content_type)
            return await self._fail(request, 502, f"upstream answered HTTP {exc.status}: "
                                    f"{exc.body[:300].decode(errors='replace')}", "BadGatewayError")
        except TimeoutError as exc:
            if request.get(DONE_SENT):  # after the client's [DONE] (reading what follows it): answered
                outcome = "ok"
                return request[STREAM]
            if not deadline.expired():  # aiohttp's connect timeout is a TimeoutError too
                outcome = "upstream_failed"
                return await self._upstream_failed(request, rid, exc)
            outcome = "deadline"
            log.warning("router_deadline", request_id=rid, deadline_s=self.cfg.request.deadline_s)
            return await self._fail(request, 504, f"deadline of {self.cfg.request.deadline_s} s passed",
                                    "TimeoutError")
        except (aiohttp.ClientError, OSError, SegmentFailed, NoMember) as exc:
            outcome = "upstream_failed"
            return await self._upstream_failed(request, rid, exc)
        except ClientGone:
            outcome = "client_gone"
            log.info("router_client_gone", request_id=rid)
            return request.get(STREAM) or web.Response(status=499)  # nobody reads it
        except asyncio.CancelledError:
            # After the stream's [DONE] the client has the whole answer (it may hang up at once).
            outcome = "ok" if request.get(DONE_SENT) else "client_gone"
            raise
        except Exception as exc:  # the router's own bug: said so, and the client told
            log.exception("router_internal_error", request_id=rid)
            return await self._fail(request, 500, f"router error: {exc!r}", "InternalServerError")
        finally:
            pipeline = trace.pipeline
            self.metrics.requests.labels(endpoint=path, pipeline=pipeline, outcome=outcome).inc()
            self.metrics.latency.labels(pipeline=pipeline).observe(time.monotonic() - trace.t0)
            if trace.first is not None and trace.last is not None:
                self.metrics.ttft.labels(pipeline=pipeline).observe(trace.first - trace.t0)
                if trace.tokens > 1:
                    self.metrics.tpot.labels(pipeline=pipeline).observe(
                        (trace.last - trace.first) / (trace.tokens - 1))

    async def _upstream_failed(self, request: web.Request, rid: str, exc: BaseException) -> web.StreamResponse:
        log.warning("router_upstream_failed", request_id=rid, error=repr(exc))
        return await self._fail(request, 502, f"upstream failed: {exc}", "BadGatewayError")

    async def _fail(self, request: web.Request, status: int, message: str, kind: str) -> web.StreamResponse:
        """An error for the client: a JSON error before the stream started, else a last SSE
        event with the error and ``[DONE]`` (what vLLM sends when a stream fails). The request
        may be past its deadline: a client that has not taken what it was sent within
        :data:`FAIL_WRITE_S` (it stopped reading, its connection open) gets its connection aborted."""
        resp = request.get(STREAM)
        if resp is None:
            return error_response(status, message, kind)
        if request.get(DONE_SENT):
            return resp  # the client has the whole stream: nothing may follow its [DONE]
        request[DONE_SENT] = True
        transport = request.transport
        try:
            async with asyncio.timeout(FAIL_WRITE_S):
                # Until the client has taken the rest: aiohttp's own wait for that (a write's drain)
                # may be one the deadline cancelled, which it would raise again at once.
                while transport is not None and transport.get_write_buffer_size():
                    await asyncio.sleep(0.05)
                err = msgspec.json.encode({"error": {"message": message, "type": kind, "param": None, "code": status}})
                await resp.write(b"data: " + err + b"\n\ndata: [DONE]\n\n")
                await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client is gone
        except TimeoutError:
            log.warning("router_client_not_reading", status=status, write_s=FAIL_WRITE_S)
            if transport is not None:
                transport.abort()
        return resp

    # ------------------------------------------------------------------ running a pipeline
    async def _run(self, req: Req) -> web.StreamResponse:
        core, pipeline = self._core, req.trace.pipeline
        assert core is not None
        if pipeline == "MD":
            with self.pools.using(self._md(req)) as MD:
                return await self._relay(req, MD, req.body)
        if pipeline == "P-RLD":
            if self.pools.members("RLD"):
                return await self._disaggregated(req, "RLD")
            # No relay decoder: P itself finishes it, in site A; nothing crosses the WAN.
            self.metrics.wan_bytes.labels(pipeline="P-RLD").observe(0)
            with self.pools.using(self.pools.pick("P")) as P:
                return await self._relay(req, P, req.body)
        if pipeline == "P-RLD-MD":
            why = unfit(core, req)
            if why is None:
                return await self._p_rld_md(req)
            # MD decodes once the KV is there.
            core.fallback(req.rid, f"p_rld_md_{why}")
        return await self._disaggregated(req, "MD")

    def _md(self, req: Req) -> Upstream:
        """The MD member the choice was made for (if still in its pool), else the least-loaded."""
        return req.md if req.md is not None and not req.md.removed else self.pools.pick("MD")

    async def _disaggregated(self, req: Req, decode: str) -> web.StreamResponse:
        """Prefill on P (its KV sent to the decode member's site/node), decode on pool ``decode``."""
        with self.pools.using(self._md(req) if decode == "MD" else self.pools.pick(decode)) as D:
            to = dest(D.member)
            params = await self._prefill(req, send_to=[to] if to else None)
            self._wan(req, params if decode == "MD" else None)
            body = {**req.body, "kv_transfer_params": params} if params is not None else req.body
            return await self._relay(req, D, body)

    async def _p_rld_md(self, req: Req) -> web.StreamResponse:
        """P sends the KV to RLD (same site) and MD (across the WAN); :class:`Handoff` runs the
        rest."""
        assert self._core is not None
        with self.pools.using(self.pools.pick("RLD")) as rld, self.pools.using(self._md(req)) as md:
            dests = [d for d in (dest(rld.member), dest(md.member)) if d]
            params = await self._prefill(req, send_to=dests or None)
            self._wan(req, params)
            if not params or not params.get("do_remote_prefill"):  # nothing sent: MD computes it
                body = {**req.body, "kv_transfer_params": params} if params is not None else req.body
                return await self._relay(req, md, body)
            sink = StreamSink(req.request) if req.read.get("stream") else CollectSink()
            return await Handoff(self._core, req, Output(self._core, req, sink), rld, md, params).run()

    def _wan(self, req: Req, params: dict | None) -> None:
        """The KV bytes this request's prefill sends to MD's site, as planned at the choice."""
        h = self.metrics.wan_bytes.labels(pipeline=req.trace.pipeline)
        if not (params and params.get("do_remote_prefill")):
            h.observe(0)
        elif req.planned_wan_bytes is not None:
            h.observe(req.planned_wan_bytes)  # else not known (no choice asked): not observed

    def _prefill_body(self, body: dict, params: dict) -> dict:
        pre = {**body, "max_tokens": 1, "n": 1, "stream": False, "kv_transfer_params": params}
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        # Its answer is not relayed: nothing it would compute for the client (prompt logprobs
        # would also make vLLM skip its prefix cache).
        for k in ("stream_options", "min_tokens", "prompt_logprobs", *LOGPROBS, "stream_interval"):
            pre.pop(k, None)
        return pre

    async def _prefill(self, req: Req, *, send_to: list[str] | None = None) -> dict | None:
        """Ask P for the prompt's KV; the ``kv_transfer_params`` it returned (None: P is
        unreachable, and decode computes the prompt)."""
        assert self._core is not None
        params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "pdd_request_id": req.rid}
        if send_to:
            params["send_to"] = send_to
        if self.cfg.request.prefill_lease_s is not None:
            params["lease_s"] = self.cfg.request.prefill_lease_s
        chosen = req.p if req.p is not None and not req.p.removed else self.pools.pick("P")
        with self.pools.using(chosen) as P:
            try:
                got = await self._core.post_json(P, req.path, self._prefill_body(req.body, params))
            except (aiohttp.ClientError, OSError) as exc:
                self._core.fallback(req.rid, "prefill_unreachable", member=P.url, error=repr(exc))
                return None
        kv = got.get("kv_transfer_params") or {}
        if not isinstance(kv, dict):  # not vLLM's shape: as if it sent nothing (decode computes the prompt)
            kv = {"pdd_error": "kv_transfer_params is not an object"}
        if not kv.get("do_remote_prefill"):
            self._core.fallback(req.rid, "kv_not_sent", reason=kv.get("pdd_error"))
        return kv

    async def _relay(self, req: Req, up: Upstream, body: dict) -> web.StreamResponse:
        """Send ``body`` to ``up`` and relay its answer: SSE event by event, or whole."""
        trace = req.trace
        async with self.http.post(f"{up.url}{req.path}", json=body) as r:
            if r.status != 200:
                raise await error_of(r)
            if not req.read.get("stream"):  # the client's, as vLLM read it
                data = await read_capped(r, RELAY_MAX_BODY)
                with contextlib.suppress(msgspec.DecodeError, AttributeError, TypeError):
                    n = int((self._decoder.decode(data).get("usage") or {}).get("completion_tokens") or 0)
                    self.metrics.output_tokens.labels(pool=up.pool).inc(n)
                return web.Response(body=data, status=200, content_type="application/json")
            out = web.StreamResponse(status=200, headers=SSE_HEADERS)
            await out.prepare(req.request)
            req.request[STREAM] = out
            n0 = trace.tokens
            what = f"{up.pool} member {up.url}'s stream"
            raw = sse_events(r.content)
            async with contextlib.aclosing(raw), \
                    contextlib.aclosing(paced_events(raw, self.cfg.request.stream_silent_s, what)) as events:
                async for event in events:
                    if event.startswith(b"data: {"):
                        with contextlib.suppress(msgspec.DecodeError, AttributeError, TypeError):
                            trace.saw(token_count(self._decoder.decode(event[6:])))
                    await out.write(event)
                    if event.startswith(b"data: [DONE]"):
                        req.request[DONE_SENT] = True
                        break  # the client has the whole answer: nothing more is relayed
            if req.request.get(DONE_SENT):
                # vLLM ends its body right after [DONE]: read that end, briefly, so that the connection
                # goes back to the pool; an upstream that holds it open silent loses it (closed).
                with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                    async with asyncio.timeout(AFTER_DONE_S):
                        await r.content.read()
            self.metrics.output_tokens.labels(pool=up.pool).inc(trace.tokens - n0)
            await out.write_eof()
            return out
