"""A bare Python loopback pipe, the ceiling for KV moved from cold registered memory here, and
the CPU one message between two processes costs.

``python -m pdd_tools.benchpipe rx PORT SIZE [loop|block] [xxh3|-]`` receives with a uvloop
``BufferedProtocol`` and ``recv_into`` straight into a memfd region (``block``: blocking
``recv_into`` calls of 4 MiB with ``MSG_WAITALL`` instead; ``xxh3``: and hashes what arrives);
``tx PORT SIZE REPS [WRITE [SECONDS]]`` sends a memfd region REPS times (or, with SECONDS, as many
times as fit in SECONDS) with blocking ``sendall`` in 4 MiB writes (or ``WRITE`` bytes). When the
sender is done, ``tx`` prints GB/s, the CPU seconds it spent sending, the bytes sent and when it
started and ended (``time.perf_counter``); ``rx`` prints the CPU seconds it spent receiving, its
number of reads and the bytes received. No framing, no acks, and by default no checksums: what
pdd-wire's bulk path would cost if it did nothing but move bytes between two processes' pools.

``python -m pdd_tools.benchpipe ipc N CPU_A CPU_B`` is the other floor, of every message between
two processes (engine and agent, agent and agent; a thread waking another wakes a CPU the same
way): N 64-byte round trips over a Unix socket pair between two processes pinned to CPU_A and
CPU_B, each blocking in ``recv`` for the other's message; prints the wall and CPU microseconds
(both processes) per round trip, and the echoing process's part of it. On the same CPU a
wake-up is a context switch; across two, the sleeping CPU must be woken (an inter-processor
interrupt, which a VM pays in exits).
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
import traceback

MiB = 1 << 20


def _region(size: int) -> memoryview:
    fd = os.memfd_create("benchpipe")
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    os.close(fd)
    return memoryview(m)


RX_MODES = ("loop", "block")


def rx(port: int, size: int, mode: str = "loop", xxh3: bool = False) -> None:
    """Receive into a memfd region until the sender's end of file, then print the CPU seconds
    spent receiving and the number of reads. ``loop``: a uvloop ``BufferedProtocol`` (each read
    takes what the socket holds, and runs Python); ``block``: one blocking ``recv_into`` with
    ``MSG_WAITALL`` per 4 MiB, in which the kernel fills the whole buffer before it returns.
    ``xxh3``: hash what arrived, per read (``loop``, while it is in cache) or per 4 MiB (``block``)."""
    if mode not in RX_MODES:
        raise ValueError(f"rx mode must be one of {RX_MODES}, got {mode!r}")
    dst = _region(size)
    if mode == "block":
        _rx_block(port, dst, xxh3)
        return
    import uvloop
    import xxhash

    hasher = xxhash.xxh3_64()

    class Sink(asyncio.BufferedProtocol):
        n = 0
        reads = 0
        total = 0

        def get_buffer(self, hint):
            return dst[self.n:]

        def buffer_updated(self, nbytes):
            self.reads += 1
            self.total += nbytes
            if xxh3:
                hasher.update(dst[self.n:self.n + nbytes])
            self.n = (self.n + nbytes) % size

        def eof_received(self):
            done.set_result(None)

    async def main():
        global done
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        sink = Sink()
        srv = await loop.create_server(lambda: sink, "127.0.0.1", port)
        cpu0 = time.process_time()
        print("ready", flush=True)
        await done
        print(f"{time.process_time() - cpu0:.4f} {sink.reads} {sink.total}", flush=True)
        srv.close()

    uvloop.run(main())


def _rx_block(port: int, dst: memoryview, xxh3: bool) -> None:
    import xxhash

    with socket.create_server(("127.0.0.1", port)) as srv:
        print("ready", flush=True)
        conn, _ = srv.accept()
    with conn:
        cpu0 = time.process_time()
        n = reads = total = 0
        while True:
            view = dst[n:n + (4 << 20)]
            got = conn.recv_into(view, len(view), socket.MSG_WAITALL)
            if not got:
                break
            reads += 1
            total += got
            if xxh3:
                xxhash.xxh3_64_intdigest(view[:got])
            n = (n + got) % len(dst)
        print(f"{time.process_time() - cpu0:.4f} {reads} {total}", flush=True)


def tx(port: int, size: int, reps: int, write: int = 4 << 20,
       seconds: float = 0.0) -> tuple[float, float, int, float, float]:
    """Send ``reps`` passes over a ``size``-byte region (with ``seconds`` > 0: as many passes as
    fit in ``seconds``), ``write`` bytes a ``sendall``: (GB/s, CPU seconds of this process while
    sending, bytes sent, start and end on ``time.perf_counter``)."""
    if write <= 0 or size <= 0:
        raise ValueError(f"size and write must be > 0 (size {size}, write {write})")
    src = _region(size)
    src[:] = os.urandom(size)
    s = socket.create_connection(("127.0.0.1", port))
    t0, cpu0 = time.perf_counter(), time.process_time()
    sent = passes = 0
    while (time.perf_counter() - t0 < seconds) if seconds > 0 else passes < reps:
        for off in range(0, size, write):
            s.sendall(src[off:off + write])
        sent += size
        passes += 1
    t1 = time.perf_counter()
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
    return sent / (time.perf_counter() - t0) / 1e9, time.process_time() - cpu0, sent, t0, t1


def ipc(n: int, cpu_a: int, cpu_b: int) -> tuple[float, float, float]:
    """(wall us, CPU us of both processes, CPU us of the echoing child) per round trip: see the
    module's docstring. The child's CPU is its own rusage (``wait4``), to the microsecond."""
    a, b = socket.socketpair()  # AF_UNIX, SOCK_STREAM, as an engine socket is
    pid = os.fork()
    if pid == 0:  # the echo side; it leaves with os._exit, never unwinding into the parent's code
        code = 1
        try:
            a.close()  # so that the parent's end closing is an end of file here
            os.sched_setaffinity(0, {cpu_b})
            for _ in range(n):
                got = b.recv(64)
                if not got:
                    break
                b.send(got)
            else:
                code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    b.close()  # so that the child's end closing (it failed) is an end of file here
    try:
        os.sched_setaffinity(0, {cpu_a})
        msg = bytes(64)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            a.send(msg)
            if not a.recv(64):
                raise RuntimeError("the echoing process ended early (its error is on stderr)")
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        a.close()  # a child still in recv sees the end of file and leaves
        _, status, ru = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"the echoing process failed ({os.waitstatus_to_exitcode(status)})")
    child = ru.ru_utime + ru.ru_stime
    return wall / n * 1e6, (cpu + child) / n * 1e6, child / n * 1e6


def ipc_round_trip_on(n: int, cpus: tuple[int, int]) -> tuple[float, float, float]:
    """:func:`ipc` on ``cpus`` in a fresh process (its pinning stays there)."""
    cmd = [sys.executable, "-m", "pdd_tools.benchpipe", "ipc", str(n), *map(str, cpus)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {run.returncode}: {run.stderr.strip()[-2000:]}")
    wall, cpu, child = map(float, run.stdout.split())
    return wall, cpu, child


def ipc_round_trip(n: int = 20000) -> dict[str, tuple[float, float, float]] | None:
    """:func:`ipc` across two CPUs and on one: ``{"cross": (wall us, CPU us, the child's CPU
    us), "same": ...}``; None on a single-CPU machine."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return {kind: ipc_round_trip_on(n, (pair[0], pair[1]))
            for kind, pair in (("cross", cpus[:2]), ("same", cpus[:1] * 2))}


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
    r = bare_pipe_split(size, reps)
    return r["gbps"], r["tx_s_per_gb"] + r["rx_s_per_gb"]


def bare_pipe_split(size: int = 64 * MiB, reps: int = 16, *, write: int = 4 * MiB, rx: str = "loop",
                    xxh3: bool = False, seconds: float = 0.0) -> dict[str, float]:
    """The bare pipe with ``write``-byte sends and the receiver in mode ``rx`` (see :func:`rx`),
    ``reps`` passes over a ``size``-byte region (``seconds`` > 0: as many as fit in that time):
    GB/s, each side's CPU seconds per GB, the receiver's reads per 4 MiB, and when the sender
    started and stopped sending (``t0``, ``t1``, on ``time.perf_counter``'s clock, which is the
    same in every process on Linux). Raises RuntimeError if the receiver did not get every byte."""
    from .harness import free_port

    if rx not in RX_MODES:
        raise ValueError(f"rx mode must be one of {RX_MODES}, got {rx!r}")
    if write <= 0:
        raise ValueError(f"write must be > 0, got {write}")
    port = free_port()
    rxp = subprocess.Popen([sys.executable, "-m", "pdd_tools.benchpipe", "rx", str(port), str(size), rx,
                            "xxh3" if xxh3 else "-"], stdout=subprocess.PIPE, text=True)
    assert rxp.stdout is not None
    try:
        if rxp.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the pipe's receiver did not start (exit status {rxp.poll()}; its error is on stderr)")
        out = subprocess.run([sys.executable, "-m", "pdd_tools.benchpipe", "tx", str(port), str(size), str(reps),
                              str(write), str(seconds)], capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"the pipe's sender exited {out.returncode}: {out.stderr.strip()[-2000:]}")
        gbps, tx_cpu, sent, t0, t1 = map(float, out.stdout.split())
        fields = rxp.stdout.readline().split()
        if len(fields) != 3:
            raise RuntimeError(f"the pipe's receiver failed (exit status {rxp.wait(10)}; its error is on stderr)")
        rx_cpu, reads, got = float(fields[0]), int(fields[1]), int(fields[2])
        if got != sent:
            raise RuntimeError(f"the pipe's receiver got {got} bytes of the {int(sent)} sent")
        gb = sent / 1e9
        return {"gbps": gbps, "tx_s_per_gb": tx_cpu / gb, "rx_s_per_gb": rx_cpu / gb,
                "rx_reads_per_4MiB": reads / (sent / (4 * MiB)), "t0": t0, "t1": t1}
    finally:
        try:
            rxp.wait(10)
        except subprocess.TimeoutExpired:
            rxp.kill()
            rxp.wait()


if __name__ == "__main__":
    if sys.argv[1] == "ipc":
        wall_us, cpu_us, child_us = ipc(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        print(f"{wall_us:.3f} {cpu_us:.3f} {child_us:.3f}")
        sys.exit(0)
    role, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if role == "rx":
        rx(port, size, sys.argv[4] if len(sys.argv) > 4 else "loop", xxh3=sys.argv[5:6] == ["xxh3"])
    else:
        gbps, cpu, sent, t0, t1 = tx(port, size, int(sys.argv[4]), int(sys.argv[5]) if len(sys.argv) > 5 else 4 << 20,
                                     float(sys.argv[6]) if len(sys.argv) > 6 else 0.0)
        print(f"{gbps:.4f} {cpu:.4f} {sent} {t0:.6f} {t1:.6f}")
