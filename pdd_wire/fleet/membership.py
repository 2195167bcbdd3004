"""Membership: this member's record in etcd under a lease, and every other member's, watched.

:class:`Membership` runs two tasks. The **lease** task registers (a lease of
``fleet.lease_ttl_s``; the member record and the live record put under it in one transaction),
keeps the lease alive every third of its TTL, and writes the live record again when its figures
moved enough (:func:`.record.should_refresh`); a lease found gone (etcd was away longer than the
TTL) is replaced and both records put again. The **watch** task lists the members once, then
watches the prefix from that revision; a watch that ends is resumed from the last revision seen,
and one etcd has compacted past (or a store reset under it) is replaced by a full listing,
diffed against what was known. With ``watch_live`` a third task does the same for the live
records (``live``: the router's, for load; agents do not need every member's figures).

While etcd is away nothing changes: the last membership stays (sessions and transfers with known
members go on), and :meth:`lookup` admits no member it has not seen. ``on_event(kind, record,
old)`` is called on the loop for every change: ``join``, ``update``, ``leave``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import structlog

from ..config import Fleet
from . import record as rec
from .etcd import Compacted, EtcdClient, EtcdError, EtcdUnavailable, KeyValue, client_ssl
from .metrics import FleetMetrics

log = structlog.get_logger("pdd_wire.fleet")

OnEvent = Callable[[str, rec.MemberRecord, "rec.MemberRecord | None"], None]
FIRST_BACKOFF_S = 0.1


@dataclass(eq=False)
class View:
    """What one watch keeps up to date: a prefix, and what to do with its keys."""

    name: str
    prefix: str
    put: Callable[[KeyValue], None]
    delete: Callable[[str], None]
    reconcile: Callable[[list[KeyValue]], None]
    revision: int = 0  # every change up to this one is applied
    listed: asyncio.Event = field(default_factory=asyncio.Event)


class Membership:
    """``me``: this member's record (None: watch only, as the router does). ``watch`` False:
    register only (the benchmark's simulated members); ``watch_live``: the live records too.
    ``client``: an EtcdClient to share (its owner closes it), else one of its own."""

    def __init__(self, fleet: Fleet, metrics: FleetMetrics, *, me: rec.MemberRecord | None = None,
                 on_event: OnEvent | None = None, client: EtcdClient | None = None, logger=None,
                 watch: bool = True, watch_live: bool = False) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.me = me
        self.on_event = on_event or (lambda kind, r, old: None)
        self.prefix = rec.members_prefix(fleet.cluster)
        self.live_prefix = rec.live_prefix(fleet.cluster)
        self._own_client = client is None
        self.client = client or EtcdClient(fleet.etcd, request_s=fleet.request_s,
                                           ssl_ctx=client_ssl(fleet.tls.ca, fleet.tls.cert, fleet.tls.key))
        self.log = (logger or log).bind(cluster=fleet.cluster)
        self.members: dict[str, rec.MemberRecord] = {}  # "site/node" -> record, this member excluded
        self.live: dict[str, rec.Live] = {}  # "site/node" -> figures (with watch_live)
        self.views = ([View("members", self.prefix, self._put, self._delete, self._reconcile)] if watch else []) + \
            ([View("live", self.live_prefix, self._put_live, self._delete_live, self._reconcile_live)]
             if watch_live else [])
        self.lease = 0
        self.up = False
        self.away_since: float | None = None
        self.listed = self.views[0].listed if self.views else asyncio.Event()  # the first listing is in
        self.registered = asyncio.Event()  # set once this member's record is in etcd
        self._live = rec.Live()
        self._written_live = self._live
        self._written_at = 0.0
        self._wake = asyncio.Event()  # the lease task: figures moved
        self._etcd_back = asyncio.Event()  # the watch task: etcd answered the other task again
        self._tasks: list[asyncio.Task] = []

    @property
    def my_key(self) -> str | None:
        return self.me.key if self.me is not None else None

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        """Start the tasks; returns at once (etcd away at start is a state, not an error)."""
        await self.client.open()
        if self.me is not None:
            self._tasks.append(asyncio.create_task(self._lease_forever(), name="fleet-lease"))
        for view in self.views:
            self._tasks.append(asyncio.create_task(self._watch_forever(view), name=f"fleet-watch-{view.name}"))

    async def stop(self) -> None:
        """Leave: the record goes with its lease (revoked, so peers see it now, not in a TTL)."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.lease:
            try:
                await self.client.revoke(self.lease)
                self.metrics.writes.labels(kind="revoke").inc()
            except EtcdError as exc:
                self.log.info("could not revoke the lease; the record goes when it expires", error=str(exc))
            self.lease = 0
        if self._own_client:
            await self.client.close()

    def set_live(self, live: rec.Live) -> None:
        """The figures as they are now; written when :func:`.record.should_refresh` allows."""
        self._live = live
        if rec.figures_moved(self._written_live, live, self.fleet.refresh_change):
            self._wake.set()

    async def lookup(self, site: str, node: str) -> rec.MemberRecord | None:
        """The member ``site/node``: as watched, else read from etcd now (it may have registered
        a moment ago); None when it is not registered, or etcd is away."""
        key = f"{site}/{node}"
        if key in self.members:
            return self.members[key]
        if not self.up:
            return None
        try:
            kv = await self.client.get(f"{self.prefix}{key}")
        except EtcdError:
            return None
        if kv is None:
            return None
        self._put(kv)
        return self.members.get(key)

    @property
    def revision(self) -> int:
        """The members' watch is current to this revision."""
        return self.views[0].revision if self.views else 0

    def describe(self) -> dict:
        return {"cluster": self.fleet.cluster, "etcd": self.fleet.etcd, "etcd_up": self.up,
                "away_s": round(time.monotonic() - self.away_since, 3) if self.away_since is not None else None,
                "registered": self.registered.is_set() and bool(self.lease), "lease": f"{self.lease:x}",
                "revision": self.revision, "members": len(self.members)}

    # ------------------------------------------------------------------ etcd up / away
    def _back(self) -> None:
        if not self.up:
            if self.away_since is not None:
                self.log.info("etcd answers again", away_s=round(time.monotonic() - self.away_since, 3))
            self.up = True
            self.away_since = None
            self.metrics.etcd_up.set(1)
            self._etcd_back.set()

    def _away(self, exc: BaseException) -> None:
        if self.up or self.away_since is None:
            self.log.warning("etcd away: keeping the last membership, admitting no new member",
                             error=str(exc), members=len(self.members))
            if self.up:
                self.metrics.etcd_lost.inc()
            self.up = False
            self.away_since = time.monotonic()
            self.metrics.etcd_up.set(0)

    # ------------------------------------------------------------------ the lease task
    async def _register(self) -> None:
        assert self.me is not None
        lease = await self.client.grant(max(2, round(self.fleet.lease_ttl_s)))
        self.metrics.writes.labels(kind="grant").inc()
        again = self.registered.is_set()
        self.lease = lease
        me = self.me
        live = self._live
        await self.client.put_all([(f"{self.prefix}{me.key}", rec.encode(msgspec.structs.replace(me, at=time.time()))),
                                   (f"{self.live_prefix}{me.key}", self._live_record(live))], lease=lease)
        self.metrics.writes.labels(kind="put").inc()
        self._written_live, self._written_at = live, time.monotonic()
        self.metrics.registrations.labels(kind="again" if again else "first").inc()
        self.log.info("registered" if not again else "registered again (the lease was gone)",
                      key=f"{self.prefix}{self.me.key}", lease=f"{lease:x}")
        self.registered.set()

    def _live_record(self, live: rec.Live) -> bytes:
        assert self.me is not None
        return rec.encode(rec.LiveRecord(site=self.me.site, node=self.me.node, live=live, at=time.time()))

    async def _write(self) -> None:
        """The live record again (the member record is written once per lease)."""
        assert self.me is not None
        live = self._live
        await self.client.put(f"{self.live_prefix}{self.me.key}", self._live_record(live), lease=self.lease)
        self.metrics.writes.labels(kind="put").inc()
        self._written_live, self._written_at = live, time.monotonic()

    async def _lease_forever(self) -> None:
        """Keep-alive every third of the TTL; a put when the refresh rule allows (woken by
        :meth:`set_live`, which never costs a keep-alive of its own)."""
        backoff = FIRST_BACKOFF_S
        ttl = self.fleet.lease_ttl_s
        next_keepalive = 0.0
        while True:
            now = time.monotonic()
            try:
                if not self.lease:
                    await self._register()
                    next_keepalive = time.monotonic() + ttl / 3
                else:
                    if now >= next_keepalive:
                        left = await self.client.keepalive(self.lease)
                        self.metrics.writes.labels(kind="keepalive").inc()
                        next_keepalive = time.monotonic() + ttl / 3
                        if left == 0:
                            self.lease = 0  # expired while etcd was away from us: register again at once
                            self._back()
                            continue
                    if rec.should_refresh(self._written_live, self._live, now - self._written_at,
                                          min_s=self.fleet.refresh_min_s, change=self.fleet.refresh_change):
                        await self._write()
                self._back()
                backoff = FIRST_BACKOFF_S
                until = next_keepalive
                if rec.figures_moved(self._written_live, self._live, self.fleet.refresh_change):
                    until = min(until, self._written_at + self.fleet.refresh_min_s)
                wait = max(0.05, until - time.monotonic())
            except EtcdUnavailable as exc:
                self._away(exc)
                wait, backoff = backoff * (0.5 + random.random() / 2), min(backoff * 2, ttl / 3)
                next_keepalive = 0.0  # the first thing to try when it answers
            except EtcdError as exc:  # e.g. the lease vanished between keep-alive and put
                self.log.warning("etcd refused; registering again", error=str(exc))
                self.lease = 0
                wait = backoff
            self._wake.clear()
            try:
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                pass

    # ------------------------------------------------------------------ the watch task
    async def _watch_forever(self, view: View) -> None:
        backoff = FIRST_BACKOFF_S
        relist, first, lost = True, True, False
        while True:
            try:
                if relist:
                    revision, kvs = await self.client.list(view.prefix)
                    view.reconcile(kvs)
                    view.revision = revision
                    if view is self.views[0]:
                        self.metrics.resyncs.labels(kind="first" if first else "full").inc()
                    relist, first, lost = False, False, False
                    view.listed.set()
                    self._back()
                created = False
                async for batch in self.client.watch(view.prefix, view.revision + 1):
                    if not created:
                        created = True
                        if batch.revision < view.revision:  # a new store under the same address
                            self.log.warning("etcd's revision went back: listing again", watch=view.name,
                                             revision=batch.revision, known=view.revision)
                            relist = True
                            break
                        if lost and view is self.views[0]:  # goes on from where the one that ended stopped
                            self.metrics.resyncs.labels(kind="resume").inc()
                        lost = False
                        self._back()
                        backoff = FIRST_BACKOFF_S
                        continue
                    for ev in batch.events:
                        if ev.deleted:
                            view.delete(ev.kv.key)
                        else:
                            view.put(ev.kv)
                        view.revision = max(view.revision, ev.kv.mod_revision)
                    if not batch.events:  # a progress notification: nothing before it is missing
                        view.revision = max(view.revision, batch.revision)
            except Compacted as exc:
                self.log.info("watch compacted: listing again", watch=view.name, compact_revision=exc.compact_revision)
                relist = True
                continue
            except EtcdUnavailable as exc:
                self._away(exc)
                lost = True
            backoff = min(backoff * 2, 2.0)
            self._etcd_back.clear()
            try:  # a backoff, cut short when the lease task finds etcd back
                async with asyncio.timeout(backoff * (0.5 + random.random() / 2)):
                    await self._etcd_back.wait()
            except TimeoutError:
                pass

    def _decode(self, kv: KeyValue, kind: type = rec.MemberRecord):
        try:
            return rec.decode(kv.key, kv.value, self.prefix if kind is rec.MemberRecord else self.live_prefix, kind)
        except rec.RecordError as exc:
            self.metrics.ignored.labels(reason="invalid").inc()
            self.log.warning("ignoring a record under the fleet prefix", error=str(exc))
            return None

    def _put(self, kv: KeyValue) -> None:
        r = self._decode(kv)
        if r is None or r.key == self.my_key:
            return
        old = self.members.get(r.key)
        if old is None and len(self.members) >= self.fleet.max_members:
            self.metrics.ignored.labels(reason="max_members").inc()
            return
        self.members[r.key] = r
        self.metrics.members.set(len(self.members))
        kind = "join" if old is None else "update"
        self.metrics.events.labels(kind=kind).inc()
        self.on_event(kind, r, old)

    def _delete(self, key: str) -> None:
        name = key[len(self.prefix):]
        old = self.members.pop(name, None)
        if old is None:
            return
        self.metrics.members.set(len(self.members))
        self.metrics.events.labels(kind="leave").inc()
        self.on_event("leave", old, old)

    def _reconcile(self, kvs: list[KeyValue]) -> None:
        """A full listing: joins and updates for what it holds, leaves for what it no longer does."""
        seen = set()
        for kv in kvs:
            r = self._decode(kv)
            if r is None:
                continue
            seen.add(r.key)
            if self.members.get(r.key) != r:
                self._put(kv)
        for key in [k for k in self.members if k not in seen]:
            self._delete(f"{self.prefix}{key}")

    def _put_live(self, kv: KeyValue) -> None:
        r = self._decode(kv, rec.LiveRecord)
        if r is not None and r.key != self.my_key and (r.key in self.live or len(self.live) < self.fleet.max_members):
            self.live[r.key] = r.live

    def _delete_live(self, key: str) -> None:
        self.live.pop(key[len(self.live_prefix):], None)

    def _reconcile_live(self, kvs: list[KeyValue]) -> None:
        self.live.clear()
        for kv in kvs:
            self._put_live(kv)
