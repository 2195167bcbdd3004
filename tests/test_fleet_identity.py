"""What etcd says about a member never replaces the handshake's proof: real etcd (one member),
real agents with mutual TLS from a throwaway PKI (tests/support/certs.py), and raw HELLOs
written from proto/ alone.

* a record can name no other certificate name than its node: an etcd writer holding b2's key
  pair cannot pass an agent calling itself b1 off as b1, at the dialer or the listener;
* the listener checks the registered fingerprint (check 4a), and the names and the fingerprint
  before it opens a session or dials anyone (a HELLO naming listed members opens nothing);
* a HELLO naming a member etcd does not have costs at most one etcd read per name and second;
  while etcd is away, no member not already known is admitted;
* a static ``peers[].fingerprint`` pins the certificate;
* records that are not valid (a bad address, fingerprint, engine URL) are ignored and counted.
"""

from __future__ import annotations

import asyncio
import io
import os
import ssl
import time

import msgspec
import pytest

from conftest import Engines, metric, until
from pdd_wire import log
from pdd_wire.engine import protocol as ev
from pdd_wire.errors import EngineRequestError, ErrorCode
from pdd_wire.fleet.record import encode, member_key
from pdd_wire.pki import cert_fingerprint
from pdd_wire.transport.tcp import KIND_CONTROL, preamble
from pdd_wire.wire import FrameType
from pdd_wire.wire import messages as m
from support.agents import free_port, running
from support.certs import make_pki
from support.fleet import etcd_client
from support.raw_peer import RawPeer

MiB = 1 << 20
@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), ["a1", "b1", "b2", "b3", "x9"])


def toml(tmp, pki, site: str, node: str, *, etcd=None, cluster: str = "", cert: str | None = None,
         peers: list[tuple[str, str, int]] = (), port: int | None = None, fleet: str = "") -> str:
    """An agent in TLS mode files (the PKI's certificate of ``cert``, default its node); with
    ``etcd`` a fleet member, else only its static ``peers`` (site, node, port)."""
    c, k = pki[cert or node]
    out = f"""
site = "{site}"
node = "{node}"
[listen]
wan = "127.0.0.1:{port or free_port()}"
admin = ""
engine_socket = "{tmp}/{node}-{os.urandom(3).hex()}.sock"
[timeouts]
heartbeat_s = 0.2
dead_after_s = 1.5
reconnect_max_backoff_s = 0.2
[tls]
cert = "{c}"
key = "{k}"
ca = "{pki['ca']}"
"""
    for ps, pn, pp in peers:
        out += f'[[peers]]\nsite = "{ps}"\nnode = "{pn}"\naddress = "127.0.0.1:{pp}"\n'
    if etcd is not None:
        eps = ", ".join(f'"{e}"' for e in etcd.endpoints)
        out += f'[fleet]\netcd = [{eps}]\ncluster = "{cluster}"\nlease_ttl_s = 2\ndial_wait_s = 1.5\n{fleet}\n'
    return out



async def tls_hello(port: int, pki, cert: str, site: str, node: str, server_name: str) -> RawPeer:
    """A control connection in mutual TLS with the PKI's certificate of ``cert``, and a HELLO
    naming ``site/node``."""
    ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    ctx.load_cert_chain(*map(str, pki[cert]))
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(preamble(KIND_CONTROL))
    await w.drain()
    await w.start_tls(ctx, server_hostname=server_name)
    peer = RawPeer(r, w)
    peer.send(FrameType.HELLO, m.Hello(versions=[1], site=site, node=node, incarnation=99,
                                       capabilities=["kv.v1", "tokens.v1", "fleet.v1"]))
    return peer


async def refusal(peer: RawPeer) -> int | None:
    """The ERROR code the agent answered the HELLO with (None: it closed without one)."""
    frames = await peer.until_closed()
    peer.close()
    return next((body.code for t, body in frames if t == FrameType.ERROR), None)


async def test_a_record_cannot_name_another_certificate(tmp_sock_dir, pki, etcd, cluster_name):
    """An etcd writer holding b2's key pair rewrites b1's record (server_name b2, b2's
    fingerprint, the address of an impostor that calls itself B/b1 with b2's certificate): a1
    (which dials B/b1) and b3 (which B/b1 dials) both refuse the impostor."""
    a1_port, b3_port = free_port(), free_port()
    async with running(toml(tmp_sock_dir, pki, "A", "a1", etcd=etcd, cluster=cluster_name, port=a1_port),
                       toml(tmp_sock_dir, pki, "B", "b3", etcd=etcd, cluster=cluster_name, port=b3_port),
                       toml(tmp_sock_dir, pki, "B", "b1", etcd=etcd, cluster=cluster_name)) as (a1, b3, b1):
        impostor_port = free_port()
        forged = msgspec.to_builtins(msgspec.structs.replace(b1.membership.me, wan=f"127.0.0.1:{impostor_port}",
                                                             fingerprint=cert_fingerprint(str(pki["b2"][0]))))
        forged["server_name"] = "b2"  # what the old record format let a writer say
        await b1.shutdown(0)
        async with etcd_client(etcd) as client:
            lease = await client.grant(30)
            await client.put(member_key(cluster_name, "B", "b1"), msgspec.json.encode(forged), lease=lease)
            await until(lambda: "B/b1" in a1.membership.members and
                        a1.membership.members["B/b1"].wan.endswith(str(impostor_port)), 5, "the forged record")
            await until(lambda: "B/b1" in b3.membership.members and
                        b3.membership.members["B/b1"].wan.endswith(str(impostor_port)), 5, "b3 has it too")
            impostor = toml(tmp_sock_dir, pki, "B", "b1", cert="b2", port=impostor_port,
                            peers=[("A", "a1", a1_port), ("B", "b3", b3_port)])
            async with running(impostor) as (imp,):
                engines = Engines()
                try:
                    ea = await engines.connect(a1.config.listen.engine_socket, "p")
                    kv = await ea.register(engines.memory(MiB), block_bytes=MiB)
                    await ea.send_kv("r1", [kv.blocks(0, 1)], to=["B/b1"], deadline_s=20)
                    failed = await ea.wait("r1", timeout=10)  # fleet.dial_wait_s: TLS never names b1
                    assert isinstance(failed, ev.TransferFailed) and failed.code == ErrorCode.PEER_UNREACHABLE
                finally:
                    await engines.close()
                # the impostor dials b3 as B/b1 with a certificate naming b2: refused before etcd is asked
                await until(lambda: metric(b3, "pddwire_fleet_admissions_total", outcome="identity_mismatch") >= 1,
                            5, "b3 refused the impostor")
                assert b3.peers.get("B/b1") is None and metric(b3, "pddwire_fleet_admissions_total",
                                                               outcome="admitted") == 0
                assert not imp.peers.get("A/a1").is_up and not imp.peers.get("B/b3").is_up
            await client.revoke(lease)


async def test_listener_checks_the_registered_fingerprint(tmp_sock_dir, pki, etcd, cluster_name):
    """b1's record names b2's fingerprint; b1 (presenting its own, valid certificate naming b1)
    dials b3: b3 refuses it IDENTITY_MISMATCH (check 4a at the listener) and opens no session."""
    async with running(toml(tmp_sock_dir, pki, "B", "b1", etcd=etcd, cluster=cluster_name),
                       toml(tmp_sock_dir, pki, "B", "b3", etcd=etcd, cluster=cluster_name)) as (b1, b3):
        await until(lambda: "B/b1" in b3.membership.members and "B/b3" in b1.membership.members, 5, "listed")
        forged = msgspec.structs.replace(b1.membership.me, fingerprint=cert_fingerprint(str(pki["b2"][0])),
                                         incarnation=b1.incarnation % 1000 + 1)  # another process's
        async with etcd_client(etcd) as client:
            lease = await client.grant(30)  # another lease: b1 waits for it (its own or none: b1 writes it back)
            await client.put(member_key(cluster_name, "B", "b1"), encode(forged), lease=lease)
            await until(lambda: b3.membership.members["B/b1"].fingerprint == forged.fingerprint, 5,
                        "the forged record")
            engines = Engines()
            try:
                e1 = await engines.connect(b1.config.listen.engine_socket, "p")
                kv = await e1.register(engines.memory(MiB), block_bytes=MiB)
                await e1.send_kv("r1", [kv.blocks(0, 1)], to=["B/b3"], deadline_s=20)
                failed = await e1.wait("r1", timeout=10)
                assert isinstance(failed, ev.TransferFailed) and failed.code == ErrorCode.PEER_UNREACHABLE
            finally:
                await engines.close()
            assert metric(b3, "pddwire_fleet_admissions_total", outcome="identity_mismatch") >= 1
            assert metric(b3, "pddwire_errors_total", code="IDENTITY_MISMATCH") >= 1
            assert b3.peers.get("B/b1") is None and metric(b3, "pddwire_fleet_lazy_sessions_total", how="dial") == 0
            await client.revoke(lease)


async def test_hellos_naming_listed_members_open_nothing(tmp_sock_dir, pki, etcd, cluster_name):
    """Whoever holds a certificate of the CA (x9's) sends HELLOs naming each listed member to a1,
    which dials them all: a1 refuses each IDENTITY_MISMATCH, opens no session and dials no one.
    HELLOs naming a member etcd does not have (B/x9, which the certificate does name) cost at most
    one etcd read per second."""
    async with running(toml(tmp_sock_dir, pki, "A", "a1", etcd=etcd, cluster=cluster_name),
                       toml(tmp_sock_dir, pki, "B", "b1", etcd=etcd, cluster=cluster_name),
                       toml(tmp_sock_dir, pki, "B", "b2", etcd=etcd, cluster=cluster_name)) as (a1, b1, b2):
        await until(lambda: len(a1.membership.members) == 2, 5, "a1 lists b1 and b2")
        port = a1.wan_address[1]
        for node in ("b1", "b2"):
            assert await refusal(await tls_hello(port, pki, "x9", "B", node, "a1")) == ErrorCode.IDENTITY_MISMATCH
        assert len(a1.peers) == 0 and metric(a1, "pddwire_fleet_lazy_sessions_total", how="dial") == 0
        assert metric(b1, "pddwire_fleet_admissions_total", outcome="admitted") == 0  # nobody was dialed
        t0 = time.monotonic()
        for _ in range(10):
            assert await refusal(await tls_hello(port, pki, "x9", "B", "x9", "a1")) == ErrorCode.UNKNOWN_PEER
        reads = metric(a1, "pddwire_fleet_etcd_requests_total", kind="get")
        assert 1 <= reads <= 1 + (time.monotonic() - t0), reads
        assert metric(a1, "pddwire_fleet_admissions_total", outcome="unknown") == 10
        # Nor does a name etcd has under a record no reader may use (not JSON).
        async with etcd_client(etcd) as client:
            await client.put(member_key(cluster_name, "C", "x9"), b"{not a record")
            t0, before = time.monotonic(), metric(a1, "pddwire_fleet_etcd_requests_total", kind="get")
            for _ in range(10):
                assert await refusal(await tls_hello(port, pki, "x9", "C", "x9", "a1")) == ErrorCode.UNKNOWN_PEER
            reads = metric(a1, "pddwire_fleet_etcd_requests_total", kind="get") - before
            assert 1 <= reads <= 1 + (time.monotonic() - t0), reads


async def test_one_certificate_backs_one_session(tmp_sock_dir, pki, etcd, cluster_name):
    """x9's key registered under two names (the certificate binds the node, not the site): its
    HELLO as 0a/x9 opens a session, as 0b/x9 meanwhile is refused IDENTITY_MISMATCH (one key
    would otherwise take a session, and its connections, under every name it registers). Once
    the first is down, the other name is admitted. (0a, 0b sort before A: x9 dials, a1 adopts.)"""
    from pdd_wire.fleet.record import MemberRecord

    async with running(toml(tmp_sock_dir, pki, "A", "a1", etcd=etcd, cluster=cluster_name)) as (a1,), \
            etcd_client(etcd) as client:
        fp = cert_fingerprint(str(pki["x9"][0]))
        for site in ("0a", "0b"):
            record = MemberRecord(site=site, node="x9", incarnation=5, wan=f"127.0.0.1:{free_port()}", fingerprint=fp)
            await client.put(member_key(cluster_name, site, "x9"), encode(record))
        await until(lambda: {"0a/x9", "0b/x9"} <= set(a1.membership.members), 5, "both listed")
        port = a1.wan_address[1]
        first = await tls_hello(port, pki, "x9", "0a", "x9", "a1")
        t, welcome, _ = await first.next()
        assert t == FrameType.WELCOME, welcome
        second = await tls_hello(port, pki, "x9", "0b", "x9", "a1")
        frames = await second.until_closed()
        second.close()
        assert [(t, b.code) for t, b in frames] == [(FrameType.ERROR, ErrorCode.IDENTITY_MISMATCH)], frames
        assert "one certificate" in frames[0][1].message and "0a/x9" in frames[0][1].message
        assert metric(a1, "pddwire_fleet_admissions_total", outcome="certificate_in_use") == 1
        first.close()
        await until(lambda: not a1.peers.get("0a/x9").is_up, 5, "the first session down")
        third = await tls_hello(port, pki, "x9", "0b", "x9", "a1")
        t, welcome, _ = await third.next()
        assert t == FrameType.WELCOME, welcome
        third.close()


async def test_tokens_to_a_member_whose_connection_dropped_end_after_peer_give_up_s(tmp_sock_dir, pki, etcd,
                                                                                     cluster_name):
    """x9 (0a/x9 sorts before A: x9 dials a1) comes up, then its connection drops and it does not
    dial again; its record stays listed, at an address nobody answers. Token IDs a1's engine
    relays to it meanwhile fail PEER_UNREACHABLE once timeouts.peer_give_up_s (3 s here) has
    passed, as with a static peer, rather than waiting behind knocks for ever."""
    from pdd_wire.fleet.record import MemberRecord

    a1_toml = toml(tmp_sock_dir, pki, "A", "a1", etcd=etcd, cluster=cluster_name).replace(
        "dead_after_s = 1.5", "dead_after_s = 1.5\npeer_give_up_s = 3")
    async with running(a1_toml) as (a1,), etcd_client(etcd) as client:
        record = MemberRecord(site="0a", node="x9", incarnation=5, wan=f"127.0.0.1:{free_port()}",
                              fingerprint=cert_fingerprint(str(pki["x9"][0])))
        await client.put(member_key(cluster_name, "0a", "x9"), encode(record))
        await until(lambda: "0a/x9" in a1.membership.members, 5, "listed")
        x9 = await tls_hello(a1.wan_address[1], pki, "x9", "0a", "x9", "a1")
        assert (await x9.next())[0] == FrameType.WELCOME
        await until(lambda: a1.peers.get("0a/x9") is not None and a1.peers.get("0a/x9").is_up, 5, "up")
        x9.close()
        await until(lambda: not a1.peers.get("0a/x9").is_up, 5, "down")
        engines = Engines()
        try:
            e = await engines.connect(a1.config.listen.engine_socket, "rld")
            await e.send_tokens("r1", "0a/x9", [1, 2, 3])
            failed = await e.wait("r1", timeout=10)
            assert isinstance(failed, ev.TransferFailed) and failed.code == ErrorCode.PEER_UNREACHABLE, failed
            assert "timeouts.peer_give_up_s" in failed.reason
            assert metric(a1, "pddwire_fleet_sessions_closed_total", reason="unreachable") == 1
        finally:
            await engines.close()


async def test_no_new_member_is_admitted_while_etcd_is_away(tmp_sock_dir, pki, etcd, cluster_name):
    async with running(toml(tmp_sock_dir, pki, "A", "a1", etcd=etcd, cluster=cluster_name,
                            fleet="request_s = 0.5")) as (a1,):
        await until(lambda: a1.membership.registered.is_set(), 5, "registered")
        await asyncio.to_thread(etcd.stop)
        try:
            await until(lambda: not a1.membership.up, 10, "a1 sees etcd away")
            code = await refusal(await tls_hello(a1.wan_address[1], pki, "x9", "B", "x9", "a1"))
            assert code == ErrorCode.UNKNOWN_PEER
            assert metric(a1, "pddwire_fleet_admissions_total", outcome="refused_etcd_away") == 1
        finally:
            await etcd.start()


async def test_a_static_peer_fingerprint_pins_its_certificate(tmp_sock_dir, pki):
    """peers[].fingerprint (no fleet): a1 pinning b2's certificate for b1 refuses b1's (valid,
    naming b1) at the dialer; pinning b1's own, the session comes up."""
    b1_port = free_port()
    b1 = toml(tmp_sock_dir, pki, "B", "b1", port=b1_port, peers=[("A", "a1", free_port())])

    def a1(fingerprint: str) -> str:
        return toml(tmp_sock_dir, pki, "A", "a1", peers=[("B", "b1", b1_port)]) + \
            f'fingerprint = "{fingerprint}"\n'

    async with running(a1(cert_fingerprint(str(pki["b2"][0]))), b1) as (a, b):
        await until(lambda: metric(a, "pddwire_errors_total", code="IDENTITY_MISMATCH") >= 1, 5, "refused")
        assert not a.peers.get("B/b1").is_up
    async with running(a1(cert_fingerprint(str(pki["b1"][0]))), b1) as (a, b):
        await until(lambda: a.peers.get("B/b1").is_up, 5, "up with the pinned certificate")


async def test_records_that_are_not_valid_are_ignored(tmp_sock_dir, pki, etcd, cluster_name):
    """Records under the prefix with a bad address, fingerprint or engine URL are ignored and
    counted; an engine naming one gets UNKNOWN_PEER_SITE; the agent goes on."""
    async with running(toml(tmp_sock_dir, pki, "A", "a1", etcd=etcd, cluster=cluster_name)) as (a1,):
        await a1.membership.listed.wait()
        good = {"site": "B", "node": "bx", "incarnation": 3, "wan": "127.0.0.1:7601",
                "fingerprint": cert_fingerprint(str(pki["b1"][0]))}
        bad = {"b4": {"wan": "nowhere"}, "b5": {"fingerprint": "md5:00"}, "b6": {"incarnation": 0},
               "b7": {"engines": [{"role": "P", "url": "file:///etc/passwd"}]}, "b8": {"transport": "rdma"}}
        async with etcd_client(etcd) as client:
            for node, change in bad.items():
                rec = good | {"node": node} | change
                await client.put(member_key(cluster_name, "B", node), msgspec.json.encode(rec))
            await until(lambda: metric(a1, "pddwire_fleet_records_ignored_total", reason="invalid") >= len(bad), 5,
                        "every bad record counted")
            assert not a1.membership.members
            engines = Engines()
            try:
                ea = await engines.connect(a1.config.listen.engine_socket, "p")
                with pytest.raises(EngineRequestError) as exc:
                    await ea.send_kv("r1", [], to=["B/b4"])
                assert exc.value.code == ErrorCode.UNKNOWN_PEER_SITE
            finally:
                await engines.close()
            await client.put(member_key(cluster_name, "B", "bx"), msgspec.json.encode(good))
            await until(lambda: "B/bx" in a1.membership.members, 5, "a valid record after them is used")
            for node in [*bad, "bx"]:
                await client.delete(member_key(cluster_name, "B", node))


async def test_knocks_cannot_make_an_agent_hammer_a_records_address(tmp_sock_dir, pki, etcd, cluster_name):
    """A member's record names the address dialed back (here a listener of the test's: a third
    party). Knocks as fast as one member can send them make b1 dial it at most one attempt per
    0.25 s (the backoff is cut short, not removed), and log the knock once, not per knock."""
    from pdd_wire.fleet.record import MemberRecord

    hits: list[float] = []

    async def third_party(r, w):
        hits.append(time.monotonic())
        w.close()

    srv = await asyncio.start_server(third_party, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    lines = io.StringIO()
    log.configure("info", "json", stream=lines)  # before the agent binds its loggers
    try:
        async with running(toml(tmp_sock_dir, pki, "B", "b1", etcd=etcd, cluster=cluster_name)) as (b1,):
            record = MemberRecord(site="Z", node="x9", incarnation=5, wan=f"127.0.0.1:{port}",
                                  fingerprint=cert_fingerprint(str(pki["x9"][0])))
            async with etcd_client(etcd) as client:
                await client.put(member_key(cluster_name, "Z", "x9"), encode(record))
                await until(lambda: "Z/x9" in b1.membership.members, 5, "x9 listed")
                t0, knocks = time.monotonic(), 0
                while time.monotonic() - t0 < 1.5:
                    assert await refusal(await tls_hello(b1.wan_address[1], pki, "x9", "Z", "x9", "b1")) == \
                        ErrorCode.DIAL_BACK
                    knocks += 1
                elapsed = time.monotonic() - t0
                dials = len([h for h in hits if h <= t0 + elapsed])
                assert knocks > 20 and dials <= 2 + elapsed / 0.25, (knocks, dials, elapsed)
        assert lines.getvalue().count("knocked: dialing back") == 1
    finally:
        log.configure(os.environ.get("PDD_TEST_LOG", "warning"), "console")
        srv.close()
