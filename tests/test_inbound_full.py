"""A listener whose ``limits.max_peer_connections`` authenticated connections are open says so on
the wire (proto/handshake.md §2, proto/errors.md 207 TOO_MANY_CONNECTIONS): the next HELLO and
the next BULK_HELLO are answered ERROR TOO_MANY_CONNECTIONS, then closed; the sessions it holds
go on. The dialer names the peer's limit in its log (once per 30 s, not a certificate problem)
and keeps dialing, at its longest backoff, until there is room.

It used to close such a connection without a frame, and the dialer's log then suggested a
refused certificate."""

from __future__ import annotations

import asyncio
import io
import json
import os

from conftest import Engines, metric, until
from pdd_wire import config as cfgmod
from pdd_wire.agent import Agent
from pdd_wire.transport.tcp import KIND_BULK, KIND_CONTROL
from pdd_wire.wire import FrameType
from pdd_wire.wire import messages as m
from support.agents import cluster_toml, run_agents, running, two_site_toml
from support.certs import make_pki
from support.raw_peer import RawPeer, hello
from test_fleet_identity import tls_hello, toml

LIMITS = "[limits]\nmax_peer_connections = {n}\n"
TOO_MANY_CONNECTIONS = 207  # proto/errors.md (the number, as a peer written from proto/ knows it)


def lines(out: io.StringIO, event: str, **fields) -> list[dict]:
    found = []
    for ln in out.getvalue().splitlines():
        if ln.startswith("{"):
            d = json.loads(ln)
            if event in d.get("event", "") and all(d.get(k) == v for k, v in fields.items()):
                found.append(d)
    return found


async def bulk_hello(port: int, session: int, stream: int, node: str = "a2") -> RawPeer:
    peer = await RawPeer.dial(port, KIND_BULK)
    peer.send(FrameType.BULK_HELLO, m.BulkHello(session=session, stream=stream, site="A", node=node))
    return peer


async def test_a_full_listener_answers_hello_and_bulk_hello_with_too_many_connections(tmp_sock_dir):
    """B (limit 4) holds A/a1's session (control and one bulk connection) and a raw A/a2's
    (control and one bulk): the next HELLO (A/a3's) and BULK_HELLO get ERROR TOO_MANY_CONNECTIONS
    (207) naming the limit, then the close; A/a1's session is untouched. A HELLO that replaces
    A/a2's live control connection is taken (the old one's place comes back as it closes); once
    A/a2 goes, A/a3 is welcomed."""
    tomls = two_site_toml(tmp_sock_dir, plaintext=True, streams=1)  # plaintext: the raw peer can speak
    tomls["B"] += LIMITS.format(n=4) + "".join(
        f'[[peers]]\nsite = "A"\nnode = "{n}"\naddress = "127.0.0.1:9"\nstreams = 1\n' for n in ("a2", "a3"))
    async with run_agents(tomls, wait_up=False) as ag:
        a, b = ag["A"], ag["B"]
        port = b.wan_address[1]
        await until(lambda: b.sessions["A/a1"].is_up and len(b.sessions["A/a1"].links) == 1, 20, "A/a1 up")
        a2, welcome = await hello(port, node="a2")  # connection 3 (its place is taken before WELCOME)
        a2_bulk = await bulk_hello(port, welcome.session, 0)
        t, _, _ = await a2_bulk.next()
        assert t == FrameType.BULK_WELCOME  # connection 4: the room is full

        refused = await RawPeer.dial(port, KIND_CONTROL)
        refused.send(FrameType.HELLO, m.Hello(versions=[1], site="A", node="a3", incarnation=78))
        got = await refused.until_closed()
        assert [(t, x.code) for t, x in got] == [(FrameType.ERROR, TOO_MANY_CONNECTIONS)], got
        assert "limits.max_peer_connections (4)" in got[0][1].message and "B/b1" in got[0][1].message
        refused.close()

        refused_bulk = await bulk_hello(port, welcome.session, 0)
        got = await refused_bulk.until_closed()
        assert [(t, x.code) for t, x in got] == [(FrameType.ERROR, TOO_MANY_CONNECTIONS)], got
        refused_bulk.close()
        assert metric(b, "pddwire_errors_total", code="TOO_MANY_CONNECTIONS") == 2

        # What B holds goes on: A/a1's session (no reconnect), A/a2's control and bulk connections.
        assert await a.sessions["B/b1"].ping(timeout=5) is not None
        assert b.sessions["A/a1"].is_up and len(b.sessions["A/a1"].links) == 1
        assert metric(b, "pddwire_reconnects_total", peer="A/a1") == 0
        assert await a2.pong(4) and b.sessions["A/a2"].is_up and len(b.sessions["A/a2"].links) == 1

        # A/a2 reconnects while the room is full: its new control connection replaces the old one
        # (which B aborts, with its bulk connection), so it is taken, not refused.
        again, _ = await hello(port, node="a2")
        assert await again.pong(5)
        await a2_bulk.until_closed()  # B aborted them: they end
        await a2.until_closed()
        await until(lambda: b.inbound.room.taken == 3, 10, "the replaced connections' places back")
        assert metric(b, "pddwire_errors_total", code="TOO_MANY_CONNECTIONS") == 2
        a2_bulk.close()
        a2.close()

        # A/a2 goes: its place comes back, and A/a3 is welcomed.
        again.close()
        await until(lambda: not b.sessions["A/a2"].is_up, 10, "a2 gone")
        a3, _ = await hello(port, node="a3")
        assert await a3.pong(5)
        a3.close()


async def test_the_dialer_names_the_peers_limit_and_dials_until_there_is_room(tmp_sock_dir, info_logs):
    """Real agents, default authentication: b1 (limit 2) holds a2's session (control and one bulk
    connection). a1 is refused at every attempt: its log names the peer's
    limits.max_peer_connections once, nothing about certificates, and it keeps dialing; when a2
    stops, a1's session comes up."""
    tomls = cluster_toml(tmp_sock_dir, [("A", "a1"), ("A", "a2"), ("B", "b1")], streams=1)
    tomls["b1"] += LIMITS.format(n=2)
    async with running(tomls["b1"]) as (b1,), running(tomls["a2"]) as (a2,):
        await until(lambda: b1.sessions["A/a2"].is_up and len(b1.sessions["A/a2"].links) == 1, 20, "a2 in")
        async with running(tomls["a1"]) as (a1,):
            await until(lambda: metric(a1, "pddwire_errors_total", code="TOO_MANY_CONNECTIONS") >= 3, 30,
                        "a1 refused three times")
            # b1 said at start that its static peers can open more than the limit holds
            warned = lines(info_logs, "limits.max_peer_connections is below what the peers that dial this agent open")
            assert [(w["max_peer_connections"], w["needed"]) for w in warned] == [(2, 4)], warned
            named = lines(info_logs, "peer at its connection limit", peer="B/b1")
            assert len(named) == 1, named  # once per 30 s, however often it is refused
            assert "limits.max_peer_connections (2)" in named[0]["error"] and named[0]["level"] == "warning"
            about_b1 = [ln for ln in info_logs.getvalue().splitlines() if '"peer": "B/b1"' in ln]
            assert not [ln for ln in about_b1 if "certificate" in ln], "a full listener is no certificate problem"
            assert not lines(info_logs, "handshake refused", peer="B/b1")
            assert not a1.sessions["B/b1"].is_up and b1.sessions["A/a2"].is_up
            await a2.shutdown(0)
            await until(lambda: a1.sessions["B/b1"].is_up and len(a1.sessions["B/b1"].links) == 1, 30,
                        "a1 in once a2 left")


async def test_a_bulk_connection_over_the_limit_is_refused_by_name_at_the_dialer(tmp_sock_dir, info_logs):
    """b1 (limit 2) takes a1's control connection and one of its two bulk connections: the other
    is refused TOO_MANY_CONNECTIONS, which a1 logs naming the peer's limit (once), and the session
    runs on the one stream it has."""
    tomls = cluster_toml(tmp_sock_dir, [("A", "a1"), ("B", "b1")], streams=2)
    tomls["b1"] += LIMITS.format(n=2)
    async with running(tomls["b1"], tomls["a1"]) as (b1, a1):
        await until(lambda: metric(a1, "pddwire_errors_total", code="TOO_MANY_CONNECTIONS") >= 2, 30,
                    "a bulk connection refused twice")
        named = lines(info_logs, "bulk connection refused", peer="B/b1")
        assert len(named) == 1 and "limits.max_peer_connections (2)" in named[0]["error"], named
        s = a1.sessions["B/b1"]
        assert s.is_up and len(s.links) == 1
        assert await s.ping(timeout=5) is not None


async def test_a_knock_into_a_full_listener_is_answered_dial_back(tmp_sock_dir, tmp_path, etcd):
    """Fleet members a1 (limit 1, its one place held by a static peer's session) and b1, which
    needs a session with a1 but sorts higher: its knock (a HELLO) takes no place at a1 (a1
    answers DIAL_BACK and dials, which costs it none), so it is not refused 207: the session
    opens and b1's tokens reach a1's engine. (Refused, b1 knocked until fleet.dial_wait_s and
    gave the session up: dial_timeout.)"""
    pki = make_pki(tmp_path / "pki", ["a0", "a1", "b1"])
    cluster = f"knock{os.getpid()}"
    a1 = Agent(cfgmod.loads(toml(tmp_sock_dir, pki, "A", "a1", etcd=etcd, cluster=cluster, peers=[("A", "a0", 9)])
                            + LIMITS.format(n=1)))
    b1 = Agent(cfgmod.loads(toml(tmp_sock_dir, pki, "B", "b1", etcd=etcd, cluster=cluster)))
    engines = Engines()
    try:
        await a1.start()
        await b1.start()
        await until(lambda: "B/b1" in a1.membership.members and "A/a1" in b1.membership.members, 10, "membership")
        a0 = await tls_hello(a1.wan_address[1], pki, "a0", "A", "a0", "a1")  # the one place
        alive = asyncio.create_task(a0.keepalive())  # (a1 finds a silent peer gone after 1.5 s)
        await until(lambda: a1.sessions["A/a0"].is_up and a1.inbound.room.taken == 1, 10, "a0's session up")
        ea = await engines.connect(a1.config.listen.engine_socket, "md")
        eb = await engines.connect(b1.config.listen.engine_socket, "rld")
        await ea.expect_tokens("r1", from_site="B")
        assert await eb.send_tokens("r1", "A/a1", [1, 2]) == 0
        got = await ea.wait_tokens("r1", timeout=20)
        assert (got.seq, got.tokens) == (0, [1, 2])
        assert metric(b1, "pddwire_fleet_lazy_sessions_total", how="knock") == 1
        assert metric(a1, "pddwire_errors_total", code="TOO_MANY_CONNECTIONS") == 0
        assert metric(b1, "pddwire_fleet_sessions_closed_total", reason="dial_timeout") == 0
        assert a1.sessions["A/a0"].is_up and a1.inbound.room.taken == 1
        alive.cancel()
        a0.close()
    finally:
        for c in engines.clients:
            await c.close()
        await b1.shutdown(0)
        await a1.shutdown(0)



async def test_a_full_listener_checks_no_more_than_max_handshakes_knocks_at_once(tmp_sock_dir):
    """With the room full, a knock (a HELLO from a peer that sorts higher) still goes through
    admission, which may read etcd (here slowed to 2 s, injected); those connections hold no
    place, so at most limits.max_handshakes (4) are checked at once and the rest are answered
    207 at once. A HELLO that is neither a knock nor a replacement (a stranger that sorts lower)
    is answered 207 before any check."""
    tomls = two_site_toml(tmp_sock_dir, plaintext=True, streams=1)
    tomls["B"] += LIMITS.format(n=1) + "max_handshakes = 4\n" + (
        '[[peers]]\nsite = "A"\nnode = "a0"\naddress = "127.0.0.1:9"\nstreams = 1\n')
    async with run_agents(tomls, sites=("B",), wait_up=False) as ag:
        b = ag["B"]
        port = b.wan_address[1]
        checking, peak = 0, 0

        async def slow_admission(site, node, names, fingerprint):
            nonlocal checking, peak
            checking += 1
            peak = max(peak, checking)
            try:
                await asyncio.sleep(2)
            finally:
                checking -= 1

        b.inbound.admit = slow_admission  # a fleet's admission, its etcd read slow
        a0, _ = await hello(port, node="a0")  # the one place
        alive = asyncio.create_task(a0.keepalive())
        await until(lambda: b.inbound.room.taken == 1, 10, "a0 in")
        stranger = await RawPeer.dial(port, KIND_CONTROL)
        stranger.send(FrameType.HELLO, m.Hello(versions=[1], site="A", node="zz", incarnation=1))
        full = [(FrameType.ERROR, TOO_MANY_CONNECTIONS)]
        assert [(t, getattr(x, "code", None)) for t, x in await stranger.until_closed()] == full
        assert peak == 0  # answered before any check
        knocks = []
        for i in range(12):
            k = await RawPeer.dial(port, KIND_CONTROL)
            k.send(FrameType.HELLO, m.Hello(versions=[1], site="C", node=f"c{i}", incarnation=1))
            knocks.append(k)
        answers = [[(t, getattr(x, "code", None)) for t, x in await k.until_closed()] for k in knocks]
        assert 1 <= peak <= 4
        assert answers.count(full) >= 12 - 4, answers
        assert b.inbound.room.taken == 1 and b.sessions["A/a0"].is_up
        alive.cancel()
        for p in [a0, stranger, *knocks]:
            p.close()


async def test_a_full_listener_does_not_take_a_hello_from_a_peer_it_dials(tmp_sock_dir):
    """A dials B. With A's room full (A/a0, which A listens to, holds its one place), a HELLO
    naming B is answered 207: it would take over A's own control connection to B, which holds
    no place in A's room, so taking it would pass the limit; A's session with B goes on."""
    tomls = two_site_toml(tmp_sock_dir, plaintext=True, streams=1)
    tomls["A"] += LIMITS.format(n=1) + '[[peers]]\nsite = "A"\nnode = "a0"\naddress = "127.0.0.1:9"\nstreams = 1\n'
    async with run_agents(tomls, wait_up=False) as ag:
        a = ag["A"]
        await until(lambda: a.sessions["B/b1"].is_up, 10, "A's session with B up")
        a0, _ = await hello(a.wan_address[1], node="a0")
        alive = asyncio.create_task(a0.keepalive())
        await until(lambda: a.inbound.room.taken == 1, 10, "a0 in")
        posing = await RawPeer.dial(a.wan_address[1], KIND_CONTROL)
        posing.send(FrameType.HELLO, m.Hello(versions=[1], site="B", node="b1", incarnation=5))
        got = [(t, getattr(x, "code", None)) for t, x in await posing.until_closed()]
        assert got == [(FrameType.ERROR, TOO_MANY_CONNECTIONS)]
        assert a.inbound.room.taken == 1
        assert await a.sessions["B/b1"].ping(timeout=5) is not None
        assert metric(a, "pddwire_reconnects_total", peer="B/b1") == 0
        alive.cancel()
        a0.close()
        posing.close()
