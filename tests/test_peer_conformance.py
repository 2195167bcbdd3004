"""The wire rules an outside peer written from proto/ alone found unwritten or unkept: an agent
that stops tells its peers of every transfer it still had open, a KV_BEGIN that reuses a
transfer id for another request is refused, and a frame with transfer id 0 is not answered.

Real in-process agents on loopback (TLS between A and B), a raw peer of tests/support for the
frames the agent's own session never sends.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from conftest import metric
from pdd_wire.engine import protocol as p
from pdd_wire.errors import EngineRequestError, ErrorCode
from pdd_wire.wire import FrameType
from pdd_wire.wire import messages as m
from support.agents import run_agents, two_site_toml
from support.raw_peer import hello

MiB = 1 << 20
KB64 = 64 << 10


async def _engines(engines, tmp):
    a = await engines.connect(tmp / "A.sock", "a")
    b = await engines.connect(tmp / "B.sock", "b")
    ra = await a.register(engines.memory(16 * MiB), block_bytes=MiB)
    rb = await b.register(engines.memory(16 * MiB), block_bytes=MiB)
    return a, b, ra, rb


def _hold_chunks(agent) -> None:
    """The agent's sender dispatches no chunk (its transfers stay open, MOVING, with nothing in
    flight): a transfer that cannot finish whatever the machine's speed."""
    for s in agent.peers:
        s.sender.pump = lambda: None


@pytest.mark.parametrize("stopping", ["A", "B"])
async def test_an_agent_that_stops_cancels_its_open_transfers_at_the_peer(tmp_sock_dir, engines, stopping):
    """The peer's engine hears SHUTTING_DOWN at once (KV_CANCEL before GOODBYE), not after its
    peer_give_up_s (30 s here) as PEER_UNREACHABLE: the sending agent stops (A) or the receiving one (B)."""
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        a, b, ra, rb = await _engines(engines, tmp_sock_dir)
        _hold_chunks(agents["A"])
        await b.post_recv("s1", [rb.blocks(0, 4)], from_site="A")
        await a.send_kv("s1", [ra.blocks(0, 4)], to=["B"])
        async with asyncio.timeout(5):
            while "s1" not in {t.request_id for t in agents["B"].sessions["A/a1"].inn.values()}:
                await asyncio.sleep(0.01)  # matched at B: MOVING on both sides, nothing sent
        t0 = asyncio.get_running_loop().time()
        await agents[stopping].shutdown(0)
        other, direction = (b, "in") if stopping == "A" else (a, "out")
        ev = await other.wait("s1", timeout=10)
        assert isinstance(ev, p.TransferFailed), ev
        assert ev.code == ErrorCode.SHUTTING_DOWN and ev.direction == direction, ev
        assert "shutting down" in ev.reason, ev
        assert asyncio.get_running_loop().time() - t0 < 5
        await asyncio.sleep(0.5)
        assert other.take("s1", kinds=(p.TransferFailed, p.KvSent, p.KvReceived)) == [], "one outcome only"


async def test_an_agent_that_stops_withdraws_its_kv_waiting_for_a_post(tmp_sock_dir, engines):
    """A send still waiting at the receiver for its post when the sender stops is cancelled
    there: the post made afterwards fails at once instead of matching a transfer nobody sends."""
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        a, b, ra, rb = await _engines(engines, tmp_sock_dir)
        await a.send_kv("w1", [ra.blocks(0, 4)], to=["B"], deadline_s=60)
        async with asyncio.timeout(5):
            while agents["B"].kv.unposted_count() != 1:
                await asyncio.sleep(0.01)
        await agents["A"].shutdown(0)
        async with asyncio.timeout(5):
            while agents["B"].kv.unposted_count():
                await asyncio.sleep(0.01)
        with pytest.raises(EngineRequestError) as ei:
            await b.post_recv("w1", [rb.blocks(0, 4)], from_site="A")
        assert ei.value.code == ErrorCode.TRANSFER_CANCELLED and "shutting down" in str(ei.value)


@contextlib.asynccontextmanager
async def _agent_b(tmp):
    async with run_agents(two_site_toml(tmp, plaintext=True), sites=("B",), wait_up=False) as ag:
        yield ag["B"]


async def _receiver_and_peer(b, engines, tmp, *posts: str):
    """Engine b on agent B with 1 MiB in 64 KiB blocks, a post from site A for each of ``posts``
    (block i for the i-th), and a raw peer through HELLO as A/a1: ``(engine, region, peer)``."""
    eb = await engines.connect(tmp / "B.sock", "b")
    rb = await eb.register(engines.memory(MiB), block_bytes=KB64)
    for i, rid in enumerate(posts):
        await eb.post_recv(rid, [rb.blocks(i, 1)], from_site="A")
    peer, _ = await hello(b.wan_address[1])
    return eb, rb, peer


def _begin(rid: str) -> m.KvBegin:
    """A KV_BEGIN of one 64 KiB block."""
    return m.KvBegin(rid, KB64, KB64, 1, KB64, 1, 10_000)


async def test_a_kv_begin_reusing_an_open_transfer_id_for_another_request_is_refused(tmp_sock_dir, engines):
    """KV_ACCEPT for the second request would let its chunks land in the first one's blocks, and
    a KV_DONE would tell its sender it was delivered: the control connection ends instead."""
    async with _agent_b(tmp_sock_dir) as b:
        eb, rb, peer = await _receiver_and_peer(b, engines, tmp_sock_dir, "x1", "x2")
        peer.send(FrameType.KV_BEGIN, _begin("x1"), transfer_id=50)
        seen = await peer.until(FrameType.KV_ACCEPT)
        assert seen[-1] is not None and seen[-1][1].request_id == "x1", seen
        peer.send(FrameType.KV_BEGIN, _begin("x1"), transfer_id=50)  # a resend: fine
        seen = await peer.until(FrameType.KV_ACCEPT)
        assert seen[-1] is not None and seen[-1][1].request_id == "x1", seen
        peer.send(FrameType.KV_BEGIN, _begin("x2"), transfer_id=50)
        got = [(t, x) for t, x in await peer.until_closed() if t != FrameType.PING]
        assert [(t, x.code) for t, x in got] == [(FrameType.ERROR, ErrorCode.UNEXPECTED_FRAME)], got
        assert "'x2'" in got[0][1].message and "'x1'" in got[0][1].message
        assert metric(b, "pddwire_errors_total", code="UNEXPECTED_FRAME") >= 1
        assert "x2" in b.posts  # the second request's post was not taken
        peer.close()


async def test_a_kv_resume_with_transfer_id_0_gets_no_answer(tmp_sock_dir):
    """Transfer id 0 names no transfer: no KV_STATUS carries it (proto/transfer.md §1)."""
    async with _agent_b(tmp_sock_dir) as b:
        peer, _ = await hello(b.wan_address[1])
        peer.send(FrameType.KV_RESUME, m.KvResume("r0"), transfer_id=0)
        peer.send(FrameType.KV_RESUME, m.KvResume("r7"), transfer_id=7)  # unknown: state 0, its own id
        seen = await peer.until(FrameType.KV_STATUS)
        statuses = [(h.transfer_id, x.state) for t, x, h in [f for f in seen if f is not None]
                    if t == FrameType.KV_STATUS]
        assert statuses == [(7, 0)], seen
        peer.close()


async def test_a_kv_begin_reusing_the_transfer_id_of_one_waiting_for_its_post_is_refused(tmp_sock_dir, engines):
    """The first KV_BEGIN waits for its post (nothing posted yet): a second one under the same
    transfer id for another request would take the first one's transfer when both are posted."""
    async with _agent_b(tmp_sock_dir) as b:
        eb, rb, peer = await _receiver_and_peer(b, engines, tmp_sock_dir)
        peer.send(FrameType.KV_BEGIN, _begin("y1"), transfer_id=60)
        async with asyncio.timeout(5):
            while b.kv.unposted_count() != 1:
                await asyncio.sleep(0.01)
        peer.send(FrameType.KV_BEGIN, _begin("y2"), transfer_id=60)
        got = [(t, x) for t, x in await peer.until_closed() if t != FrameType.PING]
        assert [(t, x.code) for t, x in got] == [(FrameType.ERROR, ErrorCode.UNEXPECTED_FRAME)], got
        assert b.kv.unposted_count() <= 1  # y2 never waited
        await eb.post_recv("y2", [rb.blocks(1, 1)], from_site="A")
        assert "y2" in b.posts  # nothing took it
        peer.close()


async def test_a_closing_session_opens_nothing_new(tmp_sock_dir, engines):
    """While a session closes (its agent stops, or a fleet session ends) a KV_BEGIN is refused,
    and so is one that waited for its post when the post comes: either would be opened only to
    be failed without a word to its sender. A resent KV_BEGIN of an open transfer is still
    answered (KV_ACCEPT)."""
    async with _agent_b(tmp_sock_dir) as b:
        eb, rb, peer = await _receiver_and_peer(b, engines, tmp_sock_dir, "c-open", "c-new")
        peer.send(FrameType.KV_BEGIN, _begin("c-open"), transfer_id=70)
        assert (await peer.until(FrameType.KV_ACCEPT))[-1] is not None
        peer.send(FrameType.KV_BEGIN, _begin("c-wait"), transfer_id=71)
        async with asyncio.timeout(5):
            while b.kv.unposted_count() != 1:
                await asyncio.sleep(0.01)
        b.sessions["A/a1"].closing = True  # as close() sets it first (the agent is not stopping)
        peer.send(FrameType.KV_BEGIN, _begin("c-new"), transfer_id=72)
        peer.send(FrameType.KV_BEGIN, _begin("c-open"), transfer_id=70)
        seen = await peer.until(FrameType.KV_ACCEPT)
        rejects = [(h.transfer_id, x.code) for f in seen if f is not None for t, x, h in [f]
                   if t == FrameType.KV_REJECT]
        assert rejects == [(72, ErrorCode.PEER_UNREACHABLE)], seen
        assert seen[-1] is not None and seen[-1][2].transfer_id == 70  # the open one: answered again
        assert "c-new" in b.posts  # not taken
        await eb.post_recv("c-wait", [rb.blocks(2, 1)], from_site="A")  # matches the waiting KV_BEGIN
        seen = await peer.until(FrameType.KV_REJECT)
        assert seen[-1] is not None and (seen[-1][2].transfer_id, seen[-1][1].code) == (71, ErrorCode.PEER_UNREACHABLE)
        ev = await eb.wait("c-wait", timeout=5)
        assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.PEER_UNREACHABLE, ev
        peer.close()
