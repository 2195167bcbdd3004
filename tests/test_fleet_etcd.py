"""The membership against what a real etcd (three members, Debian's etcd-server) and things that
are not etcd can answer: it never freezes and never dies silently.

* a put etcd refuses (the record over etcd's ``--max-request-bytes``) backs off, doubling, and
  reuses its lease (no lease leaked per retry); the member registers once a put can succeed;
* an endpoint that answers something that is not etcd's JSON, or a callback that raises, stops
  nothing; a listing that etcd compacts between two pages is listed again; a store replaced
  under the same addresses (its revision goes back) is listed again, diffed;
* a watch on a member that stopped answering (SIGSTOP) moves to another, for an agent (its
  keep-alives find it) and for a watcher without a lease (its check does);
* this member's record deleted behind its back is written again; a second process with the same
  site/node waits (counted) instead of overwriting the first; a record put over it with no lease
  (no process's) is taken back, at once and at start; one put over it under its own lease is
  written again, also when the watch shows it before the registration's answer is back;
* an update of a member's record that is not valid is that member leaving;
* a record read at once (a HELLO's lookup) is not overwritten by the watch's older events;
* etcd with TLS client certificates (``--client-cert-auth``): members register and watch; a
  client without a certificate, or without etcd's CA, is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import signal

import msgspec
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from conftest import until
from pdd_tools.etcd import EtcdCluster, EtcdTls
from pdd_wire.config import EtcdTls as FleetTls
from pdd_wire.config import Fleet
from pdd_wire.fleet import EtcdClient, EtcdUnavailable, FleetMetrics, Membership
from pdd_wire.fleet.etcd import client_ssl
from pdd_wire.fleet.record import EngineRec, MemberRecord, encode, member_key
from support.certs import make_pki
from support.fleet import etcd_client, etcd_cluster
from support.http import serving

MAX_REQUEST = 3072  # this module's etcd refuses requests over 3 KiB (ours are at most 4 KiB + the live record)
KIND = web.AppKey("kind", str)


@pytest.fixture(scope="module")
def etcd():
    yield from etcd_cluster(3, extra=["--max-request-bytes", str(MAX_REQUEST)])


def fleet(etcd_or_endpoints, cluster: str, **kw) -> Fleet:
    eps = etcd_or_endpoints if isinstance(etcd_or_endpoints, list) else etcd_or_endpoints.endpoints
    return Fleet(etcd=eps, cluster=cluster, lease_ttl_s=kw.pop("lease_ttl_s", 2), request_s=kw.pop("request_s", 0.5),
                 **kw)


def record(node: str, incarnation: int = 1, engines: int = 0) -> MemberRecord:
    return MemberRecord(site="B", node=node, incarnation=incarnation, wan="127.0.0.1:7601",
                        fingerprint="sha256:" + hashlib.sha256(node.encode()).hexdigest(),  # one certificate a member
                        engines=tuple(EngineRec(role="MD", url=f"http://{'m' * 90}.example:{8000 + i}")
                                      for i in range(engines)))


def sample(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


class Events(list):
    """on_event's calls, as (kind, key, incarnation)."""

    def __call__(self, kind, r, old) -> None:
        self.append((kind, r.key, r.incarnation))


@contextlib.asynccontextmanager
async def memberships(*made: Membership):
    try:
        for ms in made:
            await ms.start()
        yield made
    finally:
        for ms in made:
            await ms.stop()


async def test_a_refused_put_backs_off_and_reuses_its_lease(etcd, cluster_name):
    registry = CollectorRegistry()
    big = record("b1", engines=24)
    assert MAX_REQUEST < len(encode(big)) <= 4096  # ours accepts it, this etcd refuses it
    async with etcd_client(etcd.endpoints) as client:
        leases_before = set(await client.leases())
        m = Membership(fleet(etcd, cluster_name), FleetMetrics(registry), me=big, watch=False)
        async with memberships(m):
            t0 = asyncio.get_running_loop().time()
            await until(lambda: sample(registry, "pddwire_fleet_task_errors_total", task="lease") >= 4, 10,
                        "refused puts")
            elapsed = asyncio.get_running_loop().time() - t0
            puts = sample(registry, "pddwire_fleet_etcd_requests_total", kind="put")
            assert sample(registry, "pddwire_fleet_etcd_requests_total", kind="grant") == 1  # one lease, reused
            assert len(set(await client.leases()) - leases_before) == 1
            # backoff doubling from 0.1 s (each wait at least half of it), plus a try per keep-alive
            assert puts <= 2 + elapsed / (2 / 3) + math.log2(elapsed / 0.05 + 1), (puts, elapsed)
            assert not m.registered.is_set()
            m.me = record("b1")  # a record etcd takes: registered under the same lease
            await asyncio.wait_for(m.registered.wait(), 5)
            assert sample(registry, "pddwire_fleet_etcd_requests_total", kind="grant") == 1
            kv = await client.get(member_key(cluster_name, "B", "b1"))
            assert kv is not None and kv.lease == m.lease


async def _not_etcd(request: web.Request) -> web.StreamResponse:
    if request.app[KIND] == "text":
        return web.Response(status=404, text="404 page not found")
    return web.json_response({"weird": [1, 2, 3]})  # 200, JSON, not etcd's shape


@contextlib.asynccontextmanager
async def not_etcd(kind: str):
    app = web.Application()
    app[KIND] = kind
    app.router.add_route("*", "/{tail:.*}", _not_etcd)
    async with serving(app) as url:
        yield url


async def test_endpoints_that_are_not_etcd_and_failing_callbacks_stop_nothing(etcd, cluster_name):
    async with not_etcd("text") as text, not_etcd("json") as weird:
        registry = CollectorRegistry()
        f = fleet([text, weird, etcd.endpoints[0]], cluster_name)
        seen = Events()

        def on_event(kind, r, old) -> None:
            seen(kind, r, old)
            if len(seen) == 1:
                raise RuntimeError("a callback that fails")

        member = Membership(f, FleetMetrics(CollectorRegistry()), me=record("b1"), watch=False)
        watcher = Membership(f, FleetMetrics(registry), on_event=on_event)
        async with memberships(member, watcher):
            await asyncio.wait_for(member.registered.wait(), 10)
            await until(lambda: "B/b1" in watcher.members, 10, "the watcher lists b1")
            async with etcd_client(etcd.endpoints) as client:
                await client.put(member_key(cluster_name, "B", "b2"), encode(record("b2")))
                await until(lambda: "B/b2" in watcher.members, 10, "a join after the failed callback")
                await client.delete(member_key(cluster_name, "B", "b2"))
            assert sample(registry, "pddwire_fleet_task_errors_total", task="on_event") == 1


class CompactingClient(EtcdClient):
    """Fault injection: etcd compacts its history right before the second page of the first
    listing (as a compaction falling between two pages does)."""

    compacted = False

    async def call(self, path: str, body: dict) -> dict:
        if path == "kv/range" and "revision" in body and not self.compacted:
            self.compacted = True
            rev = await self.put("/pdd-test/compact", b"x")
            await super().call("kv/compaction", {"revision": str(rev)})
        return await super().call(path, body)


async def test_a_listing_compacted_between_pages_is_listed_again(etcd, cluster_name):
    async with etcd_client(etcd.endpoints) as client:
        for i in range(5):
            await client.put(member_key(cluster_name, "B", f"b{i}"), encode(record(f"b{i}")))
        registry = CollectorRegistry()
        compacting = await CompactingClient(etcd.endpoints, request_s=0.5).open()
        compacting.list_page = 2
        watcher = Membership(fleet(etcd, cluster_name), FleetMetrics(registry), client=compacting)
        try:
            async with memberships(watcher):
                await asyncio.wait_for(watcher.listed.wait(), 10)
                assert compacting.compacted and len(watcher.members) == 5
                await client.put(member_key(cluster_name, "B", "b9"), encode(record("b9")))
                await until(lambda: "B/b9" in watcher.members, 10, "the watch goes on after the listing")
        finally:
            await compacting.close()
        for i in [*range(5), 9]:
            await client.delete(member_key(cluster_name, "B", f"b{i}"))


class SlowWatch(EtcdClient):
    """Fault injection: the watch's events arrive ``delay_s`` late (a slow watch stream)."""

    delay_s = 1.0

    async def watch(self, prefix: str, start_revision: int):
        async with contextlib.aclosing(super().watch(prefix, start_revision)) as batches:
            async for batch in batches:
                if batch.events:
                    await asyncio.sleep(self.delay_s)  # the injected lateness, not a wait for readiness
                yield batch


async def test_a_record_read_now_is_not_overwritten_by_older_watch_events(etcd, cluster_name):
    seen = Events()
    slow = await SlowWatch(etcd.endpoints, request_s=0.5).open()
    watcher = Membership(fleet(etcd, cluster_name), FleetMetrics(CollectorRegistry()), client=slow, on_event=seen)
    key = member_key(cluster_name, "B", "z")
    try:
        async with memberships(watcher), etcd_client(etcd.endpoints) as client:
            await asyncio.wait_for(watcher.listed.wait(), 10)
            await client.put(key, encode(record("z", incarnation=1)))
            await client.put(key, encode(record("z", incarnation=2)))
            got = await watcher.lookup("B", "z")  # a HELLO from z: read now, before the watch shows it
            assert got is not None and got.incarnation == 2
            await client.delete(key)
            await until(lambda: "B/z" not in watcher.members, 10, "the delete, after the older puts")
            assert seen == [("join", "B/z", 2), ("leave", "B/z", 2)]
    finally:
        await slow.close()


async def test_own_record_deleted_is_written_again_and_a_duplicate_waits(etcd, cluster_name):
    registry1, registry2, seen = CollectorRegistry(), CollectorRegistry(), Events()
    first = Membership(fleet(etcd, cluster_name), FleetMetrics(registry1), me=record("b1", incarnation=1))
    watcher = Membership(fleet(etcd, cluster_name), FleetMetrics(CollectorRegistry()), on_event=seen)
    async with memberships(first, watcher), etcd_client(etcd.endpoints) as client:
        await asyncio.wait_for(first.registered.wait(), 10)
        await until(lambda: "B/b1" in watcher.members, 10, "listed")
        await client.delete(member_key(cluster_name, "B", "b1"))  # behind its back, its lease alive
        await until(lambda: sample(registry1, "pddwire_fleet_registrations_total", kind="again") == 1, 10,
                    "written again")
        await until(lambda: ("join", "B/b1", 1) in seen[1:], 10, "the watcher sees it back")
        second = Membership(fleet(etcd, cluster_name), FleetMetrics(registry2), me=record("b1", incarnation=2))
        async with memberships(second):
            await until(lambda: sample(registry2, "pddwire_fleet_duplicates_total") == 1, 10, "the duplicate")
            assert not second.registered.is_set() and watcher.members["B/b1"].incarnation == 1
            assert second.describe()["key_held_by_lease"] == f"{first.lease:x}"
            await first.stop()  # the first leaves: the second takes the name
            await asyncio.wait_for(second.registered.wait(), 10)
            await until(lambda: "B/b1" in watcher.members and watcher.members["B/b1"].incarnation == 2, 10,
                        "the second registered")


async def test_a_record_put_with_no_lease_is_taken_back(etcd, cluster_name):
    """``etcdctl put`` over a member's key (lease 0, which never ends): the member takes its key
    back under its lease, warned and counted; a key left so before the member starts is too."""
    registry = CollectorRegistry()
    key = member_key(cluster_name, "B", "b1")
    async with etcd_client(etcd.endpoints) as client:
        await client.put(key, encode(record("b1", incarnation=9)))  # a leftover, before the member starts
        member = Membership(fleet(etcd, cluster_name), FleetMetrics(registry), me=record("b1", incarnation=1))
        watcher = Membership(fleet(etcd, cluster_name), FleetMetrics(CollectorRegistry()))
        async with memberships(member, watcher):
            await asyncio.wait_for(member.registered.wait(), 10)
            assert (await client.get(key)).lease == member.lease
            assert sample(registry, "pddwire_fleet_own_record_rewritten_total", cause="no_lease") == 1
            await until(lambda: "B/b1" in watcher.members and watcher.members["B/b1"].incarnation == 1, 10,
                        "the watcher sees the member's own record")
            await client.put(key, encode(record("b1", incarnation=9)))  # a plain put, the lease alive
            await until(lambda: sample(registry, "pddwire_fleet_own_record_rewritten_total", cause="no_lease") == 2,
                        10, "taken back again")
            kv = await client.get(key)
            assert kv.lease == member.lease and b'"incarnation":1,' in kv.value
            await until(lambda: watcher.members["B/b1"].incarnation == 1, 10, "the watcher has it back")
            assert sample(registry, "pddwire_fleet_duplicates_total") == 0 and member.displaced_by is None
            assert sample(registry, "pddwire_fleet_registrations_total", kind="again") == 1


async def test_a_record_put_over_under_its_own_lease_is_written_again(etcd, cluster_name):
    """An etcd writer puts another address and fingerprint with the member's own lease ID: the
    member notices (a revision it did not write) and writes its record again."""
    registry = CollectorRegistry()
    key = member_key(cluster_name, "B", "b1")
    mine = record("b1")
    member = Membership(fleet(etcd, cluster_name), FleetMetrics(registry), me=mine)
    watcher = Membership(fleet(etcd, cluster_name), FleetMetrics(CollectorRegistry()))
    async with memberships(member, watcher), etcd_client(etcd.endpoints) as client:
        await asyncio.wait_for(member.registered.wait(), 10)
        forged = msgspec.structs.replace(mine, wan="10.9.9.9:7601", fingerprint="sha256:" + "cd" * 32)
        await client.put(key, encode(forged), lease=member.lease)
        await until(lambda: sample(registry, "pddwire_fleet_own_record_rewritten_total", cause="own_lease") == 1, 10,
                    "noticed")
        await until(lambda: sample(registry, "pddwire_fleet_registrations_total", kind="again") == 1, 10,
                    "written again")
        kv = await client.get(key)
        assert kv.lease == member.lease and b"10.9.9.9" not in kv.value and mine.fingerprint.encode() in kv.value
        await until(lambda: "B/b1" in watcher.members and watcher.members["B/b1"].wan == mine.wan, 10,
                    "the watcher has the member's own record")


class OverwrittenAtOnce(EtcdClient):
    """Fault injection: right after the member's registration applies, and before its answer is
    back, another writer puts ``forged`` over it under the member's lease, and the watch shows it."""

    forged = b""
    membership: Membership

    async def put_all_if(self, items, lease, **kw):
        answer = await super().put_all_if(items, lease, **kw)
        if answer[0] and self.forged:
            forged, self.forged = self.forged, b""
            rev = await self.put(items[0][0], forged, lease=lease)
            await until(lambda: self.membership.revision >= rev, 10, "the watch shows the put first")
        return answer


async def test_a_put_over_seen_before_the_registrations_answer_is_not_lost(etcd, cluster_name):
    registry = CollectorRegistry()
    mine = record("b1")
    client = await OverwrittenAtOnce(etcd.endpoints, request_s=0.5).open()
    client.forged = encode(msgspec.structs.replace(mine, wan="10.9.9.9:7601"))
    member = client.membership = Membership(fleet(etcd, cluster_name), FleetMetrics(registry), me=mine,
                                            client=client)
    try:
        async with memberships(member), etcd_client(etcd.endpoints) as reader:
            await until(lambda: sample(registry, "pddwire_fleet_registrations_total", kind="again") == 1, 10,
                        "written again")
            assert sample(registry, "pddwire_fleet_own_record_rewritten_total", cause="own_lease") == 1
            kv = await reader.get(member_key(cluster_name, "B", "b1"))
            assert kv.lease == member.lease and b"10.9.9.9" not in kv.value
    finally:
        await client.close()


async def test_an_invalid_update_of_a_member_is_its_leave(etcd, cluster_name):
    """A member's record put over with one no reader may use: the watch drops it (a leave, as a
    full listing would), counts it invalid, and takes it back when a valid record follows."""
    registry, seen = CollectorRegistry(), Events()
    key = member_key(cluster_name, "B", "b2")
    watcher = Membership(fleet(etcd, cluster_name), FleetMetrics(registry), on_event=seen)
    async with memberships(watcher), etcd_client(etcd.endpoints) as client:
        await asyncio.wait_for(watcher.listed.wait(), 10)
        await client.put(key, encode(record("b2")))
        await until(lambda: "B/b2" in watcher.members, 10, "joined")
        await client.put(key, encode(msgspec.structs.replace(record("b2"), wan="0.0.0.0:7601")))
        await until(lambda: "B/b2" not in watcher.members, 10, "the invalid record is not kept")
        assert seen == [("join", "B/b2", 1), ("leave", "B/b2", 1)]
        assert sample(registry, "pddwire_fleet_records_ignored_total", reason="invalid") == 1
        await client.put(key, encode(record("b2", incarnation=2)))
        await until(lambda: "B/b2" in watcher.members, 10, "a valid record joins again")
        assert seen[-1] == ("join", "B/b2", 2)
        await client.delete(key)


async def test_a_watch_moves_off_a_member_that_stopped_answering(etcd, cluster_name):
    """etcd member 0 is SIGSTOPped (a frozen process: its connections stay open, silent). A
    member leaves meanwhile: an agent's membership (its keep-alive finds member 0 mute) and a
    watcher without a lease (its check does) both see it leave."""
    agent = Membership(fleet(etcd, cluster_name), FleetMetrics(CollectorRegistry()), me=record("b1"))
    watcher = Membership(fleet(etcd, cluster_name), FleetMetrics(CollectorRegistry()))
    async with memberships(agent, watcher), etcd_client(etcd.endpoints[1:]) as client:
        lease = await client.grant(30)
        await client.put(member_key(cluster_name, "B", "b2"), encode(record("b2")), lease=lease)
        await until(lambda: "B/b2" in agent.members and "B/b2" in watcher.members, 10, "b2 listed")
        frozen = etcd.members[0]
        frozen.signal(signal.SIGSTOP)
        try:
            async with asyncio.timeout(10):  # the two others elect a leader if it was member 0
                while True:
                    try:
                        await client.revoke(lease)
                        break
                    except EtcdUnavailable:
                        continue
            await until(lambda: "B/b2" not in agent.members, 10, "the agent sees b2 leave")
            await until(lambda: "B/b2" not in watcher.members, 10, "the watcher sees b2 leave")
        finally:
            frozen.signal(signal.SIGCONT)
        await etcd.ready()


async def test_a_store_replaced_under_the_same_addresses_is_listed_again(etcd, cluster_name):
    registry = CollectorRegistry()
    member = Membership(fleet(etcd, cluster_name), FleetMetrics(CollectorRegistry()), me=record("b1"))
    watcher = Membership(fleet(etcd, cluster_name), FleetMetrics(registry))
    async with memberships(member, watcher):
        async with etcd_client(etcd.endpoints) as client:
            await client.put(member_key(cluster_name, "B", "old"), encode(record("old")))
        await until(lambda: {"B/b1", "B/old"} <= watcher.members.keys(), 10, "listed")
        await asyncio.to_thread(etcd.wipe)
        await etcd.start()  # a new store: revisions from 1 again, none of the old keys
        await until(lambda: "B/old" not in watcher.members and "B/b1" in watcher.members, 15,
                    "the new store's membership (b1 registered again)")
        assert sample(registry, "pddwire_fleet_resyncs_total", kind="full") >= 1


async def test_etcd_with_client_certificates(tmp_path, cluster_name):
    pki = make_pki(tmp_path / "pki", ["etcd", "agent"])
    ca = str(pki["ca"])
    server, client_cert = pki["etcd"], pki["agent"]
    tls = EtcdTls(ca=ca, cert=str(server[0]), key=str(server[1]), client_cert=str(client_cert[0]),
                  client_key=str(client_cert[1]))
    async with EtcdCluster(1, tls=tls) as etcd:
        f = fleet(etcd, cluster_name, tls=FleetTls(ca=ca, cert=str(client_cert[0]), key=str(client_cert[1])))
        member = Membership(f, FleetMetrics(CollectorRegistry()), me=record("b1"))
        watcher = Membership(f, FleetMetrics(CollectorRegistry()))
        async with memberships(member, watcher):
            await until(lambda: "B/b1" in watcher.members, 10, "registered and watched over TLS")
        for ctx in (client_ssl(ca, "", ""), None):  # no client certificate; no CA but the system's
            async with etcd_client(etcd.endpoints, ssl_ctx=ctx, request_s=1) as client:
                with pytest.raises(EtcdUnavailable):
                    await client.get("/pdd-wire/x")
