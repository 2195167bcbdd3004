"""Relayed token IDs a peer never acknowledged, when that peer restarts: the engine that sent
them hears it (``transfer_failed``, transfer id 0, direction out, PEER_RESTARTED), once, so the
request ends with an outcome; acknowledged streams and a plain reconnect tell nothing.

A real in-process agent (site B) and a raw peer of tests/support playing A/a1, which reads
TOKENS and acknowledges only what the test says (proto/transfer.md §12, handshake.md §6); for
the dialer's side, two real agents, B stopped and started again.
"""

from __future__ import annotations

import contextlib

from conftest import until
from pdd_wire.engine import protocol as p
from pdd_wire.errors import ErrorCode
from pdd_wire.wire import FrameType
from pdd_wire.wire import messages as m
from support.agents import run_agents, two_site_toml
from support.raw_peer import hello


@contextlib.asynccontextmanager
async def _relayed(tmp, engines):
    """Agent B, its engine, and a raw peer (incarnation 77) gone after B's engine relayed 3 token
    IDs each of ``t-unacked`` and ``t-acked`` to it: the peer read both frames and acknowledged
    ``t-acked`` only. Yields (B, its engine)."""
    async with run_agents(two_site_toml(tmp, plaintext=True), sites=("B",), wait_up=False) as ag:
        b = ag["B"]
        eb = await engines.connect(tmp / "B.sock", "rld")
        peer, _ = await hello(b.wan_address[1], incarnation=77)
        for rid in ("t-unacked", "t-acked"):
            assert await eb.send_tokens(rid, "A", [1, 2, 3]) == 0
            seen = await peer.until(FrameType.TOKENS)
            assert seen[-1] is not None and seen[-1][1].request_id == rid, seen
        peer.send(FrameType.TOKENS_ACK, m.TokensAck("t-acked", 3))
        assert await peer.pong(1)
        peer.close()
        yield b, eb


async def test_a_restarted_peers_unacknowledged_tokens_are_told_to_their_engine(tmp_sock_dir, engines):
    async with _relayed(tmp_sock_dir, engines) as (b, eb):
        peer, welcome = await hello(b.wan_address[1], incarnation=78)
        assert not welcome.resumed
        failed = await eb.wait("t-unacked", kinds=(p.TransferFailed,), timeout=10)
        assert (failed.transfer_id, failed.peer, failed.direction, failed.code) == (
            0, "A/a1", "out", ErrorCode.PEER_RESTARTED), failed
        assert "token IDs not delivered" in failed.reason and "restarted" in failed.reason, failed
        # The request's next tokens start a new stream; by its reply every earlier event is here.
        assert await eb.send_tokens("t-unacked", "A", [4]) == 0
        assert eb.take("t-acked", kinds=(p.TransferFailed,)) == []
        assert eb.take("t-unacked", kinds=(p.TransferFailed,)) == []  # once
        seen = await peer.until(FrameType.TOKENS)
        assert seen[-1] is not None and seen[-1][1] == m.Tokens("t-unacked", 0, [4]), seen
        peer.close()


async def test_a_reconnect_of_the_same_incarnation_resends_and_tells_nothing(tmp_sock_dir, engines):
    async with _relayed(tmp_sock_dir, engines) as (b, eb):
        peer, welcome = await hello(b.wan_address[1], incarnation=77)
        assert welcome.resumed
        seen = await peer.until(FrameType.TOKENS)
        assert seen[-1] is not None and seen[-1][1] == m.Tokens("t-unacked", 0, [1, 2, 3]), seen
        peer.send(FrameType.TOKENS_ACK, m.TokensAck("t-unacked", 3))
        assert await peer.pong(2)
        assert await eb.send_tokens("t-unacked", "A", [4]) == 3
        assert eb.take("t-unacked", kinds=(p.TransferFailed,)) == []
        assert eb.take("t-acked", kinds=(p.TransferFailed,)) == []
        peer.close()


async def test_a_handoffs_relay_is_not_told_as_undelivered_tokens(tmp_sock_dir, engines):
    """RLD's engine owns the request (it also waits for its tokens) and relays it in a handoff:
    at the peer's restart its outcome is the handoff's ``handoff_done`` (RLD keeps the output),
    not a ``transfer_failed`` for the relayed token IDs as well."""
    async with run_agents(two_site_toml(tmp_sock_dir, plaintext=True), sites=("B",), wait_up=False) as ag:
        b = ag["B"]
        eb = await engines.connect(tmp_sock_dir / "B.sock", "rld")
        caps = ("kv.v1", "tokens.v1", "abort.v1", "handoff.v1")
        peer, _ = await hello(b.wan_address[1], incarnation=77, capabilities=caps)
        await eb.expect_tokens("h1")
        await eb.handoff_rld("h1", "A")
        await eb.handoff_tokens("h1", [11, 12])
        seen = await peer.until(FrameType.TOKENS)
        assert seen[-1] is not None and seen[-1][1].handoff, seen
        peer.close()
        peer, _ = await hello(b.wan_address[1], incarnation=78, capabilities=caps)
        done = await eb.wait("h1", kinds=(p.HandoffDone,), timeout=10)
        assert (done.owner, done.reason) == ("RLD", "md_failed")
        assert await eb.send_tokens("other", "A", [1]) == 0  # by its reply every earlier event is here
        assert eb.take("h1", kinds=(p.TransferFailed,)) == []
        peer.close()


async def test_the_dialer_of_a_restarted_peer_tells_its_engine_too(tmp_sock_dir, engines):
    """The other side of the handshake: A dials B. B stops while A's engine relays to it; a new B
    (a new incarnation) answers A's next dial, and A's engine hears of the token IDs the old one
    never acknowledged."""
    tomls = two_site_toml(tmp_sock_dir, plaintext=True)
    async with run_agents(tomls, sites=("A",), wait_up=False) as ag:
        a = ag["A"]
        ea = await engines.connect(tmp_sock_dir / "A.sock", "p")
        async with run_agents(tomls, sites=("B",), wait_up=False) as first:
            await until(lambda: a.peers.get("B/b1").is_up, 10, "A's session with the first B")
            old = a.peers.get("B/b1").remote_incarnation
            assert await ea.send_tokens("t-acked", "B", [1, 2]) == 0
            await until(lambda: not a.peers.get("B/b1").tokens.backlog, 10, "acknowledged by the first B")
            assert first["B"].incarnation == old
        assert await ea.send_tokens("t-unacked", "B", [3, 4]) == 0  # the first B is gone: never acknowledged
        async with run_agents(tomls, sites=("B",), wait_up=False) as second:
            failed = await ea.wait("t-unacked", kinds=(p.TransferFailed,), timeout=20)
            assert (failed.transfer_id, failed.peer, failed.direction, failed.code) == (
                0, "B/b1", "out", ErrorCode.PEER_RESTARTED), failed
            assert a.peers.get("B/b1").remote_incarnation == second["B"].incarnation != old
            assert await ea.send_tokens("t-unacked", "B", [5]) == 0  # a new stream
            assert ea.take("t-acked", kinds=(p.TransferFailed,)) == []
