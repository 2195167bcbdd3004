"""A peer that opens sessions in a loop (GOODBYE "idle" right after each WELCOME) does not make
the agent write the session's own lines ("peer up", "peer said goodbye", "control connection
lost") each time: the first of each goes out, repeats are held for 30 s per peer and counted
(pdd_wire/session/lines.py). That holds for a fleet member too, whose every session is a new
object. The log never keeps saying the opposite of the peer's state: the state the held lines
ended in is written once the period has passed (``latest``)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import ssl

import pytest

from conftest import metric, until
from pdd_wire import config as cfgmod
from pdd_wire.agent import Agent
from pdd_wire.fleet.record import MemberRecord, encode, member_key
from pdd_wire.pki import cert_fingerprint
from pdd_wire.transport.tcp import KIND_CONTROL, preamble
from pdd_wire.wire import FrameType
from pdd_wire.wire import messages as m
from support.agents import free_port, run_agents, two_site_toml
from support.certs import make_pki
from support.fleet import etcd_client
from support.raw_peer import RawPeer, hello
from test_fleet_identity import toml

LOOPS = 20



def session_lines_of(out: io.StringIO, peer: str) -> list[dict]:
    wanted = {"peer up", "peer said goodbye", "control connection lost"}
    rows = [json.loads(ln) for ln in out.getvalue().splitlines() if ln.startswith("{")]
    return [d for d in rows if d.get("peer") == peer and d["event"] in wanted]


def count(rows: list[dict], event: str, **fields) -> int:
    return sum(1 for d in rows if d["event"] == event and all(d.get(k) == v for k, v in fields.items()))


async def reopen(port: int) -> None:
    """One turn of the loop: HELLO, WELCOME, GOODBYE "idle", until the agent closed it."""
    peer, _ = await hello(port, capabilities=("kv.v1", "tokens.v1", "fleet.v1"))
    peer.send(FrameType.GOODBYE, m.Goodbye("idle"))
    await peer.pong(1)  # the GOODBYE was handled (a static peer's session stays: "idle" means nothing to it)
    peer.close()
    await peer.until_closed()


async def test_a_peer_reopening_sessions_in_a_loop_is_logged_once(tmp_sock_dir, info_logs):
    async with run_agents(two_site_toml(tmp_sock_dir, plaintext=True), sites=("B",), wait_up=False) as ag:
        b = ag["B"]
        for _ in range(LOOPS):
            await reopen(b.wan_address[1])
        await until(lambda: not b.sessions["A/a1"].is_up, 10, "the last session down")
        rows = [d for d in session_lines_of(info_logs, "A/a1") if not d.get("latest")]
        # the first contact, and the first resumed one: each is a line of its own
        assert count(rows, "peer up", resumed=False) == 1 and count(rows, "peer up", resumed=True) == 1, rows
        assert count(rows, "peer said goodbye") == 1 and count(rows, "control connection lost") == 1, rows
        assert len(rows) == 4, rows


async def test_the_state_the_held_lines_ended_in_is_written_after_the_period(tmp_sock_dir, info_logs, monkeypatch):
    """Up, down (written); up (written: the first resumed), down (held): the log's last line says
    up while the peer is down, until the period passes and the held "control connection lost"
    is written with ``latest``. Then nothing more: the log says what holds."""
    monkeypatch.setattr("pdd_wire.session.lines.PERIOD_S", 1.0)  # (the owners are made after it)
    async with run_agents(two_site_toml(tmp_sock_dir, plaintext=True), sites=("B",), wait_up=False) as ag:
        b = ag["B"]
        for _ in range(3):
            await reopen(b.wan_address[1])
        await until(lambda: count(session_lines_of(info_logs, "A/a1"), "control connection lost", latest=True) == 1,
                    30, "the latest state written")
        last = session_lines_of(info_logs, "A/a1")[-1]
        assert (last["event"], last.get("latest")) == ("control connection lost", True), last
        # A peer that comes back and stays: its "peer up" (held, the period not over) is written
        # later too, since the log's last state line says it is down.
        peer, _ = await hello(b.wan_address[1])
        keep = asyncio.create_task(peer.keepalive())
        try:
            await until(lambda: session_lines_of(info_logs, "A/a1")[-1]["event"] == "peer up", 30,
                        "the peer up again, in the log")
            assert b.sessions["A/a1"].is_up
        finally:
            keep.cancel()
            peer.close()


# -- a fleet member: every session it opens is a new session object ----------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), ["a1", "b1"])


@contextlib.asynccontextmanager
async def fleet_b1(tmp, pki, etcd, cluster: str):
    agent = Agent(cfgmod.loads(toml(tmp, pki, "B", "b1", etcd=etcd, cluster=cluster)))
    await agent.start()
    try:
        yield agent
    finally:
        await agent.shutdown(0)


async def fleet_reopen(port: int, pki) -> None:
    """As A/a1, with its certificate: HELLO, WELCOME, GOODBYE "idle", until b1 closed it."""
    ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    ctx.load_cert_chain(*map(str, pki["a1"]))
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(preamble(KIND_CONTROL))
    await w.drain()
    await w.start_tls(ctx, server_hostname="b1")
    peer = RawPeer(r, w)
    peer.send(FrameType.HELLO, m.Hello(versions=[1], site="A", node="a1", incarnation=99,
                                       capabilities=["kv.v1", "tokens.v1", "fleet.v1"]))
    t, body, _ = await peer.next()
    assert t == FrameType.WELCOME, (t, body)
    peer.send(FrameType.GOODBYE, m.Goodbye("idle"))
    await peer.until_closed()  # b1 drops its side of the session at once
    peer.close()


async def test_a_fleet_member_reopening_sessions_in_a_loop_is_logged_once(tmp_sock_dir, info_logs, pki, etcd,
                                                                        cluster_name):
    cluster = cluster_name
    async with fleet_b1(tmp_sock_dir, pki, etcd, cluster) as b1:
        record = MemberRecord(site="A", node="a1", incarnation=99, wan=f"127.0.0.1:{free_port()}",
                              fingerprint=cert_fingerprint(str(pki["a1"][0])))
        async with etcd_client(etcd) as client:
            await client.put(member_key(cluster, "A", "a1"), encode(record))
            await until(lambda: "A/a1" in b1.membership.members, 10, "a1 listed")
            for _ in range(LOOPS):
                await fleet_reopen(b1.wan_address[1], pki)
                await until(lambda: b1.peers.get("A/a1") is None, 10, "b1 dropped its side")
        # each turn was a session of its own
        assert metric(b1, "pddwire_fleet_admissions_total", outcome="admitted") == LOOPS
        rows = [d for d in session_lines_of(info_logs, "A/a1") if not d.get("latest")]
        assert count(rows, "peer up") == 1 and count(rows, "peer said goodbye") == 1, rows
        assert count(rows, "control connection lost") <= 1 and len(rows) <= 3, rows
