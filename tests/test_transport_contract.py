"""The data-path contract (pdd_wire/transport/base.py), run against every implementation:
bulk TCP connections, UCX tagged messages and the in-process path.

A pair of paths is wired to two owners that stand where sessions stand (they keep the routes
and record what the path reports). For every kind: a lane comes up once connected; a chunk
sent on it lands in the receiver's blocks, byte for byte, through its route, and is reported
once as claimed; a chunk of a transfer the receiver does not hold is never written; chunks
of a transfer the receiver forgot are not written either; ``close`` ends every lane.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket

import pytest

from pdd_wire import transport
from pdd_wire.errors import ConfigError
from pdd_wire.memory import BlockMap, Extent, HostRegion
from pdd_wire.transport.bulk_loop import BulkLoop
from pdd_wire.transport.route import Route
from pdd_wire.transport.tcp import adopt
from pdd_wire.transport.tcp_path import PathSettings

CHUNK = 64 << 10
BLOCK = 16 << 10


class Owner:
    """Where a session stands: routes by transfer id, and a record of what the path said."""

    streams = 1

    def __init__(self) -> None:
        self.routes: dict[int, Route] = {}
        self.is_up = True
        self.lanes: set[int] = set()
        self.lane_changes = asyncio.Queue()
        self.arrived = asyncio.Queue()
        self.failed: list[tuple[int, int, str]] = []
        self.hold_for: set[int] = set()  # transfers whose chunks may outrun their KV_BEGIN
        self.held = asyncio.Queue()  # the wake of each chunk a path asked to hold
        self.loop: asyncio.AbstractEventLoop | None = None  # set by the pair fixture

    def lane_up(self, lane: int) -> None:
        self.lanes.add(lane)
        self.lane_changes.put_nowait(("up", lane))

    def lane_lost(self, lane: int) -> None:
        self.lanes.discard(lane)
        self.lane_changes.put_nowait(("lost", lane))

    def send_failed(self, tid: int, k: int, why: str) -> None:
        self.failed.append((tid, k, why))

    def chunk_arrived(self, tid, k, ok, nbytes, claimed, invalid=False, wrong_size=False) -> None:
        self.arrived.put_nowait((tid, k, ok, nbytes, claimed, invalid))

    def chunk_early(self, tid: int, wake) -> bool:
        if tid not in self.hold_for:
            return False
        self.loop.call_soon_threadsafe(self.held.put_nowait, wake)  # from a bulk thread
        return True

    def reconnect(self, why: str) -> None:
        raise AssertionError(f"the path asked to reconnect: {why}")

    def bulk_lost(self, conn, stream, exc) -> None:
        self.path.bulk_lost(conn, stream, exc)


def blocks(nbytes: int, fill: int | None = None, order: list[int] | None = None) -> BlockMap:
    """A memfd region of ``nbytes`` as one BlockMap: its blocks in place, or taken in ``order``."""
    fd = os.memfd_create("contract", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)  # HostRegion refuses a shrinkable fd
    if fill is not None:
        os.pwrite(fd, bytes((fill + i) % 251 for i in range(nbytes)), 0)
    region = HostRegion(1, fd, nbytes, BLOCK, owner=None)
    return BlockMap({1: region}, [Extent(1, i, 1) for i in order] if order else [Extent(1, 0, nbytes // BLOCK)])


def settings(name: str, dialer: bool, loop: BulkLoop | None) -> PathSettings:
    return PathSettings(name=name, host="127.0.0.1", port=1, server_name=name, site="S", node=name, dialer=dialer,
                        connect_s=5, handshake_s=5, backoff_max_s=1, ucx_chunk_bytes=CHUNK,
                        ssl_client=lambda: None, bulk_loop=lambda n: loop, remote_token=lambda: 0)


async def tcp_pair(a: Owner, b: Owner):
    """Bulk connections as the agents attach them, over a socket pair (no dialing)."""
    loop = BulkLoop("contract-bulk")
    loop.start()
    pa = transport.data_path("tcp", a, settings("a", True, loop))
    pb = transport.data_path("tcp", b, settings("b", False, loop))
    main = asyncio.get_running_loop()
    sa, sb = socket.socketpair()
    for sock, path in ((sa, pa), (sb, pb)):
        sock.setblocking(False)

        async def attach(sock=sock, path=path):
            handler = path.make_bulk_protocol(0, main)
            return await adopt(sock, handler.conn, ssl_ctx=None, timeout=5)

        conn = await asyncio.wrap_future(loop.submit(attach()))
        path.adopt_bulk(0, loop, conn)
    return pa, pb, lambda: loop.stop()


async def ucx_pair(a: Owner, b: Owner):
    from pdd_wire.transport import ucx

    ok, why = ucx.available()
    assert ok, why  # the test extra installs ucxx
    pa = transport.data_path("ucx", a, settings("a", True, None))
    pb = transport.data_path("ucx", b, settings("b", False, None))
    pa.connected(pb.address(), streams=1)
    pb.connected(pa.address(), streams=1)
    return pa, pb, lambda: None


async def inproc_pair(a: Owner, b: Owner):
    pa = transport.data_path("inproc", a, None)
    pb = transport.data_path("inproc", b, None)
    pa.connected(pb.address(), streams=1)
    pb.connected(pa.address(), streams=1)
    return pa, pb, lambda: None


PAIRS = {"tcp": tcp_pair, "ucx": ucx_pair, "inproc": inproc_pair}


@pytest.fixture(params=sorted(PAIRS))
async def pair(request):
    a, b = Owner(), Owner()
    a.loop = b.loop = asyncio.get_running_loop()
    pa, pb, stop = await PAIRS[request.param](a, b)
    a.path, b.path = pa, pb
    try:
        async with asyncio.timeout(30):
            while not (a.lanes and b.lanes):
                await a.lane_changes.get() if not a.lanes else await b.lane_changes.get()
        yield request.param, a, b, pa, pb
    finally:
        await pa.close()
        await pb.close()
        stop()


def expect(owner: Owner, path, tid: int, dest: BlockMap) -> Route:
    route = Route(dest, CHUNK, asyncio.get_running_loop())
    owner.routes[tid] = route
    path.expect(tid, route)
    return route


async def test_a_chunk_lands_through_the_route_byte_for_byte(pair):
    kind, a, b, pa, pb = pair
    src, dst = blocks(3 * CHUNK, fill=7), blocks(3 * CHUNK)
    route = expect(b, pb, 5, dst)
    lane = next(iter(a.lanes))
    for k in range(3):
        pa.send(lane, 5, k, src.slice(k * CHUNK, (k + 1) * CHUNK))
    got = sorted([await asyncio.wait_for(b.arrived.get(), 30) for _ in range(3)])
    assert got == [(5, k, True, CHUNK, True, False) for k in range(3)]
    assert route.complete and route.verified == {0, 1, 2}
    assert b"".join(bytes(v) for v in dst.slice(0, 3 * CHUNK)) == \
        b"".join(bytes(v) for v in src.slice(0, 3 * CHUNK))
    assert not a.failed
    assert pa.active == kind and pb.active == kind


async def test_a_chunk_of_an_unknown_transfer_is_never_written(pair):
    kind, a, b, pa, pb = pair
    src, dst = blocks(CHUNK, fill=1), blocks(CHUNK)
    lane = next(iter(a.lanes))
    pa.send(lane, 99, 0, src.slice(0, CHUNK))  # nobody expects transfer 99
    route = expect(b, pb, 6, dst)
    pa.send(lane, 6, 0, src.slice(0, CHUNK))
    seen = []
    while not seen or seen[-1][0] != 6:
        seen.append(await asyncio.wait_for(b.arrived.get(), 30))
    assert seen[-1] == (6, 0, True, CHUNK, True, False)
    assert all(not claimed for tid, _, _, _, claimed, _ in seen if tid == 99)
    assert route.verified == {0}


async def test_a_chunk_that_outran_its_kv_begin_waits_for_its_route(pair):
    """An offered transfer's chunk may come before its KV_BEGIN was handled: the path holds it
    (a bulk connection reads nothing more meanwhile) until the owner wakes it, then lands it
    through the route that exists by then. (UCX keeps a message nobody receives yet by itself.)"""
    kind, a, b, pa, pb = pair
    src, dst, other = blocks(CHUNK, fill=5), blocks(CHUNK), blocks(CHUNK)
    b.hold_for.add(11)
    route12 = expect(b, pb, 12, other)
    lane = next(iter(a.lanes))
    pa.send(lane, 11, 0, src.slice(0, CHUNK))
    pa.send(lane, 12, 0, src.slice(0, CHUNK))
    wake = await asyncio.wait_for(b.held.get(), 30) if kind != "ucx" else None
    route = expect(b, pb, 11, dst)
    if wake is not None:
        wake()
    got = [await asyncio.wait_for(b.arrived.get(), 30) for _ in range(2)]
    assert sorted(got) == [(11, 0, True, CHUNK, True, False), (12, 0, True, CHUNK, True, False)]
    if kind == "tcp":  # one stream: what came behind the held chunk waited for it
        assert [g[0] for g in got] == [11, 12]
    assert route.verified == {0} and route12.verified == {0}
    assert bytes(dst.slice(0, CHUNK)[0]) == bytes(src.slice(0, CHUNK)[0])


async def test_a_held_chunk_whose_transfer_never_opened_is_not_written(pair):
    kind, a, b, pa, pb = pair
    if kind == "ucx":
        return  # nothing is held on UCX: an unreceived message is drained after unclaimed_ttl_s
    src = blocks(CHUNK, fill=9)
    b.hold_for.add(13)
    pa.send(next(iter(a.lanes)), 13, 0, src.slice(0, CHUNK))
    (await asyncio.wait_for(b.held.get(), 30))()  # its KV_BEGIN was refused: woken, no route
    assert await asyncio.wait_for(b.arrived.get(), 30) == (13, 0, True, CHUNK, False, False)
    route = expect(b, pb, 14, blocks(CHUNK))
    pa.send(next(iter(a.lanes)), 14, 0, src.slice(0, CHUNK))
    assert await asyncio.wait_for(b.arrived.get(), 30) == (14, 0, True, CHUNK, True, False)
    assert route.verified == {0}


async def test_a_forgotten_transfer_is_not_written(pair):
    kind, a, b, pa, pb = pair
    src, dst = blocks(CHUNK, fill=3), blocks(CHUNK)
    route = expect(b, pb, 7, dst)
    del b.routes[7]
    await pb.forget(7)
    await route.close()
    pa.send(next(iter(a.lanes)), 7, 0, src.slice(0, CHUNK))
    route2 = expect(b, pb, 8, blocks(CHUNK))
    pa.send(next(iter(a.lanes)), 8, 0, src.slice(0, CHUNK))
    while (await asyncio.wait_for(b.arrived.get(), 30))[0] != 8:
        pass
    assert route2.verified == {0} and route.verified == set()
    assert bytes(dst.slice(0, CHUNK)[0]) == bytes(CHUNK)


async def test_close_ends_every_lane(pair):
    kind, a, b, pa, pb = pair
    await pa.close()
    await pb.close()
    assert not a.lanes and not b.lanes and not pa.links and not pb.links


def test_an_unknown_kind_is_named_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown transport 'carrier-pigeon' \(known: inproc, tcp, ucx\)"):
        transport.data_path("carrier-pigeon", Owner(), None)


# ---------------------------------------------------------------------------------- control connections
async def tcp_listen(on_sock):
    """What the agent's WAN listener does before it reads the preamble."""
    from pdd_wire.transport.tcp import TcpConnector

    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    loop = asyncio.get_running_loop()

    async def accept_one():
        sock, _ = await loop.sock_accept(server)
        sock.setblocking(False)
        await on_sock(sock)

    task = asyncio.create_task(accept_one())
    connector = TcpConnector("127.0.0.1", server.getsockname()[1], ssl_client=lambda: None, server_name="b")

    async def close():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.close()

    return connector, close


async def inproc_listen(on_sock):
    from pdd_wire.transport.inproc import InprocConnector, InprocListener

    listener = InprocListener("b", on_sock)
    await listener.start()
    return InprocConnector("b"), listener.close


@pytest.mark.parametrize("kind", ["tcp", "inproc"])
async def test_a_control_connection_carries_frames_both_ways_and_reports_its_end(kind):
    from pdd_wire.transport.tcp import KIND_CONTROL, FrameProtocol, adopt, read_preamble
    from pdd_wire.wire import FrameType, encode, encode_body
    from pdd_wire.wire import messages as m

    def framed():
        conn = FrameProtocol(max_body=1 << 16, max_payload=0)
        conn.frames, conn.ended = asyncio.Queue(), asyncio.get_running_loop().create_future()
        conn.on_frame = lambda c, f: c.frames.put_nowait(f)
        conn.on_lost = lambda c, e: c.ended.done() or c.ended.set_result(e)
        return conn

    accepted = asyncio.get_running_loop().create_future()

    async def on_sock(sock):
        assert await read_preamble(sock, 5) == KIND_CONTROL
        accepted.set_result(await adopt(sock, framed(), ssl_ctx=None, timeout=5))

    connector, close = await (tcp_listen if kind == "tcp" else inproc_listen)(on_sock)
    try:
        a = await connector.connect(framed(), timeout=5)
        b = await asyncio.wait_for(accepted, 10)
        a.send(encode(FrameType.PING, encode_body(m.Ping(1, 2))))
        b.send(encode(FrameType.PONG, encode_body(m.Pong(1, 2))))
        assert (await asyncio.wait_for(b.frames.get(), 10)).header.type == FrameType.PING
        assert (await asyncio.wait_for(a.frames.get(), 10)).header.type == FrameType.PONG
        a.abort()
        await asyncio.wait_for(b.ended, 10)
        await asyncio.wait_for(a.ended, 10)
    finally:
        await close()
