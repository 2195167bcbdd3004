"""The WAN path's small and long-RTT transfers (issue 15), each against a baseline measured in
the same run (``scripts/bench --only wan``):

* ``kv_transfer_overhead_ms``: engine ``send_kv`` to ``kv_received`` for one 4 KiB block between
  two agents on loopback, the receive posted first (as MD posts when a request is routed); the
  bound is 1 ms. Beside it, the same with ``transfer.offers = false`` (the KV_ACCEPT round trip).
* ``kv_goodput_4MiB_vs_bare_pipe``: 4 MiB transfers, 8 in flight, against the bare Python pipe
  (:mod:`pdd_tools.benchpipe`) moving 4 MiB writes, rounds of each interleaved.
* ``wan_rtt40_{1,16,256}_block(s)``: the time from ``send_kv`` to ``kv_received`` for 1, 16 and
  256 KV blocks of 256 KiB over a two-site link with 40 ms RTT: as root two network namespaces
  joined by a tbf-shaped veth (:mod:`pdd_tools.netns`, 1 Gbit/s) with :mod:`pdd_tools.shaper`
  adding 20 ms each way in front of B; not root, the shaper alone on loopback (delay and rate).
  The bound is the link's one-way delay + the bytes' serialization at its rate + 2 ms, both
  measured on the same link in the same run (a 1-byte echo, and a bulk stream timed at the
  receiver). Beside each, the time with offers off.

    scripts/bench --only wan [--json] [--quick]

``python -m pdd_tools.bench_wan --overhead [--quick] [--json]`` prints the per-transfer overhead
alone (about 15 s). ``--link-server|--link-client ...`` are the link measurement's two ends, run
inside the namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import statistics
import sys
import time
from pathlib import Path

from pdd_wire.engine import protocol as p
from pdd_wire.engine.client import EngineClient
from pdd_wire.memory import SharedMemory

from .benchpipe import bare_pipe
from .harness import AgentPair, agent_toml, free_port, metric_value

MiB = 1 << 20
OVERHEAD_BOUND_MS = 1.0
WAN_DELAY_MS = 20.0  # each way: 40 ms RTT
WAN_RATE_BPS = 1_000_000_000
WAN_BLOCK = 256 << 10
WAN_SLACK_MS = 2.0
# Between the post and the send (the prefill): a short prefill on loopback, a 100 ms one on the
# WAN (longer than the one-way delay the receiver's KV_OFFER takes to reach the sender).
PREFILL_LOOPBACK_S = 0.002
PREFILL_WAN_S = 0.1
NETNS_PREFIX = "pddwan"


def _no_offers(text: str) -> str:
    return text.replace("[transfer]\n", "[transfer]\noffers = false\n", 1)


# ---------------------------------------------------------------------------------------------
# one transfer, timed the way an engine sees it
async def timed_transfer(ea: EngineClient, eb: EngineClient, rid: str, src: list, dst: list, *, to: str,
                         from_site: str | None, prefill_s: float = 0.0) -> float:
    """Post ``dst`` at B, ``prefill_s`` later ``send_kv`` ``src`` from A: seconds from the send to
    B's ``kv_received`` (A's ``kv_sent`` is awaited after, untimed). MD posts when the request is
    routed, P sends when its prefill is done: the gap between them is the prefill's time."""
    await eb.post_recv(rid, dst, from_site=from_site)
    if prefill_s:
        await asyncio.sleep(prefill_s)
    t0 = time.perf_counter()
    await ea.send_kv(rid, src, to=[to])
    ev = await eb.wait(rid, timeout=120)
    dt = time.perf_counter() - t0
    if not isinstance(ev, p.KvReceived):
        raise RuntimeError(f"transfer {rid} failed at the receiver: {ev}")
    sent = await ea.wait(rid, timeout=120)
    if not isinstance(sent, p.KvSent):
        raise RuntimeError(f"transfer {rid} failed at the sender: {sent}")
    return dt


class Engines:
    """An engine on each agent of a pair, with a source and a destination region."""

    def __init__(self, sock_a: str, sock_b: str, size: int, block: int) -> None:
        self.socks, self.size, self.block = (sock_a, sock_b), size, block
        self.stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> "Engines":
        self.ea = await self.stack.enter_async_context(EngineClient(self.socks[0], "bench-wan-A"))
        self.eb = await self.stack.enter_async_context(EngineClient(self.socks[1], "bench-wan-B"))
        self.src, self.dst = SharedMemory(self.size), SharedMemory(self.size)
        self.stack.callback(self.src.close)
        self.stack.callback(self.dst.close)
        self.src.buf[:] = os.urandom(self.size)
        self.dst.buf[:] = bytes(self.size)  # paged in before timing
        self.ra = await self.ea.register(self.src, block_bytes=self.block)
        self.rb = await self.eb.register(self.dst, block_bytes=self.block)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stack.aclose()

    def check(self, nbytes: int) -> None:
        if bytes(self.dst.buf[:nbytes]) != bytes(self.src.buf[:nbytes]):
            raise RuntimeError("received bytes differ from the sent ones")


# ---------------------------------------------------------------------------------------------
# loopback: per-transfer overhead and 4 MiB goodput
async def _overhead(figs, quick: bool, *, goodput: bool = True) -> None:
    rounds, per_round = (3, 100) if quick else (6, 200)
    on, off = AgentPair(), AgentPair()
    for path in off.configs.values():
        path.write_text(_no_offers(path.read_text()))
    async with on, off:
        async with Engines(on.sockets["A"], on.sockets["B"], MiB, 4096) as e_on, \
                Engines(off.sockets["A"], off.sockets["B"], MiB, 4096) as e_off:
            got: dict[str, list[float]] = {"on": [], "off": []}
            # CPU per transfer, on (offers): both agents, and this process (the two engine clients)
            cpu = {"agents": 0.0, "clients": 0.0}
            for r in range(rounds + 1):  # the first round warms up
                for mode, e, pair in (("on", e_on, on), ("off", e_off, off)):
                    c0, p0 = pair.cpu_seconds(), time.process_time()
                    lat = [await timed_transfer(e.ea, e.eb, f"ovh-{mode}-{r}-{i}", [e.ra.blocks(0, 1)],
                                                [e.rb.blocks(0, 1)], to="B", from_site="A",
                                                prefill_s=PREFILL_LOOPBACK_S)
                           for i in range(per_round)]
                    if r:
                        got[mode] += lat
                        if mode == "on":
                            cpu["agents"] += pair.cpu_seconds() - c0
                            cpu["clients"] += time.process_time() - p0
            e_on.check(4096)
            held = metric_value(on.metrics("B"), "pddwire_chunks_held_total", outcome="held")
            taken = metric_value(on.metrics("A"), "pddwire_kv_offers_total", event="taken")
            inline = metric_value(on.metrics("A"), "pddwire_kv_inline_chunks_total", direction="tx")
            rtt = _control_rtt_ms(on)
        if goodput:
            await _goodput_4mib(figs, on, quick)
    med = {m: statistics.median(v) * 1e3 for m, v in got.items()}
    figs.add("kv_transfer_overhead_ms", med["on"], "ms", f"bound ({OVERHEAD_BOUND_MS:g} ms)", OVERHEAD_BOUND_MS,
             note=f"send_kv to kv_received, one 4 KiB block, receive posted {PREFILL_LOOPBACK_S * 1e3:g} ms before, "
                  f"median of {len(got['on'])}; "
                  f"offers off (KV_ACCEPT round trip) {med['off']:.3f} ms; {taken:.0f} offers taken, {held:.0f} "
                  f"chunks held for their KV_BEGIN; {inline:.0f} chunks sent inline; control RTT {rtt:.3f} ms; TLS; "
                  f"CPU per transfer: both agents "
                  f"{cpu['agents'] / len(got['on']) * 1e3:.3f} ms, the two engine clients "
                  f"{cpu['clients'] / len(got['on']) * 1e3:.3f} ms (one process, its 2 ms sleeps idle)")
    figs.add("kv_transfer_overhead_ms_no_offers", med["off"], "ms", f"bound ({OVERHEAD_BOUND_MS:g} ms)",
             OVERHEAD_BOUND_MS, note="the same with transfer.offers = false, rounds interleaved")


def _control_rtt_ms(pair: AgentPair) -> float:
    text = pair.metrics("A")
    n = metric_value(text, "pddwire_control_rtt_seconds_count")
    return metric_value(text, "pddwire_control_rtt_seconds_sum") / n * 1e3 if n else float("nan")


async def _goodput(pair: AgentPair, size: int, conc: int, count: int, rounds: int) -> tuple[list, list]:
    """GB/s of ``count`` transfers of ``size``, ``conc`` at a time, and of the bare pipe moving
    ``count`` writes of ``size``, for each of ``rounds`` rounds, one after the other."""
    agents, pipes = [], []
    async with Engines(pair.sockets["A"], pair.sockets["B"], size * conc, MiB) as e:
        nb = size // MiB
        slots: asyncio.Queue[int] = asyncio.Queue()
        for s in range(conc):
            slots.put_nowait(s)

        async def one(rid: str) -> None:
            s = await slots.get()
            try:
                await timed_transfer(e.ea, e.eb, rid, [e.ra.blocks(0, nb)], [e.rb.blocks(s * nb, nb)], to="B",
                                     from_site=None)
            finally:
                slots.put_nowait(s)

        await one(f"gp{size}-warm")
        for r in range(rounds):
            pipes.append((await asyncio.to_thread(bare_pipe, size, count))[0])
            t0 = time.perf_counter()
            await asyncio.gather(*(one(f"gp{size}-{r}-{i}") for i in range(count)))
            agents.append(size * count / (time.perf_counter() - t0) / 1e9)
        for s in range(conc):  # every slot's last transfer landed whole
            if bytes(e.dst.buf[s * size:(s + 1) * size]) != bytes(e.src.buf[:size]):
                raise RuntimeError("received bytes differ from the sent ones")
    return agents, pipes


async def _goodput_4mib(figs, pair: AgentPair, quick: bool) -> None:
    rounds = 3 if quick else 5
    agents, pipes = await _goodput(pair, 4 * MiB, 8, 48 if quick else 128, rounds)
    big, big_pipes = await _goodput(pair, 64 * MiB, 2, 4 if quick else 8, 2 if quick else 3)
    figs.add("kv_goodput_4MiB_vs_bare_pipe", statistics.median(agents), "GB/s", "bare python pipe (4 MiB writes)",
             statistics.median(pipes),
             note=f"4 MiB transfers, 8 at a time, median of {rounds} rounds interleaved with the pipe's (agents "
                  f"{', '.join(f'{g:.2f}' for g in agents)}; pipe {', '.join(f'{g:.2f}' for g in pipes)} GB/s); "
                  f"64 MiB transfers, 2 at a time, same pair: {statistics.median(big):.2f} GB/s (pipe, 64 MiB writes: "
                  f"{statistics.median(big_pipes):.2f}): what per-transfer costs take is the gap between the two; "
                  f"TLS, one bulk thread")


# ---------------------------------------------------------------------------------------------
# the long-RTT link
class WanLink:
    """Two agent pairs (offers on, offers off) across a 40 ms RTT link: as root, A's and B's
    agents in two network namespaces joined by a tbf-shaped veth, a shaper in A's namespace in
    front of each B agent (A dials through it); not root, the same on loopback with the shaper
    also doing the rate. Every process is stopped on exit."""

    def __init__(self, *, delay_ms: float = WAN_DELAY_MS, rate_bps: int = WAN_RATE_BPS) -> None:
        self.netns = os.geteuid() == 0
        self.delay_ms, self.rate_bps = delay_ms, rate_bps
        self.dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdd-wan-{os.getpid()}-{time.monotonic_ns()}"
        self.dir.mkdir(parents=True)
        os.chmod(self.dir, 0o700)
        self.procs: list = []  # agents and shapers: they run until close()
        self.helpers: list = []  # the link measurement's ends: they exit when done
        self.sites = None
        self.sockets: dict[str, tuple[str, str]] = {}

    def _in(self, site: str, argv: list[str]) -> list[str]:
        return self.sites.exec_argv(site, argv) if self.sites is not None else argv

    def _addr(self, site: str) -> str:
        return self.sites.addr(site) if self.sites is not None else "127.0.0.1"

    async def _spawn(self, name: str, argv: list[str], *, first_line: bool = False, helper: bool = False):
        with open(self.dir / f"{name}.log", "wb") as log:
            proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE if first_line else log,
                                                        stderr=log, start_new_session=True)
        (self.helpers if helper else self.procs).append(proc)
        return proc

    async def shaper(self, name: str, target: tuple[str, int], *, rate: bool) -> tuple[str, int]:
        """A shaper in A's namespace (or on loopback) in front of ``target``; where it listens."""
        argv = [sys.executable, "-m", "pdd_tools.shaper", "--listen", "127.0.0.1:0", "--target",
                f"{target[0]}:{target[1]}", "--delay-ms", str(self.delay_ms), "--log-level", "warning",
                "--queue-mib", "32"]
        if rate:
            argv += ["--rate-mbit", str(self.rate_bps / 1e6)]
        proc = await self._spawn(name, self._in("a", argv), first_line=True)
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        if not line.startswith(b"shaper listening on "):
            raise RuntimeError(f"the shaper did not start: {line!r}; see {self.dir}/{name}.log")
        host, _, port = line.split()[3].decode().rpartition(":")
        return host, int(port)

    async def pair(self, name: str, *, offers: bool) -> None:
        """Agents A (site A) and B (site B) of ``name``; A reaches B through a shaper."""
        ports = {s: (free_port(), free_port()) for s in "AB"}
        wan_b = (self._addr("b"), ports["B"][0])
        via = await self.shaper(f"shaper-{name}", wan_b, rate=self.sites is None)
        tls = '\n[tls]\nallow_plaintext = true\n' if self.sites is not None else ""
        for site, node, other, onode, dial in (("A", "a1", "B", "b1", via), ("B", "b1", "A", "a1",
                                                                              (self._addr("a"), ports["A"][0]))):
            sock = str(self.dir / f"{name}-{site}.sock")
            text = agent_toml(site, node, ports[site][0], ports[site][1], sock, [(other, onode, dial[1])],
                              extra=tls)
            # the peer's address: A dials B through the shaper; B's record of A is A's own address
            text = text.replace(f'address = "127.0.0.1:{dial[1]}"', f'address = "{dial[0]}:{dial[1]}"')
            text = text.replace(f'wan = "127.0.0.1:{ports[site][0]}"', f'wan = "{self._addr(site.lower())}:'
                                                                      f'{ports[site][0]}"')
            if not offers:
                text = _no_offers(text)
            cfg = self.dir / f"{name}-{site}.toml"
            cfg.write_text(text)
            await self._spawn(f"agent-{name}-{site}", self._in(site.lower(), [
                sys.executable, "-m", "pdd_wire", "--site", site, "--config", str(cfg)]))
        self.sockets[name] = (str(self.dir / f"{name}-A.sock"), str(self.dir / f"{name}-B.sock"))
        await self._wait_up(name)

    async def _wait_up(self, name: str, timeout: float = 30) -> None:
        async with asyncio.timeout(timeout):
            while True:
                for proc in self.procs:
                    if proc.returncode is not None:
                        raise RuntimeError(f"a process of the WAN bench exited ({proc.returncode}); logs in {self.dir}")
                try:
                    ok = True
                    for sock in self.sockets[name]:
                        async with EngineClient(sock, "bench-wan-probe") as c:
                            st = await c.status()
                        ok &= all(x["up"] and x["bulk_streams_up"] == x["bulk_streams"] for x in st["peers"])
                    if ok:
                        return
                except OSError:
                    pass
                await asyncio.sleep(0.1)

    async def measure_link(self, samples: int = 20, stream_bytes: int = 64 * MiB) -> tuple[float, float]:
        """The link's one-way delay (ms: half the median round trip of a 1-byte echo) and its rate
        (bytes/s of TCP payload: a bulk stream timed at the receiver from its first byte to its
        last), through a shaper of its own, from A's side to a listener beside B's agents."""
        port = free_port()
        server = await self._spawn("link-server", self._in("b", [sys.executable, "-m", "pdd_tools.bench_wan",
                                                                 "--link-server", f"{self._addr('b')}:{port}"]),
                                   first_line=True, helper=True)
        if await asyncio.wait_for(server.stdout.readline(), 20) != b"ready\n":
            raise RuntimeError(f"the link server did not start; see {self.dir}/link-server.log")
        via = await self.shaper("shaper-link", (self._addr("b"), port), rate=self.sites is None)
        probe = await self._spawn("link-client", self._in("a", [
            sys.executable, "-m", "pdd_tools.bench_wan", "--link-client", f"{via[0]}:{via[1]}", str(samples),
            str(stream_bytes)]), first_line=True, helper=True)
        out = await asyncio.wait_for(probe.stdout.read(), 120)
        await probe.wait()
        owd_ms, rate = map(float, out.split())
        return owd_ms, rate

    async def __aenter__(self) -> "WanLink":
        try:
            if self.netns:
                from .netns import TwoSites

                self.sites = TwoSites(prefix=NETNS_PREFIX, rate_bps=self.rate_bps)
                self.sites.up()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        self.procs += self.helpers
        for proc in reversed(self.procs):
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
        for proc in self.procs:
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        self.procs.clear()
        if self.sites is not None:
            self.sites.down()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def _link_server(where: str) -> None:
    """In B's namespace: echo one byte per round trip (the first connection), then time one bulk
    stream (the second): prints nothing more; the client learns the receiver's timing back."""
    host, _, port = where.rpartition(":")
    srv = socket.create_server((host, int(port)))
    print("ready", flush=True)
    echo, _ = srv.accept()
    echo.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := echo.recv(64):
        echo.sendall(data)
    bulk, _ = srv.accept()
    buf = bytearray(1 << 20)
    first = last = None
    total = 0
    while n := bulk.recv_into(buf):
        last = time.perf_counter()
        if first is None:
            first, n = last, 0  # the rate counts what came after the first read
        total += n
    bulk.sendall(f"{total} {last - first if first is not None else 0}".encode())
    bulk.close()


def _link_client(where: str, samples: int, nbytes: int) -> None:
    host, _, port = where.rpartition(":")
    echo = socket.create_connection((host, int(port)))
    echo.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(samples):
        t0 = time.perf_counter()
        echo.sendall(b"x")
        echo.recv(1)
        rtts.append(time.perf_counter() - t0)
    echo.close()
    bulk = socket.create_connection((host, int(port)))
    chunk = os.urandom(1 << 20)
    for _ in range(nbytes // len(chunk)):
        bulk.sendall(chunk)
    bulk.shutdown(socket.SHUT_WR)
    total, seconds = bulk.recv(256).split()
    print(f"{statistics.median(rtts[1:]) / 2 * 1e3:.4f} {int(total) / float(seconds):.1f}", flush=True)


async def _long_rtt(figs, quick: bool) -> None:
    reps = 3 if quick else 7
    sizes = (1, 16, 256)
    async with WanLink() as link:
        owd_ms, rate = await link.measure_link()
        await link.pair("on", offers=True)
        await link.pair("off", offers=False)
        async with Engines(*link.sockets["on"], 256 * WAN_BLOCK, WAN_BLOCK) as e_on, \
                Engines(*link.sockets["off"], 256 * WAN_BLOCK, WAN_BLOCK) as e_off:
            got = {(m, n): [] for m in ("on", "off") for n in sizes}
            for r in range(reps + 1):  # round 0 warms the connections up
                for n in sizes:
                    for mode, e in (("on", e_on), ("off", e_off)):
                        dt = await timed_transfer(e.ea, e.eb, f"wan-{mode}-{n}-{r}", [e.ra.blocks(0, n)],
                                                  [e.rb.blocks(0, n)], to="B", from_site="A", prefill_s=PREFILL_WAN_S)
                        if r:
                            got[(mode, n)].append(dt * 1e3)
            e_on.check(256 * WAN_BLOCK)
    where = (f"two network namespaces, veth tbf {WAN_RATE_BPS / 1e9:g} Gbit/s, shaper {WAN_DELAY_MS:g} ms each way"
             if link.netns else f"loopback (not root): shaper {WAN_DELAY_MS:g} ms each way and "
                                f"{WAN_RATE_BPS / 1e9:g} Gbit/s")
    for n in sizes:
        nbytes = n * WAN_BLOCK
        bound = owd_ms + nbytes / rate * 1e3 + WAN_SLACK_MS
        on, off = statistics.median(got[("on", n)]), statistics.median(got[("off", n)])
        figs.add(f"wan_rtt40_{n}_block{'s' if n > 1 else ''}", on, "ms",
                 "bound: one-way delay + serialization + 2 ms", bound,
                 note=f"{n} x {WAN_BLOCK >> 10} KiB, send_kv to kv_received ({PREFILL_WAN_S * 1e3:g} ms after the "
                      f"post), median of {reps}; offers off {off:.1f} "
                      f"ms; link measured in this run: one-way {owd_ms:.2f} ms, {rate * 8 / 1e9:.3f} Gbit/s of "
                      f"payload; {where}")


async def add_figures(figs, quick: bool) -> None:
    await _overhead(figs, quick)
    await _long_rtt(figs, quick)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--overhead"] and set(argv[1:]) <= {"--quick", "--json"}:
        # The per-transfer overhead alone (about 15 s), for comparing changes to it.
        import uvloop

        from .bench import Figures
        uvloop.run(_overhead(Figures("--json" in argv), "--quick" in argv, goodput=False))
        return 0
    if argv[:1] == ["--link-server"] and len(argv) == 2:
        _link_server(argv[1])
        return 0
    if argv[:1] == ["--link-client"] and len(argv) == 4:
        _link_client(argv[1], int(argv[2]), int(argv[3]))
        return 0
    print("usage: python -m pdd_tools.bench_wan --overhead [--quick] [--json] | --link-server HOST:PORT | "
          "--link-client HOST:PORT SAMPLES BYTES (every figure: scripts/bench --only wan)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
