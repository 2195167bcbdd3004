"""The router's pools from the fleet's membership (``[fleet]`` in the router's TOML): every
engine a member registers (``[[fleet.engines]]`` in its agent's config: role, serving URL,
engine socket) is a member of that role's pool while the member's record is in etcd, so engines
joining or leaving change the pools without a restart. Pools configured in the file stay.

The router only watches (it registers nothing): :class:`pdd_wire.fleet.Membership` without a
record of its own, watching the live records too (``membership.live``: each member's load and
link figures). While etcd is away the pools stay as they were. The pools are the router's live
:class:`~.pools.Pools` (``add(role, member)``, ``remove(role, url)``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import structlog
from prometheus_client import CollectorRegistry

from ..config import Fleet
from ..fleet import FleetMetrics, Membership
from ..fleet.record import MemberRecord
from .config import Member, RouterFleet
from .pools import Pools

log = structlog.get_logger("pdd_wire.router")


def members_of(record: MemberRecord) -> list[tuple[str, Member]]:
    """(role, pool member) for each engine ``record`` registers."""
    return [(e.role, Member(url=e.url, engine_socket=e.engine_socket, admin=e.admin, site=record.site,
                            node=record.node))
            for e in record.engines if e.role in ("P", "RLD", "MD")]


class PoolDiscovery:
    """Keeps the router's ``pools`` in step with the fleet's engines."""

    def __init__(self, cfg: RouterFleet, pools: Pools, registry: CollectorRegistry | None = None) -> None:
        self.pools = pools
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
                self.pools.remove(role, m.url)
                log.info("pool_member_left", pool=role, url=m.url, member=record.key)
        for role, m in now:
            if (role, m) not in before:
                self.pools.add(role, m)
                log.info("pool_member_joined", pool=role, url=m.url, member=record.key)
        if now:
            self.engines[record.key] = now


@contextlib.asynccontextmanager
async def discovered(router, cfg: RouterFleet | None) -> AsyncIterator[PoolDiscovery | None]:
    """Run the router's pools from the fleet while inside (nothing without ``[fleet]``)."""
    if cfg is None or not cfg.etcd:
        yield None
        return
    d = PoolDiscovery(cfg, router.pools, router.metrics.registry)
    await d.start()
    try:
        yield d
    finally:
        await d.stop()
