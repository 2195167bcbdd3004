"""Membership: this member's record in etcd under a lease, and every other member's, watched.

:class:`Membership` runs two tasks. The **lease** task keeps a lease of ``fleet.lease_ttl_s``
(granted once, kept alive every third of its TTL, granted anew only when etcd no longer has it)
and this member's records under it: the member record and the live record, put in one
transaction that succeeds only while the member key is free or already bound to this lease (so
two agents that share a site/node never overwrite each other: the second waits, logged and
counted as a duplicate, until the first one's lease ends). A member key under no lease (a plain
``etcdctl put``) is no process's, and would never end: it is taken back. The live record is
written again when its figures moved enough (:func:`.record.should_refresh`). Any change to our
record we did not write (a delete, a put at a revision not ours, whatever its lease) is someone
else's: our record is written again (under another lease: we wait, as for a duplicate). The
**watch** task lists the members once, then watches the prefix from that revision; a watch
that ends is resumed from the last revision seen, and one etcd has compacted past (or a store
that was replaced under it) is replaced by a full listing, diffed against what was known. With ``watch_live`` a
third task does the same for the live records (``live``). A member that only watches (no
record: the router) checks etcd every third of the TTL, so a watch on a member that stopped
answering is moved like an agent's (:mod:`.etcd`).

Neither task ever ends on its own: every answer etcd (or something that is not etcd) can give
is a state, logged (at most a line per 30 s for the same trouble) and counted, then retried with
a backoff that doubles up to a third of the TTL.

While etcd is away nothing changes: the last membership stays (sessions and transfers with known
members go on), and :meth:`lookup` admits no member it has not seen. ``on_event(kind, record,
old)`` is called on the loop for every change: ``join``, ``update``, ``leave``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import structlog

from ..config import Fleet
from ..log import limited
from . import record as rec
from .etcd import Compacted, EtcdClient, EtcdError, EtcdUnavailable, KeyValue, client_ssl
from .metrics import FleetMetrics

log = structlog.get_logger("pdd_wire.fleet")

OnEvent = Callable[[str, rec.MemberRecord, "rec.MemberRecord | None"], None]
FIRST_BACKOFF_S = 0.1
#: Unknown members looked up in etcd (a HELLO from a member not watched yet): a name not found is
#: not asked again for this long, and at most this many names are remembered.
LOOKUP_MISS_S = 1.0
MAX_MISSES = 4096


class Displaced(EtcdError):
    """This member's key is bound to another lease: another process registered the same site/node."""


@dataclass(eq=False)
class View:
    """What one watch keeps up to date: a prefix, and what to do with its keys."""

    name: str
    prefix: str
    put: Callable[[KeyValue], None]
    delete: Callable[[KeyValue], None]
    reconcile: Callable[[list[KeyValue], int, bool], None]  # (kvs, their revision, the store was replaced)
    revision: int = 0  # every change up to this one is applied
    cluster_id: str = ""  # the etcd cluster of the last listing
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
        self.on_event = on_event if on_event is not None else (lambda kind, r, old: None)
        self.prefix = rec.members_prefix(fleet.cluster)
        self.live_prefix = rec.live_prefix(fleet.cluster)
        self._own_client = client is None
        self.client = client or EtcdClient(fleet.etcd, request_s=fleet.request_s,
                                           ssl_ctx=client_ssl(fleet.tls.ca, fleet.tls.cert, fleet.tls.key))
        self.log = (logger or log).bind(cluster=fleet.cluster)
        self.members: dict[str, rec.MemberRecord] = {}  # "site/node" -> record, this member excluded
        self.live: dict[str, rec.Live] = {}  # "site/node" -> figures (with watch_live)
        self._revs: dict[str, int] = {}  # "site/node" -> mod_revision of the record held in members
        self.views = ([View("members", self.prefix, self._put, self._delete, self._reconcile)] if watch else []) + \
            ([View("live", self.live_prefix, self._put_live, self._delete_live, self._reconcile_live)]
             if watch_live else [])
        self.lease = 0  # granted and kept alive; the records are put under it when ``written``
        self.written = False  # this member's records are in etcd under ``lease``
        self._written_rev = 0  # the revision of that write
        # The watch's last change to our key, (revision, its lease; None: deleted), kept while a
        # registration is in flight: one after our write that arrived before its answer is not lost.
        self._own_last: tuple[int, int | None] = (0, None)
        self._own_deleted = False  # the watch saw our record deleted; counted if our lease lived on
        self._written_lease = 0  # the lease of our last write
        self.displaced_by: KeyValue | None = None  # another process's record under our key (a duplicate)
        self.up = False
        self.away_since: float | None = None
        self.listed = self.views[0].listed if self.views else asyncio.Event()  # the first listing is in
        self.registered = asyncio.Event()  # set once this member's record is in etcd
        self._live = rec.Live()
        self._written_live = self._live
        self._written_at = 0.0
        self._wake = asyncio.Event()  # the lease task: figures moved, or our record must be written again
        self._etcd_back = asyncio.Event()  # the watch task: etcd answered the other task again
        self._misses: dict[str, float] = {}  # "site/node" -> when etcd last did not have it (lookup)
        self._tasks: list[asyncio.Task] = []

    @property
    def my_key(self) -> str | None:
        return self.me.key if self.me is not None else None

    @property
    def _my_path(self) -> str | None:
        return f"{self.prefix}{self.me.key}" if self.me is not None else None

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        """Start the tasks; returns at once (etcd away at start is a state, not an error)."""
        await self.client.open()
        if self.me is not None:
            rec.check_size(self.me)  # ValueError now, naming the bound, rather than a task failing later
            self._spawn(self._lease_forever(), "fleet-lease")
        elif self.views:
            self._spawn(self._check_forever(), "fleet-check")
        for view in self.views:
            self._spawn(self._watch_forever(view), f"fleet-watch-{view.name}")

    def _spawn(self, coro, name: str) -> None:
        t = asyncio.create_task(coro, name=name)
        t.add_done_callback(self._task_ended)
        self._tasks.append(t)

    def _task_ended(self, t: asyncio.Task) -> None:
        """The tasks loop until cancelled; one that ended otherwise is a bug, never silent."""
        if t.cancelled():
            return
        exc = t.exception()
        self.metrics.task_errors.labels(task=t.get_name()).inc()
        self.log.error("fleet task ended: the membership no longer follows etcd", task=t.get_name(),
                       error=repr(exc))

    async def stop(self) -> None:
        """Leave: the record goes with its lease (revoked, so peers see it now, not in a TTL)."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.lease:
            try:  # a dead endpoint and the next at most, not every one: etcd away, the lease expires anyway
                async with asyncio.timeout(self.fleet.request_s * min(2, len(self.client.endpoints))):
                    await self.client.revoke(self.lease)
                self.metrics.writes.labels(kind="revoke").inc()
            except (EtcdError, TimeoutError) as exc:
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
        a moment ago); None when it is not registered, or etcd is away. A name etcd did not have
        is not asked again for :data:`LOOKUP_MISS_S` (a flood of HELLOs naming strangers costs
        etcd one read per name and second)."""
        key = f"{site}/{node}"
        if key in self.members:
            return self.members[key]
        if not self.up or key == self.my_key:
            return None
        now = time.monotonic()
        if now - self._misses.get(key, -LOOKUP_MISS_S) < LOOKUP_MISS_S:
            return None
        self.metrics.writes.labels(kind="get").inc()
        try:
            kv = await self.client.get(f"{self.prefix}{key}")
        except EtcdError:
            return None
        if kv is not None:
            self._misses.pop(key, None)
            self._put(kv)
            if key in self.members:
                return self.members[key]
        # Not there, or not a valid record: not read again for a while.
        if len(self._misses) >= MAX_MISSES:
            self._misses = {k: t for k, t in self._misses.items() if now - t < LOOKUP_MISS_S}
        if len(self._misses) < MAX_MISSES:
            self._misses[key] = now
        return None

    @property
    def revision(self) -> int:
        """The members' watch is current to this revision."""
        return self.views[0].revision if self.views else 0

    def describe(self) -> dict:
        d = self.displaced_by
        return {"cluster": self.fleet.cluster, "etcd": self.fleet.etcd, "etcd_up": self.up,
                "away_s": round(time.monotonic() - self.away_since, 3) if self.away_since is not None else None,
                "registered": self.written and bool(self.lease), "lease": f"{self.lease:x}",
                "key_held_by_lease": f"{d.lease:x}" if d is not None else None,
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

    def _trouble(self, task: str, exc: BaseException) -> None:
        """An answer that is not 'etcd away' (a refusal, a bug): counted, logged at a bounded rate."""
        self.metrics.task_errors.labels(task=task).inc()
        limited(self, self.log.warning, "etcd refused, or answered what this member cannot use; retrying",
                task=task, error=f"{type(exc).__name__}: {exc}", exc_info=not isinstance(exc, EtcdError))

    # ------------------------------------------------------------------ the lease task
    async def _register(self) -> None:
        """Put both records under ``self.lease``, only while our key is free or already ours."""
        assert self.me is not None and self._my_path is not None
        again = self.registered.is_set()
        live = self._live
        self._own_last = (0, None)  # only what the watch shows while this write is in flight counts
        items = [(self._my_path, rec.encode(msgspec.structs.replace(self.me, at=time.time()))),
                 (f"{self.live_prefix}{self.me.key}", self._live_record(live))]
        done, revision, holder = await self.client.put_all_if(items, self.lease, guard=self._my_path)
        self.metrics.writes.labels(kind="put").inc()
        unleased = not done and holder is not None and holder.lease == 0
        if not done and holder is not None and holder.lease == self.lease:  # ours already (an answer lost)
            done, revision, holder = await self.client.put_all_if(items, self.lease, guard=self._my_path,
                                                                  guard_lease=self.lease)
            self.metrics.writes.labels(kind="put").inc()
        elif unleased:  # a plain put: no process's lease, nor one that will end; taken back as it was read
            assert holder is not None
            done, revision, holder = await self.client.put_all_if(items, self.lease, guard=self._my_path,
                                                                  guard_mod=holder.mod_revision)
            self.metrics.writes.labels(kind="put").inc()
            if done:
                self.metrics.rewritten.labels(cause="no_lease").inc()
                self.log.warning("this member's key was put with no lease (not by an agent): taken back",
                                 key=self._my_path)
        if not done and holder is not None and holder.lease not in (0, self.lease) and self._mine(holder):
            # This process's own record under a lease it no longer keeps (a put whose answer was lost
            # before that lease was replaced): end that lease, then register again at once.
            await self.client.revoke(holder.lease)
            self.metrics.writes.labels(kind="revoke").inc()
            raise EtcdError("our own record was under a lease of ours we had lost; revoked it")
        if not done:
            if holder is not None and holder.lease not in (0, self.lease):
                if self.displaced_by is None or self.displaced_by.lease != holder.lease:
                    self.metrics.duplicates.inc()
                self.displaced_by = holder
                raise Displaced(f"{self.me.key} is registered under another lease ({holder.lease:x}): another "
                                "agent with this site and node? waiting for its lease to end")
            raise EtcdError("the member key changed during registration")  # gone or put again meanwhile: again
        self.written, self._written_rev, self.displaced_by = True, revision, None
        if self._own_deleted and self.lease == self._written_lease:  # not the delete of our lease's expiry
            self.metrics.rewritten.labels(cause="deleted").inc()
            self.log.warning("this member's record had been deleted while its lease lived: written again")
        self._own_deleted, self._written_lease = False, self.lease
        seen, lease = self._own_last
        if seen > revision:  # changed after our write, and the watch showed it before this answer came
            if lease is None:
                self._own_gone(seen)
            else:
                self._own_put(KeyValue(key=self._my_path, value=b"", mod_revision=seen, lease=lease))
        self._written_live, self._written_at = live, time.monotonic()
        self.metrics.registrations.labels(kind="again" if again else "first").inc()
        self.log.info("registered" if not again else "registered again", key=self._my_path, lease=f"{self.lease:x}")
        self.registered.set()

    def _mine(self, kv: KeyValue) -> bool:
        try:
            other = rec.decode(kv.key, kv.value, self.prefix)
        except rec.RecordError:
            return False
        return self.me is not None and other.incarnation == self.me.incarnation

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
        """Keep-alive every third of the TTL; the records when not written; a put of the live
        record when the refresh rule allows (woken by :meth:`set_live`, which never costs a
        keep-alive of its own)."""
        backoff = FIRST_BACKOFF_S
        ttl = self.fleet.lease_ttl_s
        next_keepalive = 0.0
        while True:
            now = time.monotonic()
            failed = True
            self._wake.clear()
            try:
                if not self.lease:
                    self.written = False
                    self.lease = await self.client.grant(max(2, round(ttl)))
                    self.metrics.writes.labels(kind="grant").inc()
                    next_keepalive = time.monotonic() + ttl / 3
                elif now >= next_keepalive:
                    left = await self.client.keepalive(self.lease)
                    self.metrics.writes.labels(kind="keepalive").inc()
                    next_keepalive = time.monotonic() + ttl / 3
                    if left == 0:  # expired while etcd was away from us: a new lease, at once
                        self.lease = 0
                        self._back()
                        continue
                if not self.written:
                    await self._register()
                elif rec.should_refresh(self._written_live, self._live, now - self._written_at,
                                        min_s=self.fleet.refresh_min_s, change=self.fleet.refresh_change):
                    await self._write()
                self._back()
                failed, backoff = False, FIRST_BACKOFF_S
                until = next_keepalive
                if rec.figures_moved(self._written_live, self._live, self.fleet.refresh_change):
                    until = min(until, self._written_at + self.fleet.refresh_min_s)
                wait = max(0.05, until - time.monotonic())
            except EtcdUnavailable as exc:
                self._away(exc)
                next_keepalive = 0.0  # the first thing to try when it answers
            except Displaced as exc:
                self._back()
                limited(self, self.log.error, "not registered: this member's key is held by another process",
                        error=str(exc))
            except EtcdError as exc:  # e.g. a put refused (too large, no space), the lease gone meanwhile
                self._back()
                if "lease not found" in str(exc):
                    self.lease = 0
                self._trouble("lease", exc)
            except Exception as exc:  # a bug: logged and counted, never the end of the membership
                self._trouble("lease", exc)
            if failed:  # a backoff that doubles; a lease we hold is still kept alive on time meanwhile
                wait = backoff * (0.5 + random.random() / 2)
                if self.lease and next_keepalive:
                    wait = min(wait, max(0.05, next_keepalive - time.monotonic()))
                backoff = min(backoff * 2, ttl / 3)
            try:
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                pass

    # ------------------------------------------------------------------ a watcher's check
    async def _check_forever(self) -> None:
        """Watch only (no lease to keep alive): one cheap call every third of the TTL, so that
        an endpoint that stopped answering moves the watch (:mod:`.etcd`) as an agent's
        keep-alives do."""
        while True:
            await asyncio.sleep(max(1.0, self.fleet.lease_ttl_s / 3))
            try:
                await self.client.call("maintenance/status", {})
                self._back()
            except EtcdUnavailable as exc:
                self._away(exc)
            except Exception as exc:
                self._trouble("check", exc)

    # ------------------------------------------------------------------ the watch task
    async def _watch_forever(self, view: View) -> None:
        backoff = FIRST_BACKOFF_S
        relist, reset, first, lost = True, False, True, False
        while True:
            try:
                if relist:
                    revision, kvs = await self.client.list(view.prefix)
                    self._safely(view.reconcile, kvs, revision, reset)
                    view.revision, view.cluster_id = revision, self.client.cluster_id
                    if view is self.views[0]:
                        self.metrics.resyncs.labels(kind="first" if first else "full").inc()
                    relist, reset, first, lost = False, False, False, False
                    view.listed.set()
                    self._back()
                created = False
                async with contextlib.aclosing(self.client.watch(view.prefix, view.revision + 1)) as batches:
                    async for batch in batches:
                        if not created:
                            created = True
                            if batch.revision < view.revision or \
                                    (batch.cluster_id and view.cluster_id and batch.cluster_id != view.cluster_id):
                                self.log.warning("etcd's store was replaced (its revision went back or its cluster "
                                                 "is another): listing again", watch=view.name,
                                                 revision=batch.revision, known=view.revision)
                                relist = reset = True
                                break
                            if lost and view is self.views[0]:  # goes on from where the one that ended stopped
                                self.metrics.resyncs.labels(kind="resume").inc()
                            lost = False
                            self._back()
                            backoff = FIRST_BACKOFF_S
                            continue
                        for ev in batch.events:
                            self._safely(view.delete if ev.deleted else view.put, ev.kv)
                            view.revision = max(view.revision, ev.kv.mod_revision)
                        if not batch.events:  # a progress notification: nothing before it is missing
                            view.revision = max(view.revision, batch.revision)
                if relist:
                    continue
            except Compacted as exc:
                self.log.info("etcd compacted past the watch: listing again", watch=view.name, error=str(exc))
                relist = True
            except EtcdUnavailable as exc:
                self._away(exc)
                lost = True
            except Exception as exc:  # an EtcdError (a refused range), or a bug: list again, never freeze
                self._trouble(f"watch-{view.name}", exc)
                relist = True
            backoff = min(backoff * 2, max(2.0, self.fleet.lease_ttl_s / 3))
            self._etcd_back.clear()
            try:  # a backoff, cut short when the lease task finds etcd back
                async with asyncio.timeout(backoff * (0.5 + random.random() / 2)):
                    await self._etcd_back.wait()
            except TimeoutError:
                pass

    def _safely(self, fn, *args) -> None:
        """Apply one change; a failure (of a callback) is counted and logged, the watch goes on."""
        try:
            fn(*args)
        except Exception as exc:
            self.metrics.task_errors.labels(task="on_event").inc()
            self.log.error("applying a membership change failed", error=repr(exc), exc_info=True)

    def _decode(self, kv: KeyValue, kind: type = rec.MemberRecord):
        try:
            return rec.decode(kv.key, kv.value, self.prefix if kind is rec.MemberRecord else self.live_prefix, kind)
        except rec.RecordError as exc:
            self.metrics.ignored.labels(reason="invalid").inc()
            limited(self, self.log.warning, "ignoring a record under the fleet prefix (one line per 30 s; "
                    "pddwire_fleet_records_ignored_total counts them all)", detail={"error": str(exc)})
            return None

    def _notify(self, kind: str, r: rec.MemberRecord, old: rec.MemberRecord | None) -> None:
        self.metrics.events.labels(kind=kind).inc()
        try:
            self.on_event(kind, r, old)
        except Exception as exc:
            self.metrics.task_errors.labels(task="on_event").inc()
            self.log.error("a membership callback failed", kind=kind, member=r.key, error=repr(exc), exc_info=True)

    # ------------------------------------------------------------------ our own key, seen by the watch
    def _own_put(self, kv: KeyValue) -> None:
        """A put on our key at a revision after our write is not ours, whatever its lease (an
        etcd writer can use our lease ID): our record is written again. Under no lease it is
        taken back; under another lease :class:`Displaced` says who holds it."""
        self._own_last = max(self._own_last, (kv.mod_revision, kv.lease), key=lambda e: e[0])
        if not self.written or kv.mod_revision <= self._written_rev:
            return
        self.written = False
        if kv.lease == self.lease:
            self.metrics.rewritten.labels(cause="own_lease").inc()
            self.log.warning("this member's record was put over under its own lease: writing it again",
                             revision=kv.mod_revision)
        elif kv.lease:
            limited(self, self.log.error, "this member's key was written under another lease: registering again",
                    lease=f"{kv.lease:x}")
        self._wake.set()

    def _own_gone(self, revision: int) -> None:
        self._own_last = max(self._own_last, (revision, None), key=lambda e: e[0])
        if self.written and revision > self._written_rev:
            self.written = False
            self._own_deleted = True  # by someone, or by our lease's expiry: told apart at the next write
            self.log.info("this member's record was deleted: registering again")
            self._wake.set()

    # ------------------------------------------------------------------ the members' view
    def _put(self, kv: KeyValue) -> None:
        if kv.key == self._my_path:
            self._own_put(kv)
            return
        r = self._decode(kv)
        if r is None:  # a member's record replaced by one no reader may use: it left (as a full listing has it)
            self._delete(kv)
            return
        if kv.mod_revision and kv.mod_revision <= self._revs.get(r.key, 0):
            return  # older than what a lookup already read
        old = self.members.get(r.key)
        if old is None and len(self.members) >= self.fleet.max_members:
            self.metrics.ignored.labels(reason="max_members").inc()
            return
        self.members[r.key] = r
        self._revs[r.key] = kv.mod_revision
        self.metrics.members.set(len(self.members))
        self._notify("join" if old is None else "update", r, old)

    def _delete(self, kv: KeyValue) -> None:
        if kv.key == self._my_path:
            self._own_gone(kv.mod_revision)
            return
        name = kv.key[len(self.prefix):]
        if kv.mod_revision and kv.mod_revision <= self._revs.get(name, 0):
            return  # the record a lookup read is newer than this delete
        old = self.members.pop(name, None)
        self._revs.pop(name, None)
        if old is None:
            return
        self.metrics.members.set(len(self.members))
        self._notify("leave", old, old)

    def _reconcile(self, kvs: list[KeyValue], revision: int, reset: bool) -> None:
        """A full listing at ``revision``: joins and updates for what it holds, leaves for what it
        no longer does (``reset``: a new store, whose revisions say nothing of the old one's)."""
        if reset:
            self._revs = {k: 0 for k in self._revs}
            self._own_last = (0, None)
            if self.written:  # our write's revision was the old store's: no put can be told ours
                self.written = False
                self.log.info("etcd's store was replaced: writing this member's record again")
                self._wake.set()
        seen = set()
        mine = False
        for kv in kvs:
            if kv.key == self._my_path:
                mine = True
                self._own_put(kv)
                continue
            r = self._decode(kv)
            if r is None:
                continue
            seen.add(r.key)
            if self.members.get(r.key) != r:
                self._put(kv)
        if not mine and self.me is not None:
            self._own_gone(revision)
        for key in [k for k in self.members if k not in seen and self._revs.get(k, 0) <= revision]:
            self._delete(KeyValue(key=f"{self.prefix}{key}", value=b"", mod_revision=0, lease=0))

    # ------------------------------------------------------------------ the live records' view
    def _put_live(self, kv: KeyValue) -> None:
        r = self._decode(kv, rec.LiveRecord)
        if r is not None and r.key != self.my_key and (r.key in self.live or len(self.live) < self.fleet.max_members):
            self.live[r.key] = r.live

    def _delete_live(self, kv: KeyValue) -> None:
        self.live.pop(kv.key[len(self.live_prefix):], None)

    def _reconcile_live(self, kvs: list[KeyValue], revision: int, reset: bool) -> None:
        self.live.clear()
        for kv in kvs:
            self._put_live(kv)
