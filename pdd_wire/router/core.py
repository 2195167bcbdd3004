"""What the router's parts share: its config, HTTP client, pools, metrics and load reader, and
the per-request context (:class:`Req`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import structlog
from aiohttp import web

from .config import RouterConfig
from .load import LoadReader
from .metrics import RouterMetrics
from .pools import Pools, Upstream
from .upstream import Trace, bad_gateway, error_of, read_capped

log = structlog.get_logger("pdd_wire.router")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
MAX_DRAINING = 1024  # upstream requests left to finish after their client's request ended


@dataclass(eq=False)
class Core:
    cfg: RouterConfig
    http: aiohttp.ClientSession
    pools: Pools
    metrics: RouterMetrics
    loads: LoadReader
    decoder: msgspec.json.Decoder
    draining: set[asyncio.Future] = field(default_factory=set)

    def drain(self, task: asyncio.Future, timeout_s: float) -> None:
        """Let ``task`` (an upstream request whose answer nobody needs any more, a bool: whether
        it succeeded) finish within ``timeout_s``, then cancel it; at most :data:`MAX_DRAINING`
        at once (past it: cancelled now). Each is awaited and counted
        (``pddwire_router_drains_total{outcome}``); ``close_drains`` cancels the rest."""
        if task.done():
            return
        if len(self.draining) >= MAX_DRAINING:
            task.cancel()

        async def bounded() -> None:
            outcome = "closed"
            try:
                outcome = "answered" if await asyncio.wait_for(task, timeout_s) else "failed"
            except TimeoutError:
                outcome = "timed_out"
            except Exception:
                outcome = "failed"  # (cancelled, at the cap or by close_drains: "closed")
            finally:
                self.metrics.drains.labels(outcome=outcome).inc()
                self._drained(t)

        t = asyncio.ensure_future(bounded())
        self.draining.add(t)
        self.metrics.draining.set(len(self.draining))
        t.add_done_callback(self._drained)

    def _drained(self, t: asyncio.Future) -> None:
        self.draining.discard(t)
        self.metrics.draining.set(len(self.draining))

    async def close_drains(self) -> None:
        tasks = list(self.draining)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def fallback(self, rid: str, kind: str, **fields: Any) -> None:
        """A request left its pipeline's path: counted and logged with ``kind``."""
        self.metrics.fallbacks.labels(kind=kind).inc()
        log.warning("router_fallback", request_id=rid, kind=kind, **fields)

    async def post_json(self, u: Upstream, path: str, body: dict) -> dict:
        """POST ``body`` to ``u`` and decode its JSON answer (UpstreamError: an error status)."""
        async with self.http.post(f"{u.url}{path}", json=body) as r:
            if r.status != 200:
                raise await error_of(r)
            data = await read_capped(r)
        try:
            got = self.decoder.decode(data)
        except msgspec.DecodeError as exc:  # an upstream failure, not the router's (500)
            raise bad_gateway(f"{u.url}{path} answered 200 with a body that is not JSON: {exc}") from None
        if not isinstance(got, dict):
            raise bad_gateway(f"{u.url}{path} answered 200 with JSON that is not an object")
        return got


@dataclass(eq=False)
class Req:
    """One client request as the pipelines see it."""

    request: web.Request
    path: str
    body: dict
    rid: str
    trace: Trace
    p: Upstream | None = None  # the P member whose agent made the choice (its prefill goes there)
    md: Upstream | None = None  # the MD member the choice was made for (None: least-loaded at run time)
    planned_wan_bytes: int | None = None  # KV bytes to MD's site as planned at the choice
    # ``body`` as vLLM reads it (upstream.check_fields): what the router decides and computes
    # with; ``body`` is what goes upstream.
    read: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.read:
            self.read = dict(self.body)
