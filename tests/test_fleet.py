"""The fleet on a real etcd (three members, Debian's etcd-server) and real agents: registration,
discovery, lazy connect (dial and knock), idle close, a certificate that is not the registered
one, lease expiry after ``kill -9`` of an agent process, and etcd stopped and restarted while KV
moves.

One etcd cluster for the module (about 2 s to start); every test has its own key prefix
(``fleet.cluster``), so tests see only their own members. Lease TTLs are 2 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from conftest import Engines, fill_random, metric, same_bytes, until
from pdd_wire import config as cfgmod
from pdd_wire.agent import Agent
from pdd_wire.engine import protocol as ev
from pdd_wire.errors import EngineRequestError, ErrorCode
from pdd_wire.fleet import FleetMetrics, Membership
from pdd_wire.fleet.record import MemberRecord, encode, member_key
from pdd_wire.pki import cert_fingerprint
from support.agents import free_port
from support.fleet import etcd_client, etcd_cluster, spawn_agent

MiB = 1 << 20


@pytest.fixture(scope="module")
def etcd():
    """A three-member etcd cluster on loopback (fails naming the package when etcd is missing)."""
    yield from etcd_cluster(3)


def fleet_toml(tmp, site: str, node: str, endpoints: list[str], cluster: str, *, fleet: str = "",
               port: int | None = None, heartbeat_s: float = 0.2, timeouts: str = "", lease_ttl_s: float = 2,
               advertise: str = "") -> str:
    """An agent with no [[peers]]: everything it knows comes from etcd (``advertise``: the address
    its record gives, default its own)."""
    eps = ", ".join(f'"{e}"' for e in endpoints)
    return f"""
site = "{site}"
node = "{node}"
[listen]
wan = "127.0.0.1:{port or free_port()}"
admin = "127.0.0.1:0"
engine_socket = "{tmp}/{node}.sock"
[timeouts]
heartbeat_s = {heartbeat_s}
dead_after_s = {max(1.5, 2 * heartbeat_s)}
reconnect_max_backoff_s = 0.2
shutdown_grace_s = 1
{timeouts}
[fleet]
etcd = [{eps}]
cluster = "{cluster}"
lease_ttl_s = {lease_ttl_s}
refresh_min_s = 0.5
request_s = 0.5
{f'advertise = "{advertise}"' if advertise else ""}
{fleet if "dial_wait_s" in fleet else fleet + chr(10) + "dial_wait_s = 5"}
[[fleet.engines]]
role = "{'P' if site == 'A' else 'MD'}"
url = "http://127.0.0.1:{8100 if site == 'A' else 8200}"
"""


class Fleet(dict):
    """The test's agents by node name, and the engines it connected to them."""

    def __init__(self) -> None:
        super().__init__()
        self.engines = Engines()

    async def engine(self, node: str, name: str):
        return await self.engines.connect(self[node].config.listen.engine_socket, name)


@contextlib.asynccontextmanager
async def agents(tmp, etcd, cluster, nodes, fleet: str = "", heartbeat_s: dict[str, float] | None = None):
    """``nodes``: (site, node); ``heartbeat_s``: node -> its timeouts.heartbeat_s (else 0.2)."""
    out = Fleet()
    try:
        for site, node in nodes:
            a = Agent(cfgmod.loads(fleet_toml(tmp, site, node, etcd.endpoints, cluster, fleet=fleet,
                                              heartbeat_s=(heartbeat_s or {}).get(node, 0.2))))
            await a.start()
            out[node] = a
        for a in out.values():  # everyone sees everyone
            await until(lambda a=a: len(a.membership.members) == len(nodes) - 1, 10, "membership")
        yield out
    finally:
        for c in out.engines.clients:
            await c.close()
        for a in out.values():
            await a.shutdown(0)


async def send_and_check(eng_a, eng_b, engines, rid: str, dest: str, size: int = 8 * MiB) -> None:
    src, dst = engines.memory(size), engines.memory(size)
    await fill_random(src)
    ka = await eng_a.register(src, block_bytes=MiB)
    kb = await eng_b.register(dst, block_bytes=MiB)
    await eng_b.post_recv(rid, [kb.blocks(0, size // MiB)])
    await eng_a.send_kv(rid, [ka.blocks(0, size // MiB)], to=[dest], deadline_s=20)
    assert isinstance(await eng_a.wait(rid, timeout=20), ev.KvSent)
    assert isinstance(await eng_b.wait(rid, timeout=20), ev.KvReceived)
    assert await same_bytes(src.buf, dst.buf)
    await eng_a.deregister(ka)
    await eng_b.deregister(kb)


async def test_registration_and_discovery(tmp_sock_dir, etcd, cluster_name):
    async with agents(tmp_sock_dir, etcd, cluster_name, [("A", "a1"), ("B", "b1")]) as ag:
        a, b = ag["a1"], ag["b1"]
        rec = a.membership.members["B/b1"]
        assert rec.wan == f"127.0.0.1:{b.wan_address[1]}" and rec.incarnation == b.incarnation
        assert rec.fingerprint == cert_fingerprint(b.pki.cert)  # what its handshake will have to show
        assert [(e.role, e.url) for e in rec.engines] == [("MD", "http://127.0.0.1:8200")]
        assert rec.engines[0].engine_socket == b.config.listen.engine_socket
        assert "kv.v1" in rec.capabilities and rec.versions
        assert len(a.peers) == len(b.peers) == 0  # nothing needed yet: no session, no connection
        assert a.membership.live == {}  # an agent does not watch everyone's figures ...
        router_like = Membership(a.config.fleet, FleetMetrics(CollectorRegistry()), watch_live=True)
        await router_like.start()  # ... who needs load does
        try:
            await router_like.listed.wait()  # the members' view; the live view is a task of its own
            await until(lambda: "B/b1" in router_like.live, 5, "b1's live record")
            assert router_like.live["B/b1"].engines == 0 and router_like.members.keys() == {"A/a1", "B/b1"}
        finally:
            await router_like.stop()
        st = a.describe()["fleet"]
        assert st["etcd_up"] and st["registered"] and st["members"] == 1 and st["sessions"] == []
        assert metric(a, "pddwire_fleet_registrations_total", kind="first") == 1
        assert metric(a, "pddwire_fleet_etcd_up") == 1


async def test_lazy_connect_dial_and_knock(tmp_sock_dir, etcd, cluster_name):
    """A (sorts lower) dials B on its first send; B's first need of A (tokens) makes it knock."""
    async with agents(tmp_sock_dir, etcd, cluster_name, [("A", "a1"), ("B", "b1"), ("B", "b2")]) as ag:
        a, b1, b2 = ag["a1"], ag["b1"], ag["b2"]
        ea, eb1 = await ag.engine("a1", "p"), await ag.engine("b1", "md")
        await send_and_check(ea, eb1, ag.engines, "r1", "B/b1")
        assert set(a.peers.by_key) == {"B/b1"} and set(b1.peers.by_key) == {"A/a1"}
        assert len(b2.peers) == 0  # a fleet of three, one session: connections follow traffic
        assert metric(a, "pddwire_fleet_lazy_sessions_total", how="dial") == 1
        assert metric(b1, "pddwire_fleet_admissions_total", outcome="admitted") == 1
        # b2 -> a1: b2 sorts higher, so it knocks and a1 dials it back.
        eb2 = await ag.engine("b2", "rld")
        await ea.expect_tokens("r2", from_site="B")
        await eb2.send_tokens("r2", "A/a1", [1, 2, 3])
        got = await ea.wait_tokens("r2", timeout=10)
        assert got.tokens == [1, 2, 3] and got.peer == "B/b2"
        assert metric(b2, "pddwire_fleet_lazy_sessions_total", how="knock") == 1
        assert a.peers.get("B/b2").dialer and not b2.peers.get("A/a1").dialer


async def test_idle_close_then_reopen(tmp_sock_dir, etcd, cluster_name):
    async with agents(tmp_sock_dir, etcd, cluster_name, [("A", "a1"), ("B", "b1")],
                      fleet="idle_close_s = 0.6") as ag:
        a, b = ag["a1"], ag["b1"]
        ea, eb = await ag.engine("a1", "p"), await ag.engine("b1", "md")
        await send_and_check(ea, eb, ag.engines, "r1", "B/b1", size=4 * MiB)
        await until(lambda: len(a.peers) == 0 and len(b.peers) == 0, 10, "both ends closed the idle session")
        assert metric(a, "pddwire_fleet_sessions_closed_total", reason="idle") == 1
        assert metric(b, "pddwire_fleet_sessions_closed_total", reason="idle") == 1
        await until(lambda: 'peer="B/b1"' not in a.metrics_text().decode(), 5,
                    "every series of the closed session dropped (gauges, counters, histograms)")
        await send_and_check(ea, eb, ag.engines, "r2", "B", size=4 * MiB)  # by site: a new session
        assert metric(a, "pddwire_fleet_lazy_sessions_total", how="dial") == 2


async def test_certificate_not_the_registered_one_is_refused(tmp_sock_dir, etcd, cluster_name):
    """b1's record names another certificate than the one b1 presents (put under another lease,
    so b1 waits for it as for a duplicate): a1 refuses the handshake, and the send fails after
    fleet.dial_wait_s."""
    async with agents(tmp_sock_dir, etcd, cluster_name, [("A", "a1"), ("B", "b1")],
                      fleet="dial_wait_s = 1.5") as ag, etcd_client(etcd) as client:
        a, b1 = ag["a1"], ag["b1"]
        forged = msgspec.structs.replace(b1.membership.me, fingerprint="sha256:" + "cd" * 32,
                                         incarnation=b1.incarnation % 1000 + 1)  # another process's
        lease = await client.grant(30)
        await client.put(member_key(cluster_name, "B", "b1"), encode(forged), lease=lease)
        await until(lambda: a.membership.members["B/b1"].fingerprint == forged.fingerprint, 5, "the forged record")
        await until(lambda: metric(b1, "pddwire_fleet_duplicates_total") == 1, 5, "b1 waits for that lease")
        ea = await ag.engine("a1", "p")
        kv = await ea.register(ag.engines.memory(2 * MiB), block_bytes=MiB)
        t0 = time.monotonic()
        await ea.send_kv("r1", [kv.blocks(0, 2)], to=["B/b1"], deadline_s=20)
        failed = await ea.wait("r1", timeout=10)
        assert isinstance(failed, ev.TransferFailed) and failed.code == ErrorCode.PEER_UNREACHABLE
        assert time.monotonic() - t0 < 5  # fleet.dial_wait_s, not the transfer's deadline
        assert metric(a, "pddwire_errors_total", code="IDENTITY_MISMATCH") >= 1
        assert metric(a, "pddwire_fleet_sessions_closed_total", reason="dial_timeout") == 1
        assert metric(b1, "pddwire_peer_up", peer="A/a1") == 0  # never adopted
        await client.revoke(lease)


async def test_lease_expiry_after_kill9_fails_transfers_at_once(tmp_sock_dir, etcd, cluster_name):
    """B is a pdd-wired process, killed with SIGKILL while a transfer to it waits for its post:
    A fails that transfer with PEER_UNREACHABLE once B's lease (2 s) expires, not after
    timeouts.peer_give_up_s (30 s)."""
    proc = spawn_agent(tmp_sock_dir, fleet_toml(tmp_sock_dir, "B", "b1", etcd.endpoints, cluster_name), "B", "b1")
    try:
        async with agents(tmp_sock_dir, etcd, cluster_name, [("A", "a1")]) as ag:
            a = ag["a1"]
            try:
                await until(lambda: "B/b1" in a.membership.members, 20, "b1 registered")
            except AssertionError:
                raise AssertionError((tmp_sock_dir / "b1.log").read_text()[-3000:]) from None
            ea = await ag.engine("a1", "p")
            kv = await ea.register(ag.engines.memory(2 * MiB), block_bytes=MiB)
            await ea.send_kv("r1", [kv.blocks(0, 2)], to=["B/b1"], deadline_s=60, lease_s=60)
            await until(lambda: a.peers.get("B/b1") is not None and a.peers.get("B/b1").is_up, 10, "up")
            os.kill(proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            failed = await ea.wait("r1", timeout=20)
            elapsed = time.monotonic() - t0
            assert isinstance(failed, ev.TransferFailed) and failed.code == ErrorCode.PEER_UNREACHABLE
            assert elapsed < 8, elapsed  # the lease's 2 s (and etcd's expiry sweep), far from 30 s
            assert "B/b1" not in a.membership.members and a.peers.get("B/b1") is None
            assert metric(a, "pddwire_fleet_sessions_closed_total", reason="left") == 1
            with pytest.raises(EngineRequestError) as exc:
                await ea.send_kv("r2", [kv.blocks(0, 2)], to=["B/b1"])
            assert exc.value.code == ErrorCode.UNKNOWN_PEER_SITE
    finally:
        proc.kill()
        proc.wait()


async def test_etcd_restarted_mid_traffic(tmp_sock_dir, etcd, cluster_name):
    """etcd (all three members) stops while KV moves A -> B and comes back: every transfer lands
    byte-identical, no member is admitted while it is away, and both agents reconcile after."""
    async with agents(tmp_sock_dir, etcd, cluster_name, [("A", "a1"), ("B", "b1")]) as ag:
        a, b = ag["a1"], ag["b1"]
        ea, eb = await ag.engine("a1", "p"), await ag.engine("b1", "md")
        n = 0

        async def traffic_while(job) -> None:
            nonlocal n
            task = asyncio.create_task(job)
            while not task.done() or n < 3:
                await send_and_check(ea, eb, ag.engines, f"r{n}", "B/b1", size=4 * MiB)
                n += 1
            await task

        await traffic_while(asyncio.to_thread(etcd.stop))
        await until(lambda: not a.membership.up and not b.membership.up, 10, "both see etcd away")
        await send_and_check(ea, eb, ag.engines, "away-1", "B/b1", size=4 * MiB)  # the known member still
        c = Agent(cfgmod.loads(fleet_toml(tmp_sock_dir, "B", "b9", etcd.endpoints, cluster_name)))
        await c.start()  # starts without etcd: no record, nobody can find it
        try:
            with pytest.raises(EngineRequestError) as exc:
                await ea.send_kv("to-b9", [], to=["B/b9"])
            assert exc.value.code == ErrorCode.UNKNOWN_PEER_SITE
            await traffic_while(etcd.start())
            await until(lambda: a.membership.up and b.membership.up, 10, "etcd back for both")
            await until(lambda: "B/b9" in a.membership.members, 10, "b9 registered after etcd came back")
        finally:
            await c.shutdown(0)
        for x in (a, b):
            assert metric(x, "pddwire_fleet_etcd_lost_total") >= 1
            await until(lambda x=x: metric(x, "pddwire_fleet_resyncs_total", kind="resume")
                        + metric(x, "pddwire_fleet_resyncs_total", kind="full") >= 1, 10, "the watch resumed")
        assert metric(a, "pddwire_fleet_sessions_closed_total", reason="left") == 0
        # A lease etcd no longer has (as after an outage longer than the TTL): b1 registers
        # again; a1 saw it leave and come back, and its session with b1 never dropped.
        async with etcd_client(etcd) as client:
            await client.revoke(b.membership.lease)
        await until(lambda: metric(b, "pddwire_fleet_registrations_total", kind="again") == 1, 10,
                    "b1 registered again")
        await until(lambda: "B/b1" in a.membership.members, 10, "a1 sees b1 back")
        assert metric(a, "pddwire_fleet_member_events_total", kind="leave") >= 1
        await send_and_check(ea, eb, ag.engines, "re-registered", "B/b1", size=4 * MiB)
        assert a.peers.get("B/b1").is_up and not a.fleet.lazy["B/b1"].unlisted


async def test_listener_session_recovers_when_its_dialer_restarts(tmp_sock_dir, etcd, cluster_name):
    """a1 (the dialer) is a pdd-wired process, killed with SIGKILL and started again on the same
    port; b1 (the listener) relays tokens to it again: they arrive (b1's old session was dropped,
    not left down for good)."""
    port = free_port()
    toml = fleet_toml(tmp_sock_dir, "A", "a1", etcd.endpoints, cluster_name, port=port)
    proc = spawn_agent(tmp_sock_dir, toml, "A", "a1")
    try:
        async with agents(tmp_sock_dir, etcd, cluster_name, [("B", "b1")]) as ag:
            b = ag["b1"]
            await until(lambda: "A/a1" in b.membership.members, 20, "a1 registered")
            first = b.membership.members["A/a1"].incarnation
            eb = await ag.engine("b1", "rld")
            ea = await ag.engines.connect(tmp_sock_dir / "a1.sock", "md")
            await ea.expect_tokens("r1", from_site="B")
            await eb.send_tokens("r1", "A/a1", [1, 2])
            assert (await ea.wait_tokens("r1", timeout=10)).tokens == [1, 2]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            await eb.send_tokens("r3", "A/a1", [5])  # to the dead a1: never acknowledged
            proc = spawn_agent(tmp_sock_dir, toml, "A", "a1-again")
            await until(lambda: "A/a1" in b.membership.members and b.membership.members["A/a1"].incarnation != first,
                        20, "the new a1 registered")
            ea2 = await ag.engines.connect(tmp_sock_dir / "a1.sock", "md2")
            await ea2.expect_tokens("r2", from_site="B")
            await eb.send_tokens("r2", "A/a1", [3])
            assert (await ea2.wait_tokens("r2", timeout=10)).tokens == [3]
            # r3's engine was told, once: a1's lease ran out (PEER_UNREACHABLE) or its new
            # incarnation was seen first (PEER_RESTARTED), whichever came first here.
            failed = await eb.wait("r3", timeout=20)
            assert isinstance(failed, ev.TransferFailed) and failed.transfer_id == 0, failed
            assert failed.code in (ErrorCode.PEER_RESTARTED, ErrorCode.PEER_UNREACHABLE), failed
            assert "token IDs not delivered" in failed.reason, failed
            await eb.send_tokens("r4", "A/a1", [6])  # by its reply every earlier event is here
            assert eb.take("r3", kinds=(ev.TransferFailed,)) == []
            assert b.peers.get("A/a1").is_up and b.peers.get("A/a1").remote_incarnation != first
    finally:
        proc.kill()
        proc.wait()


async def test_goodbye_idle_drops_the_listeners_side_at_once(tmp_sock_dir, etcd, cluster_name):
    """b1's heartbeat (its housekeeping tick) is 30 s, so it never runs here: b1 drops its side of
    the idle session on a1's GOODBYE "idle" itself, and a need of b1's from then on opens a new
    session instead of queueing into the closing one."""
    async with agents(tmp_sock_dir, etcd, cluster_name, [("A", "a1"), ("B", "b1")], fleet="idle_close_s = 0.6",
                      heartbeat_s={"b1": 30}) as ag:
        a, b = ag["a1"], ag["b1"]
        ea, eb = await ag.engine("a1", "p"), await ag.engine("b1", "md")
        await send_and_check(ea, eb, ag.engines, "r1", "B/b1", size=2 * MiB)
        await until(lambda: len(b.peers) == 0, 10, "b1 dropped its side on GOODBYE idle")
        assert metric(b, "pddwire_fleet_sessions_closed_total", reason="idle") == 1
        assert metric(a, "pddwire_fleet_sessions_closed_total", reason="idle") == 1
        await ea.expect_tokens("r2", from_site="B")
        await eb.send_tokens("r2", "A/a1", [7])  # a new session: b1 knocks, a1 dials
        assert (await ea.wait_tokens("r2", timeout=10)).tokens == [7]


async def test_a_session_is_ever_up_from_its_first_handshake(tmp_sock_dir, etcd, cluster_name):
    """a1's housekeeping tick never runs (heartbeat 30 s): the session it opened counts as having
    been up as soon as it is (so a drop before the next tick reconnects instead of timing out)."""
    async with agents(tmp_sock_dir, etcd, cluster_name, [("A", "a1"), ("B", "b1")], heartbeat_s={"a1": 30}) as ag:
        a = ag["a1"]
        ea, eb = await ag.engine("a1", "p"), await ag.engine("b1", "md")
        await send_and_check(ea, eb, ag.engines, "r1", "B/b1", size=2 * MiB)
        assert a.fleet.lazy["B/b1"].ever_up and ag["b1"].fleet.lazy["A/a1"].ever_up


async def test_tokens_to_a_session_given_up_are_told_to_their_engine(tmp_sock_dir, etcd, cluster_name):
    """A member listed at an address nobody answers: b1 relays tokens to it (it knocks, in vain);
    when the session is given up after fleet.dial_wait_s, the engine that sent them is told
    (transfer_failed, transfer id 0, PEER_UNREACHABLE) rather than the tokens vanishing."""
    async with agents(tmp_sock_dir, etcd, cluster_name, [("B", "b1")], fleet="dial_wait_s = 1") as ag:
        b = ag["b1"]
        ghost = MemberRecord(site="A", node="a0", incarnation=5, wan=f"127.0.0.1:{free_port()}",
                             fingerprint="sha256:" + "ab" * 32)
        async with etcd_client(etcd) as client:
            lease = await client.grant(30)
            await client.put(member_key(cluster_name, "A", "a0"), encode(ghost), lease=lease)
            await until(lambda: "A/a0" in b.membership.members, 5, "the member listed")
            eb = await ag.engine("b1", "rld")
            await eb.send_tokens("r1", "A/a0", [1, 2, 3])
            failed = await eb.wait("r1", timeout=10)
            assert isinstance(failed, ev.TransferFailed) and failed.code == ErrorCode.PEER_UNREACHABLE
            assert failed.transfer_id == 0 and failed.peer == "A/a0" and "token IDs not delivered" in failed.reason
            assert metric(b, "pddwire_fleet_sessions_closed_total", reason="dial_timeout") == 1
            await client.revoke(lease)
