"""A fleet session one side dropped is never resumed by the other (proto/handshake.md §6, §8),
and the fleet's housekeeping drops nothing after a stall of its own process.

Real agents (in this process, on real sockets) and a real etcd. a1 (site A) dials, b1 (site B)
listens; b1 registers the address of a TCP relay in front of its port (``fleet.advertise``), so
the test can cut the link between them (a partition) and mend it. With b1's ``fleet.dial_wait_s``
at 1 s, a session b1 holds down and idle is dropped on b1's side (reason ``down``) while a1,
which dials, still holds its side and reconnects once the link is back: b1 then answers with a
new session (WELCOME ``resumed`` false), and a1 must not resume what b1 no longer has.

The reverse: a1 drops its side while the link is cut (b1's record leaves etcd: the test deletes
it, b1 writes it again) and b1 keeps its own; a1's new session then meets a b1 that resumes
(WELCOME ``resumed`` true), and must have b1 drop its side instead of taking it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from conftest import Engines, metric, until
from pdd_wire import config as cfgmod
from pdd_wire.agent import Agent
from pdd_wire.engine import protocol as ev
from pdd_wire.engine.client import TRANSFER_OUTCOMES
from pdd_wire.errors import ErrorCode
from pdd_wire.fleet.record import member_key
from pdd_wire.session.dialer import Dialer
from support.agents import free_port
from support.fleet import etcd_client
from test_fleet import fleet_toml


class Relay:
    """A TCP relay to ``127.0.0.1:target``: :meth:`cut` drops every connection through it and
    refuses new ones (accepted and closed at once) until :meth:`mend` (a plain flag: no await)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self.open = True
        self.black = False  # bytes are dropped and connections kept: a blackholed link
        self.pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> "Relay":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if not self.open:
            w.transport.abort()
            return
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            w.transport.abort()
            return
        pair = (w, uw)
        self.pairs.add(pair)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(1 << 16):
                    if self.black:
                        continue
                    dst.write(data)
                    await dst.drain()
            except (OSError, ConnectionError):
                pass
            finally:
                while self.black:  # a blackhole carries no FIN or RST either
                    await asyncio.sleep(0.05)
                w.transport.abort()
                uw.transport.abort()

        await asyncio.gather(pump(r, uw), pump(ur, w), return_exceptions=True)
        self.pairs.discard(pair)

    def cut(self) -> None:
        self.open = False
        for w, uw in list(self.pairs):
            w.transport.abort()
            uw.transport.abort()

    def mend(self) -> None:
        self.open = True

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@contextlib.asynccontextmanager
async def pair(tmp, etcd, cluster, *, b_heartbeat_s: float = 0.2, b_timeouts: str = "",
               b_fleet: str = "dial_wait_s = 1", a_static: bool = False, a_fleet: str = "dial_wait_s = 30"):
    """a1 and b1, b1 registered behind a :class:`Relay`; yields (a1, b1, relay, engines).
    ``a_static``: a1 also lists b1 (at the relay) among its ``[[peers]]``, b1 knows a1 from etcd."""
    engines = Engines()
    started: list[Agent] = []
    b_port = free_port()
    relay = await Relay(b_port).start()
    try:
        static = f'[[peers]]\nsite = "B"\nnode = "b1"\naddress = "127.0.0.1:{relay.port}"\n' if a_static else ""
        # a1's dial_wait_s outlasts the declines of a loaded run: a session a1 opened (knocked) and
        # declined until then would be dropped as dial_timeout, with no need left to open another.
        a = Agent(cfgmod.loads(fleet_toml(tmp, "A", "a1", etcd.endpoints, cluster, lease_ttl_s=30, fleet=a_fleet)
                               + static))
        await a.start()
        started.append(a)
        b = Agent(cfgmod.loads(fleet_toml(tmp, "B", "b1", etcd.endpoints, cluster, port=b_port, lease_ttl_s=30,
                                          advertise=f"127.0.0.1:{relay.port}", heartbeat_s=b_heartbeat_s,
                                          timeouts=b_timeouts, fleet=b_fleet)))
        await b.start()
        started.append(b)
        await until(lambda: "B/b1" in a.membership.members and "A/a1" in b.membership.members, 10, "membership")
        yield a, b, relay, engines
    finally:
        for c in engines.clients:
            await c.close()
        for ag in started:
            await ag.shutdown(0)
        await relay.close()


def acked(agent: Agent, key: str) -> bool:
    """Every token ID ``agent`` relayed to ``key`` was acknowledged (the session is idle)."""
    s = agent.peers.get(key)
    return s is not None and not any(st.unacked for st in s.tokens.tok_out.values())


def up(agent: Agent, key: str) -> bool:
    s = agent.peers.get(key)
    return s is not None and s.is_up


async def partition_until_b_drops(a: Agent, b: Agent, relay: Relay) -> None:
    """Cut the link until b1 dropped its side of the session (down and idle for dial_wait_s);
    a1 still holds its side (a dialer's session is dropped only when idle and up)."""
    b_side = b.peers.get("A/a1")
    relay.cut()
    await until(lambda: b.peers.get("A/a1") is None, 15, "b1 dropped its side of the session")
    assert metric(b, "pddwire_fleet_sessions_closed_total", reason="down") == 1
    assert b_side is not None  # (its closing begins in a task of its own: wait for it)
    await until(lambda: b_side.closing, 10, "b1's side of the session closing")
    assert a.peers.get("B/b1") is not None and not a.peers.get("B/b1").is_up


@pytest.mark.parametrize("a_static", [False, True], ids=["fleet", "a1_lists_b1"])
async def test_tokens_queued_for_a_dropped_listener_side_are_told_not_resumed(tmp_sock_dir, etcd, cluster_name,
                                                                              a_static):
    """a1 relays tokens to b1 (delivered, acknowledged); b1 drops its side; a1 queues more for
    the same request, then reconnects and b1 answers with a fresh session. a1 must not resume
    the stream at its own position (b1 would see a gap and ask for frames a1 no longer has, for
    ever, the engine never told): its engine hears that those token IDs were not delivered,
    exactly once, and a new stream then flows. The same when a1 lists b1 among its static
    ``[[peers]]`` (a session it never drops) while b1 knows a1 from etcd only."""
    async with pair(tmp_sock_dir, etcd, cluster_name, a_static=a_static) as (a, b, relay, engines):
        ea = await engines.connect(a.config.listen.engine_socket, "rld")
        eb = await engines.connect(b.config.listen.engine_socket, "md")
        await eb.expect_tokens("r1", from_site="A")
        assert await ea.send_tokens("r1", "B/b1", [1, 2, 3]) == 0
        got = await eb.wait_tokens("r1", timeout=10)
        assert (got.seq, got.tokens) == (0, [1, 2, 3])
        await until(lambda: acked(a, "B/b1"), 10, "a1's tokens acknowledged")
        await partition_until_b_drops(a, b, relay)
        assert await ea.send_tokens("r1", "B/b1", [4, 5]) == 3  # queued in a1's side
        relay.mend()
        failed = await ea.wait("r1", timeout=20)
        assert isinstance(failed, ev.TransferFailed) and failed.transfer_id == 0 and failed.peer == "B/b1"
        assert failed.code == ErrorCode.PEER_UNREACHABLE and "token IDs not delivered" in failed.reason
        assert "nothing to resume" in failed.reason
        assert metric(a, "pddwire_fleet_sessions_closed_total", reason="dropped_by_peer") == (0 if a_static else 1)
        await until(lambda: up(a, "B/b1") and up(b, "A/a1"), 15, "the new session up")
        assert a.peers.get("B/b1").tokens.tok_out == {}  # nothing of the old stream is resent
        await eb.expect_tokens("r3", from_site="A")
        await ea.send_tokens("r3", "B/b1", [6])
        got = await eb.wait_tokens("r3", timeout=10)
        assert (got.seq, got.tokens) == (0, [6])
        assert metric(b, "pddwire_token_gaps_total", peer="A/a1") == 0
        assert ea.take("r1", kinds=(ev.TransferFailed,)) == []  # told once


async def test_tokens_from_a_fresh_listener_side_are_not_taken_for_resends(tmp_sock_dir, etcd, cluster_name):
    """b1 relays tokens to a1 (delivered); b1 drops its side; a1 reconnects and b1's fresh
    session relays the request's next tokens from index 0 (b1 has no stream for it any more).
    a1 must not hold its old stream's position against them (it would take them for a resend of
    what it delivered, acknowledge and drop them: lost without a word)."""
    async with pair(tmp_sock_dir, etcd, cluster_name) as (a, b, relay, engines):
        ea = await engines.connect(a.config.listen.engine_socket, "md")
        eb = await engines.connect(b.config.listen.engine_socket, "rld")
        await ea.expect_tokens("r2", from_site="B")
        await eb.send_tokens("r2", "A/a1", [7, 8])
        got = await ea.wait_tokens("r2", timeout=10)
        assert (got.seq, got.tokens) == (0, [7, 8])
        await until(lambda: acked(b, "A/a1"), 10, "b1's tokens acknowledged")
        await partition_until_b_drops(a, b, relay)
        relay.mend()
        await until(lambda: up(a, "B/b1") and up(b, "A/a1"), 15, "the new session up")
        assert await eb.send_tokens("r2", "A/a1", [9]) == 0  # b1's stream starts afresh
        got = await ea.wait_tokens("r2", timeout=10)
        assert (got.seq, got.tokens) == (0, [9])


async def test_a_stalled_tick_does_not_give_up_a_session_whose_dialer_is_back(tmp_sock_dir, etcd, cluster_name):
    """b1's session with a1 is down with tokens waiting (the link cut); the link is mended and at
    once this process stalls (the event loop blocked) for longer than b1's give-up time. When the
    loop runs again a1's HELLO is on its way but not read yet: b1's first fleet tick, late by the
    stall, must not give the session up (and fail the tokens); the next one finds it back, and
    the tokens arrive."""
    # b1 ticks every 3 s: a1 has that long after the stall to be back (a loaded machine's TLS
    # handshake, its dialer's backoff), before b1's next tick judges.
    async with pair(tmp_sock_dir, etcd, cluster_name, b_heartbeat_s=3.0,
                    b_timeouts="peer_give_up_s = 4") as (a, b, relay, engines):
        ea = await engines.connect(a.config.listen.engine_socket, "md")
        eb = await engines.connect(b.config.listen.engine_socket, "rld")
        await ea.expect_tokens("r1", from_site="B")
        await eb.send_tokens("r1", "A/a1", [1])
        assert (await ea.wait_tokens("r1", timeout=10)).tokens == [1]
        await until(lambda: acked(b, "A/a1"), 10, "b1's tokens acknowledged")
        relay.cut()
        await eb.send_tokens("r1", "A/a1", [2])  # unacknowledged: b1's session is busy
        await until(lambda: not up(b, "A/a1") and not up(a, "B/b1"), 10, "the session down on both sides")
        relay.mend()
        time.sleep(6.5)  # the stall itself (not a wait): longer than give-up (4 s) and a tick late by 3 s
        got = await ea.wait_tokens("r1", timeout=20)
        assert (got.seq, got.tokens) == (1, [2])
        assert metric(b, "pddwire_fleet_sessions_closed_total", reason="unreachable") == 0
        assert b.fleet.lazy["A/a1"].session is b.peers.get("A/a1")


async def relayed_and_acked(src: Agent, src_eng, dst_eng, rid: str, dest: str, tokens: list[int]) -> None:
    """``src_eng`` (an engine of ``src``) relays ``tokens`` of ``rid`` to ``dest``: they reach
    ``dst_eng`` from index 0, and ``src`` has them acknowledged."""
    await dst_eng.expect_tokens(rid, from_site=src.config.site)
    assert await src_eng.send_tokens(rid, dest, tokens) == 0
    got = await dst_eng.wait_tokens(rid, timeout=10)
    assert (got.seq, got.tokens) == (0, tokens)
    await until(lambda: acked(src, dest), 10, f"{src.config.node}'s tokens acknowledged")


async def unlist_b_while_cut(a: Agent, b: Agent, relay: Relay, etcd, cluster: str) -> None:
    """Cut the link, then delete b1's record from etcd: a1, whose session with b1 is down,
    drops its side at once (``left``); b1 writes its record again and keeps its side."""
    b_side = b.peers.get("A/a1")
    relay.cut()
    await until(lambda: not up(a, "B/b1") and not up(b, "A/a1"), 10, "the session down on both sides")
    async with etcd_client(etcd) as client:
        await client.delete(member_key(cluster, "B", "b1"))
    await until(lambda: metric(a, "pddwire_fleet_sessions_closed_total", reason="left") == 1, 10,
                "a1 dropped its side (b1 left)")
    await until(lambda: "B/b1" in a.membership.members, 10, "b1's record written again, a1 sees it")
    assert b.peers.get("A/a1") is b_side and b_side is not None and not b_side.closing  # b1 kept its side


@pytest.mark.parametrize("goodbye", ["delivered", "lost_with_its_connection", "blackholed"])
async def test_a_listener_does_not_resume_into_a_session_its_dialer_dropped(tmp_sock_dir, etcd, cluster_name,
                                                                           monkeypatch, goodbye):
    """b1 relays tokens to a1 (delivered), then more while the link is cut (not acknowledged: b1
    keeps its busy side and knocks). a1 drops its side (b1 left etcd) and, knocked, opens a new
    session; b1 resumes it. b1's resend (from its own position) must not be taken by a1's new
    stream, which starts at 0 (a gap, a resend request for frames b1 no longer has: never
    delivered, no engine told): a1 has b1 drop its side, b1's engine is told once that those
    token IDs were not delivered, and a fresh session carries what follows."""
    relays: list[Relay] = []
    if goodbye != "delivered":
        # The first WELCOME that resumes meets a link fault (injected as a1's dialer handles it):
        # its connection aborted (lost_with_its_connection), or every byte after it dropped and no
        # close ever seen (blackholed). That decline's GOODBYE "idle" never reaches b1, which keeps
        # its side; a1's next dial meets the same resume and must decline it again. (The first
        # version declined once per session; the second ended the declines on a silent link.)
        real, faulted = Dialer.welcomed, []

        def link_fault_once(self, conn, msg, *, first):
            if first and msg.resumed and not faulted:
                faulted.append(conn)
                if goodbye == "blackholed":
                    relays[0].black = True
                else:
                    conn.transport.abort()
            return real(self, conn, msg, first=first)

        monkeypatch.setattr(Dialer, "welcomed", link_fault_once)
    async with pair(tmp_sock_dir, etcd, cluster_name) as (a, b, relay, engines):
        ea = await engines.connect(a.config.listen.engine_socket, "md")
        eb = await engines.connect(b.config.listen.engine_socket, "rld")
        await relayed_and_acked(b, eb, ea, "r1", "A/a1", [1, 2])
        relay.cut()
        assert await eb.send_tokens("r1", "A/a1", [3]) == 2  # unacknowledged: b1 keeps its side
        kb = await eb.register(engines.memory(1 << 20), block_bytes=1 << 20)
        await eb.send_kv("r5", [kb.blocks(0, 1)], to=["A/a1"], deadline_s=60)  # queued in b1's side
        relays.append(relay)
        await unlist_b_while_cut(a, b, relay, etcd, cluster_name)
        relay.mend()
        if goodbye == "blackholed":
            await until(lambda: faulted and faulted[0].closed, 20, "a1 done waiting for the silent link to close")
            relay.black = False  # the link heals; what the blackhole held is broken now
            for w, uw in list(relay.pairs):
                w.transport.abort()
                uw.transport.abort()
        failed = await eb.wait("r1", timeout=20)
        assert isinstance(failed, ev.TransferFailed) and failed.transfer_id == 0 and failed.peer == "A/a1"
        assert failed.code == ErrorCode.PEER_UNREACHABLE and "token IDs not delivered" in failed.reason
        failed = await eb.wait("r5", timeout=20)  # not announced to a1's new session: failed with the old one
        assert isinstance(failed, ev.TransferFailed) and failed.code == ErrorCode.PEER_UNREACHABLE
        await until(lambda: up(a, "B/b1") and up(b, "A/a1"), 15, "the new session up")
        declines = 1 if goodbye == "delivered" else 2
        assert metric(a, "pddwire_fleet_sessions_closed_total", reason="resume_declined") == declines
        assert metric(b, "pddwire_fleet_sessions_closed_total", reason="idle") == 1
        assert b.peers.get("A/a1").tokens.tok_out == {}  # nothing of the old stream is resent
        await ea.expect_tokens("r4", from_site="B")
        await eb.send_tokens("r4", "A/a1", [9])
        got = await ea.wait_tokens("r4", timeout=10)
        assert (got.seq, got.tokens) == (0, [9])
        assert metric(a, "pddwire_token_gaps_total", peer="B/b1") == 0  # b1's resend was not read
        assert ea.take("r1", kinds=(ev.TokensReceived,)) == []
        assert eb.take("r1", kinds=(ev.TransferFailed,)) == []  # told once
        assert eb.take("r5", kinds=TRANSFER_OUTCOMES) == [] and a.peers.get("B/b1").inn == {}


async def test_a_dialers_new_stream_is_not_taken_for_a_resend_by_a_listener_that_kept_its_side(
        tmp_sock_dir, etcd, cluster_name):
    """a1 relays tokens to b1 (delivered, acknowledged); a1 drops its side (b1 left etcd) while
    b1 keeps its own (idle, its dial_wait_s long). The request's next tokens start a new stream
    at 0 in a1's new session; b1, had it resumed, would hold its old stream's position against
    them (taken for a resend of what it delivered: acknowledged and dropped, no engine told). They
    must reach b1's engine."""
    async with pair(tmp_sock_dir, etcd, cluster_name, b_fleet="dial_wait_s = 60") as (a, b, relay, engines):
        ea = await engines.connect(a.config.listen.engine_socket, "rld")
        eb = await engines.connect(b.config.listen.engine_socket, "md")
        await relayed_and_acked(a, ea, eb, "r2", "B/b1", [1, 2, 3])
        await unlist_b_while_cut(a, b, relay, etcd, cluster_name)
        assert await ea.send_tokens("r2", "B/b1", [4]) == 0  # a new session, a new stream
        relay.mend()
        got = await eb.wait_tokens("r2", timeout=20)
        assert (got.seq, got.tokens) == (0, [4])
        assert metric(a, "pddwire_fleet_sessions_closed_total", reason="resume_declined") == 1
        assert metric(b, "pddwire_fleet_sessions_closed_total", reason="idle") == 1
        assert ea.take("r2", kinds=(ev.TransferFailed,)) == []  # nothing was lost to tell of
