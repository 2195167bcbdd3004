"""The UCX progress engine on the caller's own event loop (as the agent runs it): callback
operations, wake-ups without lost completions, a large message that gives the loop back while it
lands, cancel and close mid-transfer, the per-loop shared instance. Real ucxx, two workers of
this process over shared memory."""

from __future__ import annotations

import asyncio

import pytest

from pdd_wire.errors import ErrorCode, TransferError, TransportError
from pdd_wire.memory import SharedMemory
from pdd_wire.transport import ucx

pytestmark = pytest.mark.ucx

MiB = 1 << 20


@pytest.fixture
async def on_loop():
    """A UcxLoop on the test's running loop and two connected peers on it."""
    loop = ucx.UcxLoop("test-ucx-here", options={"TLS": "sm,self"}, unclaimed_ttl_s=30)
    loop.start(asyncio.get_running_loop())
    a, b = ucx.UcxPeer(loop, "a"), ucx.UcxPeer(loop, "b")
    await a.connect(b.local_address())
    await b.connect(a.local_address())
    yield loop, a, b
    await loop.aclose()
    assert not loop.running


class Outcomes:
    """``done`` callbacks that record each call (to check: exactly once, and when)."""

    def __init__(self) -> None:
        self.calls: dict[int, list] = {}
        self.ended = asyncio.Event()
        self.expect = 0

    def done(self, key: int):
        def cb(exc: BaseException | None) -> None:
            self.calls.setdefault(key, []).append(exc)
            if len(self.calls) >= self.expect:
                self.ended.set()
        return cb

    async def wait(self, n: int) -> None:
        self.expect = n
        if len(self.calls) < n:
            await asyncio.wait_for(self.ended.wait(), 30)


def pattern(seed: int, n: int) -> bytes:
    return (bytes((seed * 7 + i) % 251 for i in range(4096)) * (n // 4096 + 1))[:n]


async def test_callback_operations_end_exactly_once_and_never_inside_their_start(on_loop):
    loop, a, b = on_loop
    out = Outcomes()
    # An eager message (it completes inside tag_send) and one that arrives before its receive.
    a.start_send(1, b"x" * 100, out.done(1))
    a.start_send(2, b"y" * 200, out.done(2))
    assert not out.calls  # not inside start_send
    while b.pending()["unclaimed"] < 2:
        await asyncio.sleep(0)
    got1, got2 = bytearray(100), bytearray(200)
    b.start_recv(1, got1, out.done(11))
    b.start_recv(2, got2, out.done(12))
    assert 11 not in out.calls and 12 not in out.calls  # nor inside start_recv, though it came first
    await out.wait(4)
    await asyncio.sleep(0.05)  # a second call would come now
    assert out.calls == {1: [None], 2: [None], 11: [None], 12: [None]}
    assert bytes(got1) == b"x" * 100 and bytes(got2) == b"y" * 200


async def test_no_completion_is_lost_while_the_engine_sleeps_between_messages(on_loop):
    """Ping-pong: after each message nothing moves, so the engine arms both workers and sleeps;
    every next message must wake it through the workers' epoll fds (not the safety timer)."""
    loop, a, b = on_loop
    before = dict(loop.stats)
    sizes = [64, 5000, 9000, 200_000, 1 << 20]
    for i in range(60):
        n = sizes[i % len(sizes)]
        src, (x, y) = pattern(i, n), (a, b) if i % 2 else (b, a)
        got = bytearray(n)
        await asyncio.gather(x.send(1000 + i, src), y.recv(1000 + i, got))
        assert bytes(got) == src
    woke = loop.stats["wakeups"] - before["wakeups"]
    assert woke >= 30  # it did sleep between messages...
    assert loop.stats["safety_wakeups"] - before["safety_wakeups"] <= woke // 10  # ...and events woke it


async def test_a_64mib_message_lands_while_the_loop_keeps_turning(on_loop):
    """The receive is made in bounded turns (one shared-memory segment per progress step), so
    other callbacks on the loop, token frames in the agent, run while it lands."""
    loop, a, b = on_loop
    size = 64 * MiB
    src, dst = SharedMemory(size), SharedMemory(size)
    try:
        src.buf[:] = pattern(3, size)
        turns = 0
        landing = asyncio.ensure_future(b.recv(77, dst.buf))
        sending = asyncio.ensure_future(a.send(77, src.buf))

        def tick() -> None:
            nonlocal turns
            if not landing.done():
                turns += 1
                asyncio.get_running_loop().call_soon(tick)
        tick()
        await asyncio.gather(landing, sending)
        assert bytes(dst.buf) == bytes(src.buf)
        assert turns > 16  # 128 segments of 512 KiB: the loop was given back many times
    finally:
        src.close()
        dst.close()


async def test_cancel_mid_transfer_tells_each_receive_once_and_frees_its_buffer(on_loop):
    loop, a, b = on_loop
    out = Outcomes()
    tid = 4242
    bufs = [bytearray(MiB) for _ in range(4)]
    for k in range(4):
        b.start_recv(ucx.tag_for(ucx.DIR_DIALER, tid, k), bufs[k], out.done(k))
    big = SharedMemory(MiB)
    try:
        big.buf[:] = pattern(9, MiB)
        sent = asyncio.ensure_future(a.send(ucx.tag_for(ucx.DIR_DIALER, tid, 0), big.buf))
        await out.wait(1)  # chunk 0 landed
        n = await b.cancel_transfer(ucx.DIR_DIALER, tid, drain_s=5)
        await sent
        # the rest of the transfer arrives after the cancel: drained, its sender completes
        for k in (1, 2):
            await a.send(ucx.tag_for(ucx.DIR_DIALER, tid, k), big.buf)
    finally:
        big.close()
    assert n == 3
    assert out.calls[0] == [None] and bytes(bufs[0]) == pattern(9, MiB)
    for k in (1, 2, 3):
        [exc] = out.calls[k]
        assert isinstance(exc, TransferError) and exc.code == ErrorCode.TRANSFER_CANCELLED
        assert bytes(bufs[k]) == bytes(MiB)  # never written
    assert b.stats["drained"] >= 2


async def test_close_tells_waiting_callback_operations_and_later_starts_fail_at_once(on_loop):
    loop, a, b = on_loop
    out = Outcomes()
    b.start_recv(5, bytearray(10), out.done(5))
    b.close()
    await out.wait(1)
    assert isinstance(out.calls[5][0], TransportError)
    await b.wait_closed()
    with pytest.raises(TransportError, match="closed"):
        b.start_recv(6, bytearray(10), out.done(6))
    with pytest.raises(TransportError, match="closed"):
        b.start_send(6, b"x", out.done(6))
    assert 6 not in out.calls


async def test_the_shared_engine_is_one_per_loop_and_starts_again_after_its_last_release():
    here = asyncio.get_running_loop()
    for _ in range(2):
        first = ucx.acquire_loop(here, options={"TLS": "sm,self"})
        assert ucx.acquire_loop(here) is first and first.on_loop() and not first.own_thread
        a, b = ucx.UcxPeer(first), ucx.UcxPeer(first)
        await a.connect(b.local_address())
        await b.connect(a.local_address())
        got = bytearray(4)
        await asyncio.gather(a.send(3, b"ping"), b.recv(3, got))
        assert got == b"ping"
        await ucx.arelease_loop(first)
        assert first.running  # one user left
        await ucx.arelease_loop(first)
        assert not first.running and a.closed and b.closed
        with pytest.raises(TransportError):
            await first.run(asyncio.sleep(0))


# --------------------------------------------------------------------------------------
# the data path on the session's loop
# --------------------------------------------------------------------------------------
async def test_chunks_of_scattered_blocks_land_byte_for_byte_through_worker_threads():
    """Blocks that are not contiguous are gathered (sender) and scattered (receiver) by worker
    threads, never by the loop; the bytes land as if they were contiguous."""
    from pdd_wire import transport
    from pdd_wire.transport.route import Route
    from test_transport_contract import BLOCK, Owner, blocks, settings

    a, b = Owner(), Owner()
    pa = transport.data_path("ucx", a, settings("a", True, None))
    pb = transport.data_path("ucx", b, settings("b", False, None))
    a.path, b.path = pa, pb
    try:
        pa.connected(pb.address(), streams=1)
        pb.connected(pa.address(), streams=1)
        while not (a.lanes and b.lanes):
            await asyncio.wait_for(a.lane_changes.get() if not a.lanes else b.lane_changes.get(), 30)
        src = blocks(4 * BLOCK, fill=5, order=[0, 2, 3, 1])
        dst = blocks(4 * BLOCK, order=[3, 1, 0, 2])
        chunk = 2 * BLOCK
        route = Route(dst, chunk, asyncio.get_running_loop())
        b.routes[9] = route
        pb.expect(9, route)
        lane = next(iter(a.lanes))
        for k in range(2):
            pa.send(lane, 9, k, src.slice(k * chunk, (k + 1) * chunk))
        got = sorted([await asyncio.wait_for(b.arrived.get(), 30) for _ in range(2)])
        assert got == [(9, k, True, chunk, True, False) for k in range(2)]
        assert b"".join(bytes(v) for v in dst.slice(0, 4 * BLOCK)) == \
            b"".join(bytes(v) for v in src.slice(0, 4 * BLOCK))
        assert route.complete and not a.failed
        await pa.close()
        pa.send(lane, 10, 0, src.slice(0, chunk))  # after close: a failure told, not raised
        async with asyncio.timeout(10):
            while not a.failed:
                await asyncio.sleep(0.01)
        assert a.failed == [(10, 0, "ucx_error")]
    finally:
        await pa.close()
        await pb.close()


async def test_a_done_callback_that_raises_does_not_stop_the_engine(on_loop):
    loop, a, b = on_loop

    def broken(exc: BaseException | None) -> None:
        raise RuntimeError("a caller's bug")
    got = bytearray(8)
    b.start_recv(21, got, broken)
    await a.send(21, b"12345678")
    after = bytearray(5)
    await asyncio.wait_for(asyncio.gather(a.send(22, b"still"), b.recv(22, after)), 10)
    assert got == b"12345678" and after == b"still" and loop.running
