"""The handoff rules an outside peer written from proto/ alone found unkept: a handoff that RLD
gives up after its commit still ends with one ``handoff_done``, a commit nobody answers ends in
bounded time, nothing more is sent for a restarted peer's handoffs, a peer's free text does not
grow a metric's label set, and an engine's out-of-range epoch is that request's error only.

A real in-process agent (site B) and a raw peer of tests/support playing A/a1 (the other
agent's half of the handoff), so the frames are exactly what the spec allows and nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from conftest import metric
from pdd_wire.engine import protocol as p
from pdd_wire.errors import EngineRequestError, ErrorCode
from pdd_wire.wire import FrameType, Lane
from pdd_wire.wire import messages as m
from support.agents import run_agents, two_site_toml
from support.raw_peer import hello

CAPS = ("kv.v1", "tokens.v1", "abort.v1", "handoff.v1")
HANDOFF_FRAMES = {FrameType.HANDOFF_PROGRESS, FrameType.HANDOFF_COMMIT, FrameType.HANDOFF_TAKEN,
                  FrameType.HANDOFF_RELEASE, FrameType.HANDOFF_ABORT}


@contextlib.asynccontextmanager
async def _agent_b(tmp, timeouts: str = ""):
    tomls = two_site_toml(tmp, plaintext=True)
    tomls["B"] = tomls["B"].replace("dead_after_s = 1.5", f"dead_after_s = 1.5\n{timeouts}")
    async with run_agents(tomls, sites=("B",), wait_up=False) as ag:
        yield ag["B"]


async def _committed_rld(b, engines, tmp, rid: str, incarnation: int = 77):
    """B's engine relays 3 tokens of ``rid`` to A (one-shot: it reports itself busy); the raw
    peer reports MD ready, and B commits at 3: ``(engine, peer, ready_at)``, ``ready_at`` the
    loop time just before MD's readiness was sent (B cannot have committed earlier)."""
    eb = await engines.connect(tmp / "B.sock", "rld")
    peer, _ = await hello(b.wan_address[1], incarnation=incarnation, capabilities=CAPS)
    await eb.set_load(0.95)
    await eb.handoff_rld(rid, "A")
    await eb.handoff_tokens(rid, [11, 12, 13])
    ready_at = asyncio.get_running_loop().time()
    peer.send(FrameType.HANDOFF_PROGRESS, m.HandoffProgress(rid, 0, 0))
    seen = await peer.until(FrameType.HANDOFF_COMMIT)
    assert seen[-1] is not None and seen[-1][1] == m.HandoffCommit(rid, 0, 3, "one-shot"), seen
    await eb.wait(rid, kinds=(p.StopGenerating,), timeout=5)
    return eb, peer, ready_at


@pytest.mark.parametrize("by", ["engine_abort", "request_abort"])
async def test_rld_giving_up_after_its_commit_still_ends_the_handoff_for_its_engine(tmp_sock_dir, engines, by):
    """RLD's engine keeps the request's KV until ``handoff_done``: an abort after the commit (its
    own, or MD's site's REQUEST_ABORT) ends the handoff with one, owner MD (RLD never resumes)."""
    async with _agent_b(tmp_sock_dir) as b:
        eb, peer, _ = await _committed_rld(b, engines, tmp_sock_dir, "h1")
        if by == "engine_abort":
            assert await eb.abort("h1", "client went away") == 1
            label = "rld_failed"
        else:
            peer.send(FrameType.REQUEST_ABORT, m.RequestAbort("h1", "client went away"))
            ev = await eb.wait("h1", kinds=(p.RequestAborted,), timeout=5)
            assert ev.origin == "A/a1"
            label = "aborted"
        evs = eb.take("h1")
        assert [type(e) for e in evs] == [p.Emit, p.HandoffDone], evs  # [0, 3) emitted, then the end
        assert (evs[1].owner, evs[1].reason, evs[1].position) == ("MD", label, 3)
        peer.send(FrameType.HANDOFF_TAKEN, m.HandoffTaken("h1", 0, 3))  # late: changes nothing
        assert await peer.pong(1)
        assert eb.take("h1") == []
        assert metric(b, "pddwire_handoffs_total", role="RLD", mode="one-shot", reason=label) == 1
        peer.close()


async def test_a_commit_nobody_answers_ends_once_a_live_md_would_have_answered(tmp_sock_dir, engines):
    """An MD agent that is up but never answers (it forgot the request, or never knew it): RLD
    settles as for an MD lost after the commit once MD's own deadline (handoff_s +
    handoff_md_margin_s) and peer_give_up_s have passed since its COMMIT, not before: until MD's
    deadline a live MD may still release, and RLD must then resume."""
    async with _agent_b(tmp_sock_dir, "handoff_s = 1.5\nhandoff_md_margin_s = 0.5\npeer_give_up_s = 2") as b:
        # Timed from before the commit could happen: a stamp taken once the commit was seen lags
        # it by however long this process was not run in between (CI: a loaded machine).
        eb, peer, committed = await _committed_rld(b, engines, tmp_sock_dir, "h2")
        alive = asyncio.create_task(peer.keepalive(0.2))
        try:
            # Another request, whose MD releases at its deadline (2 s after its handoff_md, which
            # came before the commit; 2.5 s here): RLD resumes it.
            await eb.handoff_rld("h2b", "A")
            await eb.handoff_tokens("h2b", [21, 22])
            peer.send(FrameType.HANDOFF_PROGRESS, m.HandoffProgress("h2b", 0, 0))
            await eb.wait("h2b", kinds=(p.StopGenerating,), timeout=5)
            await asyncio.sleep(2.5)
            peer.send(FrameType.HANDOFF_RELEASE, m.HandoffRelease("h2b", 0, "deadline"))
            resumed = await eb.wait("h2b", kinds=(p.HandoffDone,), timeout=5)
            assert (resumed.owner, resumed.reason) == ("RLD", "md_released")
            assert (await eb.wait("h2b", kinds=(p.StartGenerating,), timeout=5)).position == 2
            done = await eb.wait("h2", kinds=(p.HandoffDone,), timeout=15)
        finally:
            alive.cancel()
        assert asyncio.get_running_loop().time() - committed >= 1.5 + 0.5 + 2 - 0.1
        assert (done.owner, done.reason, done.position) == ("MD", "md_failed_after_commit", 3)
        assert [type(e) for e in eb.take("h2")] == [p.Emit]  # [0, 3), before the commit; nothing resumes
        peer.close()


async def test_nothing_more_goes_to_a_restarted_peer_for_its_handoffs(tmp_sock_dir, engines):
    """The peer's new incarnation never knew the handoffs of the old one: RLD keeps the output
    (``handoff_done`` md_failed) and sends it no ABORT, neither at the restart nor as the
    reconnect's resend; RLD goes on emitting."""
    async with _agent_b(tmp_sock_dir) as b:
        eb = await engines.connect(tmp_sock_dir / "B.sock", "rld")
        peer, _ = await hello(b.wan_address[1], capabilities=CAPS)
        await eb.handoff_rld("h3", "A")
        await eb.handoff_tokens("h3", [11, 12])
        peer.close()
        peer, _ = await hello(b.wan_address[1], incarnation=78, capabilities=CAPS)
        done = await eb.wait("h3", kinds=(p.HandoffDone,), timeout=5)
        assert (done.owner, done.reason) == ("RLD", "md_failed")
        await asyncio.sleep(0.3)  # past the heartbeat: any resend would have gone out
        peer.send(FrameType.PING, m.Ping(nonce=1, sent_ns=1))
        seen = await peer.until(FrameType.PONG)
        assert seen[-1] is not None, seen
        assert [f for f in seen if f[0] in HANDOFF_FRAMES] == [], seen
        assert await eb.handoff_tokens("h3", [13]) == "RLD"
        emitted = [t for e in eb.take("h3", kinds=(p.Emit,)) for t in e.tokens]
        assert emitted == [11, 12, 13]
        peer.close()


async def test_a_restarted_peers_early_relay_is_forgotten(tmp_sock_dir):
    """Relayed tokens kept for a request MD's engine has not registered yet belong to the peer's
    incarnation that sent them: after its restart, the new one's relay for the same request id
    (epoch 0 again) starts afresh rather than being dropped as out of step with the old one's."""
    async with _agent_b(tmp_sock_dir) as b:
        peer, _ = await hello(b.wan_address[1], capabilities=CAPS)
        peer.send(FrameType.TOKENS, m.Tokens("h6", 0, [1, 2, 3], handoff=True), lane=Lane.TOKEN)
        assert await peer.pong(1)
        peer.close()
        peer, _ = await hello(b.wan_address[1], incarnation=78, capabilities=CAPS)
        peer.send(FrameType.TOKENS, m.Tokens("h6", 0, [7, 8], handoff=True), lane=Lane.TOKEN)
        assert await peer.pong(2)
        assert metric(b, "pddwire_tokens_dropped_total", peer="A/a1", reason="over_bounds") == 0
        peer.close()


async def test_an_early_relay_resent_over_what_is_kept_adds_only_its_new_tokens(tmp_sock_dir):
    """A resend that overlaps the relayed tokens kept for a request MD has not registered yet (the
    receiver forgot the stream, then the connection dropped) adds its new tail, in step: it is
    not dropped whole, which would put every later frame out of step with MD's positions."""
    async with _agent_b(tmp_sock_dir) as b:
        peer, _ = await hello(b.wan_address[1], capabilities=CAPS)
        peer.send(FrameType.TOKENS, m.Tokens("h7", 0, [1, 2, 3], handoff=True), lane=Lane.TOKEN)
        assert await peer.pong(1)
        b.sessions["A/a1"].tokens.drop("h7")  # forgotten here (as the least recently used stream)
        peer.send(FrameType.TOKENS, m.Tokens("h7", 2, [3, 4], handoff=True), lane=Lane.TOKEN)
        peer.send(FrameType.TOKENS, m.Tokens("h7", 4, [5], handoff=True), lane=Lane.TOKEN)
        assert await peer.pong(2)
        assert metric(b, "pddwire_tokens_dropped_total", peer="A/a1", reason="over_bounds") == 0
        assert b.handoffs.early["A/a1"]["h7"].tokens.tolist() == [1, 2, 3, 4, 5]
        peer.close()


async def test_a_peers_abort_reasons_do_not_grow_the_metrics_label_set(tmp_sock_dir, engines):
    """HANDOFF_ABORT's reason is free text (up to 4096 characters): it reaches MD's engine as it
    is, and is counted as ``other``."""
    async with _agent_b(tmp_sock_dir) as b:
        eb = await engines.connect(tmp_sock_dir / "B.sock", "md")
        peer, _ = await hello(b.wan_address[1], capabilities=CAPS)
        for i in range(3):
            rid = f"h4-{i}"
            await eb.handoff_md(rid, "A")
            peer.send(FrameType.HANDOFF_ABORT, m.HandoffAbort(rid, 0, f"reason number {i}"))
            done = await eb.wait(rid, kinds=(p.HandoffDone,), timeout=5)
            assert (done.owner, done.reason) == ("RLD", f"reason number {i}")
        assert metric(b, "pddwire_handoffs_total", role="MD", mode="none", reason="other") == 3
        labels = {s.labels.get("reason") for fam in b.metrics.registry.collect() for s in fam.samples
                  if fam.name == "pddwire_handoffs"}
        assert labels == {"other"}, labels
        peer.close()


@pytest.mark.parametrize("epoch", [-1, 1 << 63])
async def test_an_out_of_range_epoch_is_that_requests_error(tmp_sock_dir, engines, epoch):
    """Like every other range an engine request breaks: BAD_REQUEST naming it, and the engine's
    connection (and its other requests) go on."""
    async with _agent_b(tmp_sock_dir) as b:
        eb = await engines.connect(tmp_sock_dir / "B.sock", "rld")
        peer, _ = await hello(b.wan_address[1], capabilities=CAPS)
        with pytest.raises(EngineRequestError) as e:
            await eb.handoff_rld("h5", "A", epoch=epoch)
        assert e.value.code == ErrorCode.BAD_REQUEST and "epoch" in str(e.value)
        assert await eb.handoff_rld("h5", "A", epoch=(1 << 63) - 1) == {"peer": "A/a1"}
        peer.close()
