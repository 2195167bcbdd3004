"""Inline chunks (proto/transfer.md §17): a KV_CHUNK of at most transfer.inline_bytes travels on
the control connection itself, right behind its KV_BEGIN. Real agents, sockets and memory; the
hostile peers are raw peers written from proto/ (support/raw_peer.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest

from conftest import engine_pair, fill_random, metric, same_bytes, until
from pdd_wire.engine import protocol as p
from pdd_wire.errors import ErrorCode
from pdd_wire.session.protocol import INLINE
from pdd_wire.wire import FrameType, Lane
from pdd_wire.wire import messages as m
from support.agents import run_agents, two_site_toml
from support.raw_peer import hello

BLOCK = 16 << 10


def _toml(tmp, inline: dict[str, int] | None = None, **kw) -> dict:
    """Two agents; ``inline[site]`` sets that agent's transfer.inline_bytes."""
    tomls = two_site_toml(tmp, **kw)
    for site, n in (inline or {}).items():
        tomls[site] = tomls[site].replace("[transfer]\n", f"[transfer]\ninline_bytes = {n}\n", 1)
    return tomls


def inline_chunks(agent, peer: str, direction: str) -> float:
    return metric(agent, "pddwire_kv_inline_chunks_total", peer=peer, direction=direction)


async def test_a_small_transfer_goes_inline_and_lands_byte_identical(tmp_sock_dir, engines):
    async with run_agents(_toml(tmp_sock_dir)) as ag:
        ea, eb, src, dst, ra, rb = await engine_pair(engines, tmp_sock_dir, 16 * BLOCK, BLOCK)
        for rid, first, n in (("posted-first", 0, 1), ("sent-first", 4, 3)):
            if rid == "posted-first":
                await eb.post_recv(rid, [rb.blocks(first, n)], from_site="A")
                await until(lambda: "posted-first" in ag["A"].sessions["B/b1"].sender.offers, what="the offer at A")
                await ea.send_kv(rid, [ra.blocks(first, n)], to=["B"])
            else:  # KV_ACCEPT first, then the chunk inline
                await ea.send_kv(rid, [ra.blocks(first, n)], to=["B"], lease_s=10)
                await until(lambda: ag["B"].kv.unposted, what="the KV_BEGIN waiting for its post")
                await eb.post_recv(rid, [rb.blocks(first, n)], from_site="A")
            got = await eb.wait(rid, timeout=10)
            assert isinstance(got, p.KvReceived) and got.bytes == n * BLOCK, got
            assert isinstance(await ea.wait(rid, timeout=10), p.KvSent)
        assert await same_bytes(dst.buf[:BLOCK], src.buf[:BLOCK])
        assert await same_bytes(dst.buf[4 * BLOCK:7 * BLOCK], src.buf[4 * BLOCK:7 * BLOCK])
        assert not any(dst.buf[BLOCK:4 * BLOCK]) and not any(dst.buf[7 * BLOCK:])
        assert inline_chunks(ag["A"], "B/b1", "tx") == 2
        assert inline_chunks(ag["B"], "A/a1", "rx") == 2
        assert metric(ag["A"], "pddwire_chunks_total", peer="B/b1", direction="tx") == 2
        assert metric(ag["B"], "pddwire_chunks_held_total", peer="A/a1", outcome="held") == 0
        assert metric(ag["A"], "pddwire_retransmits_total", peer="B/b1", reason="busy") == 0


async def test_inline_bytes_in_flight_stay_within_the_bound(tmp_sock_dir, engines):
    """48 transfers of 16 KiB at once, inline_bytes 32 KiB: never more than 32 KiB in flight on
    the control connection (what does not fit goes on the bulk connections); every byte lands."""
    async with run_agents(_toml(tmp_sock_dir, inline={"A": 2 * BLOCK})) as ag:
        ea, eb, src, dst, ra, rb = await engine_pair(engines, tmp_sock_dir, 48 * BLOCK, BLOCK)
        flow = ag["A"].sessions["B/b1"].flow
        peak, dispatch = [0], flow.dispatch

        def watched(now):
            out = dispatch(now)
            peak[0] = max(peak[0], flow.lanes.get(INLINE, 0))
            return out

        flow.dispatch = watched
        for i in range(48):
            await eb.post_recv(f"r{i}", [rb.blocks(i, 1)], from_site="A")
        await until(lambda: len(ag["A"].sessions["B/b1"].sender.offers) == 48, what="48 offers at A")
        await asyncio.gather(*(ea.send_kv(f"r{i}", [ra.blocks(i, 1)], to=["B"]) for i in range(48)))
        for i in range(48):
            assert isinstance(await eb.wait(f"r{i}", timeout=10), p.KvReceived)
            assert isinstance(await ea.wait(f"r{i}", timeout=10), p.KvSent)
        assert await same_bytes(dst.buf, src.buf)
        sent_inline = inline_chunks(ag["A"], "B/b1", "tx")
        assert 0 < peak[0] <= 2 * BLOCK
        assert 1 <= sent_inline <= 48
        assert metric(ag["A"], "pddwire_chunks_total", peer="B/b1", direction="tx") == 48


@pytest.mark.parametrize("off", ["A", "B"])
async def test_with_inline_off_on_either_side_chunks_go_bulk(tmp_sock_dir, engines, off):
    async with run_agents(_toml(tmp_sock_dir, inline={off: 0})) as ag:
        ea, eb, src, dst, ra, rb = await engine_pair(engines, tmp_sock_dir, 4 * BLOCK, BLOCK)
        assert ("inline.v1" in ag["A"].sessions["B/b1"].remote_caps) == (off == "A")
        await eb.post_recv("r", [rb.blocks(0, 2)], from_site="A")
        await ea.send_kv("r", [ra.blocks(0, 2)], to=["B"])
        assert isinstance(await eb.wait("r", timeout=10), p.KvReceived)
        assert await same_bytes(dst.buf[:2 * BLOCK], src.buf[:2 * BLOCK])
        assert inline_chunks(ag["A"], "B/b1", "tx") == 0 and inline_chunks(ag["B"], "A/a1", "rx") == 0
        assert INLINE not in ag["A"].sessions["B/b1"].flow.lanes


async def test_a_lost_control_connection_sends_its_inline_chunks_again(tmp_sock_dir, engines):
    """The control connection drops with an inline chunk in flight (it never reached B): after
    the reconnect it is sent again, and lands."""
    async with run_agents(_toml(tmp_sock_dir)) as ag:
        ea, eb, src, dst, ra, rb = await engine_pair(engines, tmp_sock_dir, 4 * BLOCK, BLOCK)
        sess = ag["A"].sessions["B/b1"]
        send, lost = sess.sender._send_inline, []

        def lose_first(tid, k, views):
            if lost:
                return send(tid, k, views)
            lost.append((tid, k))  # in flight on the control connection, which now goes
            asyncio.get_running_loop().call_soon(sess.reconnect, "test: the control connection drops")

        sess.sender._send_inline = lose_first
        await eb.post_recv("again", [rb.blocks(0, 2)], from_site="A")
        await until(lambda: "again" in sess.sender.offers, what="the offer at A")
        await ea.send_kv("again", [ra.blocks(0, 2)], to=["B"])
        assert isinstance(await eb.wait("again", timeout=20), p.KvReceived)
        assert isinstance(await ea.wait("again", timeout=20), p.KvSent)
        assert await same_bytes(dst.buf[:2 * BLOCK], src.buf[:2 * BLOCK])
        assert lost and inline_chunks(ag["A"], "B/b1", "tx") >= 1
        assert metric(ag["A"], "pddwire_retransmits_total", peer="B/b1", reason="connection_lost") >= 1


# -- raw peers: what a second implementation sees, and what a hostile one meets -----------------
@contextlib.asynccontextmanager
async def _agent_b(tmp, inline: int = 64 << 10):
    tomls = _toml(tmp, inline={"B": inline}, plaintext=True)
    async with run_agents(tomls, sites=("B",), wait_up=False) as ag:
        yield ag["B"]


CAPS = ("kv.v1", "tokens.v1", "offer.v1", "inline.v1")


async def test_a_raw_peer_sends_kv_inline_and_gets_it_acknowledged(tmp_sock_dir, engines):
    """From proto/ alone: HELLO with inline.v1, KV_BEGIN, the chunk on the control connection,
    KV_DONE back; the bytes are in the engine's memory. A chunk for a transfer never announced
    is dropped and writes nothing; the session stays up."""
    async with _agent_b(tmp_sock_dir) as b:
        peer, welcome = await hello(b.wan_address[1], capabilities=CAPS)
        assert "inline.v1" in welcome.capabilities
        eb = await engines.connect(tmp_sock_dir / "B.sock", "decode")
        mem = engines.memory(4 * BLOCK)
        rb = await eb.register(mem, block_bytes=BLOCK)
        await eb.post_recv("raw", [rb.blocks(1, 2)], from_site="A")
        seen = await peer.until(FrameType.KV_OFFER)
        assert seen[-1][1].request_id == "raw"
        data = os.urandom(2 * BLOCK)
        peer.send(FrameType.KV_CHUNK, b"", transfer_id=55, seq=0, payload=[os.urandom(BLOCK)])  # never announced
        peer.send(FrameType.KV_BEGIN, m.KvBegin("raw", 2 * BLOCK, 4 << 20, 1, BLOCK, 2, 5000, offered=True),
                  transfer_id=7)
        peer.send(FrameType.KV_CHUNK, b"", lane=Lane.BULK, transfer_id=7, seq=0, payload=[data])
        seen = await peer.until(FrameType.KV_DONE)
        assert seen[-1][2].transfer_id == 7
        got = await eb.wait("raw", timeout=10)
        assert isinstance(got, p.KvReceived) and got.bytes == 2 * BLOCK
        assert bytes(mem.buf[BLOCK:3 * BLOCK]) == data
        assert not any(mem.buf[:BLOCK]) and not any(mem.buf[3 * BLOCK:])
        assert await peer.pong(3)
        assert inline_chunks(b, "A/a1", "rx") == 2
        peer.close()


async def test_a_bad_inline_checksum_is_asked_for_again(tmp_sock_dir, engines):
    async with _agent_b(tmp_sock_dir) as b:
        peer, _ = await hello(b.wan_address[1], capabilities=CAPS)
        eb = await engines.connect(tmp_sock_dir / "B.sock", "decode")
        mem = engines.memory(2 * BLOCK)
        await fill_random(mem)
        rb = await eb.register(mem, block_bytes=BLOCK)
        await eb.post_recv("bad", [rb.blocks(0, 1)], from_site="A")
        await peer.until(FrameType.KV_OFFER)
        peer.send(FrameType.KV_BEGIN, m.KvBegin("bad", BLOCK, 4 << 20, 1, BLOCK, 1, 5000, offered=True),
                  transfer_id=8)
        good = os.urandom(BLOCK)
        peer.send(FrameType.KV_CHUNK, b"", transfer_id=8, seq=0, payload=[good], xxh3=12345)
        seen = await peer.until(FrameType.KV_NACK)
        assert seen[-1][1].code == ErrorCode.CHUNK_CHECKSUM and seen[-1][2].transfer_id == 8
        peer.send(FrameType.KV_CHUNK, b"", transfer_id=8, seq=0, payload=[good])
        assert isinstance(await eb.wait("bad", timeout=10), p.KvReceived)
        assert bytes(mem.buf[:BLOCK]) == good
        peer.close()


@pytest.mark.parametrize("case", ["before HELLO", "payload on a PING", "over 64 KiB", "no checksum", "lz4",
                                  "empty", "not advertised"])
async def test_a_bad_inline_chunk_closes_only_that_connection(tmp_sock_dir, engines, case):
    """Each row of proto/transfer.md §17's table: the named ERROR, that connection closed, the
    agent still serving (a new session comes up and moves KV inline)."""
    from pdd_wire.transport.tcp import KIND_CONTROL
    from support.raw_peer import RawPeer

    async with _agent_b(tmp_sock_dir, inline=0 if case == "not advertised" else 64 << 10) as b:
        port = b.wan_address[1]
        chunk = {"transfer_id": 9, "seq": 0, "payload": [os.urandom(BLOCK)]}
        if case == "before HELLO":
            peer = await RawPeer.dial(port, KIND_CONTROL)
            peer.send(FrameType.KV_CHUNK, b"", **chunk)
            code = ErrorCode.UNEXPECTED_FRAME
        else:
            peer, welcome = await hello(port, capabilities=CAPS, incarnation=90)
            assert ("inline.v1" in welcome.capabilities) == (case != "not advertised")
            if case == "payload on a PING":
                peer.send(FrameType.PING, m.Ping(nonce=1, sent_ns=1), payload=[b"x" * 10])
                code = ErrorCode.FRAME_TOO_LARGE
            elif case == "over 64 KiB":
                peer.send(FrameType.KV_CHUNK, b"", transfer_id=9, seq=0, payload=[os.urandom((64 << 10) + 1)])
                code = ErrorCode.FRAME_TOO_LARGE
            elif case == "no checksum":
                peer.send(FrameType.KV_CHUNK, b"", checksum=False, **chunk)
                code = ErrorCode.MALFORMED_BODY
            elif case == "lz4":
                peer.send(FrameType.KV_CHUNK, b"", flags=2, **chunk)
                code = ErrorCode.MALFORMED_BODY
            elif case == "empty":
                peer.send(FrameType.KV_CHUNK, b"", transfer_id=9, seq=0)
                code = ErrorCode.MALFORMED_BODY
            else:
                peer.send(FrameType.KV_CHUNK, b"", **chunk)
                code = ErrorCode.UNEXPECTED_FRAME
        frames = await peer.until_closed()
        errors = [body for t, body in frames if t == FrameType.ERROR]
        assert errors and errors[-1].code == code, frames
        peer.close()
        # The agent goes on: a new session moves KV (inline where advertised).
        good, welcome = await hello(port, capabilities=CAPS, incarnation=91)
        eb = await engines.connect(tmp_sock_dir / "B.sock", "decode")
        rb = await eb.register(engines.memory(BLOCK), block_bytes=BLOCK)
        await eb.post_recv("after", [rb.blocks(0, 1)], from_site="A")
        if "inline.v1" in welcome.capabilities:
            await good.until(FrameType.KV_OFFER)
            good.send(FrameType.KV_BEGIN, m.KvBegin("after", BLOCK, 4 << 20, 1, BLOCK, 1, 5000, offered=True),
                      transfer_id=10)
            good.send(FrameType.KV_CHUNK, b"", transfer_id=10, seq=0, payload=[os.urandom(BLOCK)])
            assert isinstance(await eb.wait("after", timeout=10), p.KvReceived)
        else:
            assert await good.pong(2)
        good.close()
