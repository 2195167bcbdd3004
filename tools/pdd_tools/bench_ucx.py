"""UCX local-path benchmark between two processes: ``python -m pdd_tools.bench_ucx [--quick] [--configs]``.

Goodput of one-way streams of 4 MiB messages (8 in flight) and 64 MiB messages (2 in flight),
as the agent figures move them (``scripts/bench --only ucx``, :mod:`.bench_ucx_agents`),
between two processes over shared memory (``UCX_TLS=sm,self``), memfd-backed buffers
(:class:`pdd_wire.memory.SharedMemory`), three ways:

* ``ucx_goodput_<size>``: :class:`pdd_wire.transport.ucx.UcxPeer` on its progress engine,
  driven from the process's own uvloop as the agent drives it;
* bare ucxx (``ucxx.init(progress_mode=...)``, ``Endpoint.send/recv(force_tag=True)``) moving
  the same buffers, in the configurations of :data:`CONFIGS`; the baseline is the best of
  :data:`BASELINE_CONFIGS` measured in the same run (``--configs`` measures every one: thread
  progress, error handling and a listener are far behind, or do not connect, here);
* ``ucx_perftest_<size>``: UCX's own C benchmark (``ucx_perftest -t tag_bw``, shipped in the
  libucx wheel), the transport's ceiling on this machine.

Each stream keeps ``window`` messages in flight (receiver slots are reused only after their
previous receive finished); a round is timed on the receiver from the moment it tells the
sender to start until the last message has landed; a measurement is the median of its rounds,
between two fresh processes. Kinds are measured alternately, so that load from elsewhere on the
host hits them alike. ``BENCH_SPIN=<seconds>`` (an experiment): the engine's ``spin_s``.
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
import tempfile
import time

MiB = 1 << 20
START_TAG = (1 << 63) - 1
TLS = "sm,self"
#: label -> (message bytes, messages per round, in flight): the agent figures' sizes and concurrency.
PLANS = {"4MiB": (4 * MiB, 200, 8), "64MiB": (64 * MiB, 24, 2)}
#: Bare ucxx configurations: progress mode, how the endpoint is made, UCX peer error handling, UCX_TLS.
CONFIGS: dict[str, dict] = {
    "blocking": {"mode": "blocking"},
    "polling": {"mode": "polling"},
    "thread": {"mode": "thread"},
    "thread-polling": {"mode": "thread-polling"},
    "blocking+error-handling": {"mode": "blocking", "eh": True},
    "blocking+error-handling+tcp": {"mode": "blocking", "eh": True, "tls": "sm,self,tcp"},
    "listener": {"mode": "blocking", "connect": "listener", "tls": "sm,self,tcp"},
    "listener+error-handling": {"mode": "blocking", "connect": "listener", "eh": True, "tls": "sm,self,tcp"},
}
#: The candidates for the in-run baseline (the others are far behind here: ``--configs``).
BASELINE_CONFIGS = ("blocking", "polling")


def describe(config: str) -> str:
    """A bare configuration in words, as figures name their baseline."""
    c = CONFIGS[config]
    how = "listener" if c.get("connect") == "listener" else "worker address"
    eh = "error handling on" if c.get("eh") else "error handling off"
    return f"bare ucxx tag send/recv ({c['mode']} progress, {how}, {eh}, UCX_TLS={c.get('tls', TLS)})"


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
        import uvloop

        from pdd_wire.transport import ucx

        async def main() -> list[float]:
            spin = os.environ.get("BENCH_SPIN")  # an experiment: the engine's spin_s
            loop = ucx.acquire_loop(asyncio.get_running_loop(), **({"spin_s": float(spin)} if spin else {}))
            peer = ucx.UcxPeer(loop, role)
            _say("ADDR " + peer.local_address().hex())
            remote = bytes.fromhex((await asyncio.get_running_loop().run_in_executor(None, _hear)).split()[1])
            await peer.connect(remote)
            times = await _stream(role, peer.send, peer.recv, bufs, size, count, window, rounds)
            _report(role, bufs, size, times)
            await asyncio.get_running_loop().run_in_executor(None, _hear)  # the peer may still be draining
            peer.close()
            await peer.wait_closed()
            await ucx.arelease_loop(loop)

        uvloop.run(main())
    else:
        import ucxx

        mode, connect, eh = args.get("mode", "blocking"), args.get("connect", "address"), args.get("eh", False)

        async def main() -> list[float]:
            ucxx.init(progress_mode=mode)
            loop = asyncio.get_running_loop()
            if connect == "address":
                _say("ADDR " + bytes(memoryview(ucxx.get_worker_address())).hex())
                remote = bytes.fromhex((await loop.run_in_executor(None, _hear)).split()[1])
                ep = await ucxx.create_endpoint_from_worker_address(
                    ucxx.get_ucx_address_from_buffer(remote), endpoint_error_handling=eh)
            elif role == "recv":      # listener: the receiver listens, the sender dials
                got: asyncio.Future = loop.create_future()

                def accepted(e) -> None:
                    if not got.done():
                        got.set_result(e)
                lst = ucxx.create_listener(accepted, endpoint_error_handling=eh)
                _say(f"ADDR {lst.port}")
                await loop.run_in_executor(None, _hear)
                ep = await asyncio.wait_for(got, 10)   # (ucxx refuses a listener without error handling)
            else:
                _say("ADDR -")
                port = int((await loop.run_in_executor(None, _hear)).split()[1])
                ep = await ucxx.create_endpoint("127.0.0.1", port, endpoint_error_handling=eh)

            async def send(tag, view):
                await ep.send(view, tag=tag, force_tag=True)

            async def recv(tag, view):
                await ep.recv(view, tag=tag, force_tag=True)

            try:
                return await _stream(role, send, recv, bufs, size, count, window, rounds)
            finally:
                await ep.close()

        _report(role, bufs, size, asyncio.run(main()))
        _hear()  # wait for the parent before tearing down (the peer may still be draining)
    for b in bufs:
        b.release()
    mem.close()


def _report(role: str, bufs: list, size: int, times: list[float]) -> None:
    ok = role != "recv" or all(bytes(b) == _pattern(i, size) for i, b in enumerate(bufs))
    _say("RESULT " + json.dumps({"times": times, "ok": ok}))


def _spawn(args: dict, env: dict) -> subprocess.Popen:
    err = tempfile.TemporaryFile()  # noqa: SIM115 - read back when the child fails (_why), closed with it
    p = subprocess.Popen([sys.executable, "-m", "pdd_tools.bench_ucx", "--child", json.dumps(args)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, text=True)
    p.errfile = err  # type: ignore[attr-defined]
    return p


def _read(p: subprocess.Popen, timeout: float) -> str:
    assert p.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark child exited ({p.wait()}): {_why(p)}")
        if line.startswith("@@"):
            return line[2:].strip()
    raise TimeoutError("benchmark child too slow")


def _why(p: subprocess.Popen) -> str:
    """The last line of a child's stderr that names an error."""
    err = p.errfile  # type: ignore[attr-defined]
    err.seek(0)
    lines = [ln.strip() for ln in err.read().decode(errors="replace").splitlines()]
    named = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (named or lines or ["?"])[-1][:300]


def measure_pair(kind: str, size: int, count: int, window: int, rounds: int,
                 tls: str = TLS, timeout: float = 300.0, **config) -> float:
    """GB/s (1e9 bytes/s), median over rounds, receiver-timed, between two fresh processes."""
    env = dict(os.environ, UCX_TLS=tls)
    common = {"kind": kind, "size": size, "count": count, "window": window, "rounds": rounds, **config}
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
            p.errfile.close()  # type: ignore[attr-defined]
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


def measure_bare(config: str, size: int, count: int, window: int, rounds: int) -> float:
    """:func:`measure_pair` of bare ucxx in configuration ``config`` (:data:`CONFIGS`)."""
    c = dict(CONFIGS[config])
    return measure_pair("bare", size, count, window, rounds, tls=c.pop("tls", TLS), **c)


def best(results: dict[str, list[float]]) -> tuple[str, float]:
    """The configuration whose median is highest, and that median."""
    name = max(results, key=lambda k: statistics.median(results[k]))
    return name, statistics.median(results[name])


def run(quick: bool = False) -> list[dict]:
    """The transport's figures: ``UcxPeer`` alone and ``ucx_perftest`` against the best bare
    ucxx configuration of :data:`BASELINE_CONFIGS`, measured alternately in this run."""
    rounds, reps = (3, 1) if quick else (7, 2)
    rows = []
    for label, (size, count, window) in PLANS.items():
        count = count // 4 if quick else count
        peer: list[float] = []
        bare: dict[str, list[float]] = {c: [] for c in BASELINE_CONFIGS}
        for _ in range(reps):
            peer.append(measure_pair("peer", size, count, window, rounds))
            for c in BASELINE_CONFIGS:
                bare[c].append(measure_bare(c, size, count, window, rounds))
        config, base = best(bare)
        others = ", ".join(f"{c} {statistics.median(v):.2f}" for c, v in bare.items())
        rows.append(_row(f"ucx_goodput_{label}", statistics.median(peer), config, base,
                         f"UcxPeer alone, {window} in flight; bare ucxx GB/s: {others}"))
        pt = measure_perftest(size, max(count, 20))
        if pt is not None:
            rows.append(_row(f"ucx_perftest_{label}", pt, config, base, "ucx_perftest -t tag_bw (C)"))
    return rows


def _row(figure: str, value: float, config: str, base: float, note: str) -> dict:
    return {"figure": figure, "value": round(value, 3), "unit": "GB/s", "baseline": describe(config),
            "baseline_value": round(base, 3), "ratio": round(value / base, 3), "note": note}


def run_configs(quick: bool = False) -> list[dict]:
    """Every bare configuration of :data:`CONFIGS` and ``UcxPeer``, each size, alternately;
    a configuration that cannot connect here says why."""
    rounds, reps = (3, 1) if quick else (5, 2)
    rows = []
    for label, (size, count, window) in PLANS.items():
        count = count // 4 if quick else count
        got: dict[str, list[float]] = {c: [] for c in ("UcxPeer", *CONFIGS)}
        errors: dict[str, str] = {}
        for _ in range(reps):
            for c in got:
                if c in errors:
                    continue
                try:
                    got[c].append(measure_pair("peer", size, count, window, rounds) if c == "UcxPeer"
                                  else measure_bare(c, size, count, window, rounds))
                except (RuntimeError, TimeoutError) as exc:
                    errors[c] = str(exc)
        for c, v in got.items():
            row = {"figure": f"ucx_config_{label}", "config": c, "unit": "GB/s",
                   "what": "UcxPeer (the agent's engine)" if c == "UcxPeer" else describe(c)}
            rows.append(row | ({"value": round(statistics.median(v), 3)} if v else {"error": errors[c]}))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdd_tools.bench_ucx", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and messages")
    ap.add_argument("--configs", action="store_true", help="every bare ucxx configuration, not only the baseline's")
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
    print(f"# {why}; UCX_TLS={TLS}; run: python -m pdd_tools.bench_ucx [--quick] [--configs]", file=sys.stderr)
    for row in (run_configs if ns.configs else run)(ns.quick):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
