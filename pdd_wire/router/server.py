"""The router: an OpenAI-compatible HTTP front (aiohttp) over unmodified ``vllm serve`` instances.

A request a user would send to ``vllm serve`` is sent here unchanged. The router runs it as P-MD,
the way vLLM's own P/D proxies do: it asks a prefill instance (pool P) for the prompt with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}`` (P's PddWireConnector
sends the prompt's KV through the agents), then sends the user's request to a main-decode
instance (pool MD) with the ``kv_transfer_params`` prefill returned, unchanged, and relays MD's
answer, streamed (SSE, event by event) or not. Each pool member is picked least-loaded (requests
in flight through this router).

Bounded: every request ends by ``request.deadline_s``; a client that goes away cancels its
handler, which closes the upstream connections. docs/router.md has the whole story.

Each request's pipeline is P's agent's choice (``choose_pipeline``, as engine "router"): P-MD;
P-RLD (long input, short output) in site A; P-RLD-MD, RLD streaming at once and handing the
output to MD once MD holds the KV (one-shot, :meth:`Router._p_rld_md`).
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
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    generate_latest,
)

from ..config import parse_hostport
from ..engine.client import EngineClient
from ..engine.hashes import chain_hashes, layer_hashes
from ..errors import PddWireError
from .config import RouterConfig
from .upstream import (
    COMPLETIONS_MAX_TOKENS,
    Pool,
    RouterMetrics,
    Trace,
    Upstream,
    UpstreamError,
    batched,
    dest,
    error_response,
    expected_output,
    sse_events,
    token_count,
    tokenize_request,
    without,
)

log = structlog.get_logger("pdd_wire.router")

_STREAM = web.RequestKey("pdd_stream", web.StreamResponse)  # the client's stream, once started
_WHOLE_RUN = 5  # see _rld_then_md: trailing tokens with whole text before MD may take over


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
        self._decoder = msgspec.json.Decoder()
        self._engines: dict[Upstream, EngineClient] = {}  # P member -> its agent, as engine "router"
        self._engine_lock = asyncio.Lock()

    # ------------------------------------------------------------------ life cycle
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self) -> Self:
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=self.cfg.request.connect_s),
            connector=aiohttp.TCPConnector(limit=0))
        # handler_cancellation: a client that goes away cancels its handler, which closes the
        # upstream connections it holds (vLLM then aborts those requests).
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        host, port = parse_hostport(self.cfg.listen.address, "listen.address")
        await web.TCPSite(self._runner, host, port).start()
        self.port = self._runner.addresses[0][1]
        log.info("router_listening", address=f"{host}:{self.port}",
                 pools={k: [u.url for u in p.members] for k, p in self.pools.items()})
        return self

    @property
    def url(self) -> str:
        host, _ = parse_hostport(self.cfg.listen.address, "listen.address")
        return f"http://{host}:{self.port}"

    async def stop(self) -> None:
        for eng in self._engines.values():
            await eng.close()
        self._engines.clear()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

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
        return error_response(503, last, "ServiceUnavailableError")

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
            return error_response(400, f"the body is not JSON: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object")
        rid = f"rtr-{uuid.uuid4().hex[:16]}"
        trace = Trace("none")
        out: web.StreamResponse | None = None
        outcome = "error"
        try:
            async with asyncio.timeout(self.cfg.request.deadline_s):
                trace.pipeline, trace.prompt_ids = await self._choose(path, body, rid)
                out = await self._run(request, path, body, rid, trace)
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
            pipeline = trace.pipeline
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
            return error_response(status, message, kind)
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
                self._fallback(rid, "prefill_unreachable", member=P.url, error=repr(exc))
                return None
        got = self._decoder.decode(data).get("kv_transfer_params") or {}
        if not got.get("do_remote_prefill"):
            self._fallback(rid, "kv_not_sent", reason=got.get("pdd_error"))
        return got

    # ------------------------------------------------------------------ the pipeline choice
    def _fallback(self, rid: str, kind: str, **fields) -> None:
        self.metrics.fallbacks.labels(kind=kind).inc()
        log.warning("router_fallback", request_id=rid, kind=kind, **fields)

    async def _choose(self, path: str, body: dict, rid: str) -> tuple[str, list[int] | None]:
        """The request's pipeline, logged and counted with its reason. P's agent decides
        (``choose_pipeline``: MD's matched prefix, the live link, the anomalous-traffic filter);
        without an answer the request runs P-MD."""
        toks = None
        if batched(body):
            # Several prompts in one request would share one transfer name: MD computes them.
            pipeline, reason, fields = "MD", "batched_prompts", {}
        elif not self.cfg.choice.ask_agent:
            pipeline, reason, fields = "P-MD", "ask_agent_off", {}
        else:
            pipeline, reason, fields, toks = await self._ask_agent(path, body, rid)
        self.metrics.pipelines.labels(pipeline=pipeline, reason=reason).inc()
        log.info("router_pipeline", request_id=rid, pipeline=pipeline, reason=reason, **fields)
        return pipeline, toks

    async def _ask_agent(self, path: str, body: dict, rid: str) -> tuple[str, str, dict, list[int] | None]:
        ch = self.cfg.choice
        P = self.pools["P"].pick()
        if not P.member.engine_socket:
            return "P-MD", "no_engine_socket", {}, None
        MD = self.pools["MD"].pick()
        try:
            async with asyncio.timeout(ch.timeout_s):
                toks, max_len = await self._prompt_tokens(P, path, body)
                expected = expected_output(path, body, len(toks), max_len)
                # PddWireConnector names one agent block per vLLM block and layer; a vLLM block
                # is in MD's prefix inventory when its layer 0 is (a match counts whole blocks).
                hashes = layer_hashes(chain_hashes(toks, ch.block_tokens, model=ch.prefix_salt), 1) \
                    if ch.block_tokens and ch.prefix_salt else []
                eng = await self._engine(P)
                try:
                    d = await eng.choose_pipeline(
                        rid, to=dest(MD.member), input_tokens=len(toks), expected_output_tokens=expected,
                        kv_bytes_per_token=ch.kv_bytes_per_token, block_hashes=hashes or None,
                        block_tokens=ch.block_tokens if hashes else 0)
                except OSError:  # the agent went away: connect again next time
                    await self._drop_engine(P)
                    raise
        except (PddWireError, aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, TypeError,
                UpstreamError) as exc:
            self._fallback(rid, "choice_failed", error=repr(exc))
            return "P-MD", "choice_failed", {}, None
        hit = int(d.get("prefix_hit_tokens") or 0)
        self.metrics.prompt_tokens.labels(source="md_prefix").inc(hit)
        self.metrics.prompt_tokens.labels(source="missing").inc(len(toks) - hit)
        return d["pipeline"], d["reason"], {
            "input_tokens": len(toks), "expected_output_tokens": expected, "md": MD.url,
            "prefix_hit_tokens": hit, "prefix_source": d.get("prefix_source"),
            "predicted_wan_s": d.get("predicted_wan_s")}, toks

    async def _engine(self, P: Upstream) -> EngineClient:
        """P's agent, as engine "router" (one connection per P member, opened when first asked)."""
        async with self._engine_lock:
            eng = self._engines.get(P)
            if eng is None:
                eng = self._engines[P] = await EngineClient(P.member.engine_socket, "router").connect()
            return eng

    async def _drop_engine(self, P: Upstream) -> None:
        eng = self._engines.pop(P, None)
        if eng is not None:
            await eng.close()

    async def _prompt_tokens(self, P: Upstream, path: str, body: dict) -> tuple[list[int], int | None]:
        """The prompt's token ids (asked of P's ``/tokenize`` unless the request gives them), and
        the model's context length when P told it."""
        ids, req = tokenize_request(path, body)
        if ids is not None:
            return ids, None
        async with self._http.post(f"{P.url}/tokenize", json=req) as r:
            data = await r.read()
            if r.status != 200:
                raise UpstreamError(r.status, data, r.content_type or "application/json")
        got = self._decoder.decode(data)
        return list(got["tokens"]), got.get("max_model_len")

    # ------------------------------------------------------------------ running a pipeline
    async def _run(self, request: web.Request, path: str, body: dict, rid: str,
                   trace: Trace) -> web.StreamResponse:
        pipeline = trace.pipeline
        if pipeline == "MD":
            with self._using(self.pools["MD"].pick()) as MD:
                return await self._relay(request, MD, path, body, trace)
        if pipeline == "P-RLD":
            if self.pools["RLD"].members:
                return await self._disaggregated(request, path, body, rid, trace, "RLD")
            # No relay decoder: P itself finishes it, in site A; nothing crosses the WAN.
            with self._using(self.pools["P"].pick()) as P:
                return await self._relay(request, P, path, body, trace)
        if pipeline == "P-RLD-MD":
            unfit = self._handoff_unfit(path, body, trace)
            if unfit is None:
                return await self._p_rld_md(request, path, body, rid, trace)
            # MD decodes once the KV is there.
            self._fallback(rid, f"p_rld_md_{unfit}")
        return await self._disaggregated(request, path, body, rid, trace, "MD")

    async def _disaggregated(self, request: web.Request, path: str, body: dict, rid: str, trace: Trace,
                             decode: str) -> web.StreamResponse:
        """Prefill on P (its KV sent to the decode member's site/node), decode on pool ``decode``."""
        with self._using(self.pools[decode].pick()) as D:
            to = dest(D.member)
            params = await self._prefill(path, body, rid, send_to=[to] if to else None)
            dec = {**body, "kv_transfer_params": params} if params is not None else body
            return await self._relay(request, D, path, dec, trace)

    # ------------------------------------------------------------------ P-RLD-MD
    def _handoff_unfit(self, path: str, body: dict, trace: Trace) -> str | None:
        """Why this request cannot be handed from RLD to MD here (None: it can). MD continues
        from token ids, so the prompt's must be known, and only a streamed completion's output
        can be spliced event by event."""
        if not self.pools["RLD"].members:
            return "no_rld_member"
        if path != "/v1/completions":
            return "chat"
        if not body.get("stream"):
            return "not_streamed"
        if trace.prompt_ids is None:
            return "no_prompt_ids"
        if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1:
            return "n"
        if body.get("echo") or body.get("stop"):
            return "echo_or_stop"  # a stop string may straddle the switch
        return None

    async def _md_holds_kv(self, M: Upstream, path: str, body: dict) -> bool:
        """MD loads the prompt's KV: asked the prompt with P's params and ``max_tokens=1``, it
        answers once the KV is verified and in its cache (prefix caching keeps its blocks)."""
        try:
            async with self._http.post(f"{M.url}{path}", json=body) as r:
                await r.read()
                return r.status == 200
        except (aiohttp.ClientError, OSError):
            return False

    async def _p_rld_md(self, request: web.Request, path: str, body: dict, rid: str,
                        trace: Trace) -> web.StreamResponse:
        """P sends the KV to RLD (same site) and MD (across the WAN); RLD streams to the user at
        once; when MD holds the KV, RLD is stopped at position m (its stream closed: vLLM aborts
        it) and MD continues from the prompt and the m emitted tokens (their KV computed in one
        extend step, the prompt's from its prefix cache). Every position is relayed once, in
        order: RLD's events up to m, MD's after, as one stream (RLD's id)."""
        with self._using(self.pools["RLD"].pick()) as R, self._using(self.pools["MD"].pick()) as M:
            dests = [d for d in (dest(R.member), dest(M.member)) if d]
            params = await self._prefill(path, body, rid, send_to=dests or None)
            if not params or not params.get("do_remote_prefill"):  # nothing sent: MD computes it
                dec = {**body, "kv_transfer_params": params} if params is not None else body
                return await self._relay(request, M, path, dec, trace)
            warm = asyncio.get_running_loop().create_task(
                self._md_holds_kv(M, path, self._prefill_body(body, params)))
            try:
                return await self._rld_then_md(request, path, body, rid, trace, R, M, params, warm)
            finally:
                if not warm.done():
                    warm.cancel()  # closes MD's request: vLLM aborts it, its receive is cancelled
                await asyncio.gather(warm, return_exceptions=True)

    async def _rld_then_md(self, request: web.Request, path: str, body: dict, rid: str, trace: Trace,
                           R: Upstream, M: Upstream, params: dict, warm: asyncio.Task) -> web.StreamResponse:
        h = self.cfg.handoff
        want_ids = bool(body.get("return_token_ids"))
        max_tokens = body.get("max_tokens") or COMPLETIONS_MAX_TOKENS
        emitted: list[int] = []
        head: dict = {}  # RLD's stream id and created: MD's events carry them too
        finished = switch = False  # finished: RLD's last token came
        stay = False  # MD failed or was not ready in time: RLD keeps the request to its end
        # MD detokenizes from token ids: it primes its detokenizer with the shortest suffix (4
        # tokens or more) of its prompt that decodes without U+FFFD, else with the whole prompt,
        # whose undecodable tail it may then emit as text. So MD takes over at position 0 (its
        # prompt is the user's, as for a single server) or where each of RLD's last 5 tokens
        # ended on a whole character (the last 4 then decode cleanly on their own).
        whole_run = 0
        out: web.StreamResponse | None = None

        async def md_ready() -> bool:
            """Whether MD holds the KV now; at the cap, wait for it (bounded)."""
            nonlocal stay
            m = len(emitted)
            if m < h.min_rld_tokens or m >= max_tokens:
                return False
            capped = h.max_rld_tokens is not None and m >= h.max_rld_tokens
            if not warm.done() and capped:
                left = h.md_ready_s - (time.monotonic() - trace.t0)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(warm), max(0.0, left))
            if not warm.done():
                if capped or time.monotonic() - trace.t0 > h.md_ready_s:
                    self._fallback(rid, "md_not_ready", position=m)
                    self.metrics.handoffs.labels(mode="one-shot", outcome="md_not_ready").inc()
                    stay = True
                return False
            if not warm.result():
                self._fallback(rid, "md_failed", position=m)
                self.metrics.handoffs.labels(mode="one-shot", outcome="md_failed").inc()
                stay = True
                return False
            return m == 0 or whole_run >= _WHOLE_RUN  # else a later token boundary

        rld_body = {**body, "kv_transfer_params": params, "return_token_ids": True}
        rld_failed: BaseException | None = None
        try:
            r: aiohttp.ClientResponse | None = await self._http.post(f"{R.url}{path}", json=rld_body)
        except (aiohttp.ClientError, OSError) as exc:
            r, rld_failed = None, exc
        if r is not None:
            async with r:  # leaving it closes RLD's stream: vLLM aborts the request there
                if r.status != 200:
                    rld_failed = UpstreamError(r.status, await r.read(), r.content_type or "application/json")
                else:
                    out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                                  "Cache-Control": "no-cache"})
                    await out.prepare(request)
                    request[_STREAM] = out
                    events = sse_events(r.content)
                    while True:
                        if not (finished or stay) and await md_ready():
                            switch = True
                            break
                        try:
                            event = await anext(events, None)
                        except (aiohttp.ClientError, OSError) as exc:
                            rld_failed = exc
                            break
                        if event is None:
                            if not finished:
                                rld_failed = aiohttp.ClientPayloadError("RLD's stream ended before its last token")
                            break
                        if event.startswith(b"data: {"):
                            ev = self._decoder.decode(event[6:])
                            head = head or {"id": ev.get("id"), "created": ev.get("created")}
                            ids = [t for c in ev.get("choices") or () for t in c.get("token_ids") or ()]
                            finished = finished or any(c.get("finish_reason") for c in ev.get("choices") or ())
                            if ids:
                                text = "".join(c.get("text") or "" for c in ev.get("choices") or ())
                                whole = len(ids) == 1 and bool(text) and "\ufffd" not in text
                                whole_run = whole_run + 1 if whole else 0
                            if not want_ids:
                                event = without(ev, ("token_ids", "prompt_token_ids"))
                            emitted += ids
                            trace.saw(len(ids))
                        await out.write(event)
        self.metrics.output_tokens.labels(pool="RLD").inc(len(emitted))
        outcome = "switched"
        if rld_failed is not None and not finished:
            if stay:  # MD cannot take it either
                raise rld_failed
            # RLD failed: MD takes the output over from where RLD left it, once it holds the KV.
            self._fallback(rid, "rld_failed", position=len(emitted), error=repr(rld_failed))
            left = h.md_ready_s - (time.monotonic() - trace.t0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(warm), max(0.0, left))
            if not (warm.done() and warm.result()):
                raise rld_failed
            switch, outcome = True, "rld_failed"
        if not switch:
            if not stay:
                self.metrics.handoffs.labels(mode="one-shot", outcome="rld_finished").inc()
            await out.write_eof()
            return out
        if out is None:
            out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                          "Cache-Control": "no-cache"})
            await out.prepare(request)
            request[_STREAM] = out
        return await self._md_continues(out, path, body, rid, trace, M, emitted, head, want_ids, max_tokens,
                                        outcome)

    async def _md_continues(self, out: web.StreamResponse, path: str, body: dict, rid: str, trace: Trace,
                            M: Upstream, emitted: list[int], head: dict, want_ids: bool,
                            max_tokens: int, outcome: str) -> web.StreamResponse:
        m = len(emitted)
        cont = {**body, "prompt": trace.prompt_ids + emitted, "max_tokens": max_tokens - m, "return_token_ids": True}
        cont.pop("kv_transfer_params", None)
        if body.get("min_tokens"):
            cont["min_tokens"] = max(0, body["min_tokens"] - m)
        t_switch = trace.last if trace.last is not None else time.monotonic()
        log.info("router_handoff", request_id=rid, mode="one-shot", position=m, md=M.url, outcome=outcome)
        self.metrics.handoffs.labels(mode="one-shot", outcome=outcome).inc()
        first = True
        n = 0
        async with self._http.post(f"{M.url}{path}", json=cont) as r:
            if r.status != 200:
                raise aiohttp.ClientResponseError(r.request_info, r.history, status=r.status,
                                                  message=(await r.read()).decode(errors="replace")[:500])
            async for event in sse_events(r.content):
                if event.startswith(b"data: {"):
                    ev = self._decoder.decode(event[6:])
                    ids = [t for c in ev.get("choices") or () for t in c.get("token_ids") or ()]
                    if ids and first:
                        first = False
                        stall = time.monotonic() - t_switch
                        self.metrics.stall.labels(mode="one-shot").observe(stall)
                        log.info("router_handoff_stall", request_id=rid, mode="one-shot", position=m,
                                 stall_ms=round(stall * 1e3, 3))
                    ev.update({k: v for k, v in head.items() if v is not None})
                    if ev.get("usage"):  # as one request: m more output tokens, m fewer prompt tokens
                        u = ev["usage"]
                        u["prompt_tokens"] = u.get("prompt_tokens", 0) - m
                        u["completion_tokens"] = u.get("completion_tokens", 0) + m
                    event = without(ev, ("prompt_token_ids",) if want_ids else ("token_ids", "prompt_token_ids"))
                    n += len(ids)
                    trace.saw(len(ids))
                await out.write(event)
        self.metrics.output_tokens.labels(pool="MD").inc(n)
        await out.write_eof()
        return out

    async def _relay(self, request: web.Request, up: Upstream, path: str, body: dict,
                     trace: Trace) -> web.StreamResponse:
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
            async for event in sse_events(r.content):
                if event.startswith(b"data: {"):
                    with contextlib.suppress(msgspec.DecodeError, AttributeError, TypeError):
                        trace.saw(token_count(self._decoder.decode(event[6:])))
                await out.write(event)
            self.metrics.output_tokens.labels(pool=up.pool).inc(trace.tokens - n0)
            await out.write_eof()
            return out
