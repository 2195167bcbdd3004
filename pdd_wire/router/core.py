"""What the router's parts share: its config, HTTP client, pools, metrics and load reader, and
the per-request context (:class:`Req`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import structlog
from aiohttp import web

from .config import RouterConfig
from .load import LoadReader
from .metrics import RouterMetrics
from .pools import Pools, Upstream
from .upstream import Trace, UpstreamError

log = structlog.get_logger("pdd_wire.router")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass(eq=False)
class Core:
    cfg: RouterConfig
    http: aiohttp.ClientSession
    pools: Pools
    metrics: RouterMetrics
    loads: LoadReader
    decoder: msgspec.json.Decoder

    def fallback(self, rid: str, kind: str, **fields: Any) -> None:
        """A request left its pipeline's path: counted and logged with ``kind``."""
        self.metrics.fallbacks.labels(kind=kind).inc()
        log.warning("router_fallback", request_id=rid, kind=kind, **fields)

    async def post_json(self, u: Upstream, path: str, body: dict) -> dict:
        """POST ``body`` to ``u`` and decode its JSON answer (UpstreamError: an error status)."""
        async with self.http.post(f"{u.url}{path}", json=body) as r:
            data = await r.read()
            if r.status != 200:
                raise UpstreamError(r.status, data, r.content_type or "application/json")
        return self.decoder.decode(data)


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
