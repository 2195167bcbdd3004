"""Token frames queued while a peer is down (proto/transfer.md §11-§12), with real agents A and B
(in-process, TLS, A dials B through a fault relay: tests/support/agents.py).

* A backlog larger than ``limits.control_buffer_bytes`` is resent after the reconnect *paced*
  against the control connection's buffer: it arrives exactly once and in order, tokens sent
  during the resend come behind it, and no control connection is cut for PEER_NOT_READING
  (before, the whole resend went into the write buffer at once and the agent cut the
  connection on every reconnect: the session never came back).
* ``limits.max_unacked_tokens`` bounds what one peer's unacknowledged tokens hold: beyond it,
  ``send_tokens`` gets LIMIT_EXCEEDED naming the limit; acknowledged tokens make room again.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from conftest import metric, until
from pdd_tools.shaper import Shaper
from pdd_wire.engine import protocol as p
from pdd_wire.errors import EngineRequestError, ErrorCode
from support.agents import free_port, run_agents, two_site_toml

MiB = 1 << 20
CONTROL_BUFFER = 4 * MiB
REQUESTS = 8
SENDS = 240  # per request, while B is down
PER_SEND = 1024  # token IDs per send_tokens: A's agent joins them into 8192-token frames


@contextlib.asynccontextmanager
async def agents_behind_relay(tmp, limits: str):
    """Agents A and B with ``limits`` in both [limits] tables; A reaches B through a relay."""
    ports = {"A": free_port(), "B": free_port()}
    async with Shaper(target=("127.0.0.1", ports["B"])) as relay:
        tomls = two_site_toml(tmp, ports=ports, wan_override={"B": f"127.0.0.1:{relay.port}"},
                              extra=f"[limits]\n{limits}\n")
        async with run_agents(tomls) as ag:
            yield relay, ag["A"], ag["B"]


async def link_down(relay: Shaper, a) -> None:
    """Every connection through the relay reset, and new ones refused: B is unreachable from A."""
    relay.reject_new(True)
    relay.abort_all()
    await until(lambda: not a.sessions["B/b1"].is_up, what="A sees B down")


def not_reading(*agents) -> float:
    return sum(metric(x, "pddwire_errors_total", code="PEER_NOT_READING") for x in agents)


def ids(r: int, first: int, n: int) -> list[int]:
    """Token IDs of request ``r`` from index ``first``: distinct, 5 msgpack bytes each."""
    return [100_000 + r * 10_000_000 + first + k for k in range(n)]


async def test_a_backlog_larger_than_the_control_buffer_arrives_once_in_order_after_the_reconnect(
        tmp_sock_dir, engines):
    async with agents_behind_relay(tmp_sock_dir, f"control_buffer_bytes = {CONTROL_BUFFER}") as (relay, a, b):
        ea = await engines.connect(tmp_sock_dir / "A.sock", "sender")
        eb = await engines.connect(tmp_sock_dir / "B.sock", "receiver")
        rids = [f"backlog-{r}" for r in range(REQUESTS)]
        for rid in rids:
            await eb.expect_tokens(rid, "A")
        await link_down(relay, a)
        sent: dict[str, list[int]] = {rid: [] for rid in rids}
        for _ in range(SENDS):
            for r, rid in enumerate(rids):
                batch = ids(r, len(sent[rid]), PER_SEND)
                assert await ea.send_tokens(rid, "B", batch) == len(sent[rid])
                sent[rid] += batch
        relay_a = a.sessions["B/b1"].tokens

        def unacked() -> int:
            return sum(len(t) for ts in relay_a.tok_out.values() for _, t, _ in ts.unacked)

        queued = unacked()
        assert queued == REQUESTS * SENDS * PER_SEND  # all waits at A ...
        assert queued * 5 > 2 * CONTROL_BUFFER  # ... and is far more than the connection may hold unsent
        reconnects = metric(a, "pddwire_reconnects_total", peer="B/b1")
        relay.set_rate(16 * MiB)  # a link that takes ~0.6 s for the backlog: the resend spans many turns
        relay.reject_new(False)
        await until(lambda: a.sessions["B/b1"].is_up, what="A and B reconnected")
        # Tokens sent while the resend is under way go behind it, in their stream's order.
        for r, rid in enumerate(rids):
            batch = ids(r, len(sent[rid]), 100)
            assert await ea.send_tokens(rid, "B", batch) == len(sent[rid])
            sent[rid] += batch
        for rid in rids:
            got: list[int] = []
            async with asyncio.timeout(30):
                while len(got) < len(sent[rid]):
                    ev = await eb.wait_tokens(rid)
                    assert (ev.peer, ev.seq) == ("A/a1", len(got))  # each index once, in order
                    got += ev.tokens
            assert got == sent[rid]
        await until(lambda: unacked() == 0, what="every token acknowledged")
        assert not_reading(a, b) == 0
        assert metric(a, "pddwire_reconnects_total", peer="B/b1") == reconnects + 1  # one reconnect, kept
        assert a.sessions["B/b1"].is_up and b.sessions["A/a1"].is_up
        await asyncio.sleep(0.3)
        assert [e for rid in rids for e in eb.take(rid, kinds=(p.TokensReceived,))] == []  # nothing more, twice


async def test_the_per_peer_cap_refuses_send_tokens_with_the_named_limit(tmp_sock_dir, engines):
    cap = 65_536
    async with agents_behind_relay(tmp_sock_dir, f"max_unacked_tokens = {cap}") as (relay, a, b):
        ea = await engines.connect(tmp_sock_dir / "A.sock", "sender")
        eb = await engines.connect(tmp_sock_dir / "B.sock", "receiver")
        await link_down(relay, a)
        accepted = 0
        with pytest.raises(EngineRequestError) as refused:
            for i in range(10 * cap // 1000):  # ten times the cap, over several requests
                await ea.send_tokens(f"capped-{i % 4}", "B", ids(i % 4, i, 1000))
                accepted += 1000
        assert refused.value.code == ErrorCode.LIMIT_EXCEEDED
        assert f"limits.max_unacked_tokens ({cap})" in str(refused.value) and "B/b1" in str(refused.value)
        assert cap - 2 * 8192 < accepted <= cap  # what was kept stayed within the cap (frames count too)
        assert a.sessions["B/b1"].tokens.backlog <= cap
        assert metric(a, "pddwire_tokens_unacked", peer="B/b1") == a.sessions["B/b1"].tokens.backlog > cap // 2
        # Another request to the same peer is refused too: the cap is per peer.
        with pytest.raises(EngineRequestError) as refused:
            await ea.send_tokens("another", "B", ids(9, 0, 1000))
        assert "limits.max_unacked_tokens" in str(refused.value)
        # A handoff's relay is not refused (a refused run would put its stream out of step with
        # the positions MD holds); it counts toward the backlog like any stream.
        before = a.sessions["B/b1"].tokens.backlog
        assert a.sessions["B/b1"].tokens.send("handoff-1", ids(8, 0, 1000), handoff=True) == 0
        assert a.sessions["B/b1"].tokens.backlog > before
        # B back: what was kept is delivered and acknowledged, and there is room again.
        await eb.expect_tokens("capped-0", "A")
        relay.reject_new(False)
        await until(lambda: a.sessions["B/b1"].tokens.backlog == 0, what="the backlog acknowledged")
        assert metric(a, "pddwire_tokens_unacked", peer="B/b1") == 0
        assert await ea.send_tokens("another", "B", ids(9, 0, 1000)) == 0
        assert not_reading(a, b) == 0
