"""The fleet's membership at 100 and 1,000 members on one real etcd (Debian's etcd-server).

    python -m pdd_tools.bench_fleet [--json] [--quick] [--members 100,1000] [--watchers 100]

Simulated members run the agent's real registration code (:class:`pdd_wire.fleet.Membership`
with a record: lease, keep-alive, the live-figure refresh rule) and no data path; they share
one etcd client (one connection pool), as one process of many members would. Watchers run the
real watch code, each with its own client and watch stream: ``min(N, --watchers)`` of them, so
at 100 members every member watches (the fan-out of a whole fleet: N streams, each join sent to
each), and at 1,000 the same 100 streams, with ten times the members each holds. Per fleet size N:

* ``fleet_visible_p50_ms_N`` / ``_p99_``: from a new member's registration (its lease grant and
  put) until *every* watcher has it, over probe registrations made one at a time while the N
  are registered. Baseline: one bare etcd put's round trip, measured in the same run.
Watchers watch ``members/`` only, as agents do (live figures go to ``live/``, which only the
router watches), so what reaches them is joins and leaves, not every member's figures.

* ``fleet_etcd_writes_per_s_N``: puts (raft writes) per second at steady state, while every
  member's live figures change at every 1 s tick (a busy fleet: transfers, queue and link
  figures random-walk by up to 40 %). Baseline: the puts a member would make without the
  refresh rule (one per tick whose figures moved). Keep-alives are counted in the note.
* ``fleet_watcher_rss_mb_N``: the resident memory of a watcher process holding N members.
  Baseline: the same process before its first listing.

Members' lease TTL and refresh interval are the defaults (10 s, 10 s, 25 %).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

from prometheus_client import CollectorRegistry

from pdd_wire.config import Fleet
from pdd_wire.fleet import EtcdClient, FleetMetrics, Membership
from pdd_wire.fleet.record import LinkRec, Live, MemberRecord
from pdd_wire.stats import percentile

from .etcd import EtcdCluster

TICK_S = 1.0  # how often an agent hands its figures to the membership (its heartbeat)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def member(i: int) -> MemberRecord:
    site = "A" if i % 2 else "B"
    return MemberRecord(site=site, node=f"n{i:05d}", incarnation=i + 1, wan=f"10.{i // 250}.{i % 250}.1:7601",
                        fingerprint="sha256:" + f"{i:064x}", versions=(1,),
                        capabilities=("kv.v1", "tokens.v1", "resume.v1", "handoff.v1", "abort.v1", "prefix.v1",
                                      "lz4.v1"))


def busy(rng: random.Random, last: Live) -> Live:
    """The next tick's figures of a busy member: each moves by up to 40 %."""
    def walk(x: float, floor: float) -> float:
        return max(0.0, max(x, floor) * (1 + rng.uniform(-0.4, 0.4)))

    links = last.links or tuple(LinkRec(f"B/n{j:05d}", 2e9, 0.03) for j in range(4))
    return Live(transfers=int(walk(last.transfers, 8)), queue_bytes=int(walk(last.queue_bytes, 1 << 28)), engines=1,
                links=tuple(LinkRec(lk.peer, walk(lk.bandwidth_Bps, 1e9), walk(lk.rtt_s, 0.01)) for lk in links))


class Watchers:
    """``n`` watch-only memberships; ``seen[key]`` is when the last of them had the member."""

    def __init__(self, fleet: Fleet, n: int) -> None:
        self.seen_by: dict[str, int] = {}
        self.seen: dict[str, float] = {}
        self.n = n
        self.all = [Membership(fleet, FleetMetrics(CollectorRegistry()), on_event=self._event) for _ in range(n)]

    def _event(self, kind: str, rec: MemberRecord, old) -> None:
        if kind == "join":
            c = self.seen_by[rec.key] = self.seen_by.get(rec.key, 0) + 1
            if c == self.n:
                self.seen[rec.key] = time.monotonic()

    async def start(self) -> None:
        for w in self.all:
            await w.start()
        await asyncio.gather(*(w.listed.wait() for w in self.all))

    async def stop(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.all))


async def register_all(fleet: Fleet, n: int, client: EtcdClient, metrics: FleetMetrics) -> list[Membership]:
    """``n`` simulated members registered (64 at a time), sharing ``client``."""
    sem = asyncio.Semaphore(64)

    async def one(i: int) -> Membership:
        async with sem:
            m = Membership(fleet, metrics, me=member(i), client=client, watch=False)
            await m.start()
            await m.registered.wait()
            return m

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def writes(registry: CollectorRegistry, kind: str) -> float:
    return registry.get_sample_value("pddwire_fleet_etcd_requests_total", {"kind": kind}) or 0.0


async def put_rtt(client: EtcdClient, reps: int) -> list[float]:
    out = []
    for i in range(reps):
        t0 = time.monotonic()
        await client.put(f"/pdd-bench/put/{i}", b"x" * 600)
        out.append((time.monotonic() - t0) * 1e3)
    return out


async def one_size(endpoints: list[str], n: int, watchers: int, probes: int, steady_s: float) -> dict:
    fleet = Fleet(etcd=endpoints, cluster=f"bench{n}-{os.getpid()}")
    shared = await EtcdClient(endpoints, request_s=5.0).open()
    registry = CollectorRegistry()
    metrics = FleetMetrics(registry)  # every simulated member counts into this one
    members: list[Membership] = []
    w = Watchers(fleet, watchers)
    try:
        await w.start()
        t0 = time.monotonic()
        members = await register_all(fleet, n, shared, metrics)
        reg_s = time.monotonic() - t0
        while len(w.seen) < n:
            await asyncio.sleep(0.01)
        visible = []
        for k in range(probes):
            rec = member(100_000 + k)
            t0 = time.monotonic()
            m = Membership(fleet, metrics, me=rec, client=shared, watch=False)
            await m.start()
            while rec.key not in w.seen:
                await asyncio.sleep(0.0005)
            visible.append((w.seen[rec.key] - t0) * 1e3)
            await m.stop()  # the steady state below has exactly n members
        base = await put_rtt(shared, 50)
        # steady state: every member's figures move at every tick
        rngs = [random.Random(i) for i in range(len(members))]
        lives = [busy(rng, Live()) for rng in rngs]

        def tick() -> None:
            for i, m in enumerate(members):
                lives[i] = busy(rngs[i], lives[i])
                m.set_live(lives[i])

        tick()  # a first level; refreshes are due refresh_min_s after each registration
        await asyncio.sleep(fleet.refresh_min_s)
        puts0, keepalives0 = writes(registry, "put"), writes(registry, "keepalive")
        naive = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < steady_s:
            tick()
            naive += len(members)  # every figure moved: a put each without the refresh rule
            await asyncio.sleep(TICK_S)
        span = time.monotonic() - t0
        puts, keepalives = writes(registry, "put") - puts0, writes(registry, "keepalive") - keepalives0
        return {"n": len(members), "watchers": watchers, "register_s": reg_s, "visible": visible, "put_ms": base,
                "puts_per_s": puts / span, "keepalives_per_s": keepalives / span, "naive_per_s": naive / span}
    finally:
        await asyncio.gather(*(m.stop() for m in members), return_exceptions=True)
        await w.stop()
        await shared.close()


def watcher_rss(endpoints: list[str], cluster: str, n: int) -> dict:
    """A watcher in a process of its own: its RSS before and after it holds ``n`` members."""
    out = subprocess.run([sys.executable, "-m", "pdd_tools.bench_fleet", "--rss-watcher", cluster, str(n),
                          "--etcd", ",".join(endpoints)], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"watcher process failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


async def _rss_watcher(endpoints: list[str], cluster: str, n: int) -> None:
    w = Membership(Fleet(etcd=endpoints, cluster=cluster), FleetMetrics(CollectorRegistry()))
    empty = rss_mb()
    await w.start()
    while len(w.members) < n:
        await asyncio.sleep(0.01)
    full = rss_mb()
    await w.stop()
    print(json.dumps({"empty_mb": empty, "rss_mb": full}))


async def add_figures(figs, quick: bool, sizes: tuple[int, ...] = (100, 1000), watchers: int = 100) -> None:
    from pdd_wire import log

    log.configure("warning", "console", stream=sys.stderr)  # a line per registration otherwise
    probes = 20 if quick else 50
    steady = 12.0 if quick else 30.0
    async with EtcdCluster(1) as etcd:
        for n in sizes:
            r = await one_size(etcd.endpoints, n, min(n, watchers), probes, steady)
            # the watcher process while the N members are still registered: listed from etcd anew
            fleet = Fleet(etcd=etcd.endpoints, cluster=f"bench{n}-rss-{os.getpid()}")
            shared = await EtcdClient(etcd.endpoints, request_s=5.0).open()
            held: list[Membership] = []
            try:
                held = await register_all(fleet, n, shared, FleetMetrics(CollectorRegistry()))
                rss = await asyncio.to_thread(watcher_rss, etcd.endpoints, fleet.cluster, n)
            finally:
                await asyncio.gather(*(m.stop() for m in held), return_exceptions=True)
                await shared.close()
            vis, put = r["visible"], r["put_ms"]
            put50 = percentile(put, 50)
            every = " (every member watching)" if r["watchers"] >= n else ""
            figs.add(f"fleet_visible_p50_ms_{n}", percentile(vis, 50), "ms", "etcd put round trip", put50,
                     note=f"registration (lease grant + put) to all {r['watchers']} watchers{every}; "
                          f"{len(vis)} probes; "
                          f"{n} members registered in {r['register_s']:.1f} s")
            figs.add(f"fleet_visible_p99_ms_{n}", percentile(vis, 99), "ms", "etcd put round trip", put50,
                     note=f"max {max(vis):.1f} ms; put p99 {percentile(put, 99):.2f} ms")
            figs.add(f"fleet_etcd_writes_per_s_{n}", r["puts_per_s"], "/s", "a put per moved figure",
                     r["naive_per_s"], note=f"busy fleet, refresh_min_s 10; keep-alives {r['keepalives_per_s']:.0f}/s "
                                            f"(leader, no raft write); bound N/10 = {n / 10:.0f}/s")
            figs.add(f"fleet_watcher_rss_mb_{n}", rss["rss_mb"], "MB", "the watcher before listing", rss["empty_mb"],
                     note=f"{(rss['rss_mb'] - rss['empty_mb']) * 1024 / n:.2f} KB per member held")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--members", default="100,1000")
    ap.add_argument("--watchers", type=int, default=100, help="watch streams per fleet size: min(N, this)")
    ap.add_argument("--rss-watcher", nargs=2, metavar=("CLUSTER", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--etcd", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import uvloop

    if args.rss_watcher:
        uvloop.run(_rss_watcher(args.etcd.split(","), args.rss_watcher[0], int(args.rss_watcher[1])))
        return 0
    sizes = tuple(int(x) for x in args.members.split(","))
    uvloop.run(add_figures(Printed(args.json), args.quick, sizes, args.watchers))
    return 0


class Printed:
    """Figures printed as they come (``scripts/bench`` passes its own ``Figures`` instead)."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def add(self, figure: str, value: float, unit: str, baseline: str | None = None,
            baseline_value: float | None = None, note: str = "") -> None:
        row = {"figure": figure, "value": round(value, 4), "unit": unit, "baseline": baseline,
               "baseline_value": baseline_value, "ratio": round(value / baseline_value, 3) if baseline_value else None,
               "note": note}
        print(json.dumps(row) if self.as_json else f"{figure:30s} {value:10.3f} {unit:3s}  {row['ratio']}x "
              f"{baseline} ({baseline_value:.3f})   {note}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
