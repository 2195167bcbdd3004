"""UCX local-path benchmark: ``python -m pdd_tools.bench_ucx [--quick]``.

Goodput of one-way streams of 4 MiB and 64 MiB messages between two processes over shared
memory (``UCX_TLS=sm,self``), three ways, in one run:

* ``ucx_goodput_<size>``: :class:`pdd_wire.transport.ucx.UcxPeer` moving memfd-backed buffers
  (:class:`pdd_wire.memory.SharedMemory`) on the :class:`~pdd_wire.transport.ucx.UcxLoop`;
* its baseline, bare ucxx (``ucxx.init(progress_mode=os.environ.get("BENCH_BARE_MODE", "blocking"))``,
  ``create_endpoint_from_worker_address``, ``Endpoint.send/recv(force_tag=True)``) moving the
  same memfd buffers: the Python binding's ceiling;
* ``ucx_perftest_<size>``: UCX's own C benchmark (``ucx_perftest -t tag_bw``, shipped in the
  libucx wheel), the transport's ceiling on this machine.

Each stream keeps ``window`` messages in flight (receiver slots are reused only after their
previous receive finished); a round is timed on the receiver from the moment it tells the
sender to start until the last message has landed. A run's figure is the median of its
rounds; the reported figure is the best of the runs (the two paths are run alternately, so
that load from elsewhere on the host hits both alike).

Knobs for experiments: ``BENCH_SPIN=<seconds>`` (the UcxLoop's spin before it sleeps),
``BENCH_BARE_MODE=blocking|polling|thread`` (ucxx's progress mode for the baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

MiB = 1 << 20
START_TAG = (1 << 63) - 1
TLS = "sm,self"


def _pattern(slot: int, n: int) -> bytes:
    block = bytes((slot * 7 + j) % 251 for j in range(4096))
    return (block * (n // 4096 + 1))[:n]


def _say(line: str) -> None:
    sys.stdout.write("@@" + line + "\n")
    sys.stdout.flush()


def _hear() -> str:
    while True:
        line = sys.stdin.readline()
        if not line:
            raise SystemExit("parent went away")
        if line.startswith("@@"):
            return line[2:].strip()


async def _stream(role: str, send, recv, bufs, size: int, count: int, window: int,
                  rounds: int) -> list[float]:
    """The common protocol. ``send(tag, view)`` / ``recv(tag, view)`` are coroutines."""
    times = []
    go = bytearray(8)
    for r in range(rounds):
        base = (r + 1) << 32
        if role == "recv":
            slots: list[asyncio.Task | None] = [None] * window
            t0 = time.perf_counter()
            first = [asyncio.ensure_future(recv(base + i, bufs[i])) for i in range(min(window, count))]
            slots[:len(first)] = first
            await send(START_TAG, go)
            for i in range(window, count):
                s = i % window
                await slots[s]
                slots[s] = asyncio.ensure_future(recv(base + i, bufs[s]))
            await asyncio.gather(*[t for t in slots if t is not None])
            times.append(time.perf_counter() - t0)
        else:
            await recv(START_TAG, go)
            slots = [None] * window
            for i in range(count):
                s = i % window
                if slots[s] is not None:
                    await slots[s]
                slots[s] = asyncio.ensure_future(send(base + i, bufs[s]))
            await asyncio.gather(*[t for t in slots if t is not None])
    return times


def _child(args: dict) -> None:
    kind, role, size, count = args["kind"], args["role"], args["size"], args["count"]
    window, rounds = args["window"], args["rounds"]
    from pdd_wire.memory import SharedMemory

    mem = SharedMemory(size * window)
    bufs = [mem.buf[i * size:(i + 1) * size] for i in range(window)]
    if role == "send":
        for i, b in enumerate(bufs):
            b[:] = _pattern(i, size)

    if kind == "peer":
        from pdd_wire.transport import ucx

        loop = ucx.acquire_loop(spin_s=float(os.environ.get("BENCH_SPIN", ucx.SPIN_S)))
        peer = ucx.UcxPeer(loop, role)
        _say("ADDR " + peer.local_address().hex())
        remote = bytes.fromhex(_hear().split()[1])

        async def main() -> list[float]:
            await peer.connect(remote)
            return await _stream(role, peer.send, peer.recv, bufs, size, count, window, rounds)

        times = loop.submit(main()).result()
        peer.close()
        ucx.release_loop(loop)
    else:
        import ucxx

        async def main() -> list[float]:
            ucxx.init(progress_mode=os.environ.get("BENCH_BARE_MODE", "blocking"))
            _say("ADDR " + bytes(memoryview(ucxx.get_worker_address())).hex())
            remote = bytes.fromhex((await asyncio.get_running_loop().run_in_executor(None, _hear)).split()[1])
            ep = await ucxx.create_endpoint_from_worker_address(
                ucxx.get_ucx_address_from_buffer(remote), endpoint_error_handling=False)

            async def send(tag, view):
                await ep.send(view, tag=tag, force_tag=True)

            async def recv(tag, view):
                await ep.recv(view, tag=tag, force_tag=True)

            try:
                return await _stream(role, send, recv, bufs, size, count, window, rounds)
            finally:
                await ep.close()

        times = asyncio.run(main())
    ok = True
    if role == "recv":
        ok = all(bytes(b) == _pattern(i, size) for i, b in enumerate(bufs))
    _say("RESULT " + json.dumps({"times": times, "ok": ok}))
    _hear()  # wait for the parent before tearing down (the peer may still be draining)
    for b in bufs:
        b.release()
    mem.close()


def _spawn(args: dict, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdd_tools.bench_ucx", "--child", json.dumps(args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)


def _read(p: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark child exited ({p.wait()})")
        if line.startswith("@@"):
            return line[2:].strip()
    raise TimeoutError("benchmark child too slow")


def measure_pair(kind: str, size: int, count: int, window: int, rounds: int,
                 tls: str = TLS, timeout: float = 300.0) -> float:
    """GB/s (1e9 bytes/s), median over rounds, receiver-timed, between two fresh processes."""
    env = dict(os.environ, UCX_TLS=tls)
    common = {"kind": kind, "size": size, "count": count, "window": window, "rounds": rounds}
    recv = _spawn(dict(common, role="recv"), env)
    send = _spawn(dict(common, role="send"), env)
    try:
        ra, sa = _read(recv, 60), _read(send, 60)
        for p, line in ((recv, sa), (send, ra)):
            p.stdin.write("@@" + line + "\n")
            p.stdin.flush()
        result = json.loads(_read(recv, timeout).split(" ", 1)[1])
        _read(send, timeout)
        for p in (recv, send):
            p.stdin.write("@@BYE\n")
            p.stdin.flush()
        for p in (recv, send):
            p.wait(60)
    finally:
        for p in (recv, send):
            if p.poll() is None:
                p.kill()
                p.wait()
    if not result["ok"]:
        raise RuntimeError(f"{kind}: received bytes differ from what was sent")
    return size * count / statistics.median(result["times"]) / 1e9


def perftest_binary() -> tuple[str, str] | None:
    """(ucx_perftest, its lib dir) from the libucx wheel, else from PATH."""
    try:
        import libucx
        root = os.path.dirname(libucx.__file__)
        exe = os.path.join(root, "bin", "ucx_perftest")
        if os.access(exe, os.X_OK):
            return exe, os.path.join(root, "lib")
    except ImportError:
        pass
    exe = shutil.which("ucx_perftest")
    return (exe, "") if exe else None


def measure_perftest(size: int, iters: int, tls: str = TLS) -> float | None:
    """ucx_perftest tag_bw, GB/s (it reports MB/s of 2**20 bytes)."""
    found = perftest_binary()
    if found is None:
        return None
    exe, libdir = found
    from .harness import free_port

    port = free_port()
    env = dict(os.environ, UCX_TLS=tls)
    if libdir:
        env["LD_LIBRARY_PATH"] = libdir + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    server = subprocess.Popen([exe, "-p", str(port)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        out = ""
        for _ in range(50):  # the server needs a moment to listen
            time.sleep(0.1)
            r = subprocess.run([exe, "127.0.0.1", "-p", str(port), "-t", "tag_bw", "-s", str(size),
                                "-n", str(iters)], env=env, capture_output=True, text=True, timeout=120,
                               check=False)
            out = r.stdout
            if r.returncode == 0:
                break
        for line in out.splitlines():
            if line.startswith("Final:"):
                return float(line.split()[6]) * MiB / 1e9
        return None
    finally:
        try:
            server.wait(10)   # it exits after serving one client
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def run(quick: bool = False) -> list[dict]:
    rounds = 3 if quick else 7
    plans = [(4 * MiB, 64 if quick else 200, 4), (64 * MiB, 8 if quick else 24, 2)]
    rows = []
    for size, count, window in plans:
        label = f"{size // MiB}MiB"
        peer_gbps, bare_gbps = [], []
        for _ in range(1 if quick else 2):
            peer_gbps.append(measure_pair("peer", size, count, window, rounds))
            bare_gbps.append(measure_pair("bare", size, count, window, rounds))
        a, b = max(peer_gbps), max(bare_gbps)
        rows.append({"figure": f"ucx_goodput_{label}", "value": round(a, 3), "unit": "GB/s",
                     "baseline": "bare ucxx tag send/recv", "baseline_value": round(b, 3),
                     "ratio": round(a / b, 3)})
        pt = measure_perftest(size, max(count, 20))
        if pt is not None:
            rows.append({"figure": f"ucx_perftest_{label}", "value": round(pt, 3), "unit": "GB/s",
                         "baseline": "bare ucxx tag send/recv", "baseline_value": round(b, 3),
                         "ratio": round(pt / b, 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdd_tools.bench_ucx", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and messages")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        _child(json.loads(ns.child))
        return 0
    from pdd_wire.transport.ucx import available
    ok, why = available()
    if not ok:
        print(f"UCX path unavailable: {why}", file=sys.stderr)
        return 2
    print(f"# {why}; UCX_TLS={TLS}; run: python -m pdd_tools.bench_ucx [--quick]", file=sys.stderr)
    for row in run(ns.quick):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
