"""A listener whose ``limits.max_peer_connections`` authenticated connections are open says so on
the wire (proto/handshake.md §2, proto/errors.md 207 TOO_MANY_CONNECTIONS): the next HELLO and
the next BULK_HELLO are answered ERROR TOO_MANY_CONNECTIONS, then closed; the sessions it holds
go on. The dialer names the peer's limit in its log (once per 30 s, not a certificate problem)
and keeps dialing, at its longest backoff, until there is room.

It used to close such a connection without a frame, and the dialer's log then suggested a
refused certificate."""

from __future__ import annotations

import io
import json

from conftest import metric, until
from pdd_wire.transport.tcp import KIND_BULK, KIND_CONTROL
from pdd_wire.wire import FrameType
from pdd_wire.wire import messages as m
from support.agents import cluster_toml, run_agents, running, two_site_toml
from support.raw_peer import RawPeer, hello

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
    (control and one bulk): the next HELLO and BULK_HELLO get ERROR TOO_MANY_CONNECTIONS (207)
    naming the limit, then the close; A/a1's session is untouched; once A/a2 goes, a HELLO is
    welcomed again."""
    tomls = two_site_toml(tmp_sock_dir, plaintext=True, streams=1)  # plaintext: the raw peer can speak
    tomls["B"] += LIMITS.format(n=4) + '[[peers]]\nsite = "A"\nnode = "a2"\naddress = "127.0.0.1:9"\nstreams = 1\n'
    async with run_agents(tomls, wait_up=False) as ag:
        a, b = ag["A"], ag["B"]
        port = b.wan_address[1]
        await until(lambda: b.sessions["A/a1"].is_up and len(b.sessions["A/a1"].links) == 1, 20, "A/a1 up")
        a2, welcome = await hello(port, node="a2")  # connection 3 (its place is taken before WELCOME)
        a2_bulk = await bulk_hello(port, welcome.session, 0)
        t, _, _ = await a2_bulk.next()
        assert t == FrameType.BULK_WELCOME  # connection 4: the room is full

        refused = await RawPeer.dial(port, KIND_CONTROL)
        refused.send(FrameType.HELLO, m.Hello(versions=[1], site="A", node="a2", incarnation=78))
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

        # A/a2 goes: its places come back, and a HELLO is welcomed again.
        a2_bulk.close()
        a2.close()
        await until(lambda: not b.sessions["A/a2"].is_up and not b.sessions["A/a2"].links, 10, "a2 gone")
        again, _ = await hello(port, node="a2")
        assert await again.pong(5)
        again.close()


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
