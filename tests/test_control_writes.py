"""Control connections write once per loop turn (pdd_wire/transport/tcp.py FrameProtocol), and
the session's KV_ACKs of a turn go as ranges in that write (pdd_wire/session/acks.py).

Two real FrameProtocols over a real loopback socket, plain and mutual TLS, on asyncio's loop
and on uvloop (the agent's): every frame sent in one turn leaves in one transport write, in
the order sent; ``fail`` and ``close`` flush what the turn queued before the ERROR frame and
the end; the PEER_NOT_READING limit counts the queued bytes; a closed connection raises at
once. The writes are counted on the real transport (a counting wrapper passes everything on).
"""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvloop

from pdd_wire.errors import ErrorCode, ProtocolError, TransportError
from pdd_wire.session.acks import AckBatch
from pdd_wire.transport.tcp import (
    KIND_CONTROL,
    FrameProtocol,
    adopt,
    dial,
    read_preamble,
)
from pdd_wire.transport.tls import client_tls_context, server_tls_context
from pdd_wire.wire import FrameType, decode_body, encode, encode_body
from pdd_wire.wire import messages as m
from support.certs import make_pki
from support.counting import Counting

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), ["a1", "b1"])


@pytest.fixture(params=[(loop, tls) for loop in LOOPS for tls in ("plain", "tls")], ids=lambda p: "-".join(p))
def run(request, pki):
    """Run ``scenario(a, b)`` on a fresh loop of the kind named, over a connection a dialed."""
    loop_kind, tls = request.param

    def go(scenario, *, max_unsent: int = 0):
        with asyncio.Runner(loop_factory=LOOPS[loop_kind]) as runner:
            runner.run(_with_pair(scenario, pki if tls == "tls" else None, max_unsent))
    return go


def framed(max_unsent: int = 0) -> FrameProtocol:
    conn = FrameProtocol(max_body=1 << 16, max_payload=0, max_unsent=max_unsent)
    conn.frames = asyncio.Queue()
    conn.ended = asyncio.get_running_loop().create_future()
    conn.on_frame = lambda c, f: c.frames.put_nowait(f)
    conn.on_lost = lambda c, e: c.ended.done() or c.ended.set_result(e)
    return conn


async def _with_pair(scenario, pki, max_unsent: int) -> None:
    loop = asyncio.get_running_loop()
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    accepted = loop.create_future()
    sctx = server_tls_context(*pki["b1"], pki["ca"]) if pki else None
    cctx = client_tls_context(*pki["a1"], pki["ca"]) if pki else None

    async def accept_one():
        sock, _ = await loop.sock_accept(server)
        sock.setblocking(False)
        assert await read_preamble(sock, 5) == KIND_CONTROL
        accepted.set_result(await adopt(sock, framed(), ssl_ctx=sctx, timeout=5))

    task = asyncio.create_task(accept_one())
    try:
        a = await dial("127.0.0.1", server.getsockname()[1], KIND_CONTROL, framed(max_unsent), ssl_ctx=cctx,
                       server_name="b1", timeout=5)
        b = await asyncio.wait_for(accepted, 10)
        a.transport = Counting(a.transport)
        await scenario(a, b)
        a.abort()
        b.abort()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.close()


def ping(i: int) -> list:
    return encode(FrameType.PING, encode_body(m.Ping(i, 0)))


async def nonces(conn: FrameProtocol, n: int) -> list[int]:
    got = []
    for _ in range(n):
        f = await asyncio.wait_for(conn.frames.get(), 10)
        assert f.header.type == FrameType.PING
        got.append(decode_body(f.header.type, f.body).nonce)
    return got


def test_the_frames_of_one_turn_leave_in_one_write_in_the_order_sent(run):
    async def scenario(a, b):
        for i in range(200):
            a.send(ping(i))
        assert a.transport.writes == 0  # queued until the turn ends
        assert await nonces(b, 200) == list(range(200))
        assert a.transport.writes == 1
        for i in range(200, 203):  # a later turn: its own single write, after the first
            a.send(ping(i))
        assert await nonces(b, 3) == [200, 201, 202]
        assert a.transport.writes == 2
    run(scenario)


def test_fail_sends_what_the_turn_queued_then_the_error_frame(run):
    async def scenario(a, b):
        for i in range(5):
            a.send(ping(i))
        a.fail(ProtocolError("bad frame from you", ErrorCode.MALFORMED_BODY))
        assert await nonces(b, 5) == list(range(5))
        f = await asyncio.wait_for(b.frames.get(), 10)
        assert f.header.type == FrameType.ERROR
        err = decode_body(f.header.type, f.body)
        assert (err.code, err.message) == (ErrorCode.MALFORMED_BODY, "bad frame from you")
        await asyncio.wait_for(b.ended, 10)
        with pytest.raises(TransportError, match="connection closed"):
            a.send(ping(9))
    run(scenario)


def test_close_sends_what_the_turn_queued_then_ends(run):
    async def scenario(a, b):
        for i in range(5):
            a.send(ping(i))
        a.close()
        with pytest.raises(TransportError, match="connection closed"):  # at once, not at the flush
            a.send(ping(9))
        assert await nonces(b, 5) == list(range(5))
        await asyncio.wait_for(b.ended, 10)
        assert b.frames.empty()
    run(scenario)


def test_the_not_reading_limit_counts_the_bytes_queued_this_turn(run):
    limit = 4096

    async def scenario(a, b):
        size = sum(len(x) for x in ping(0))
        sent = 0
        with pytest.raises(TransportError) as caught:
            for i in range(limit):  # nothing reaches the transport this turn: only the queue grows
                a.send(ping(i))
                sent += 1
        assert caught.value.code == ErrorCode.PEER_NOT_READING
        assert sent == limit // size  # the frame that took the queue past the limit raised
        assert f"{(sent + 1) * size} bytes unsent" in str(caught.value)
        await asyncio.wait_for(a.ended, 10)
        assert isinstance(await asyncio.wait_for(a.ended, 10), TransportError)
        with pytest.raises(TransportError, match="connection closed"):
            a.send(ping(0))
    run(scenario, max_unsent=limit)


def test_acks_of_one_turn_go_as_ranges_in_that_turns_write_none_overtaken(run):
    """The session's AckBatch on a real control connection: contiguous chunks acked in one turn
    leave as one KV_ACK {first, count} per run (either neighbour), per transfer; a frame of
    another type sent after some acks goes after them; all of it in the turn's one write."""
    async def scenario(a, b):
        def send(ftype, body, *, tid=0):
            if not batch.hold(a, ftype, body, tid):
                a.send(encode(ftype, encode_body(body), transfer_id=tid))
            return True

        batch = AckBatch(send)
        for tid, k in ((1, 0), (1, 1), (1, 2), (2, 5), (1, 3), (2, 4)):
            send(FrameType.KV_ACK, m.KvAck(k, 1), tid=tid)
        send(FrameType.PING, m.Ping(77, 0))
        for tid, k in ((1, 7), (1, 6), (1, 9)):
            send(FrameType.KV_ACK, m.KvAck(k, 1), tid=tid)
        got = []
        for _ in range(5):
            f = await asyncio.wait_for(b.frames.get(), 10)
            msg = decode_body(f.header.type, f.body)
            got.append((f.header.transfer_id, msg.first, msg.count) if isinstance(msg, m.KvAck) else msg.nonce)
        assert got == [(1, 0, 4), (2, 4, 2), 77, (1, 6, 2), (1, 9, 1)], got
        assert a.transport.writes == 1
    run(scenario)


def test_a_flush_callback_that_raises_does_not_stop_the_connections_writes(run):
    """``on_flush`` (the session's ack batch) raising is a bug, logged: the turn's frames still
    leave, and later turns still flush (the flush-due mark is reset whatever it did)."""
    async def scenario(a, b):
        calls = []

        def broken():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a bug in the flush callback")

        a.on_flush = broken
        for i in range(3):
            a.send(ping(i))
        assert await nonces(b, 3) == [0, 1, 2]
        for i in range(3, 6):  # the next turn flushes too: nothing is left queued behind the raise
            a.send(ping(i))
        assert await nonces(b, 3) == [3, 4, 5]
        assert len(calls) == 2 and a.transport.writes == 2
    run(scenario)


def test_children_of_a_forgotten_peer_are_looked_up_again():
    """Metrics.child caches ``labels()``; once a peer's series are removed (a closed fleet
    session), its cached children must go too, or counts would go to a series no longer exported."""
    from pdd_wire.metrics import Metrics

    metrics = Metrics()
    metrics.child(metrics.frames, "B/b1", "control", "tx").inc()
    metrics.frames.remove("B/b1", "control", "tx")
    metrics.drop_children("B/b1")
    metrics.child(metrics.frames, "B/b1", "control", "tx").inc(2)
    text = metrics.render().decode()
    assert 'pddwire_frames_total{direction="tx",lane="control",peer="B/b1"} 2.0' in text
