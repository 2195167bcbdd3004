"""RLD's live load, read from each RLD member's own vLLM ``/metrics``.

Why there: the handoff mode needs RLD's load as the engine sees it, counting every request it
serves -- other routers' and any other client's -- not what this router has in flight. vLLM
exports it on every server (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``); RLD's agent does not know it (the connector reports no load).

Bounded: a member is scraped only while a P-RLD-MD request wants its figure, at most once per
``rld_load.interval_s`` (one scrape in flight per member), each within ``rld_load.timeout_s``;
a figure older than ``rld_load.max_age_s`` counts as unknown, and so does one read before the
request that asks was running on RLD (it would not count that request). The page is scanned
line by line for the three gauges only (vLLM's page is tens of KB of histograms; no full parse
on the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import structlog

from .config import RldLoad
from .metrics import RouterMetrics
from .pools import Load, Upstream
from .upstream import UpstreamError, read_capped

log = structlog.get_logger("pdd_wire.router")

_GAUGES = (b"vllm:num_requests_running", b"vllm:num_requests_waiting", b"vllm:kv_cache_usage_perc")


def parse_load(text: bytes, max_num_seqs: int) -> Load:
    """The load figure of a vLLM ``/metrics`` page: (running + waiting) / ``max_num_seqs``, or
    the KV cache use when higher (0 ``max_num_seqs``: the KV cache use, and at least 1 while
    requests wait). Summed over engines (data parallel). ValueError: a gauge is missing."""
    sums = dict.fromkeys(_GAUGES, 0.0)
    seen: set[bytes] = set()
    for line in text.splitlines():
        if not line.startswith(b"vllm:"):
            continue
        for g in _GAUGES:
            if line.startswith(g) and line[len(g):len(g) + 1] in (b"{", b" "):
                sums[g] += float(line.rsplit(b" ", 1)[1])
                seen.add(g)
    if len(seen) < len(_GAUGES):
        raise ValueError(f"no {', '.join(g.decode() for g in _GAUGES if g not in seen)} in the page")
    running, waiting, kv = (sums[g] for g in _GAUGES)
    slots = (running + waiting) / max_num_seqs if max_num_seqs else (1.0 if waiting else 0.0)
    return Load(value=max(slots, kv), at=time.monotonic(), running=running, waiting=waiting, kv_usage=kv)


class LoadReader:
    """Reads RLD members' load (``since(u, t)``; ``kick(u)`` starts a scrape when the figure is
    stale). Owns its scrape tasks: ``close()`` cancels and awaits them."""

    def __init__(self, cfg: RldLoad, http: aiohttp.ClientSession, metrics: RouterMetrics) -> None:
        self.cfg, self.http, self.metrics = cfg, http, metrics
        self._tasks: dict[Upstream, asyncio.Task] = {}
        self._tried: dict[Upstream, float] = {}  # when each member's last scrape was sent
        self._failed: dict[Upstream, float] = {}  # when its last failed scrape was sent
        self._dropped: set[asyncio.Task] = set()  # scrapes of removed members, cancelled

    def kick(self, u: Upstream) -> None:
        """Start a scrape of ``u`` unless one runs or one started within ``interval_s``."""
        now = time.monotonic()
        if u in self._tasks or now - self._tried.get(u, 0.0) < self.cfg.interval_s or u.removed:
            return
        self._tried[u] = now
        self._tasks[u] = asyncio.get_running_loop().create_task(self._scrape(u, now))

    def since(self, u: Upstream, t: float) -> tuple[float | None, asyncio.Future | float | None]:
        """``u``'s load as read by a scrape sent at or after ``t`` (``time.monotonic``) and no
        older than ``max_age_s``: ``(figure, None)``. Else ``(None, wake)`` while one may still
        come (``wake``: the scrape to wait for, or the seconds until ``interval_s`` lets one
        start; this call starts it when it may), and ``(None, None)`` once a scrape sent since
        ``t`` failed: the load is unknown. Bounded: ``interval_s`` + ``timeout_s``."""
        now = time.monotonic()
        if u.load.asked >= t and now - u.load.at <= self.cfg.max_age_s:
            return u.load.value, None
        if self._failed.get(u, -1.0) >= t or u.removed:
            return None, None
        self.kick(u)
        task = self._tasks.get(u)
        if task is not None:
            return None, task
        return None, max(0.0, self._tried.get(u, 0.0) + self.cfg.interval_s - now)

    def forget(self, u: Upstream) -> None:
        task = self._tasks.pop(u, None)
        if task is not None:
            task.cancel()
            self._dropped.add(task)
            task.add_done_callback(self._dropped.discard)
        self._tried.pop(u, None)
        self._failed.pop(u, None)
        with contextlib.suppress(KeyError):
            self.metrics.rld_load.remove(u.url)

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *self._dropped]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    async def _scrape(self, u: Upstream, asked: float) -> None:
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                async with self.http.get(f"{u.url}/metrics") as r:
                    if r.status != 200:
                        raise ValueError(f"HTTP {r.status}")
                    text = await read_capped(r, 4 << 20)  # a metrics page: some 100 KB
            load = parse_load(text, u.member.max_num_seqs)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, UpstreamError) as exc:
            self._failed[u] = asked
            self.metrics.load_scrapes.labels(outcome="failed").inc()
            log.warning("router_rld_load_unread", member=u.url, error=repr(exc))
        else:
            load.asked = asked
            u.load = load
            self.metrics.load_scrapes.labels(outcome="ok").inc()
            if not u.removed:
                self.metrics.rld_load.labels(member=u.url).set(load.value)
        finally:
            if self._tasks.get(u) is asyncio.current_task():
                del self._tasks[u]
