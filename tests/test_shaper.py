"""pdd_tools.shaper: delay, order under jitter, the rate limit, address checks and the CLI.

Everything runs for real on loopback: an asyncio echo/sink server, the shaper in front of it,
a client through the shaper; the CLI as a subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest

from pdd_tools.shaper import Shaper

MiB = 1 << 20


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
    except ConnectionError:
        pass  # the shaper resets what is still open when it closes
    finally:
        writer.close()


async def _echo_server() -> asyncio.Server:
    return await asyncio.start_server(_echo, "127.0.0.1", 0)


async def _round_trips(address: tuple[str, int], n: int) -> list[float]:
    reader, writer = await asyncio.open_connection(*address)
    rtts = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            writer.write(b"x")
            await reader.readexactly(1)
            rtts.append(time.perf_counter() - t0)
    finally:
        writer.close()
    return rtts


async def test_delay_adds_20ms_each_way_to_the_round_trip():
    server = await _echo_server()
    async with server, Shaper(target=server.sockets[0].getsockname()[:2], delay_ms=20) as sh:
        rtts = await _round_trips(sh.address, 5)
        assert min(rtts) >= 0.040, rtts
        sh.set_delay(0)  # takes effect at once: no round trip waits 40 ms any more
        assert min(await _round_trips(sh.address, 5)) < 0.040
        assert sh.stats.connections == 2


@pytest.mark.parametrize("dist", ["uniform", "normal"])
async def test_bytes_arrive_intact_and_in_order_with_jitter(dist):
    payload = os.urandom(8 * MiB)
    server = await _echo_server()
    target = server.sockets[0].getsockname()[:2]
    async with server, Shaper(target=target, delay_ms=3, jitter_ms=3, jitter_dist=dist) as sh:
        reader, writer = await asyncio.open_connection(*sh.address)

        async def send() -> None:
            for off in range(0, len(payload), 100_000):  # odd-sized writes: many chunks
                writer.write(payload[off:off + 100_000])
                await writer.drain()
            writer.write_eof()

        sender = asyncio.create_task(send())
        echoed = await asyncio.wait_for(reader.read(-1), 30)  # until the forwarded EOF
        await sender
        writer.close()
        assert hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()
        stats = sh.stats
        assert (stats.bytes_c2s, stats.bytes_s2c, stats.connections) == (len(payload), len(payload), 1)


async def test_rate_limit_holds():
    size, rate = 4 * MiB, 20e6
    got = asyncio.get_running_loop().create_future()

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = 0
        while data := await reader.read(1 << 16):
            n += len(data)
        got.set_result((n, time.perf_counter()))
        writer.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    async with server, Shaper(target=server.sockets[0].getsockname()[:2], rate_Bps=rate) as sh:
        _, writer = await asyncio.open_connection(*sh.address)
        t0 = time.perf_counter()
        writer.write(os.urandom(size))
        writer.write_eof()
        n, t1 = await asyncio.wait_for(got, 10)
        writer.close()
    expected = size / rate
    assert n == size
    assert 0.8 * expected <= t1 - t0, (t1 - t0, expected)


@pytest.mark.parametrize("delay_ms", [10_000, 0])  # bound by the delay queue / by pause_writing
async def test_memory_is_bounded_when_the_target_does_not_read(delay_ms):
    limit = 1 * MiB
    stalled = asyncio.Event()

    async def never_reads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await stalled.wait()
        writer.close()

    server = await asyncio.start_server(never_reads, "127.0.0.1", 0)
    async with server, Shaper(target=server.sockets[0].getsockname()[:2], delay_ms=delay_ms,
                              queue_limit=limit) as sh:
        _, writer = await asyncio.open_connection(*sh.address)
        chunk = bytes(1 * MiB)

        async def flood() -> None:
            while True:
                writer.write(chunk)
                await writer.drain()

        flooder = asyncio.create_task(flood())
        await asyncio.sleep(0.5)
        try:
            assert not flooder.done()  # the sender is blocked in drain(): back-pressure reached it
            assert writer.transport.get_write_buffer_size() > 0
            assert sh.stats.queued <= limit + 256 * 1024, sh.stats
            if delay_ms:  # nothing is due yet: the queue filled up to its limit, then reading stopped
                assert sh.stats.queued > limit // 2 and sh.stats.bytes_c2s == 0, sh.stats
        finally:
            flooder.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await flooder
            stalled.set()
            writer.close()


@pytest.mark.parametrize(
    "listen, target",
    [
        (("127.0.0.1", 0), ("8.8.8.8", 80)),
        (("127.0.0.1", 0), ("172.32.0.1", 80)),  # just outside 172.16/12
        (("0.0.0.0", 0), ("127.0.0.1", 80)),  # listening on every interface
        (("127.0.0.1", 0), ("example.com", 80)),  # names are not resolved
    ],
)
def test_non_private_addresses_are_refused(listen, target):
    with pytest.raises(ValueError, match="not a loopback or private address|not a numeric IP"):
        Shaper(listen=listen, target=target)


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdd_tools.shaper", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


@pytest.mark.parametrize(
    "args, named",
    [
        (["--listen", "127.0.0.1:0", "--target", "127.0.0.1:1", "--delay-ms", "-5"], "--delay-ms"),
        (["--listen", "127.0.0.1:0", "--target", "1.1.1.1:443"], "--target"),
        (["--listen", "127.0.0.1", "--target", "127.0.0.1:1"], "--listen"),
        (["--listen", "127.0.0.1:0", "--target", "127.0.0.1:1", "--rate-mbit", "0"], "--rate-mbit"),
    ],
)
def test_cli_exits_2_naming_a_bad_argument(args, named):
    proc = _cli(*args)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 2
    assert f"argument {named}" in err, err


async def test_cli_relays_and_exits_0_on_sigterm():
    server = await _echo_server()
    port = server.sockets[0].getsockname()[1]
    proc = _cli("--listen", "127.0.0.1:0", "--target", f"127.0.0.1:{port}", "--delay-ms", "5",
                "--jitter-ms", "1", "--rate-mbit", "100")
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
        assert line.startswith("shaper listening on 127.0.0.1:"), line
        listen_port = int(line.split()[3].rsplit(":", 1)[1])
        async with server:
            rtts = await _round_trips(("127.0.0.1", listen_port), 2)
            assert min(rtts) >= 0.008  # (5 - 1) ms each way at the least
            proc.send_signal(signal.SIGTERM)
            rc = await asyncio.wait_for(asyncio.to_thread(proc.wait), 20)
        assert rc == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
