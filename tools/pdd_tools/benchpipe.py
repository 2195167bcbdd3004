"""A bare Python loopback pipe, the ceiling for KV moved from cold registered memory here.

``python -m pdd_tools.benchpipe rx PORT SIZE`` receives with a uvloop ``BufferedProtocol`` and
``recv_into`` straight into a memfd region; ``tx PORT SIZE REPS`` sends a memfd region with
blocking ``sendall`` in 4 MiB writes and prints GB/s and the CPU seconds it spent sending; ``rx``
prints the CPU seconds it spent receiving when the sender is done. No framing, no checksums, no
acks: what pdd-wire's bulk path would cost if it did nothing but move bytes between two
processes' pools.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import shutil
import socket
import subprocess
import sys
import time

MiB = 1 << 20


def _region(size: int) -> memoryview:
    fd = os.memfd_create("benchpipe")
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    os.close(fd)
    return memoryview(m)


def rx(port: int, size: int) -> None:
    import uvloop

    dst = _region(size)

    class Sink(asyncio.BufferedProtocol):
        n = 0

        def get_buffer(self, hint):
            return dst[self.n:]

        def buffer_updated(self, nbytes):
            self.n = (self.n + nbytes) % size

        def eof_received(self):
            done.set_result(None)

    async def main():
        global done
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        srv = await loop.create_server(Sink, "127.0.0.1", port)
        cpu0 = time.process_time()
        print("ready", flush=True)
        await done
        print(f"{time.process_time() - cpu0:.4f}", flush=True)
        srv.close()

    uvloop.run(main())


def tx(port: int, size: int, reps: int) -> tuple[float, float]:
    """(GB/s, CPU seconds of this process while sending)."""
    src = _region(size)
    src[:] = os.urandom(size)
    s = socket.create_connection(("127.0.0.1", port))
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(reps):
        for off in range(0, size, 4 << 20):
            s.sendall(src[off:off + (4 << 20)])
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
    return size * reps / (time.perf_counter() - t0) / 1e9, time.process_time() - cpu0


# The baselines scripts/bench measures in its run, each between two processes.
def iperf3_goodput(seconds: int = 3, write: str = "1M") -> float | None:
    """iperf3 single stream over loopback, GB/s received; None when iperf3 is missing."""
    from .harness import free_port

    if shutil.which("iperf3") is None:
        return None
    port = free_port()
    srv = subprocess.Popen(["iperf3", "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        out = None
        for _ in range(50):
            r = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-l", write, "-t", str(seconds), "-J"],
                               capture_output=True, text=True)
            # iperf3 can exit 0 with an "error" and no totals (the server not yet listening): try again.
            got = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {}
            if "sum_received" in got.get("end", {}):
                out = got
                break
            time.sleep(0.1)
        if out is None:
            return None
        return out["end"]["sum_received"]["bits_per_second"] / 8 / 1e9
    finally:
        srv.kill()
        srv.wait()


def bare_pipe_goodput(size: int = 64 * MiB, reps: int = 16) -> float:
    """The bare Python pipe between two processes' memfd regions (see benchpipe), GB/s."""
    return bare_pipe(size, reps)[0]


def bare_pipe(size: int = 64 * MiB, reps: int = 16) -> tuple[float, float]:
    """The bare Python pipe: (GB/s, CPU seconds of sender and receiver per GB moved)."""
    from .harness import free_port

    port = free_port()
    rx = subprocess.Popen([sys.executable, "-m", "pdd_tools.benchpipe", "rx", str(port), str(size)],
                          stdout=subprocess.PIPE, text=True)
    try:
        rx.stdout.readline()  # "ready"
        out = subprocess.run([sys.executable, "-m", "pdd_tools.benchpipe", "tx", str(port), str(size), str(reps)],
                             capture_output=True, text=True, check=True)
        gbps, tx_cpu = map(float, out.stdout.split())
        rx_cpu = float(rx.stdout.readline())
        return gbps, (tx_cpu + rx_cpu) / (size * reps / 1e9)
    finally:
        try:
            rx.wait(10)
        except subprocess.TimeoutExpired:
            rx.kill()
            rx.wait()


if __name__ == "__main__":
    role, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if role == "rx":
        rx(port, size)
    else:
        gbps, cpu = tx(port, size, int(sys.argv[4]))
        print(f"{gbps:.4f} {cpu:.4f}")
