"""A peer written from proto/ alone, breaking the rules against a real agent (plaintext, so it
can speak at all: with the default TLS it could not get past the handshake). Each bad frame
closes that connection only; the agent goes on serving."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import pytest

from conftest import metric, until
from pdd_wire.engine import protocol as p
from pdd_wire.errors import ErrorCode, ProtocolError
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


@pytest.mark.parametrize("ftype", [FrameType.KV_REJECT, FrameType.KV_CANCEL, FrameType.ERROR])
def test_code_zero_from_a_peer_is_no_ok_an_engine_could_be_told(ftype):
    """0 (OK) is never sent (proto/errors.md): a KV_REJECT, KV_CANCEL or ERROR carrying it is
    decoded as PEER_ERROR with the original named, as an unassigned code is -- an engine is
    never told a transfer failed with code 0."""
    fields = {FrameType.KV_REJECT: ["r", 0, "zero"], FrameType.KV_CANCEL: ["r", 0, "zero", False],
              FrameType.ERROR: [0, "zero"]}[ftype]
    msg = m.decode_body(ftype, msgspec.msgpack.encode(fields))
    assert msg.code == ErrorCode.PEER_ERROR and msg.message == "zero (peer code 0)", msg


@pytest.mark.parametrize("site", ["A\n", "-A", "a" * 64, "A/a1"])
def test_a_site_name_is_the_whole_string_the_spec_allows(site):
    """1-63 of [A-Za-z0-9._-], starting alphanumeric (proto/messages.md), and nothing after:
    a regex's ``$`` would also let a final newline through (it did, on the wire and in the
    config alike)."""
    with pytest.raises(ProtocolError) as exc:
        m.decode_body(FrameType.HELLO, msgspec.msgpack.encode({"versions": [1], "site": site, "node": "a1",
                                                               "incarnation": 7}))
    assert exc.value.code == ErrorCode.OUT_OF_RANGE
    from pdd_wire.config import NAME

    assert not NAME.match(site) and NAME.match("A") and NAME.match("a" * 63)


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


async def test_an_empty_kv_chunk_fails_its_transfer_and_an_empty_lz4_one_is_asked_again(tmp_sock_dir, engines):
    """No chunk is empty. An empty payload (the frame reader calls no payload sink for it) was
    answered KV_NACK CHUNK_BUSY, which a sender resends without counting: a loop for ever. It is
    a chunk of the wrong size, checksum flag or not: the transfer fails MALFORMED_BODY
    (proto/transfer.md §7); with LZ4 it does not decode: KV_NACK CHUNK_CHECKSUM."""
    from pdd_wire.wire import Flags

    async with agent_b(tmp_sock_dir) as b:
        eb = await engines.connect(tmp_sock_dir / "B.sock", "b")
        rb = await eb.register(engines.memory(1 << 20), block_bytes=64 << 10)
        for i, rid in enumerate(("e1", "e2")):
            await eb.post_recv(rid, [rb.blocks(i, 1)], from_site="A")
        peer, welcome = await hello_as_a(b)
        bulk = await RawPeer.dial(b.wan_address[1], KIND_BULK)
        bulk.send(FrameType.BULK_HELLO, m.BulkHello(session=welcome.session, stream=0, site="A", node="a1"))
        assert (await bulk.next())[0] == FrameType.BULK_WELCOME
        for tid, rid in ((11, "e1"), (12, "e2")):
            peer.send(FrameType.KV_BEGIN, m.KvBegin(rid, 64 << 10, 64 << 10, 1, 64 << 10, 1, 10_000), transfer_id=tid)
            seen = await peer.until(FrameType.KV_ACCEPT)
            assert seen[-1] is not None, seen
        checked = int(Flags.PAYLOAD_CHECKSUM)
        bulk.send(FrameType.KV_CHUNK, b"", transfer_id=12, flags=checked | int(Flags.LZ4), payload=[])
        seen = await peer.until(FrameType.KV_NACK)
        assert seen[-1] is not None and seen[-1][2].transfer_id == 12, seen
        assert seen[-1][1].code == ErrorCode.CHUNK_CHECKSUM, seen
        bulk.send(FrameType.KV_CHUNK, b"", transfer_id=11, flags=checked, payload=[])
        seen = await peer.until(FrameType.KV_CANCEL)
        assert seen[-1] is not None and seen[-1][2].transfer_id == 11, seen
        assert (seen[-1][1].code, seen[-1][1].by_receiver) == (ErrorCode.MALFORMED_BODY, True), seen
        assert not [f for f in seen if f is not None and f[0] == FrameType.KV_NACK], seen
        ev = await eb.wait("e1", timeout=5)
        assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.MALFORMED_BODY, ev
        # The bulk connection and the other transfer go on: its real chunk lands.
        bulk.send(FrameType.KV_CHUNK, b"", transfer_id=12, payload=[b"z" * (64 << 10)])
        ev = await eb.wait("e2", timeout=5)
        assert isinstance(ev, p.KvReceived), ev
        # Without the checksum flag (a frame with no payload has flag 0, proto/frames.md): the same.
        await eb.post_recv("e3", [rb.blocks(2, 1)], from_site="A")
        peer.send(FrameType.KV_BEGIN, m.KvBegin("e3", 64 << 10, 64 << 10, 1, 64 << 10, 1, 10_000), transfer_id=13)
        assert (await peer.until(FrameType.KV_ACCEPT))[-1] is not None
        bulk.send(FrameType.KV_CHUNK, b"", transfer_id=13, payload=[])
        seen = await peer.until(FrameType.KV_CANCEL)
        assert seen[-1] is not None and (seen[-1][2].transfer_id, seen[-1][1].code) == (13, ErrorCode.MALFORMED_BODY)
        assert await peer.pong(5)
        bulk.close()
        peer.close()



async def test_request_aborts_tied_to_nothing_are_counted_and_logged_once_per_period(tmp_sock_dir, info_logs):
    """A REQUEST_ABORT tied to nothing here is ignored (proto/transfer.md §10). It wrote one log
    line each: some 200 bytes of log for 60 on the wire, several MB/s from one peer. Now one
    line per 30 s per peer; the counter has them all."""
    async with agent_b(tmp_sock_dir) as b:
        peer, _ = await hello_as_a(b)
        info_logs.seek(0)
        info_logs.truncate()
        for i in range(2000):
            peer.send(FrameType.REQUEST_ABORT, m.RequestAbort(f"nobody-{i}", "gone"))
        assert await peer.pong(6)
        assert metric(b, "pddwire_request_aborts_total", direction="rx") == 2000
        ignored = [ln for ln in info_logs.getvalue().splitlines() if "REQUEST_ABORT" in ln]
        assert len(ignored) == 1 and "A/a1" in ignored[0], ignored
        peer.close()


async def test_a_token_stream_forgotten_here_goes_on_from_the_senders_next_frame(tmp_sock_dir, engines):
    """B keeps the last 4 x max_transfers (here 16) token streams per peer. Between two frames of
    request r0, A sends frames of 16 other streams: B forgets r0. A's next frame (seq 3; 0-2 were
    acknowledged, so A holds nothing before it) is delivered from index 3 -- not taken as a gap
    whose resend (of frames A no longer has) would stall r0 for good."""
    tomls = two_site_toml(tmp_sock_dir, plaintext=True)
    tomls["B"] = tomls["B"].replace("[transfer]\n", "[transfer]\nmax_transfers = 4\n")
    async with run_agents(tomls, sites=("B",), wait_up=False) as ag:
        b = ag["B"]
        e = await engines.connect(tmp_sock_dir / "B.sock", "b")
        await e.expect_tokens("r0", "A")
        peer, _ = await hello_as_a(b)
        alive = asyncio.create_task(peer.keepalive())
        try:
            peer.send(FrameType.TOKENS, m.Tokens("r0", 0, [11, 12, 13]))
            for i in range(16):
                peer.send(FrameType.TOKENS, m.Tokens(f"x{i}", 0, [7]))
            peer.send(FrameType.TOKENS, m.Tokens("r0", 3, [14, 15, 16]))
            assert await peer.pong(4)
            got = [(t.seq, t.tokens) for t in [await e.wait_tokens("r0", timeout=10) for _ in range(2)]]
            assert got == [(0, [11, 12, 13]), (3, [14, 15, 16])], got
            assert metric(b, "pddwire_token_gaps_total", peer="A/a1") == 0
            # The engine aborts r0: the stream is dropped here, and what A still had on its way
            # reaches that engine no more (it owns r0 no longer): held for an owner, then dropped.
            await e.abort("r0")
            peer.send(FrameType.TOKENS, m.Tokens("r0", 6, [17]))
            assert await peer.pong(5)
            assert "r0" in b.sessions["A/a1"].tokens.held
            await e.status()  # a round trip: an event sent before its answer would be here now
            assert e.take("r0", kinds=(p.TokensReceived,)) == []
        finally:
            alive.cancel()
            peer.close()
