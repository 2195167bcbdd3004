"""The router's bounds on what its clients can make it hold: requests in flight
(``request.max_inflight``), and from them its upstream connections.

A client request to ``/v1/completions`` or ``/v1/chat/completions`` holds a slot from its arrival
to the last byte of its answer (a streamed one's ``[DONE]``, a whole one's body written out),
and gives it back however it ends: its answer, an error, the client gone (its handler
cancelled), the deadline. With every slot taken, one more is answered ``503`` at once, in
vLLM's error shape and with ``Retry-After``, before its body is read or an upstream is asked
(Envoy's ``max_requests`` circuit breaker does the same); what is in flight goes on untouched.
``/healthz``, ``/metrics`` and ``/v1/models`` hold no slot: they answer when the router is full.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import structlog
from aiohttp import web

from .core import MAX_DRAINING
from .metrics import RouterMetrics
from .upstream import error_response

log = structlog.get_logger("pdd_wire.router")

T = TypeVar("T")

RETRY_AFTER_S = 1
#: A refusal is logged at most once per this (a flood would otherwise be a flood of log lines);
#: each is counted (``pddwire_router_requests_refused_total``).
REFUSED_LOG_S = 30.0
#: Upstream connections one request in flight holds at once, at most: P-MD and P-RLD one at a
#: time (P's ``/tokenize``, its prefill, then decode's answer); P-RLD-MD two (RLD's stream and MD's
#: warm request, then one absorb request at a time; at the switch RLD's stream is closed before
#: MD's continuation, which an absorb round being cancelled may overlap; a hand-back is one at a time).
UPSTREAM_PER_REQUEST = 2
#: Connections outside any request: one ``/healthz`` round (one probe per member; concurrent
#: calls share it), one ``/v1/models`` walk (shared the same way), one RLD load scrape per RLD
#: member. Room for a fleet of about a hundred members probed and scraped at once.
SIDE_CONNECTIONS = 256


def upstream_limit(max_inflight: int) -> int:
    """The router's upstream connection pool (aiohttp's ``limit``): what ``max_inflight``
    requests hold at most, the warm requests left to finish after theirs ended
    (:data:`~.core.MAX_DRAINING`), and :data:`SIDE_CONNECTIONS`. Legitimate use never reaches it;
    a connection past it would wait for one (up to ``request.connect_s``), so it is a bound on
    sockets, not a queue."""
    return UPSTREAM_PER_REQUEST * max_inflight + MAX_DRAINING + SIDE_CONNECTIONS


Handler = Callable[[web.Request, str], Awaitable[web.StreamResponse]]


class Inflight:
    """At most ``limit`` client requests in flight (``run``); the gauge
    ``pddwire_router_requests_inflight`` shows how many, ``pddwire_router_requests_refused_total``
    counts the ones answered 503. A whole answer is written within the request's slot, within
    ``deadline_s`` of its arrival (or ``grace_s`` once that has passed): a client that does not
    take it has its connection aborted."""

    def __init__(self, limit: int, metrics: RouterMetrics, deadline_s: float, grace_s: float) -> None:
        self.limit, self.metrics, self.deadline_s, self.grace_s = limit, metrics, deadline_s, grace_s
        self.count = 0
        self._refused = 0  # since the last log line
        self._logged = -REFUSED_LOG_S

    async def run(self, request: web.Request, path: str, handler: Handler) -> web.StreamResponse:
        if self.count >= self.limit:
            return self._refuse(path)
        self.count += 1
        self.metrics.requests_inflight.set(self.count)
        t0 = time.monotonic()
        try:
            resp = await handler(request, path)
            if not resp.prepared:  # a whole answer: written out before the slot is given back
                await self._write(request, resp, t0)
            return resp
        finally:
            self.count -= 1
            self.metrics.requests_inflight.set(self.count)

    def _refuse(self, path: str) -> web.Response:
        self.metrics.refused.labels(endpoint=path).inc()
        self._refused += 1
        now = time.monotonic()
        if now - self._logged >= REFUSED_LOG_S:
            log.warning("router_full", max_inflight=self.limit, refused=self._refused, per_s=REFUSED_LOG_S)
            self._logged, self._refused = now, 0
        resp = error_response(503, f"the router is at its limit of {self.limit} requests in flight "
                                   f"(request.max_inflight); retry after {RETRY_AFTER_S} s",
                              "ServiceUnavailableError")
        resp.headers["Retry-After"] = str(RETRY_AFTER_S)
        resp.force_close()  # no keep-alive: the connection ends after the answer (the router never reads the body)
        return resp

    async def _write(self, request: web.Request, resp: web.StreamResponse, t0: float) -> None:
        try:
            async with asyncio.timeout(max(t0 + self.deadline_s - time.monotonic(), self.grace_s)):
                await resp.prepare(request)
                await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client is gone (aiohttp finds so too when it finishes the response)
        except TimeoutError:
            log.warning("router_client_not_reading", status=resp.status, write_s=self.grace_s)
            if request.transport is not None:
                request.transport.abort()


class Shared(Generic[T]):
    """``await shared()``: one run of ``fn`` at a time, its result given to every caller that
    came while it ran (a caller that goes away does not cancel it for the others). What
    ``/healthz`` and ``/v1/models`` ask upstream is thus bounded however often they are called."""

    def __init__(self, fn: Callable[[], Awaitable[T]]) -> None:
        self._fn = fn
        self._task: asyncio.Future[T] | None = None

    async def __call__(self) -> T:
        if self._task is None:
            self._task = task = asyncio.ensure_future(self._fn())
            task.add_done_callback(self._done)
        return await asyncio.shield(self._task)

    def _done(self, task: asyncio.Future[Any]) -> None:
        if self._task is task:
            self._task = None
        if not task.cancelled():
            task.exception()  # retrieved: every caller may have gone

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
