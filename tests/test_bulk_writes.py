"""Bulk connections write their chunks themselves when they can (pdd_wire/transport/tcp.py
``FrameProtocol._write_now``): ``os.writev`` releases the GIL during the copy, where uvloop's own
first write attempt holds it (docs/benchmarks.md, "Token frames under load").

Two real bulk FrameProtocols over a real loopback socket, plaintext and mutual TLS, on asyncio's
loop and on uvloop: the receiver stops reading while the sender queues 1 MiB chunks, so that
writes are partial and the rest waits in the transport; every chunk then arrives whole, verified,
in the order sent. Plaintext writes bypass the transport while its buffer is empty (fewer
transport writes than chunks); TLS ones always go through it (the transport encrypts).
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
import uvloop

from pdd_wire.transport.tcp import (
    KIND_BULK,
    FrameProtocol,
    adopt,
    dial,
    read_preamble,
)
from pdd_wire.transport.tls import client_tls_context, server_tls_context
from pdd_wire.wire import FrameType, Lane, encode
from support.certs import make_pki
from support.counting import Counting

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
MiB = 1 << 20
CHUNKS = 48  # 1 MiB each; the first 24 MiB while the receiver is paused: past what loopback buffers hold


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), ["a1", "b1"])


def bulk_conn() -> FrameProtocol:
    # The sink declines every payload: it is read into scratch, hashed, and copied out here.
    conn = FrameProtocol(max_body=1 << 16, max_payload=4 * MiB, sink=lambda h, b: None, bulk=True)
    conn.got = []
    conn.all_in = asyncio.get_running_loop().create_future()

    def on_frame(c, f):
        c.got.append((f.header.seq, bytes(f.payload), f.payload_ok))
        if len(c.got) == CHUNKS and not c.all_in.done():
            c.all_in.set_result(None)
    conn.on_frame = on_frame
    return conn


async def _scenario(tls_pki) -> tuple[FrameProtocol, FrameProtocol, Counting, list[bytes]]:
    loop = asyncio.get_running_loop()
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    sctx = server_tls_context(*tls_pki["b1"], tls_pki["ca"]) if tls_pki else None
    cctx = client_tls_context(*tls_pki["a1"], tls_pki["ca"]) if tls_pki else None
    accepted = loop.create_future()

    async def accept_one():
        sock, _ = await loop.sock_accept(server)
        sock.setblocking(False)
        assert await read_preamble(sock, 5) == KIND_BULK
        accepted.set_result(await adopt(sock, bulk_conn(), ssl_ctx=sctx, timeout=5))

    task = asyncio.create_task(accept_one())
    try:
        a = await dial("127.0.0.1", server.getsockname()[1], KIND_BULK, bulk_conn(), ssl_ctx=cctx,
                       server_name="b1", timeout=5)
        b = await asyncio.wait_for(accepted, 10)
        counting = a.transport = Counting(a.transport)
        payloads = [os.urandom(MiB) for _ in range(CHUNKS)]
        b.transport.pause_reading()
        for k in range(CHUNKS // 2):
            a.send(encode(FrameType.KV_CHUNK, lane=Lane.BULK, transfer_id=7, seq=k,
                          payload=[memoryview(payloads[k])]))
        await asyncio.sleep(0.05)
        b.transport.resume_reading()
        for k in range(CHUNKS // 2, CHUNKS):
            a.send(encode(FrameType.KV_CHUNK, lane=Lane.BULK, transfer_id=7, seq=k,
                          payload=[memoryview(payloads[k])]))
            if k % 4 == 0:
                await asyncio.sleep(0)  # let the transport drain now and then: direct writes resume
        await asyncio.wait_for(b.all_in, 30)
        a.abort()
        b.abort()
        return a, b, counting, payloads
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.close()


@pytest.mark.parametrize("loop_kind", LOOPS)
@pytest.mark.parametrize("tls", ["plain", "tls"])
def test_chunks_arrive_whole_and_in_order_through_partial_writes(loop_kind, tls, pki):
    with asyncio.Runner(loop_factory=LOOPS[loop_kind]) as runner:
        a, b, counting, payloads = runner.run(_scenario(pki if tls == "tls" else None))
    assert [seq for seq, _, _ in b.got] == list(range(CHUNKS))
    assert all(ok for _, _, ok in b.got), "a chunk failed its checksum"
    assert [data for _, data, _ in b.got] == payloads
    if tls == "plain":
        assert a._fd >= 0
        assert counting.writes < CHUNKS, "every chunk went through the transport: no direct write"
    else:
        assert a._fd == -1  # TLS: the transport encrypts, so it writes everything
        assert counting.writes == CHUNKS


def test_the_write_benchmark_measures_both_ways():
    """``pdd_tools.bench_gil`` (scripts/bench --only latency) drives the shipped FrameProtocol on a
    BulkLoop both ways; each way yields its samples (the figures compare them, not this test)."""
    from pdd_tools.bench_gil import measure

    got = measure(rounds=1, seconds=0.3)
    assert len(got["direct"]) > 20 and len(got["transport"]) > 20


# -- the direct write's branches, with os.writev scripted ------------------------------------------
class Transport:
    """Stands in for the transport around the direct write: what it is handed, and its buffer."""

    def __init__(self, buffered: int = 0) -> None:
        self.buffered = buffered
        self.handed: list[bytes] = []

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return False

    def writelines(self, buffers) -> None:
        self.handed.append(b"".join(bytes(memoryview(b).cast("B")) for b in buffers))


def scripted_send(monkeypatch, buffers, answers, *, buffered: int = 0):
    """Send ``buffers`` on a plaintext bulk FrameProtocol whose ``os.writev`` answers from
    ``answers`` (a byte count, or an exception to raise); returns (bytes writev took, what the
    transport was handed, writev's calls)."""
    import pdd_wire.transport.tcp as tcp

    taken = bytearray()
    calls = []

    def writev(fd, batch):
        calls.append(len(batch))
        a = answers.pop(0)
        if isinstance(a, BaseException):
            raise a
        data = b"".join(bytes(memoryview(b).cast("B")) for b in batch)
        taken.extend(data[:a])
        return a

    monkeypatch.setattr(tcp.os, "writev", writev)

    async def go():
        conn = FrameProtocol(max_body=1 << 16, max_payload=0, bulk=True)
        conn.transport = Transport(buffered)
        conn._fd = 1000
        conn.send(buffers)
        return conn.transport.handed

    handed = asyncio.run(go())
    return bytes(taken), handed, calls


def test_a_short_write_hands_the_rest_to_the_transport_cut_where_the_socket_stopped(monkeypatch):
    bufs = [b"h" * 48, memoryview(bytearray(b"a" * 1000)), memoryview(bytearray(b"b" * 1000))]
    taken, handed, calls = scripted_send(monkeypatch, bufs, [1500])
    assert taken + b"".join(handed) == b"h" * 48 + b"a" * 1000 + b"b" * 1000
    assert len(taken) == 1500 and len(handed) == 1 and calls == [3]


def test_a_full_socket_or_a_failed_write_leaves_everything_to_the_transport(monkeypatch):
    for err in (BlockingIOError(), BrokenPipeError(), ConnectionResetError()):
        taken, handed, _ = scripted_send(monkeypatch, [b"x" * 10, b"y" * 20], [err])
        assert taken == b"" and handed == [b"x" * 10 + b"y" * 20]


def test_nothing_is_written_directly_while_the_transport_still_holds_bytes(monkeypatch):
    taken, handed, calls = scripted_send(monkeypatch, [b"z" * 64], [], buffered=1)
    assert calls == [] and handed == [b"z" * 64]  # a direct write would overtake what it holds


def test_a_view_of_another_format_is_cut_in_bytes(monkeypatch):
    import array

    words = memoryview(array.array("I", range(256)))  # 4-byte items
    taken, handed, _ = scripted_send(monkeypatch, [b"h" * 48, words], [48 + 10])
    assert taken + b"".join(handed) == b"h" * 48 + words.tobytes()


def test_more_buffers_than_one_writev_takes_go_in_batches(monkeypatch):
    import pdd_wire.transport.tcp as tcp

    monkeypatch.setattr(tcp, "_IOV_MAX", 4)
    bufs = [bytes([i]) * 10 for i in range(10)]  # a header and nine layer pages, say
    taken, handed, calls = scripted_send(monkeypatch, bufs, [40, 40, 15])
    assert calls == [4, 4, 2]
    assert taken + b"".join(handed) == b"".join(bufs) and len(taken) == 95
