"""The goodput, CPU-per-byte and token-latency figures of ``scripts/bench`` (groups ``goodput`` and
``latency``), between two ``pdd-wired`` processes on loopback, each beside its baseline measured in
the same run:

* ``kv_goodput_{4,64}MiB`` against iperf3 and against the bare Python pipe (``benchpipe``);
* ``cpu_per_gb_{4,64}MiB``: CPU seconds of both agents per GB moved against the bare pipe's sender
  and receiver, with each agent's main loop and bulk threads apart (what scales with bulk threads
  and what one event loop must carry) and the projection for a 100 Gbit/s line;
* ``ipc_round_trip_cpu_us``: the CPU a message that wakes a process on the other CPU costs here,
  against the same on one CPU (``benchpipe ipc``): what each of a transfer's messages pays;
* ``token_latency_under_load_p99``: token frames while 1 GiB transfers run, against idle samples
  taken between those transfers (so both see the same machine);
* ``token_latency_under_load_p99_placed``: the same with two agents placed by ``[cpus]``, as close
  to two nodes as the CPUs allow (:func:`placed_layout`; on two CPUs the event loops and the
  engines on one, both agents' bulk threads on the other);
* ``wake_latency_under_load_p99``: three processes that only wake one another
  (:mod:`~pdd_tools.wakeprobe`), during more such transfers, against the same idle token p99: a
  reference for what this host's scheduler alone does to three wake-ups under the agents'
  transfers as they run now.

Bare-pipe and agent rounds are interleaved (``rounds``), and each figure is the median over rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable

from pdd_wire.engine import protocol as p
from pdd_wire.engine.client import EngineClient
from pdd_wire.errors import ConfigError
from pdd_wire.memory import SharedMemory
from pdd_wire.placement import format_cpus, parse_cpus
from pdd_wire.stats import percentile

from .benchpipe import bare_pipe, bare_pipe_goodput, ipc_round_trip, iperf3_goodput
from .harness import AgentPair, metric_value
from .wakeprobe import WakeProbe

MiB = 1 << 20
#: The wake probe's chain: as many processes as a token wakes (agent A, agent B, engine B), and a
#: message as often as the token samples'.
WAKE_HOPS = 3
WAKE_PERIOD_S = 0.002
#: 100 Gbit/s, the line the CPU figures are projected to.
LINE_GBPS = 12.5


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of ``pid`` by kind: ``bulk`` (threads named
    ``pdd-bulk-N``, as :class:`~pdd_wire.transport.bulk_loop.BulkLoop` names them) and ``main`` (the rest:
    the event loop, and the short-lived registration and UCX threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"main": 0.0, "bulk": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                comm, _, rest = f.read().partition(") ")
        except OSError:  # the thread ended meanwhile
            continue
        fields = rest.split()
        kind = "bulk" if comm.rpartition("(")[2].startswith("pdd-bulk") else "main"
        out[kind] += (int(fields[11]) + int(fields[12])) / tick
    return out


def agents_cpu(pair: AgentPair) -> dict[str, float]:
    """CPU seconds so far by agent and kind: ``A.main``, ``A.bulk``, ``B.main``, ``B.bulk``."""
    return {f"{s}.{k}": v for s, pr in pair.procs.items() for k, v in thread_cpu(pr.pid).items()}


async def goodput(ea: EngineClient, eb: EngineClient, size: int, count: int, concurrency: int,
                  to: str = "B", cpu: Callable[[], dict[str, float]] | None = None) -> tuple[float, list, dict]:
    """GB/s, each transfer's seconds, and (with ``cpu``, a clock of CPU seconds by name) the CPU
    seconds the timed transfers took by name."""
    block = MiB
    nb = size // block
    src = SharedMemory(size)
    dst = SharedMemory(size * concurrency)
    try:
        src.buf[:] = os.urandom(size)
        dst.buf[:] = bytes(dst.size)  # fault the pages in before timing
        ra = await ea.register(src, block_bytes=block)
        rb = await eb.register(dst, block_bytes=block)
        tag = f"g{size}-{time.monotonic_ns()}"
        sent: list[str] = []

        async def one(i: int, slot: int) -> float:
            rid = f"{tag}-{i}"
            t0 = time.perf_counter()
            await eb.post_recv(rid, [rb.blocks(slot * nb, nb)])
            await ea.send_kv(rid, [ra.blocks(0, nb)], to=[to])
            ev = await eb.wait(rid, timeout=120)
            if not isinstance(ev, p.KvReceived):
                raise RuntimeError(f"transfer failed: {ev}")
            sent.append(rid)  # the receiving slot is free now; the sender's kv_sent is checked at the end
            return time.perf_counter() - t0

        await one(-1, 0)  # warm-up
        slots: asyncio.Queue[int] = asyncio.Queue()
        for s in range(concurrency):
            slots.put_nowait(s)
        lat: list[float] = []

        async def worker(i: int) -> None:
            s = await slots.get()
            try:
                lat.append(await one(i, s))
            finally:
                slots.put_nowait(s)

        cpu0 = cpu() if cpu else {}
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(count)))
        elapsed = time.perf_counter() - t0
        used = {k: v - cpu0[k] for k, v in cpu().items()} if cpu else {}
        for rid in sent:
            ev = await ea.wait(rid, timeout=120)
            if not isinstance(ev, p.KvSent):
                raise RuntimeError(f"sender saw {ev}")
        if bytes(dst.buf[:size]) != bytes(src.buf):
            raise RuntimeError("received bytes differ from the sent ones")
        await ea.deregister(ra)
        await eb.deregister(rb)
        return size * count / elapsed / 1e9, lat, used
    finally:
        src.close()
        dst.close()


async def token_latency(ea: EngineClient, eb: EngineClient, n: int, rid: str, until=None) -> list[float]:
    """Engine A to engine B through both agents, ms, one token every 2 ms."""
    await eb.expect_tokens(rid, "A")  # B's engine takes rid's tokens from site A (not timed)
    out = []
    for i in range(n):
        if until is not None and until():
            break
        t0 = time.perf_counter()
        await ea.send_tokens(rid, "B", [i])
        await eb.wait_tokens(rid, timeout=10)
        out.append((time.perf_counter() - t0) * 1e3)
        await asyncio.sleep(0.002)
    return out


async def relay_bytes(pair: AgentPair, ea: EngineClient, eb: EngineClient, per_frame: int) -> float:
    """Bytes on A's token lane per relayed token (from A's metrics), token IDs as a 150K vocab gives."""
    rid = f"relay-{per_frame}"
    before = metric_value(pair.metrics("A"), "pddwire_bytes_total", lane="token", direction="tx")
    tokens = [100_000 + 37 * i for i in range(100)]
    for i in range(0, 100, per_frame):
        await ea.send_tokens(rid, "B", tokens[i:i + per_frame])
    got = 0
    while got < 100:
        got += len((await eb.wait_tokens(rid, timeout=10)).tokens)
    after = metric_value(pair.metrics("A"), "pddwire_bytes_total", lane="token", direction="tx")
    return (after - before) / 100


@contextlib.asynccontextmanager
async def load_pools(ea: EngineClient, eb: EngineClient, size: int):
    """``size`` bytes (a multiple of 64 MiB) of random KV registered with A and as much zeroed
    memory with B, in 4 MiB blocks: ``(A's registration, B's, blocks)``; deregistered and freed on
    the way out."""
    src, dst = SharedMemory(size), SharedMemory(size)
    try:
        chunk = os.urandom(64 * MiB)
        for off in range(0, size, len(chunk)):
            src.buf[off:off + len(chunk)] = chunk
        dst.buf[:] = bytes(size)
        ra = await ea.register(src, block_bytes=4 * MiB)
        rb = await eb.register(dst, block_bytes=4 * MiB)
        yield ra, rb, size // (4 * MiB)
        await ea.deregister(ra)
        await eb.deregister(rb)
    finally:
        src.close()
        dst.close()


async def load_transfer(ea: EngineClient, eb: EngineClient, pools, rid: str, during=None) -> tuple[float, float]:
    """One transfer of every block of ``pools`` (:func:`load_pools`) from A to B, with
    ``await during(done)`` running meanwhile (``done()``: whether it has arrived); when
    ``send_kv`` was sent and when ``kv_received`` came, on ``time.perf_counter``'s clock."""
    ra, rb, nb = pools
    await eb.post_recv(rid, [rb.blocks(0, nb)])
    t0 = time.perf_counter()
    await ea.send_kv(rid, [ra.blocks(0, nb)], to=["B"])
    arrived = asyncio.ensure_future(eb.wait(rid, timeout=300))
    if during is not None:
        await during(arrived.done)
    ev = await arrived
    t1 = time.perf_counter()
    if not isinstance(ev, p.KvReceived):
        raise RuntimeError(f"load transfer failed: {ev}")
    await ea.wait(rid, timeout=60)
    return t0, t1


def _gbps(pools, spans: list[tuple[float, float]]) -> float:
    """GB/s of the median transfer of ``pools`` over ``spans`` (from :func:`load_transfer`)."""
    return pools[2] * 4 * MiB / statistics.median(t1 - t0 for t0, t1 in spans) / 1e9


async def latency_under_load(ea: EngineClient, eb: EngineClient, pools, samples: int,
                             idle_per_transfer: int) -> tuple[list, list, float]:
    """Token latencies while transfers of ``pools`` (:func:`load_pools`) run (``samples`` in
    all), and idle ones taken just before each transfer (``idle_per_transfer``); the transfers'
    GB/s."""
    lat: list[float] = []
    idle: list[float] = []
    spans = []
    k = 0
    while len(lat) < samples and k < 20:
        rid = f"load-{k}"
        k += 1
        idle += await token_latency(ea, eb, idle_per_transfer, f"idle-{rid}")

        async def tokens(done, rid=rid) -> None:
            await asyncio.sleep(0.02)  # let the bulk stream get going
            lat.extend(await token_latency(ea, eb, samples - len(lat), f"tok-{rid}", until=done))

        spans.append(await load_transfer(ea, eb, pools, rid, tokens))
    return lat, idle, _gbps(pools, spans)


async def wake_under_load(ea: EngineClient, eb: EngineClient, pools, transfers: int,
                          quiet_s: float = 1.0) -> tuple[list, list, float]:
    """The wake probe's latencies (ms, :mod:`pdd_tools.wakeprobe`: ``WAKE_HOPS`` processes that only
    wake one another, a message every ``WAKE_PERIOD_S``) while ``transfers`` back-to-back
    transfers of ``pools`` (:func:`load_pools`) run between the agents (from 20 ms after each
    ``send_kv``, as the token samples, to its ``kv_received``), and during ``quiet_s`` just
    before them with nothing running; the transfers' GB/s. No token is sampled meanwhile."""
    spans = []
    windows = []
    probe = await WakeProbe.start(period_s=WAKE_PERIOD_S, hops=WAKE_HOPS)
    try:
        q0 = time.perf_counter()
        await asyncio.sleep(quiet_s)
        q1 = time.perf_counter()
        for k in range(transfers):
            streaming = []

            async def mark(done, streaming=streaming) -> None:
                await asyncio.sleep(0.02)
                streaming.append(time.perf_counter())

            spans.append(await load_transfer(ea, eb, pools, f"wake-{k}", mark))
            windows.append((streaming[0], spans[-1][1]))
    except BaseException:
        probe.kill()  # the transfers' error is the one to see
        await probe.proc.wait()
        raise
    samples = await probe.stop()
    under = [ms for _, when, ms in samples if any(a <= when <= b for a, b in windows)]
    quiet = [ms for _, when, ms in samples if q0 <= when <= q1]
    if not under or not quiet:
        raise RuntimeError(f"the wake probe got {len(under)} messages during the transfers and {len(quiet)} "
                           f"before them: too few to say anything (transfers too short?)")
    return under, quiet, _gbps(pools, spans)


async def latency_under_bare_pipe(ea: EngineClient, eb: EngineClient, rounds: int, samples: int) -> tuple[list, float]:
    """Token latencies (about ``samples``) while the bare pipe runs between two other processes
    (4 MiB writes of a 64 MiB region, 6 GB a round: about 2 s here), and the pipe's median GB/s."""
    lat: list[float] = []
    gbps = []
    for r in range(rounds):
        job = asyncio.ensure_future(asyncio.to_thread(bare_pipe, 64 * MiB, 96))
        # Both interpreters start, fill their regions and connect first (0.2-0.4 s here): sample
        # only once the pipe streams; the samples (about 0.3 s of them) end well before it does.
        await asyncio.sleep(0.8)
        lat += await token_latency(ea, eb, max(samples // rounds, 1), f"pipe-{r}", until=job.done)
        gbps.append((await job)[0])
    return lat, statistics.median(gbps)


class Baselines:
    """iperf3 and the bare pipe, measured in this run (``cpu`` by size: bare pipe s/GB rounds)."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.iperf3 = iperf3_goodput(2 if quick else 3)
        self.pipe: list[float] = []  # 64 MiB GB/s per round
        self.cpu: dict[int, list[float]] = {4 * MiB: [], 64 * MiB: []}

    def round(self, size: int) -> None:
        gbps, per_gb = bare_pipe(size, reps=(8 if self.quick else 16) * (64 * MiB // size))
        self.cpu[size].append(per_gb)
        if size == 64 * MiB:
            self.pipe.append(gbps)


def baselines(figs, quick: bool) -> Baselines:
    base = Baselines(quick)
    if base.iperf3 is None:
        print("# iperf3 not found: goodput ratios against it are left out (apt-get install iperf3)", file=sys.stderr)
    base.round(64 * MiB)
    hot = bare_pipe_goodput(MiB, reps=1024 if quick else 4096)
    figs.add("bare_pipe_hot_1MiB", hot, "GB/s", "iperf3 -l 1M", base.iperf3,
             note="one 1 MiB buffer, in cache: the Python I/O path reaches iperf3")
    figs.add("bare_pipe_cold_64MiB", base.pipe[0], "GB/s", "iperf3 -l 1M", base.iperf3,
             note="64 MiB memfd pools, as KV moves: bytes no longer come from cache")
    rt = ipc_round_trip(5000 if quick else 20000)
    if rt is not None:
        (wall, cpu, _), (_, same, _) = rt["cross"], rt["same"]
        figs.add("ipc_round_trip_cpu_us", cpu, "us", "the same on one CPU", same,
                 note=f"CPU microseconds of the two processes together per 64-byte round trip (two "
                      f"messages) over a Unix socket pair between processes on two CPUs, each asleep in "
                      f"recv until the other's message ({wall:.1f} us wall): what waking a process on the "
                      f"other CPU costs here; a 4 MiB transfer passes about a dozen messages between "
                      f"engines, agents and their threads (pdd_tools.benchpipe ipc)")
    return base


async def goodput_figures(figs, pair: AgentPair, ea: EngineClient, eb: EngineClient, base: Baselines,
                          quick: bool) -> None:
    """KV goodput and CPU per GB at 4 and 64 MiB, bare pipe and agents interleaved."""
    rounds = 2
    for size, count, conc in ((4 * MiB, 64 if quick else 256, 8), (64 * MiB, 8 if quick else 24, 2)):
        label = f"{size // MiB}MiB"
        rates, per_gb, lat_all = [], [], []
        parts: dict[str, list[float]] = {}
        for r in range(rounds):
            if len(base.cpu[size]) <= r:
                base.round(size)
            gbps, lat, used = await goodput(ea, eb, size, count, conc, cpu=lambda: agents_cpu(pair))
            gb = size * count / 1e9
            rates.append(gbps)
            lat_all += lat
            per_gb.append(sum(used.values()) / gb)
            for k, v in used.items():
                parts.setdefault(k, []).append(v / gb)
        mine = statistics.median(per_gb)
        split = {k: statistics.median(v) for k, v in parts.items()}
        loop_max = max(split["A.main"], split["B.main"])
        figs.add(f"cpu_per_gb_{label}", mine, "s/GB", "bare python pipe", statistics.median(base.cpu[size]),
                 note=f"CPU seconds of both agents per GB moved, timed transfers only, median of {rounds} rounds "
                      f"interleaved with the pipe's; sender main {split['A.main']:.3f} + bulk {split['A.bulk']:.3f}, "
                      f"receiver main {split['B.main']:.3f} + bulk {split['B.bulk']:.3f} s/GB; {LINE_GBPS} GB/s "
                      f"(100 Gbit/s) would need {mine * LINE_GBPS:.1f} cores for both agents, and one main loop "
                      f"carries {loop_max * LINE_GBPS:.2f} cores of it")
        gbps = statistics.median(rates)
        note = (f"{count} transfers, {conc} at a time, median of {rounds} rounds; "
                f"median {statistics.median(lat_all) * 1e3:.1f} ms each")
        figs.add(f"kv_goodput_{label}", gbps, "GB/s", "iperf3 -l 1M", base.iperf3, note=note)
        if size != 4 * MiB:  # kv_goodput_4MiB_vs_bare_pipe: the wan group (bench_wan), against 4 MiB writes
            figs.add(f"kv_goodput_{label}_vs_bare_pipe", gbps, "GB/s", "bare python pipe",
                     statistics.median(base.pipe), note="memfd to memfd, no framing or checksums (pdd_tools.benchpipe)")


def core_of(cpu: int) -> frozenset[int]:
    """The logical CPUs of ``cpu``'s physical core (its hyperthread siblings and itself), from
    sysfs; ``{cpu}`` where the kernel does not say."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            return parse_cpus(f.read().strip(), "thread_siblings_list") | {cpu}
    except (OSError, ConfigError):
        return frozenset({cpu})


def placed_layout(cpus: Iterable[int], siblings: Callable[[int], frozenset[int]] = core_of
                  ) -> tuple[dict[str, dict[str, str]], list[int], str]:
    """Where :func:`placed_latency_figures` puts things on ``cpus`` (two or more): ``[cpus]`` for
    agents A and B, the CPUs of the engines' process, and a description for the note. As close
    to two nodes as the machine allows, counted in physical cores (``siblings``: a CPU's
    hyperthreads; on a single core, in logical CPUs), so that no bulk thread shares a core with
    an event loop or the engines:

    * 5 cores or more: each agent's event loop on a core of its own, the engines on a third, and
      the rest split between the two agents' bulk threads;
    * 3 or 4: both event loops and the engines on the first core, the rest split between the
      agents' bulk threads;
    * 2: event loops and engines on the first, both agents' bulk threads on the second (where one
      bulk thread can be switched out holding its GIL for the other agent's: docs/benchmarks.md,
      "CPU placement")."""
    allowed = sorted(set(cpus))
    if len(allowed) < 2:
        raise ValueError(f"placement needs two CPUs or more, got {allowed}")
    units: list[list[int]] = []
    seen: set[int] = set()
    for c in allowed:
        if c not in seen:
            core = sorted((siblings(c) | {c}) & set(allowed))
            seen.update(core)
            units.append(core)
    what = "cores"
    if len(units) < 2:  # one core's hyperthreads: place them as CPUs
        units, what = [[c] for c in allowed], "CPUs (hyperthreads of one core)"
    if len(units) >= 5:
        mains, engines, rest = units[:2], units[2], units[3:]
    else:
        mains, engines, rest = units[:1] * 2, units[0], units[1:]
    if len(rest) >= 2:
        half = (len(rest) + 1) // 2
        bulks = [rest[:half], rest[half:]]
        if len(units) >= 5:
            how = f"each agent's event loop, the engines and each agent's bulk threads on {what} of their own"
        else:
            how = (f"the event loops and the engines on one of the {what}, each agent's bulk threads on {what} "
                   "of their own")
    else:
        bulks = [rest, rest]
        how = f"the event loops and the engines on one of the two {what}, both agents' bulk threads on the other"
    how += (", no bulk thread on a core of the token path's" if what == "cores" else
            ", so the bulk threads share the token path's core as its other hyperthreads")
    layout = {s: {"main": format_cpus(m), "bulk": format_cpus([c for u in b for c in u])}
              for s, m, b in zip("AB", mains, bulks)}
    return layout, engines, how


async def placed_latency_figures(figs, quick: bool, gbps: float, ratio: float) -> None:
    """``token_latency_under_load_p99_placed``: the token figure again with two agents placed by
    ``[cpus]`` as :func:`placed_layout` says, and the engines' process (this one) on its CPUs, so
    the token path's processes share no core with the bulk threads (where the machine has two
    cores or more); against idle samples of the same agents. ``gbps`` and ``ratio``: the unplaced
    agents' transfers and token ratio in this run, for the note."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("# one CPU: token_latency_under_load_p99_placed needs two (cpus.main apart from cpus.bulk)",
              file=sys.stderr)
        return
    layout, engines, how = placed_layout(cpus)
    before = os.sched_getaffinity(0)
    extra = {s: f'[cpus]\nmain = "{c["main"]}"\nbulk = "{c["bulk"]}"\n' for s, c in layout.items()}
    async with AgentPair(extra_by_site=extra) as pair:
        async with EngineClient(pair.sockets["A"], "bench-A") as ea, EngineClient(pair.sockets["B"], "bench-B") as eb:
            placed = {s: pair.status(s)["cpus"] for s in "AB"}
            if placed != layout:
                raise RuntimeError(f"the agents did not run where [cpus] put them: {placed}, not {layout}")
            os.sched_setaffinity(0, engines)  # the engines off the bulk CPUs
            try:
                idle = await token_latency(ea, eb, 100 if quick else 300, "idle")
                async with load_pools(ea, eb, 1 << 30) as pools:
                    loaded, between, placed_gbps = await latency_under_load(ea, eb, pools, 100 if quick else 300,
                                                                            25 if quick else 50)
            finally:
                os.sched_setaffinity(0, before)
    idle += between
    where = "; ".join(f'{s}: main = "{c["main"]}", bulk = "{c["bulk"]}"' for s, c in layout.items())
    figs.add("token_latency_under_load_p99_placed", percentile(loaded, 99), "ms", "idle p99 (placed)",
             percentile(idle, 99),
             note=f"the token figure with both agents placed by [cpus] ({where}) and the engines' process on "
                  f"CPU {format_cpus(engines)}: {how}; "
                  f"{len(loaded)} samples during 1 GiB transfers at {placed_gbps:.2f} GB/s (unplaced, in this "
                  f"run: {gbps:.2f} GB/s and {ratio:.1f}x), p50 {percentile(loaded, 50):.2f} ms; "
                  f"idle: {len(idle)} samples")


async def latency_figures(figs, pair: AgentPair, ea: EngineClient, eb: EngineClient, quick: bool) -> None:
    """Token latency idle and while 1 GiB transfers run, and the relay's bytes per token."""
    idle = await token_latency(ea, eb, 100 if quick else 300, "idle")
    for per_frame in (1, 100):
        figs.add(f"relay_bytes_per_token{'' if per_frame == 1 else '_batched'}",
                 await relay_bytes(pair, ea, eb, per_frame), "B",
                 note=f"TOKENS frames A->B for 100 tokens sent {per_frame} per call, "
                      "header and msgpack body (PDD: 1.5 KB per 100 tokens)")
    async with load_pools(ea, eb, 1 << 30) as pools:  # one fill and registration for both
        loaded, between, gbps = await latency_under_load(ea, eb, pools, 100 if quick else 300, 25 if quick else 50)
        under, quiet, wake_gbps = await wake_under_load(ea, eb, pools, 2 if quick else 4)
    idle += between
    figs.add("token_latency_idle_p50", percentile(idle, 50), "ms")
    figs.add("token_latency_idle_p99", percentile(idle, 99), "ms")
    figs.add("token_latency_under_load_p50", percentile(loaded, 50), "ms")
    figs.add("token_latency_under_load_p99", percentile(loaded, 99), "ms", "idle p99", percentile(idle, 99),
             note=f"{len(loaded)} samples during 1 GiB transfers at {gbps:.2f} GB/s; idle: {len(idle)} samples, "
                  "before and between the transfers")
    figs.add("wake_latency_under_load_p99", percentile(under, 99), "ms", "token idle p99", percentile(idle, 99),
             note=f"{WAKE_HOPS} processes that only wake one another, a message every {WAKE_PERIOD_S * 1e3:g} ms "
                  f"(pdd_tools.wakeprobe: none an agent or an engine, none doing any work), during 1 GiB "
                  f"transfers between the agents at {wake_gbps:.2f} GB/s with no token sampled: a reference for "
                  f"the wake-ups a token pays on its way (agent A, agent B, engine B) under these transfers, "
                  f"without the agents' work; {len(under)} messages, p50 "
                  f"{percentile(under, 50):.2f} ms; with nothing running, just before, p99 "
                  f"{percentile(quiet, 99):.2f} ms ({len(quiet)} messages), so the transfers make it "
                  f"{percentile(under, 99) / percentile(quiet, 99):.0f}x slower")
    await placed_latency_figures(figs, quick, gbps, percentile(loaded, 99) / percentile(idle, 99))
    foreign, pipe_gbps = await latency_under_bare_pipe(ea, eb, 2 if quick else 3, len(loaded))
    figs.add("token_latency_under_bare_pipe_p99", percentile(foreign, 99), "ms", "idle p99", percentile(idle, 99),
             note=f"the same token path while the bare pipe moves 4 MiB writes between two other processes "
                  f"({pipe_gbps:.2f} GB/s), the agents idle: what this host's cores, busy with a transfer that is not "
                  f"the agents', do to the token path; {len(foreign)} samples, p50 {percentile(foreign, 50):.2f} ms")
