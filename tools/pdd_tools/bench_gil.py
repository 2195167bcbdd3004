"""What a bulk thread's writes cost the main loop of the same process: ``python -m pdd_tools.bench_gil [--json]``.

A :class:`pdd_wire.transport.bulk_loop.BulkLoop` thread sends 4 MiB KV_CHUNK frames of a 64 MiB memfd
pool on a real plaintext bulk :class:`~pdd_wire.transport.tcp.FrameProtocol` to a reader in
another process, as an agent's bulk thread does, while the main thread measures how late its
0.5 ms sleeps wake (what a token frame waiting for the GIL sees). Two ways, alternated, 3 s each:

* ``direct`` (shipped): the connection writes what the socket takes with ``os.writev``, which
  releases the GIL during the copy, and hands the rest to the transport;
* ``transport`` (the baseline): every frame through the uvloop transport, whose first write
  attempt runs the copy with the GIL held.

Figure ``bulk_write_main_thread_late_p50_ms`` / ``_p99_ms``: the direct way's lateness, ratio
against the transport's in the same run (``scripts/bench --only latency`` adds them).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time

MiB = 1 << 20
POOL = 64 * MiB
CHUNK = 4 * MiB


_DRAIN = """
import socket, sys
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
buf = bytearray(4 << 20)
while conn.recv_into(buf):
    pass
"""


def _one(direct: bool, seconds: float) -> list[float]:
    from pdd_wire.memory import SharedMemory
    from pdd_wire.transport.bulk_loop import BulkLoop
    from pdd_wire.transport.tcp import FrameProtocol
    from pdd_wire.wire import FrameType, Lane, encode

    reader = subprocess.Popen([sys.executable, "-c", _DRAIN], stdout=subprocess.PIPE, text=True)
    mem = bulk = None
    stop = threading.Event()
    try:
        assert reader.stdout is not None
        port = int(reader.stdout.readline())
        mem = SharedMemory(POOL)
        mem.buf[:] = os.urandom(POOL)
        bulk = BulkLoop("pdd-bulk-bench")
        bulk.start()

        async def sender() -> None:
            loop = asyncio.get_running_loop()
            conn = FrameProtocol(max_body=1 << 16, max_payload=0, bulk=True)
            await loop.create_connection(lambda: conn, "127.0.0.1", port)
            if not direct:
                conn._fd = -1  # the baseline: every frame through the transport
            k = 0
            try:
                while not stop.is_set():
                    off = (k * CHUNK) % POOL
                    conn.send(encode(FrameType.KV_CHUNK, lane=Lane.BULK, transfer_id=1, seq=k,
                                     payload=[mem.buf[off:off + CHUNK]]))
                    k += 1
                    tr = conn.transport
                    assert tr is not None  # connected
                    while tr.get_write_buffer_size() > 2 * CHUNK and not stop.is_set():
                        await asyncio.sleep(0.0002)  # an agent's credit window bounds what is queued
            finally:
                conn.abort()

        fut = bulk.submit(sender())
        late: list[float] = []
        time.sleep(0.3)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end and not fut.done():
            t0 = time.perf_counter()
            time.sleep(0.0005)
            late.append((time.perf_counter() - t0 - 0.0005) * 1e3)
        stop.set()  # (also below, on the way out of an error)
        fut.result(10)  # the sender's error, if it failed
        return late
    finally:
        stop.set()
        if bulk is not None:
            bulk.stop()
        reader.kill()  # it reads until the sender closes; gone either way
        reader.wait(10)
        if reader.stdout is not None:
            reader.stdout.close()
        if mem is not None:
            mem.close()


def measure(rounds: int = 2, seconds: float = 3.0) -> dict[str, list[float]]:
    got: dict[str, list[float]] = {"direct": [], "transport": []}
    for _ in range(rounds):
        for mode in ("direct", "transport"):
            got[mode] += _one(mode == "direct", seconds)
    return got


def _pct(v: list[float], q: float) -> float:
    return statistics.quantiles(v, n=100)[int(q) - 1]


def add_figures(figs, quick: bool) -> None:
    # The bench process's own switch interval is the agent's (pdd_wire.cli sets 1 ms).
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    try:
        got = measure(1 if quick else 2, 2.0 if quick else 3.0)
    finally:
        sys.setswitchinterval(old)
    for q in (50, 99):
        d, t = _pct(got["direct"], q), _pct(got["transport"], q)
        figs.add(f"bulk_write_main_thread_late_p{q}_ms", d, "ms", "every frame through the uvloop transport", t,
                 note=f"a bulk thread sending 4 MiB chunks on a plaintext bulk connection; the main thread's "
                      f"0.5 ms sleeps, p{q} of how late they woke, {len(got['direct'])} and "
                      f"{len(got['transport'])} samples, alternated (pdd_tools.bench_gil)")


def main(argv: list[str]) -> int:
    from .bench import Figures

    figs = Figures("--json" in argv)
    add_figures(figs, "--quick" in argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
