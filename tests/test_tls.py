"""Mutual TLS between real in-process agents over real loopback sockets, with a throwaway PKI.

A (a1) always dials B (b1): ("A", "a1") sorts first. Where the dialer must be seen retrying, a
shaper (pdd_tools.shaper) sits in between and its accepted connections count A's dial attempts (bulk connections
are only dialed once a control handshake succeeded), so no test sleeps to wait for retries.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from structlog.testing import capture_logs

from conftest import fill_random, metric, same_bytes
from pdd_tools.shaper import Shaper
from pdd_wire import config as cfgmod
from pdd_wire.agent import Agent
from pdd_wire.engine import protocol as p
from pdd_wire.errors import ConfigError, ErrorCode
from support.agents import free_port, run_agents, two_site_toml, wait_links
from support.certs import make_pki

MiB = 1 << 20


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), ["a1", "b1"])


def tls_for(pki, *, a1=None, b1=None) -> dict:
    """two_site_toml's ``tls``: node -> (cert, key), and the (good) CA. A node given the rogue
    certificate trusts the rogue CA, as a rogue agent would (the agent refuses to start with a
    certificate its own tls.ca did not sign); the other node does not."""
    tls = {"a1": a1 or pki["a1"], "b1": b1 or pki["b1"], "ca": pki["ca"]}
    for node in ("a1", "b1"):
        if tls[node] == pki["rogue"]:
            tls[f"ca_{node}"] = pki["rogue_ca"]
    return tls


def errors_by_code(agent) -> dict[str, float]:
    """pddwire_errors_total of an agent, by code."""
    return {s.labels["code"]: s.value for fam in agent.metrics.registry.collect() if fam.name == "pddwire_errors"
            for s in fam.samples if s.name == "pddwire_errors_total"}


def errors_total(agent) -> float:
    return sum(errors_by_code(agent).values())


@contextlib.asynccontextmanager
async def agent(toml: str):
    a = Agent(cfgmod.loads(toml))
    try:
        await a.start()
        yield a
    finally:
        await a.shutdown(0)


async def refused_dials(a: Agent, relay: Shaper, attempts: int = 3, timeout: float = 10) -> None:
    """Wait until A has dialed B (through ``relay``) ``attempts`` times and been refused each
    time: the session never comes up and no bulk connection is ever opened."""
    sess = a.sessions["B/b1"]
    async with asyncio.timeout(timeout):
        # The (n+1)-th connection is dialed only after the n-th attempt has failed.
        while len(relay.connections) <= attempts:
            assert not sess.is_up and not sess.links, "the session came up with a refused certificate"
            await asyncio.sleep(0.01)
    assert not sess.is_up and not sess.links


def relayed(tmp, relay_port: int, ports: dict, tls: dict) -> dict:
    return two_site_toml(tmp, ports=ports, wan_override={"B": f"127.0.0.1:{relay_port}"}, tls=tls)


# ---------------------------------------------------------------------------------- working TLS
async def test_kv_and_tokens_over_mutual_tls_byte_identical(tmp_sock_dir, engines, pki):
    async with run_agents(two_site_toml(tmp_sock_dir, tls=tls_for(pki))) as ag:
        for me, peer, name in (("A", "B/b1", "b1"), ("B", "A/a1", "a1")):
            sess = ag[me].sessions[peer]
            ssl_obj = sess.control.transport.get_extra_info("ssl_object")
            assert ssl_obj is not None, f"{me}'s control connection is not TLS"
            assert ssl_obj.version() == "TLSv1.3"
            assert sess.control.peer_names == {name}  # the peer's verified certificate
            assert len(sess.links) == sess.streams == 4
            for link in sess.links.values():
                bulk_ssl = link.conn.transport.get_extra_info("ssl_object")
                assert bulk_ssl is not None, f"{me}'s bulk connection {link.stream} is not TLS"
                assert bulk_ssl.version() == "TLSv1.3"
                assert link.conn.peer_names == {name}

        ea = await engines.connect(tmp_sock_dir / "A.sock", "prefill")
        eb = await engines.connect(tmp_sock_dir / "B.sock", "decode")
        size = 64 * MiB
        src, dst = engines.memory(size), engines.memory(size)
        await fill_random(src)
        ra = await ea.register(src, block_bytes=MiB)
        rb = await eb.register(dst, block_bytes=MiB)
        await eb.post_recv("tls", [rb.blocks(0, 64)], from_site="A")
        await ea.send_kv("tls", [ra.blocks(0, 64)], to=["B"])
        got = await eb.wait("tls", timeout=60)
        assert isinstance(got, p.KvReceived) and got.bytes == size and got.peer == "A/a1", got
        sent = await ea.wait("tls", timeout=10)
        assert isinstance(sent, p.KvSent) and sent.bytes == size, sent
        assert await same_bytes(dst.buf, src.buf)

        await ea.send_tokens("tls", "B", [101, 7592, 2088])
        tok = await eb.wait_tokens("tls", timeout=10)
        assert tok.tokens == [101, 7592, 2088] and tok.seq == 0 and tok.peer == "A/a1"
        assert metric(ag["B"], "pddwire_bytes_total", peer="A/a1", lane="bulk", direction="rx") == size
        assert metric(ag["B"], "pddwire_checksum_failures_total", peer="A/a1") == 0
        assert errors_total(ag["A"]) == 0 and errors_total(ag["B"]) == 0


# ---------------------------------------------------------------------------------- rogue CA
async def test_peer_with_a_rogue_ca_certificate_never_comes_up_until_fixed(tmp_sock_dir, pki):
    """B presents a certificate from another CA: A's dialer refuses it, again and again; once B
    restarts with its good certificate, the session comes up."""
    ports = {"A": free_port(), "B": free_port()}
    async with Shaper(target=("127.0.0.1", ports["B"])) as relay:
        rogue = relayed(tmp_sock_dir, relay.port, ports, tls_for(pki, b1=pki["rogue"]))
        good = relayed(tmp_sock_dir, relay.port, ports, tls_for(pki))
        async with agent(good["A"]) as a:
            async with agent(rogue["B"]) as b:
                await refused_dials(a, relay, attempts=4)
                assert not b.sessions["A/a1"].is_up
                assert metric(a, "pddwire_peer_up", peer="B/b1") == 0
            async with agent(good["B"]) as b:  # same port, the good certificate
                await wait_links(a)
                await wait_links(b)
                assert a.sessions["B/b1"].control.transport.get_extra_info("ssl_object") is not None
                assert metric(a, "pddwire_peer_up", peer="B/b1") == 1


async def test_rogue_ca_refusals_are_counted_in_the_errors_metric(tmp_sock_dir, pki):
    """An operator must see in /metrics why a peer stays down: a certificate the CA did not sign
    is an error, not just 'peer not reachable'."""
    ports = {"A": free_port(), "B": free_port()}
    async with Shaper(target=("127.0.0.1", ports["B"])) as relay:
        tomls = relayed(tmp_sock_dir, relay.port, ports, tls_for(pki, b1=pki["rogue"]))
        async with agent(tomls["A"]) as a, agent(tomls["B"]):
            await refused_dials(a, relay, attempts=3)
            assert errors_total(a) >= 3, errors_by_code(a)


async def test_dialer_with_a_rogue_ca_certificate_is_refused_by_the_listener(tmp_sock_dir, pki):
    """The other direction: A's client certificate is from the rogue CA; B (CERT_REQUIRED)
    refuses the TLS handshake, so A never gets as far as HELLO."""
    ports = {"A": free_port(), "B": free_port()}
    async with Shaper(target=("127.0.0.1", ports["B"])) as relay:
        tomls = relayed(tmp_sock_dir, relay.port, ports, tls_for(pki, a1=pki["rogue"]))
        async with agent(tomls["A"]) as a, agent(tomls["B"]) as b:
            await refused_dials(a, relay, attempts=3)
            assert not b.sessions["A/a1"].is_up
            assert metric(b, "pddwire_peer_up", peer="A/a1") == 0


# ---------------------------------------------------------------------------------- wrong name
async def test_client_certificate_for_the_wrong_node_is_refused_with_identity_mismatch(tmp_sock_dir, pki):
    """A presents a valid certificate (good CA) that names b1, not a1: B's HELLO check refuses
    it with IDENTITY_MISMATCH and tells A so in an ERROR frame."""
    ports = {"A": free_port(), "B": free_port()}
    async with Shaper(target=("127.0.0.1", ports["B"])) as relay:
        tomls = relayed(tmp_sock_dir, relay.port, ports, tls_for(pki, a1=pki["b1"]))
        with capture_logs() as logs:
            async with agent(tomls["A"]) as a, agent(tomls["B"]) as b:
                await refused_dials(a, relay, attempts=3)
                assert metric(b, "pddwire_errors_total", code="IDENTITY_MISMATCH") >= 3
                assert metric(a, "pddwire_errors_total", code="IDENTITY_MISMATCH") >= 3
                assert not b.sessions["A/a1"].is_up
        refused = [e for e in logs if e["event"] == "handshake refused"]
        assert refused and all(e["code"] == "IDENTITY_MISMATCH" for e in refused), refused
        assert "'a1'" in refused[0]["error"]


async def test_identity_mismatch_refusal_is_not_counted_as_unknown_peer_by_the_dialer(tmp_sock_dir, pki):
    """B refused A with IDENTITY_MISMATCH; A is a configured peer of B, so A's own metrics and
    logs must not report UNKNOWN_PEER."""
    ports = {"A": free_port(), "B": free_port()}
    async with Shaper(target=("127.0.0.1", ports["B"])) as relay:
        tomls = relayed(tmp_sock_dir, relay.port, ports, tls_for(pki, a1=pki["b1"]))
        with capture_logs() as logs:
            async with agent(tomls["A"]) as a, agent(tomls["B"]) as b:
                await refused_dials(a, relay, attempts=3)
                assert metric(b, "pddwire_errors_total", code="UNKNOWN_PEER") == 0
                assert metric(a, "pddwire_errors_total", code="UNKNOWN_PEER") == 0, errors_by_code(a)
        dialer = [e for e in logs if e["event"] == "handshake refused"]
        assert dialer and all(e["code"] == "IDENTITY_MISMATCH" for e in dialer), dialer


async def test_server_certificate_for_the_wrong_node_is_refused(tmp_sock_dir, pki):
    """A expects b1, B presents a valid certificate (good CA) for a1: A's dialer refuses it."""
    ports = {"A": free_port(), "B": free_port()}
    async with Shaper(target=("127.0.0.1", ports["B"])) as relay:
        tomls = relayed(tmp_sock_dir, relay.port, ports, tls_for(pki, b1=pki["a1"]))
        async with agent(tomls["A"]) as a, agent(tomls["B"]) as b:
            await refused_dials(a, relay, attempts=4)
            assert not b.sessions["A/a1"].is_up


async def test_server_certificate_for_the_wrong_node_is_counted_as_identity_mismatch(tmp_sock_dir, pki):
    """The dialer-side name check: the chain is valid but names a1 where A expects b1."""
    ports = {"A": free_port(), "B": free_port()}
    async with Shaper(target=("127.0.0.1", ports["B"])) as relay:
        tomls = relayed(tmp_sock_dir, relay.port, ports, tls_for(pki, b1=pki["a1"]))
        async with agent(tomls["A"]) as a, agent(tomls["B"]):
            await refused_dials(a, relay, attempts=3)
            assert metric(a, "pddwire_errors_total", code="IDENTITY_MISMATCH") >= 3, errors_by_code(a)


async def test_server_name_lets_a_peer_certificate_carry_another_name(tmp_sock_dir, pki):
    """peers[].server_name: A accepts B's certificate for 'a1' when told to expect that name."""
    ports = {"A": free_port(), "B": free_port()}
    tomls = two_site_toml(tmp_sock_dir, ports=ports, tls=tls_for(pki, b1=pki["a1"]))
    tomls["A"] = tomls["A"].replace('node = "b1"\n', 'node = "b1"\nserver_name = "a1"\n', 1)
    assert 'server_name = "a1"' in tomls["A"]
    async with run_agents(tomls) as ag:
        assert ag["A"].sessions["B/b1"].control.peer_names == {"a1"}
        assert ag["A"].sessions["B/b1"].control.transport.get_extra_info("ssl_object") is not None


# ---------------------------------------------------------------------------------- plaintext
def test_plaintext_off_loopback_needs_allow_plaintext(tmp_sock_dir):
    text = two_site_toml(tmp_sock_dir)["A"].replace('wan = "127.0.0.1:', 'wan = "10.1.2.3:7000" #', 1)
    with pytest.raises(ConfigError) as ei:
        cfgmod.loads(text)
    assert ei.value.key == "listen.wan" and "tls.allow_plaintext" in str(ei.value)
    cfg = cfgmod.loads(text + "\n[tls]\nallow_plaintext = true\n")
    assert cfg.listen.wan == "10.1.2.3:7000" and cfg.tls.allow_plaintext and not cfg.tls.enabled

    peer_off = two_site_toml(tmp_sock_dir)["A"].replace('address = "127.0.0.1:', 'address = "192.0.2.9:7000" #', 1)
    with pytest.raises(ConfigError) as ei:
        cfgmod.loads(peer_off)
    assert ei.value.key == "peers[0].address" and "tls.allow_plaintext" in str(ei.value)

    # With TLS configured, a non-loopback address needs no opt-in (here: files must exist).
    with pytest.raises(ConfigError) as ei:
        cfgmod.loads(text + '\n[tls]\ncert = "/nonexistent/c.pem"\nkey = "/nonexistent/k.pem"\nca = "/x"\n')
    assert ei.value.key == "tls.cert"


async def test_allowed_plaintext_off_loopback_warns_at_start_and_works(tmp_sock_dir):
    """A listens on 0.0.0.0 (not loopback) in plaintext with tls.allow_plaintext = true: it
    starts, says so with a warning, and B (dialing it on 127.0.0.1) still pairs with it."""
    tomls = two_site_toml(tmp_sock_dir, plaintext=True)
    tomls["A"] = tomls["A"].replace('wan = "127.0.0.1:', 'wan = "0.0.0.0:', 1)
    with capture_logs() as logs:
        async with run_agents(tomls) as ag:
            assert ag["A"].wan_address[0] == "0.0.0.0"
            assert ag["A"].sessions["B/b1"].control.transport.get_extra_info("ssl_object") is None
    warnings = [e for e in logs if e["log_level"] == "warning" and "PLAINTEXT" in e["event"]]
    assert sorted(w["site"] for w in warnings) == ["A", "B"], logs


async def test_a_refused_handshake_releases_its_connection_at_once(tmp_sock_dir, pki):
    """A HELLO refused under TLS (here: a node no agent lists, with a good certificate) is
    answered with ERROR and closed; once closed, nothing holds its connection. fail()'s bound on
    a peer that does not read (abort after 1 s) held the protocol, its TLS transport and buffers
    (~300 KB) for that second: a flood of refusals (every fleet knock is one) grew the agent by
    ~110 KB each."""
    import gc
    import ssl

    from pdd_wire.transport.tcp import KIND_CONTROL, FrameProtocol, preamble
    from pdd_wire.wire import FrameType
    from pdd_wire.wire import messages as m
    from support.raw_peer import RawPeer

    tomls = two_site_toml(tmp_sock_dir, tls=tls_for(pki))
    ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    ctx.load_cert_chain(*map(str, pki["a1"]))
    async with agent(tomls["B"]) as b:
        for i in range(40):
            r, w = await asyncio.open_connection("127.0.0.1", b.wan_address[1])
            w.write(preamble(KIND_CONTROL))
            await w.start_tls(ctx, server_hostname="b1")
            peer = RawPeer(r, w)
            peer.send(FrameType.HELLO, m.Hello(versions=[1], site="A", node=f"x{i}", incarnation=5))
            got = await peer.until_closed()
            assert [(t, x.code) for t, x in got] == [(FrameType.ERROR, ErrorCode.UNKNOWN_PEER)], got
            peer.close()
        await asyncio.sleep(0.1)  # well within the second the old bound held each one
        gc.collect()
        alive = [o for o in gc.get_objects() if isinstance(o, FrameProtocol) and o.closed]
        assert len(alive) <= 2, f"{len(alive)} closed connections still held"
