"""The ``ucx`` group of ``scripts/bench``: KV between two agents of one site over UCX, beside the
best bare ucxx configuration measured in the same run.

Each round measures, one after the other so that load from elsewhere on the host hits them
alike: bare ucxx in each of :data:`~.bench_ucx.BASELINE_CONFIGS` (blocking and polling
progress, worker address, error handling off), ``UcxPeer`` alone (:mod:`.bench_ucx`), then two
fresh agents (site A's nodes ``a1`` and ``a2``, ``transport = "ucx"``) moving 4 MiB transfers 8
at a time and 64 MiB transfers 2 at a time from engine to engine (``send_kv`` to
``kv_received``). The agent figure is the median of its rounds; its baseline is the bare
configuration with the best median, named in the figure. The same agents then measure token
frames (engine to engine, A to a2) idle and while a 1 GiB transfer moves over UCX.

Where the CPU of an agent transfer goes (``ucx_agent_cpu_<size>``): CPU ms per transfer of the
sending agent, the receiving agent (whose loop also makes the shared-memory copy) and the
engines (this process), timed transfers only. With py-spy installed (``.venv/bin/pip install
py-spy``; it is no dependency) one more 4 MiB run is sampled (``py-spy record --gil
--nonblocking``) and ``ucx_agent_profile_4MiB_<agent>`` say what each agent's loop spends its
Python time on (:data:`CATEGORIES`) and how much it spends without the GIL (the copy, syscalls);
``BENCH_PROFILE_DIR=<dir>`` keeps the raw samples there (``sender.txt``, ``receiver.txt``:
py-spy's ``--format raw``, collapsed stacks for a flame graph).
"""

from __future__ import annotations

import asyncio
import collections
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

from pdd_wire.engine import protocol as p
from pdd_wire.engine.client import EngineClient
from pdd_wire.memory import SharedMemory
from pdd_wire.stats import percentile

from . import bench_goodput, bench_ucx
from .harness import AgentPair

MiB = 1 << 20
#: Transfers per round of the agent figures (quick: a quarter), by bench_ucx.PLANS label.
TRANSFERS = {"4MiB": 256, "64MiB": 24}
GoodputFn = Callable[..., Awaitable[tuple]]
#: Where a sample of an agent's loop holding the GIL goes: its innermost frame that matches.
CATEGORIES = (
    ("prometheus metrics", ("prometheus_client",)),
    ("control frames out (encode, TLS, write)", ("FrameProtocol.send", "SSLObject.write", "wire/frame.py:1")),
    ("control frames in (read, TLS, decode)", ("FrameReader", "SSLObject.read", "decode_body", "buffer_updated")),
    ("UCX engine (progress, matching, completions)", ("transport/ucx",)),
    ("engine socket (requests, events)", ("engine_server", "engine_handlers", "engine/protocol")),
    ("desk (posts, matching)", ("pdd_wire/desk",)),
    ("session (transfer state, acks)", ("pdd_wire/session", "pdd_wire/transfer")),
    ("logging", ("structlog",)),
)
RATE = 1000  # py-spy samples per second


def _cpu(pid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (None: this one)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuClock(dict):
    """CPU seconds so far by name: the sending agent, the receiving agent, the engines (this
    process); two readings subtract to what was used between them."""

    def __init__(self, pair: AgentPair) -> None:
        super().__init__(sender=_cpu(pair.procs["A"].pid), receiver=_cpu(pair.procs["B"].pid), engines=_cpu())

    def __sub__(self, other: dict) -> dict[str, float]:
        return {k: v - other[k] for k, v in self.items()}


async def _token_rtts(ea: EngineClient, eb: EngineClient, dest: str, rid: str, n: int,
                      busy: asyncio.Future | None = None) -> list[float]:
    """Token frames engine A -> engine B, ms, one every 2 ms: ``n`` of them, or while ``busy``
    is not done."""
    await eb.expect_tokens(rid, "A")
    out: list[float] = []
    while len(out) < n and not (busy is not None and busy.done()):
        t0 = time.perf_counter()
        await ea.send_tokens(rid, dest, [len(out)])
        await eb.wait_tokens(rid, timeout=10)
        out.append((time.perf_counter() - t0) * 1e3)
        await asyncio.sleep(0.002)
    return out


async def _tokens_under_load(pair: AgentPair, ea: EngineClient, eb: EngineClient, samples: int) -> tuple[list, float]:
    """Token RTTs while 1 GiB transfers move over UCX (as many as ``samples`` need, at most
    8), and the transfers' GB/s."""
    size, block = 1 << 30, 4 * MiB
    src, dst = SharedMemory(size), SharedMemory(size)
    try:
        src.buf[:] = os.urandom(64 * MiB) * (size // (64 * MiB))
        dst.buf[:] = bytes(size)
        ra, rb = await ea.register(src, block_bytes=block), await eb.register(dst, block_bytes=block)
        lat: list[float] = []
        seconds = []
        for k in range(8):
            if len(lat) >= samples:
                break
            rid = f"ucx-load-{k}"
            await eb.post_recv(rid, [rb.blocks(0, size // block)])
            t0 = time.perf_counter()
            await ea.send_kv(rid, [ra.blocks(0, size // block)], to=[pair.dest])
            done = asyncio.ensure_future(eb.wait(rid, timeout=120))
            lat += await _token_rtts(ea, eb, pair.dest, f"tok-{rid}", samples - len(lat), done)
            if not isinstance(ev := await done, p.KvReceived):
                raise RuntimeError(f"load transfer failed: {ev}")
            seconds.append(time.perf_counter() - t0)
            await ea.wait(rid, timeout=60)
        await ea.deregister(ra)
        await eb.deregister(rb)
        return lat, size / statistics.median(seconds) / 1e9
    finally:
        src.close()
        dst.close()


def _py_spy() -> str | None:
    return shutil.which("py-spy") or next(
        (p for p in [os.path.join(os.path.dirname(sys.executable), "py-spy")] if os.access(p, os.X_OK)), None)


def categorize(raw: str) -> tuple[int, collections.Counter[str]]:
    """Samples of a ``py-spy record --format raw`` file, and their count by :data:`CATEGORIES`
    (else "event loop (uvloop, asyncio)")."""
    total, per = 0, collections.Counter[str]()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        total += int(n)
        frames = stack.split(";")[1:]
        name = next((name for fr in reversed(frames) for name, pats in CATEGORIES if any(p in fr for p in pats)),
                    "event loop (uvloop, asyncio)")
        per[name] += int(n)
    return total, per


async def _profile(figs, pair: AgentPair, goodput: GoodputFn, ea: EngineClient, eb: EngineClient,
                   count: int) -> None:
    """``count`` 4 MiB transfers, 8 at a time, with py-spy sampling both agents' loops."""
    size, _, conc = bench_ucx.PLANS["4MiB"]
    spy = _py_spy()
    if spy is None:
        print("# ucx_agent_profile_4MiB left out: py-spy is not installed (.venv/bin/pip install py-spy)",
              file=sys.stderr)
        return
    keep = os.environ.get("BENCH_PROFILE_DIR")
    with tempfile.TemporaryDirectory() as scratch:
        tmp = keep or scratch
        procs = {}
        for name, site in (("sender", "A"), ("receiver", "B")):
            procs[name] = subprocess.Popen(
                [spy, "record", "--gil", "--nonblocking", "--rate", str(RATE), "--format", "raw", "--output",
                 f"{tmp}/{name}.txt", "--pid", str(pair.procs[site].pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await asyncio.sleep(1.0)  # py-spy attaches (it says nothing when it has)
        _, _, used = await goodput(ea, eb, size, count, conc, to=pair.dest, cpu=lambda: CpuClock(pair))
        for pr in procs.values():
            pr.send_signal(signal.SIGINT)   # py-spy writes its file and exits
        for name, pr in procs.items():
            await asyncio.to_thread(pr.wait, 30)
            try:
                with open(f"{tmp}/{name}.txt") as f:
                    total, per = categorize(f.read())
            except OSError:
                print(f"# ucx_agent_profile_4MiB_{name} left out: py-spy wrote nothing (it needs ptrace)",
                      file=sys.stderr)
                continue
            cpu_ms = used[name] / count * 1e3
            gil_ms = total / RATE / count * 1e3
            figs.add(f"ucx_agent_profile_4MiB_{name}", gil_ms, "ms",
                     note=f"GIL held per transfer (wall time: a loop preempted while it holds the GIL counts), "
                          f"of {cpu_ms:.2f} ms CPU ({max(0.0, cpu_ms - gil_ms):.2f} without the GIL: the copy, "
                          "syscalls): " + ", ".join(
                              f"{k} {100 * v / total:.0f}%" for k, v in per.most_common()))


async def add_figures(figs, quick: bool, goodput: GoodputFn = bench_goodput.goodput) -> None:
    """The group's figures into ``figs``. ``goodput(ea, eb, size, count, concurrency, to=...,
    cpu=clock)`` -> (GB/s, per-transfer seconds, CPU used by the timed transfers: ``clock()``
    after less before): the engine-to-engine driver the other goodput figures use."""
    from pdd_wire.transport import ucx

    ok, why = ucx.available()
    if not ok:
        print(f"# UCX figures left out: {why}", file=sys.stderr)
        return
    rounds, inner, cut = (2, 3, 4) if quick else (3, 5, 1)
    plans = bench_ucx.PLANS
    bare: dict[str, dict[str, list[float]]] = {label: {c: [] for c in bench_ucx.BASELINE_CONFIGS} for label in plans}
    peer: dict[str, list[float]] = {label: [] for label in plans}
    agent: dict[str, list[float]] = {label: [] for label in plans}
    cpu: dict[str, list[dict]] = {label: [] for label in plans}
    idle: list[float] = []
    loaded: list[float] = []
    load_gbps = 0.0
    for r in range(rounds):
        for label, (size, count, conc) in plans.items():
            count //= cut
            for c in bench_ucx.BASELINE_CONFIGS:
                bare[label][c].append(await asyncio.to_thread(bench_ucx.measure_bare, c, size, count, conc, inner))
            peer[label].append(await asyncio.to_thread(bench_ucx.measure_pair, "peer", size, count, conc, inner))
        async with AgentPair(same_site_ucx=True) as pair:
            async with EngineClient(pair.sockets["A"], "bench-A") as ea, \
                    EngineClient(pair.sockets["B"], "bench-B") as eb:
                for label, (size, _, conc) in plans.items():
                    count = TRANSFERS[label] // cut
                    gbps, _, used = await goodput(ea, eb, size, count, conc, to=pair.dest,
                                                  cpu=lambda pair=pair: CpuClock(pair))
                    agent[label].append(gbps)
                    cpu[label].append({k: v / count * 1e3 for k, v in used.items()})
                if r == rounds - 1:
                    idle = await _token_rtts(ea, eb, pair.dest, "ucx-idle", 100 if quick else 300)
                    loaded, load_gbps = await _tokens_under_load(pair, ea, eb, 100 if quick else 300)
                    await _profile(figs, pair, goodput, ea, eb, 4 * TRANSFERS["4MiB"] // cut)
    for label, (size, messages, conc) in plans.items():
        count = TRANSFERS[label] // cut
        config, base = bench_ucx.best(bare[label])
        others = ", ".join(f"{c} {statistics.median(v):.2f}" for c, v in bare[label].items())
        figs.add(f"ucx_agent_goodput_{label}", statistics.median(agent[label]), "GB/s", bench_ucx.describe(config),
                 base, note=f"two agents of site A, transport ucx, engine send_kv to kv_received; {count} transfers, "
                            f"{conc} at a time; median of {rounds} rounds; bare ucxx GB/s: {others}")
        figs.add(f"ucx_goodput_{label}", statistics.median(peer[label]), "GB/s", bench_ucx.describe(config), base,
                 note=f"UcxPeer alone between two processes (pdd_tools.bench_ucx), {conc} in flight")
        ms = {k: statistics.median(c[k] for c in cpu[label]) for k in cpu[label][0]}
        cores = os.cpu_count() or 1
        bound = cores * size / (sum(ms.values()) / 1e3) / 1e9
        figs.add(f"ucx_agent_cpu_{label}", sum(ms.values()), "ms", note="CPU per transfer: " + ", ".join(
            f"{k} {v:.2f}" for k, v in ms.items()) + " (the receiving agent makes the shared-memory copy); "
            f"so at most {bound:.2f} GB/s on this host's {cores} cores, were they all free for it")
        pt = await asyncio.to_thread(bench_ucx.measure_perftest, size, max(messages, 20))
        if pt is not None:
            figs.add(f"ucx_perftest_{label}", pt, "GB/s", bench_ucx.describe(config), base,
                     note="ucx_perftest -t tag_bw (UCX's C benchmark, from the libucx wheel)")
    if idle and loaded:
        figs.add("ucx_token_latency_idle_p99", percentile(idle, 99), "ms", note="token frames engine A -> a2, idle")
        figs.add("ucx_token_latency_under_load_p99", percentile(loaded, 99), "ms", "idle p99 (same agents)",
                 percentile(idle, 99), note=f"{len(loaded)} samples during 1 GiB UCX transfers at {load_gbps:.2f} GB/s"
                                            f"; p50 {percentile(loaded, 50):.2f} ms")
