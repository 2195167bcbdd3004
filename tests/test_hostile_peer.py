"""A peer written from proto/ alone, breaking the rules against a real agent (plaintext, so it
can speak at all: with the default TLS it could not get past the handshake). Each bad frame
closes that connection only; the agent goes on serving."""

from __future__ import annotations

import contextlib

from conftest import metric
from pdd_wire.errors import ErrorCode
from pdd_wire.transport.tcp import KIND_BULK, KIND_CONTROL
from pdd_wire.wire import FrameType, Lane, encode_bytes
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
