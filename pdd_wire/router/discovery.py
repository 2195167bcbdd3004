"""The router's pools from the fleet's membership (``[fleet]`` in the router's TOML): every
engine a member registers (``[[fleet.engines]]`` in its agent's config: role, serving URL,
engine socket) is a member of that role's pool while the member's record is in etcd, so engines
joining or leaving change the pools without a restart. Pools configured in the file stay.

A pool member is keyed by its URL (:class:`~.pools.Pools`), and several owners may name the same
(role, URL): the file, and any number of fleet members (two agents on one node registering the
same ``vllm serve``, or a file entry the fleet registers too). Each (role, URL) is reference
counted by its owners: it is added when its first owner appears, replaced by a surviving owner's
entry when the one in the pool leaves (a file entry is never replaced), and removed only when no
owner is left.

The router only watches (it registers nothing): :class:`pdd_wire.fleet.Membership` without a
record of its own. It does not watch the members' live records (``live/``): its load figures
come from the engines themselves (``rld_load``). While etcd is away the pools stay as they were.

Where user traffic goes is what etcd says: whoever can write the cluster's prefix can put an
engine URL in the pools. Give routers etcd over TLS, and the agents write-only roles on their
prefix (docs/operator.md, "A fleet").
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

CONFIGURED = ""  # the owner of a pool entry from the router's file (a member key is "site/node")


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
        self.membership = Membership(fleet, FleetMetrics(registry or CollectorRegistry()), on_event=self._event,
                                     logger=log)
        self.engines: dict[str, list[tuple[str, Member]]] = {}  # member key -> what it put in the pools
        # (role, url) -> owner -> its entry; the pool holds the entry of ``holder``
        self.owners: dict[tuple[str, str], dict[str, Member]] = {}
        self.holder: dict[tuple[str, str], str] = {}
        for u in pools:  # what the file configured: owned for good
            self.owners[(u.pool, u.url)] = {CONFIGURED: u.member}
            self.holder[(u.pool, u.url)] = CONFIGURED

    async def start(self) -> None:
        await self.membership.start()

    async def stop(self) -> None:
        await self.membership.stop()

    def _event(self, kind: str, record: MemberRecord, old: MemberRecord | None) -> None:
        before = self.engines.pop(record.key, [])
        now = [] if kind == "leave" else members_of(record)
        for role, m in before:
            if (role, m) not in now:
                self._drop(role, m, record.key)
        for role, m in now:
            if (role, m) not in before:
                self._own(role, m, record.key)
        if now:
            self.engines[record.key] = now

    def _own(self, role: str, m: Member, owner: str) -> None:
        key = (role, m.url.rstrip("/"))
        owners = self.owners.setdefault(key, {})
        owners[owner] = m
        if key not in self.holder:
            self.holder[key] = owner
            self.pools.add(role, m)
            log.info("pool_member_joined", pool=role, url=m.url, member=owner)
        elif self.holder[key] == owner:  # its entry changed (socket, admin): the pool takes the new one
            self.pools.add(role, m)

    def _drop(self, role: str, m: Member, owner: str) -> None:
        key = (role, m.url.rstrip("/"))
        owners = self.owners.get(key, {})
        if owners.pop(owner, None) is None:
            return
        if not owners:
            del self.owners[key]
            del self.holder[key]
            self.pools.remove(role, m.url)
            log.info("pool_member_left", pool=role, url=m.url, member=owner)
        elif self.holder[key] == owner:  # another owner keeps it: its entry now
            heir = next(iter(owners))
            self.holder[key] = heir
            self.pools.add(role, owners[heir])
            log.info("pool_member_kept", pool=role, url=m.url, left=owner, now=heir or "(file)")


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
