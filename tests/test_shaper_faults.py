"""The shaper's fault injection (pdd_tools.shaper: flip, cut, pause, link drop, refused
connections) and its plain relaying: bulk, half-close, resets, the delay queue's bound.

Every test runs on both the default asyncio loop and uvloop, each in a fresh
loop (asyncio.Runner), and fails if the loop reports an unhandled error or a
task is left pending at the end.  Readiness is always awaited (events,
futures, reads), never slept for.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop

from pdd_tools.shaper import Shaper

TIMEOUT = 10  # seconds; any single wait in these tests
MiB = 1 << 20

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(params=sorted(LOOPS))
def run(request) -> Callable[[Callable[[], Awaitable[Any]]], Any]:
    """Run an async test body on a fresh loop of the parametrized kind."""
    factory = LOOPS[request.param]

    def run(body: Callable[[], Awaitable[Any]]) -> Any:
        errors: list[dict[str, Any]] = []

        async def main() -> Any:
            asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
            result = await asyncio.wait_for(body(), 4 * TIMEOUT)
            leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            assert not leftover, leftover
            return result

        with asyncio.Runner(loop_factory=factory) as runner:
            result = runner.run(main())
        assert not errors, errors
        return result

    return run


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


class Target:
    """A TCP server on 127.0.0.1:0 running ``handler(reader, writer)`` per connection.

    Each connection's handler result (or the exception it raised) is put on
    ``results``, in completion order.
    """

    def __init__(self, handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[Any]]):
        self._handler = handler
        self._tasks: set[asyncio.Task[Any]] = set()
        self.results: asyncio.Queue[Any] = asyncio.Queue()
        self.port = 0

    async def __aenter__(self) -> Target:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            try:
                result: Any = await self._handler(reader, writer)
            except (ConnectionError, OSError) as exc:
                result = exc
            self.results.put_nowait(result)
        finally:
            writer.transport.abort()
            self._tasks.discard(task)

    async def result(self) -> Any:
        return await asyncio.wait_for(self.results.get(), TIMEOUT)


async def read_all(reader: asyncio.StreamReader) -> tuple[bytes, BaseException | None]:
    """Read to EOF or error; return what arrived and the error (None at a clean EOF)."""
    buf = bytearray()
    try:
        while chunk := await reader.read(MiB):
            buf += chunk
    except (ConnectionError, OSError) as exc:
        return bytes(buf), exc
    return bytes(buf), None


async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[bytes, BaseException | None]:
    return await read_all(reader)


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    total = 0
    while chunk := await reader.read(MiB):
        total += len(chunk)
        writer.write(chunk)
        await writer.drain()
    writer.write_eof()
    await writer.drain()
    return total


async def send_all(writer: asyncio.StreamWriter, data: bytes, *, eof: bool = True) -> None:
    view = memoryview(data)
    for i in range(0, len(view), MiB):
        writer.write(view[i : i + MiB])
        await writer.drain()
    if eof:
        writer.write_eof()
        await writer.drain()


async def connect(relay: Shaper) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", relay.port), TIMEOUT)


async def roundtrip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, msg: bytes) -> float:
    t0 = time.monotonic()
    writer.write(msg)
    await writer.drain()
    got = await asyncio.wait_for(reader.readexactly(len(msg)), TIMEOUT)
    elapsed = time.monotonic() - t0
    assert got == msg
    return elapsed


# -- plain relaying -----------------------------------------------------------


def test_bulk_64mib_both_directions(run):
    n = 64 * MiB
    up, down = payload(n, 1), payload(n, 2)

    async def server(reader, writer):
        async def send():
            await send_all(writer, down)

        sender = asyncio.create_task(send())
        try:
            received, exc = await read_all(reader)
        finally:
            await sender
        return received, exc

    async def body():
        async with Target(server) as target, Shaper(target=("127.0.0.1", target.port)) as relay:
            reader, writer = await connect(relay)
            sender = asyncio.create_task(send_all(writer, up))
            got_down, exc = await asyncio.wait_for(read_all(reader), TIMEOUT)
            await sender
            assert exc is None
            assert got_down == down
            got_up, exc = await target.result()
            assert exc is None
            assert got_up == up
            conn = relay.connections[0]
            await conn.wait_closed()
            assert (conn.bytes_c2s, conn.bytes_s2c) == (n, n)
            assert conn.closed
            writer.close()
            await writer.wait_closed()

    run(body)


def test_half_close_forwarded(run):
    """EOF from the client reaches the server as EOF; the reply still comes back."""

    async def body():
        async with Target(echo) as target, Shaper(target=("127.0.0.1", target.port)) as relay:
            reader, writer = await connect(relay)
            await send_all(writer, b"hello, half-closed world")
            assert (await read_all(reader)) == (b"hello, half-closed world", None)
            assert await target.result() == len(b"hello, half-closed world")
            await relay.connections[0].wait_closed()
            writer.close()

    run(body)


def test_target_down_resets_client(run):
    async def body():
        async with Target(sink) as target:
            port = target.port
        async with Shaper(target=("127.0.0.1", port)) as relay:
            reader, writer = await connect(relay)
            data, exc = await asyncio.wait_for(read_all(reader), TIMEOUT)
            assert data == b""
            conn = relay.connections[0]
            await conn.wait_closed()
            assert isinstance(conn.error, OSError)
            writer.close()

    run(body)


# -- flip_byte_at -------------------------------------------------------------


def diff_offsets(a: bytes, b: bytes) -> list[int]:
    assert len(a) == len(b)
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


def test_flip_byte_at_c2s_once(run):
    data = payload(2 * MiB, 3)
    offset = 1_234_567

    async def body():
        async with Target(sink) as target, Shaper(target=("127.0.0.1", target.port)) as relay:
            relay.flip_byte_at(offset)
            for attempt in range(2):
                reader, writer = await connect(relay)
                await send_all(writer, data)
                got, exc = await target.result()
                assert exc is None
                if attempt == 0:
                    assert diff_offsets(data, got) == [offset]
                    assert got[offset] == data[offset] ^ 0xFF
                else:
                    assert got == data  # the fault is spent
                assert relay.flips_done == 1
                writer.close()
                await writer.wait_closed()

    run(body)


def test_flip_byte_at_s2c(run):
    data = payload(MiB, 4)

    async def body():
        async with Target(echo) as target, Shaper(target=("127.0.0.1", target.port)) as relay:
            relay.flip_byte_at(0, direction="s2c")
            relay.flip_byte_at(len(data) - 1, direction="s2c")
            reader, writer = await connect(relay)
            sender = asyncio.create_task(send_all(writer, data))
            got, exc = await asyncio.wait_for(read_all(reader), TIMEOUT)
            await sender
            assert exc is None
            assert diff_offsets(data, got) == [0, len(data) - 1]  # echo got it intact
            assert await target.result() == len(data)
            assert relay.flips_done == 2
            writer.close()

    run(body)


def test_flip_byte_at_skips_small_connections(run):
    small, big = payload(100, 5), payload(MiB, 6)

    async def body():
        async with Target(sink) as target, Shaper(target=("127.0.0.1", target.port)) as relay:
            # Offset 10 lies in both connections, but only the big one carries
            # more than 64 KiB in total.
            relay.flip_byte_at(10, min_conn_bytes=64 * 1024)
            for data, flipped in ((small, []), (big, [10]), (big, [])):
                reader, writer = await connect(relay)
                await send_all(writer, data)
                got, exc = await target.result()
                assert exc is None
                assert diff_offsets(data, got) == flipped
                writer.close()
            assert relay.flips_done == 1

    run(body)


def test_flip_hold_released_when_spent_elsewhere(run):
    """A small connection holding a flip's offset is let go, unflipped, once
    a bigger connection takes the flip."""
    small, big = payload(100, 12), payload(MiB, 13)

    async def body():
        async with Target(echo) as target, Shaper(target=("127.0.0.1", target.port)) as relay:
            relay.flip_byte_at(10, min_conn_bytes=64 * 1024)
            ra, wa = await connect(relay)
            wa.write(small)
            read_a = asyncio.create_task(ra.readexactly(len(small)))
            # Held: the connection has not carried enough yet.  (The timeout
            # is the assertion, not synchronisation.)
            done, _ = await asyncio.wait({read_a}, timeout=0.2)
            assert not done
            rb, wb = await connect(relay)
            sender = asyncio.create_task(send_all(wb, big))
            got_b, exc = await asyncio.wait_for(read_all(rb), TIMEOUT)
            await sender
            assert exc is None
            assert diff_offsets(big, got_b) == [10]
            assert await asyncio.wait_for(read_a, TIMEOUT) == small
            assert relay.flips_done == 1
            for w in (wa, wb):
                w.close()
                await w.wait_closed()

    run(body)


# -- cut_after ----------------------------------------------------------------


def test_cut_after_resets_then_next_connection_works(run):
    data = payload(MiB, 7)
    cut = 40_000

    async def body():
        async with Target(sink) as target, Shaper(target=("127.0.0.1", target.port)) as relay:
            relay.cut_after(cut)
            reader, writer = await connect(relay)
            writer.write(data)  # more than the cut: the rest is never forwarded
            got_client, exc_client = await asyncio.wait_for(read_all(reader), TIMEOUT)
            assert got_client == b""
            assert exc_client is None or isinstance(exc_client, ConnectionError)
            got, exc = await target.result()
            # Never a byte past the cut; on loopback the prefix arrives whole.
            assert got == data[:cut]
            assert isinstance(exc, ConnectionResetError)
            conn = relay.connections[0]
            await conn.wait_closed()
            assert conn.bytes_c2s == cut
            assert relay.cuts_done == 1
            writer.transport.abort()

            # The fault is spent: the next connection carries everything.
            reader, writer = await connect(relay)
            await send_all(writer, data)
            assert await target.result() == (data, None)
            assert relay.cuts_done == 1
            writer.close()

    run(body)


def test_cut_after_s2c_count(run):
    data = payload(256 * 1024, 8)
    cut = 1000

    async def body():
        async with Target(echo) as target, Shaper(target=("127.0.0.1", target.port)) as relay:
            relay.cut_after(cut, direction="s2c", count=2)
            for i in range(3):
                reader, writer = await connect(relay)
                writer.write(data)
                writer.write_eof()
                got, exc = await asyncio.wait_for(read_all(reader), TIMEOUT)
                result = await target.result()
                if i < 2:
                    assert got == data[:cut]
                    assert isinstance(exc, ConnectionResetError)
                    # The echo may have sent everything before the reset came.
                    assert result == len(data) or isinstance(result, OSError)
                else:
                    assert (got, exc) == (data, None)
                    assert result == len(data)
                assert relay.cuts_done == min(i + 1, 2)
                writer.transport.abort()

    run(body)


# -- set_delay ----------------------------------------------------------------


def test_set_delay_adds_latency(run):
    delay_ms = 100

    async def body():
        async with Target(echo) as target, Shaper(target=("127.0.0.1", target.port)) as relay:
            reader, writer = await connect(relay)
            await roundtrip(reader, writer, b"warm-up")
            relay.set_delay(delay_ms)
            # One way each direction: a round trip takes at least twice the delay.
            assert await roundtrip(reader, writer, b"ping") >= 2 * delay_ms / 1e3
            # Order is kept across many small chunks and a large one.
            msgs = [b"%d," % i for i in range(200)] + [payload(3 * MiB, 9)]
            for m in msgs:
                writer.write(m)
            expected = b"".join(msgs)
            got = await asyncio.wait_for(reader.readexactly(len(expected)), TIMEOUT)
            assert got == expected
            relay.set_delay(0)
            await roundtrip(reader, writer, b"fast again")
            writer.close()
            await writer.wait_closed()

    run(body)


def test_delay_queue_bounded(run):
    """With a long delay the relay stops reading once queue_limit bytes are queued."""
    limit = 256 * 1024
    data = payload(32 * MiB, 10)

    async def body():
        async with Target(sink) as target, Shaper(target=("127.0.0.1", target.port), queue_limit=limit) as relay:
            relay.set_delay(300)
            reader, writer = await connect(relay)
            (conn,) = await relay.wait_connections(1)
            sender = asyncio.create_task(send_all(writer, data))
            # The relay must stop reading: the client blocks.  (The timeout is
            # the assertion, not synchronisation.)
            done, _ = await asyncio.wait({sender}, timeout=0.2)
            assert not done
            assert limit < conn.queued_peak <= limit + MiB  # at most one read past the limit
            relay.set_delay(0)
            await asyncio.wait_for(sender, TIMEOUT)
            assert await target.result() == (data, None)
            assert conn.queued_peak <= limit + MiB
            writer.close()

    run(body)


# -- pause / resume -----------------------------------------------------------


def test_pause_resume(run):
    async def body():
        async with Target(echo) as target, Shaper(target=("127.0.0.1", target.port)) as relay:
            reader, writer = await connect(relay)
            await roundtrip(reader, writer, b"before")
            conn = relay.connections[0]
            relay.pause()
            writer.write(b"held")
            await writer.drain()
            read = asyncio.create_task(reader.readexactly(4))
            # Nothing may come through while paused; wait_for's timeout is
            # the assertion here, not synchronisation.
            done, _ = await asyncio.wait({read}, timeout=0.2)
            assert not done
            assert conn.bytes_c2s == len(b"before")
            relay.resume()
            assert await asyncio.wait_for(read, TIMEOUT) == b"held"
            await roundtrip(reader, writer, b"after")
            writer.close()
            await writer.wait_closed()

    run(body)


def test_pause_holds_bulk_data_bounded(run):
    data = payload(16 * MiB, 11)

    async def body():
        async with Target(sink) as target, Shaper(target=("127.0.0.1", target.port)) as relay:
            reader, writer = await connect(relay)
            (conn,) = await relay.wait_connections(1)
            relay.pause()
            sender = asyncio.create_task(send_all(writer, data))
            done, _ = await asyncio.wait({sender}, timeout=0.3)
            assert not done  # the client blocks: the relay stops reading
            assert conn.bytes_c2s == 0
            assert conn.queued_peak <= MiB
            relay.resume()
            await asyncio.wait_for(sender, TIMEOUT)
            assert await target.result() == (data, None)
            writer.close()

    run(body)


# -- abort_all / reject_new ---------------------------------------------------


def test_abort_all(run):
    async def body():
        async with Target(echo) as target, Shaper(target=("127.0.0.1", target.port)) as relay:
            clients = [await connect(relay) for _ in range(3)]
            for reader, writer in clients:
                await roundtrip(reader, writer, b"up")
            relay.abort_all()
            for reader, writer in clients:
                got, exc = await asyncio.wait_for(read_all(reader), TIMEOUT)
                assert got == b""
                assert isinstance(exc, ConnectionResetError)
                writer.transport.abort()
            for _ in clients:
                assert isinstance(await target.result(), ConnectionResetError)
            for conn in relay.connections:
                await conn.wait_closed()
            # The listener stays up.
            reader, writer = await connect(relay)
            await roundtrip(reader, writer, b"again")
            assert len(await relay.wait_connections(4)) == 4
            writer.close()
            await writer.wait_closed()

    run(body)


def test_target_reset_reaches_client(run):
    async def server(reader, writer):
        await reader.readexactly(5)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
        return "reset"

    async def body():
        async with Target(server) as target, Shaper(target=("127.0.0.1", target.port)) as relay:
            reader, writer = await connect(relay)
            writer.write(b"hello")
            got, exc = await asyncio.wait_for(read_all(reader), TIMEOUT)
            assert got == b""
            assert isinstance(exc, ConnectionResetError)
            assert await target.result() == "reset"
            await relay.connections[0].wait_closed()
            writer.transport.abort()

    run(body)


def test_reject_new(run):
    async def body():
        async with Target(echo) as target, Shaper(target=("127.0.0.1", target.port)) as relay:
            reader, writer = await connect(relay)
            await roundtrip(reader, writer, b"live")
            relay.reject_new(True)
            r2, w2 = await connect(relay)
            got, exc = await asyncio.wait_for(read_all(r2), TIMEOUT)
            assert got == b""
            assert isinstance(exc, ConnectionResetError)
            w2.transport.abort()
            assert relay.rejected == 1
            assert len(relay.connections) == 1
            # Existing connections are unaffected.
            await roundtrip(reader, writer, b"still live")
            relay.reject_new(False)
            r3, w3 = await connect(relay)
            await roundtrip(r3, w3, b"accepted")
            assert len(relay.connections) == 2
            for w in (writer, w3):
                w.close()
                await w.wait_closed()

    run(body)


def test_close_is_idempotent_and_resets(run):
    async def body():
        async with Target(echo) as target:
            relay = Shaper(target=("127.0.0.1", target.port))
            await relay.start()
            reader, writer = await connect(relay)
            await roundtrip(reader, writer, b"x")
            relay.set_delay(5000)  # data queued in the relay when it closes
            writer.write(b"queued")
            await asyncio.gather(relay.close(), relay.close())
            await relay.close()
            got, exc = await asyncio.wait_for(read_all(reader), TIMEOUT)
            assert got == b""
            assert isinstance(exc, ConnectionResetError)
            assert all(c.closed for c in relay.connections)
            writer.transport.abort()
            with pytest.raises(OSError):
                await asyncio.open_connection("127.0.0.1", relay.port)

    run(body)


def test_wait_connections_timeout(run):
    async def body():
        async with Target(echo) as target, Shaper(target=("127.0.0.1", target.port)) as relay:
            with pytest.raises(TimeoutError):
                await relay.wait_connections(1, timeout=0.05)
            reader, writer = await connect(relay)
            await relay.wait_connections(1)
            writer.close()
            await writer.wait_closed()

    run(body)
