"""A peer written from proto/ alone, breaking the rules against a real agent (plaintext, so it
can speak at all: with the default TLS it could not get past the handshake). Each bad frame
closes that connection only; the agent goes on serving."""

from __future__ import annotations

import asyncio
import contextlib

from conftest import metric, until
from pdd_wire.errors import ErrorCode
from pdd_wire.transport.tcp import KIND_BULK, KIND_CONTROL
from pdd_wire.wire import FrameType, Lane, encode_body, encode_bytes
from pdd_wire.wire import messages as m
from support.agents import run_agents, two_site_toml
from support.raw_peer import RawPeer, hello


@contextlib.asynccontextmanager
async def agent_b(tmp):
    async with run_agents(two_site_toml(tmp, plaintext=True), sites=("B",), wait_up=False) as ag:
        yield ag["B"]


async def hello_as_a(b) -> tuple[RawPeer, m.Welcome]:
    return await hello(b.wan_address[1])


async def test_out_of_range_values_close_that_connection_and_unknown_codes_are_named(tmp_sock_dir):
    async with agent_b(tmp_sock_dir) as b:
        # A NACK of chunk -1 (it once wrapped to the last segment) closes the connection.
        peer, _ = await hello_as_a(b)
        peer.writer.write(encode_bytes(FrameType.KV_NACK, b"\x91\xff", transfer_id=1))  # msgpack [-1]
        got = await peer.until_closed()
        assert [(t, x.code) for t, x in got if t != FrameType.PING] == [(FrameType.ERROR, ErrorCode.OUT_OF_RANGE)], got
        peer.close()
        # So does a HELLO whose max_chunk would have made 65,536 chunks of 64 KiB.
        peer = await RawPeer.dial(b.wan_address[1], KIND_CONTROL)
        peer.send(FrameType.HELLO, {"versions": [1], "site": "A", "node": "a1", "incarnation": 77, "max_chunk": 1})
        got = await peer.until_closed()
        assert [(t, x.code) for t, x in got if t != FrameType.PING] == [(FrameType.ERROR, ErrorCode.OUT_OF_RANGE)], got
        peer.close()
        # The agent serves the next peer; a KV_CANCEL with a code nobody assigned is handled
        # (as PEER_ERROR), not a failure: the connection stays and answers a PING.
        peer, _ = await hello_as_a(b)
        peer.send(FrameType.KV_CANCEL, [ "nobody-posted-this", 999, "from the future", False], transfer_id=5)
        peer.send(FrameType.KV_REJECT, ["nor-this", 12345, "?"], transfer_id=6)
        assert await peer.pong(9)
        assert b.sessions["A/a1"].is_up
        peer.close()


async def test_a_chunk_without_its_checksum_closes_the_bulk_connection_only(tmp_sock_dir):
    async with agent_b(tmp_sock_dir) as b:
        peer, welcome = await hello_as_a(b)
        bulk = await RawPeer.dial(b.wan_address[1], KIND_BULK)
        bulk.send(FrameType.BULK_HELLO, m.BulkHello(session=welcome.session, stream=0, site="A", node="a1"))
        t, _, _ = await bulk.next()
        assert t == FrameType.BULK_WELCOME
        bulk.send(FrameType.KV_CHUNK, b"", lane=Lane.BULK, transfer_id=1, payload=[b"k" * 1000], checksum=False)
        got = await bulk.until_closed()  # the ERROR may be lost: the agent aborts right after it
        assert all(t == FrameType.ERROR and x.code == ErrorCode.MALFORMED_BODY and "checksum" in x.message
                   for t, x in got), got
        assert metric(b, "pddwire_chunks_total", peer="A/a1", direction="rx") == 0
        # The control connection is untouched.
        assert await peer.pong(3)
        bulk.close()
        peer.close()


def _errors(b, code: ErrorCode) -> float:
    return metric(b, "pddwire_errors_total", code=code.name)


async def test_framing_errors_and_bad_preambles_are_counted_by_their_code(tmp_sock_dir):
    """Every framing error found in a peer's bytes is named and counted (proto/frames.md §1),
    the preamble's too (no reply there: no TLS yet); the agent keeps serving."""
    async with agent_b(tmp_sock_dir) as b:
        port = b.wan_address[1]
        # Reserved preamble bytes not 0: a bad preamble, closed without a reply.
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"PDDWC\x01\x01\x00")
        assert await r.read() == b""
        w.close()
        await until(lambda: _errors(b, ErrorCode.BAD_MAGIC) == 1, what="the bad preamble counted")
        # A control frame whose header check fails.
        peer, _ = await hello_as_a(b)
        bad = bytearray(encode_bytes(FrameType.PING, encode_body(m.Ping(nonce=1, sent_ns=1))))
        bad[40] ^= 0xFF
        peer.writer.write(bytes(bad))
        got = await peer.until_closed()
        assert (FrameType.ERROR, ErrorCode.HEADER_CHECKSUM) in [(t, getattr(x, "code", None)) for t, x in got], got
        await until(lambda: _errors(b, ErrorCode.HEADER_CHECKSUM) == 1, what="the header check counted")
        peer.close()
        # A bulk connection that sends a PING after its BULK_HELLO.
        peer, welcome = await hello_as_a(b)
        bulk = await RawPeer.dial(port, KIND_BULK)
        bulk.send(FrameType.BULK_HELLO, m.BulkHello(session=welcome.session, stream=0, site="A", node="a1"))
        assert (await bulk.next())[0] == FrameType.BULK_WELCOME
        before = _errors(b, ErrorCode.UNEXPECTED_FRAME)
        bulk.send(FrameType.PING, m.Ping(nonce=2, sent_ns=1))
        await bulk.until_closed()
        await until(lambda: _errors(b, ErrorCode.UNEXPECTED_FRAME) == before + 1, what="the bulk error counted")
        assert await peer.pong(4)  # the control connection is untouched
        bulk.close()
        peer.close()


async def test_a_kv_begin_with_transfer_id_0_is_out_of_range(tmp_sock_dir):
    async with agent_b(tmp_sock_dir) as b:
        peer, _ = await hello_as_a(b)
        peer.send(FrameType.KV_BEGIN, m.KvBegin("r-0", 4096, 4096, 1, 4096, 1, 1000), transfer_id=0)
        got = await peer.until_closed()
        assert [(t, x.code) for t, x in got if t != FrameType.PING] == [(FrameType.ERROR, ErrorCode.OUT_OF_RANGE)], got
        assert "transfer_id 0" in next(x.message for t, x in got if t == FrameType.ERROR)
        peer.close()


async def test_bulk_hello_while_the_control_connection_is_down_is_named(tmp_sock_dir):
    async with agent_b(tmp_sock_dir) as b:
        peer, welcome = await hello_as_a(b)
        peer.close()
        await until(lambda: not b.sessions["A/a1"].is_up, what="the session down")
        bulk = await RawPeer.dial(b.wan_address[1], KIND_BULK)
        bulk.send(FrameType.BULK_HELLO, m.BulkHello(session=welcome.session, stream=0, site="A", node="a1"))
        got = await bulk.until_closed()
        assert got and all(t == FrameType.ERROR and x.code == ErrorCode.UNEXPECTED_FRAME
                           and "control connection is down" in x.message for t, x in got), got
        bulk.close()


async def test_a_listener_that_speaks_before_welcome_is_refused_by_the_dialer(tmp_sock_dir):
    """proto/handshake.md §2: the listener sends nothing before WELCOME but ERROR. A listener
    (written here) that answers HELLO with a KV_BEGIN instead: agent A, its dialer, refuses it
    (ERROR UNEXPECTED_FRAME, counted) and opens nothing for it."""
    from pdd_wire.wire import FrameReader, decode_body

    got: asyncio.Queue = asyncio.Queue()

    async def listener(reader, writer):
        await reader.readexactly(8)  # the preamble
        frames = FrameReader(max_body=1 << 20)
        seen = []
        while not seen:
            seen += frames.feed(await reader.read(65536))
        assert seen[0].header.type == FrameType.HELLO
        writer.write(encode_bytes(FrameType.KV_BEGIN, encode_body(m.KvBegin("r-early", 4096, 4096, 1, 4096, 1, 1000)),
                                  transfer_id=5))
        answer = []
        while data := await reader.read(65536):
            answer += [(f.header.type, decode_body(f.header.type, f.body)) for f in frames.feed(data)]
        await got.put(answer)
        writer.close()

    server = await asyncio.start_server(listener, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        tomls = two_site_toml(tmp_sock_dir, plaintext=True, wan_override={"B": f"127.0.0.1:{port}"})
        async with run_agents(tomls, sites=("A",), wait_up=False) as ag:
            answer = await asyncio.wait_for(got.get(), 10)
            assert [(t, x.code) for t, x in answer] == [(FrameType.ERROR, ErrorCode.UNEXPECTED_FRAME)], answer
            assert "KV_BEGIN before WELCOME" in answer[0][1].message
            assert _errors(ag["A"], ErrorCode.UNEXPECTED_FRAME) >= 1
            assert not ag["A"].sessions["B/b1"].inn and not ag["A"].kv.unposted_count()
    finally:
        server.close()
        await server.wait_closed()
