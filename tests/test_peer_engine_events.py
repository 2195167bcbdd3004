"""What a peer's frames can make the agent tell a local engine is bounded by the engine's own
work, not by what the peer sends (proto/handoff.md §5, proto/transfer.md §10 and §12):

* a handoff's relay reaches MD's engine as extends of at most ``MAX_EXTEND_TOKENS`` positions,
  one at a time, and past ``MAX_RELAYED_TOKENS`` MD gives the request back (before: every
  position kept, then one extend of them all: 3.6M IDs made an 18 MB event that broke the
  client, 14M cut the engine off);
* copies of a REQUEST_ABORT that come while the first one's cancel runs tell the engine
  ``aborted`` once (before: once per copy, all in one turn: 5,000 copies with a long reason cut
  the engine off at ``limits.engine_queue_bytes``).

A real in-process agent (site B) and a raw peer written from proto/ alone playing A/a1.
"""

from __future__ import annotations

import asyncio
import contextlib

from pdd_wire.desk.handoff_protocol import MAX_EXTEND_TOKENS, MAX_RELAYED_TOKENS
from pdd_wire.engine import protocol as p
from pdd_wire.transport.tcp import KIND_BULK
from pdd_wire.wire import FrameType, Lane
from pdd_wire.wire import messages as m
from pdd_wire.wire.frame import F_CHECKSUM, Header, encode_header
from support.agents import run_agents, two_site_toml
from support.raw_peer import RawPeer, hello

CAPS = ("kv.v1", "tokens.v1", "abort.v1", "handoff.v1")
KiB = 1 << 10
PER_FRAME = 100_000
BIG = 1 << 31  # token IDs of 5 bytes each on the wire


async def _bulk(b, welcome) -> RawPeer:
    bulk = await RawPeer.dial(b.wan_address[1], KIND_BULK)
    bulk.send(FrameType.BULK_HELLO, m.BulkHello(session=welcome.session, stream=0, site="A", node="a1"))
    assert (await bulk.next())[0] == FrameType.BULK_WELCOME
    return bulk


@contextlib.asynccontextmanager
async def _md_handoff(tmp, engines):
    """Agent B with an MD engine that posted request "h" (one 64 KiB block) and took it over from
    A with ``handoff_md``, and the raw peer A/a1: ``(b, md, its region, peer, welcome)``."""
    async with run_agents(two_site_toml(tmp, plaintext=True), sites=("B",), wait_up=False) as ag:
        b = ag["B"]
        md = await engines.connect(tmp / "B.sock", "md")
        rb = await md.register(engines.memory(1 << 20), block_bytes=64 * KiB)
        peer, welcome = await hello(b.wan_address[1], capabilities=CAPS)
        alive = asyncio.create_task(peer.keepalive(0.2))
        try:
            await md.post_recv("h", [rb.blocks(0, 1)], from_site="A")
            await md.handoff_md("h", "A")
            yield b, md, rb, peer, welcome
        finally:
            alive.cancel()
            peer.close()


async def _relay(peer: RawPeer, rid: str, n: int) -> None:
    for seq in range(0, n, PER_FRAME):
        peer.send(FrameType.TOKENS, m.Tokens(rid, seq, [BIG + i for i in range(seq, min(n, seq + PER_FRAME))], True))
        await peer.writer.drain()


async def test_a_handoff_relay_reaches_md_in_bounded_extends(tmp_sock_dir, engines):
    """RLD relays 300,000 positions before MD's KV is there: MD's engine gets them as extends of
    at most MAX_EXTEND_TOKENS, each after it absorbed the last, in order, every position once."""
    n = 300_000
    async with _md_handoff(tmp_sock_dir, engines) as (b, md, rb, peer, welcome):
        await _relay(peer, "h", n)
        bulk = await _bulk(b, welcome)
        peer.send(FrameType.KV_BEGIN, m.KvBegin("h", 64 * KiB, 64 * KiB, 1, 64 * KiB, 1, 10_000), transfer_id=11)
        assert (await peer.until(FrameType.KV_ACCEPT))[-1] is not None
        bulk.send(FrameType.KV_CHUNK, b"", transfer_id=11, payload=[b"z" * (64 * KiB)])
        got: list[int] = []
        sizes = []
        while len(got) < n:
            ev = await md.wait("h", kinds=(p.Extend,), timeout=20)
            assert ev.first == len(got), (ev.first, len(got))
            sizes.append(len(ev.tokens))
            got += ev.tokens
            await md.handoff_extended("h", ev.first + len(ev.tokens))
        assert got == [BIG + i for i in range(n)]
        assert max(sizes) <= MAX_EXTEND_TOKENS and len(sizes) >= n // MAX_EXTEND_TOKENS, sizes
        await md.post_recv("after", [rb.blocks(4, 1)], from_site="A")  # the engine is still served
        bulk.close()


async def test_a_relay_past_the_per_request_limit_gives_the_request_back(tmp_sock_dir, engines):
    """RLD relays more than MAX_RELAYED_TOKENS positions: a protocol error of the handoff; MD
    gives the request back (HANDOFF_RELEASE, and ``handoff_done`` owner RLD to its engine) and
    keeps no more of them; the engine is not cut off."""
    async with _md_handoff(tmp_sock_dir, engines) as (b, md, rb, peer, _):
        await _relay(peer, "h", MAX_RELAYED_TOKENS + 2 * PER_FRAME)
        seen = await peer.until(FrameType.HANDOFF_RELEASE, timeout=20)
        assert seen[-1] is not None and seen[-1][1] == m.HandoffRelease("h", 0, "protocol_error"), seen[-3:]
        done = await md.wait("h", kinds=(p.HandoffDone,), timeout=10)
        assert done.owner == "RLD"
        e = b.handoffs.live.get("h")
        assert e is None or len(e.sm.tokens) <= MAX_RELAYED_TOKENS
        await md.post_recv("after", [rb.blocks(4, 1)], from_site="A")


async def test_copies_of_a_request_abort_tell_the_engine_once(tmp_sock_dir, engines):
    """The peer holds its transfer's cancel open (a chunk begun on a bulk connection, then
    silence: the receiver waits up to 1 s for it to stop writing) and sends 2,000 copies of a
    REQUEST_ABORT with a 4 KiB reason meanwhile: the engine hears ``aborted`` once."""
    async with run_agents(two_site_toml(tmp_sock_dir, plaintext=True), sites=("B",), wait_up=False) as ag:
        b = ag["B"]
        eb = await engines.connect(tmp_sock_dir / "B.sock", "dec")
        rb = await eb.register(engines.memory(1 << 20), block_bytes=64 * KiB)
        await eb.post_recv("bystander", [rb.blocks(8, 1)], from_site="A")
        await eb.post_recv("r", [rb.blocks(0, 2)], from_site="A")
        peer, welcome = await hello(b.wan_address[1])
        alive = asyncio.create_task(peer.keepalive(0.2))
        try:
            bulk = await _bulk(b, welcome)
            peer.send(FrameType.KV_BEGIN, m.KvBegin("r", 128 * KiB, 64 * KiB, 2, 64 * KiB, 2, 30_000), transfer_id=11)
            assert (await peer.until(FrameType.KV_ACCEPT))[-1] is not None
            bulk.writer.write(encode_header(Header(type=FrameType.KV_CHUNK, flags=F_CHECKSUM, lane=Lane.BULK,
                                                   transfer_id=11, seq=0, payload_len=64 * KiB, payload_xxh3=1), b"")
                              + b"x" * 10)  # chunk 0 begun, never finished
            await bulk.writer.drain()
            await asyncio.sleep(0.2)
            frame = m.RequestAbort("r", "x" * 4096)
            for i in range(2000):
                peer.send(FrameType.REQUEST_ABORT, frame)
                if i % 200 == 0:
                    await peer.writer.drain()
            await peer.writer.drain()
            await eb.wait("r", kinds=(p.RequestAborted,), timeout=10)
            await asyncio.sleep(1.5)  # copies would come by now (the cancel took up to 1 s)
            assert eb.take("r", kinds=(p.RequestAborted,)) == []
            assert len(b.kv.aborting) == 0
            await eb.post_recv("after", [rb.blocks(4, 1)], from_site="A")  # still served
            bulk.close()
        finally:
            alive.cancel()
            peer.close()
