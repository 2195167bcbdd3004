"""The router's pools from the fleet's membership (``[fleet]`` in the router's TOML): every
engine a member registers (``[[fleet.engines]]`` in its agent's config: role, serving URL,
engine socket) is a member of that role's pool while the member's record is in etcd, so engines
joining or leaving change the pools without a restart. Pools configured in the file stay.

The router only watches (it registers nothing): :class:`pdd_wire.fleet.Membership` without a
record of its own. While etcd is away the pools stay as they were.

The seam into the pools is :class:`PoolSink` (``add(role, member)``, ``remove(role, url)``).
Until the router's pools are a runtime object of their own, :func:`sink_for` adapts today's
``Router.pools`` (a dict of :class:`~.upstream.Pool`), and an empty pool answers 503 instead of
failing the request with a division by zero.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Protocol

import structlog
from prometheus_client import CollectorRegistry

from ..config import Fleet
from ..fleet import FleetMetrics, Membership
from ..fleet.record import MemberRecord
from .config import Member, RouterFleet
from .upstream import Pool, Upstream, UpstreamError

log = structlog.get_logger("pdd_wire.router")


class PoolSink(Protocol):
    def add(self, role: str, member: Member) -> object: ...
    def remove(self, role: str, url: str) -> object: ...


class DiscoveredPool(Pool):
    """A pool that may be empty while the fleet has no engine of its role."""

    def pick(self) -> Upstream:
        if not self.members:
            body = json.dumps({"error": {"message": f"pool {self.name} has no member (none registered in the fleet)",
                                         "type": "ServiceUnavailableError", "param": None, "code": 503}})
            raise UpstreamError(503, body.encode(), "application/json")
        return super().pick()


class DictPools:
    """:class:`PoolSink` over ``{role: Pool}`` (the router's pools today)."""

    def __init__(self, pools: dict[str, Pool]) -> None:
        for name, pool in list(pools.items()):
            if not isinstance(pool, DiscoveredPool):
                pools[name] = DiscoveredPool(name, pool.members)
        self.pools = pools

    def add(self, role: str, member: Member) -> Upstream:
        self.remove(role, member.url)
        u = Upstream(role, member)
        self.pools[role].members.append(u)
        return u

    def remove(self, role: str, url: str) -> Upstream | None:
        members = self.pools[role].members
        u = next((u for u in members if u.url == url.rstrip("/")), None)
        if u is not None:
            members.remove(u)  # requests that hold it finish on it; new ones do not pick it
        return u


def sink_for(router) -> PoolSink:
    pools = router.pools
    return pools if hasattr(pools, "add") and hasattr(pools, "remove") else DictPools(pools)


def members_of(record: MemberRecord) -> list[tuple[str, Member]]:
    """(role, pool member) for each engine ``record`` registers."""
    return [(e.role, Member(url=e.url, engine_socket=e.engine_socket, admin=e.admin, site=record.site,
                            node=record.node))
            for e in record.engines if e.role in ("P", "RLD", "MD")]


class PoolDiscovery:
    """Keeps ``sink`` in step with the fleet's engines."""

    def __init__(self, cfg: RouterFleet, sink: PoolSink, registry: CollectorRegistry | None = None) -> None:
        self.sink = sink
        fleet = Fleet(etcd=list(cfg.etcd), cluster=cfg.cluster, request_s=cfg.request_s, tls=cfg.tls)
        # watch_live: the members' load and link figures (membership.live), for the router to read
        self.membership = Membership(fleet, FleetMetrics(registry or CollectorRegistry()), on_event=self._event,
                                     logger=log, watch_live=True)
        self.engines: dict[str, list[tuple[str, Member]]] = {}  # member key -> what it put in the pools

    async def start(self) -> None:
        await self.membership.start()

    async def stop(self) -> None:
        await self.membership.stop()

    def _event(self, kind: str, record: MemberRecord, old: MemberRecord | None) -> None:
        before = self.engines.pop(record.key, [])
        now = [] if kind == "leave" else members_of(record)
        for role, m in before:
            if (role, m) not in now:
                self.sink.remove(role, m.url)
                log.info("pool_member_left", pool=role, url=m.url, member=record.key)
        for role, m in now:
            if (role, m) not in before:
                self.sink.add(role, m)
                log.info("pool_member_joined", pool=role, url=m.url, member=record.key)
        if now:
            self.engines[record.key] = now


@contextlib.asynccontextmanager
async def discovered(router, cfg: RouterFleet | None) -> AsyncIterator[PoolDiscovery | None]:
    """Run the router's pools from the fleet while inside (nothing without ``[fleet]``)."""
    if cfg is None or not cfg.etcd:
        yield None
        return
    d = PoolDiscovery(cfg, sink_for(router), router.metrics.registry)
    await d.start()
    try:
        yield d
    finally:
        await d.stop()
