"""The demo: PDD against plain cross-datacenter PD, end to end, on one machine.

``scripts/demo`` (``pdd-wire demo``) starts three agents, one per node as PDD has them: prefill
P (node a1) and relay decode RLD (node a2) in datacenter A, main decode MD (node b1) in
datacenter B, and the simulated engines of :mod:`pdd_wire.engine.sim` on them. It replays one
trace shaped like PDD's traffic (:mod:`pdd_wire.trace`) twice:

* **pd**: plain cross-DC PD. Every request is P-MD: P prefills and ships the KV MD lacks
  across the WAN; MD emits the first token once the KV is in.
* **pdd**: PDD. For each request a router asks P's agent ``choose_pipeline`` (live link
  figures): P-MD when the missing KV crosses within the TTFT budget; P-RLD-MD otherwise (one
  ``send_kv`` to RLD and MD at once, RLD decodes and emits while the KV crosses the WAN, then
  hands the output over, one-shot or catch-up by its load); P-RLD for the anomalous requests
  (ultra-long input, ultra-short output: finished on RLD, nothing crosses).

It prints a table (TTFT p50/p90/p99 of both runs, WAN bytes, handoffs by mode, pipelines
chosen), and writes under ``--out`` (``demo-out/``) ``figures.json``, ``ttft_cdf.png``, one
JSON line per request of each run (``pd/requests.jsonl``, ``pdd/requests.jsonl``) and every
process's log. TTFT is the time from a request's arrival to the first token emitted to the user:
the ``emit`` of position 0 (RLD's, in a handoff), or the decoder's own first token.

**Two datacenters.** As root, sites A and B are network namespaces joined by a veth pair
(:class:`pdd_wire.netns.TwoSites`, a tbf at ``--link-mbit`` on both ends); site A's agents and
engines run in namespace A, site B's in B. WAN latency comes from one
:mod:`pdd_wire.shaper` relay in namespace A in front of MD's agent (half of ``--rtt-ms`` each
way, with jitter): the agents of A dial B (the lower site/node dials), so their peer address for
b1 is the shaper's. Without root it falls back to loopback, with the shaper also doing the
rate (per connection, so the KV goes over one bulk connection there). Everything is stopped and
the namespaces removed on exit, whatever happens (Ctrl-C, SIGTERM, errors).

Each site's engines run in a process of their own (``python -m pdd_wire.demo --site-engines
SPEC``), driven over its stdin/stdout by this process, which plays the router and the user.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .stats import percentile

MiB = 1 << 20
PIPELINES = ("P-MD", "P-RLD-MD", "P-RLD")
NODES = {"P": ("A", "a1"), "RLD": ("A", "a2"), "MD": ("B", "b1")}
RLD_PEER, MD_PEER = "A/a2", "B/b1"
# The agents' anomalous-traffic filter, scaled like the trace (PDD: input >= 32K, output < 500).
ANOMALY_MIN_INPUT, ANOMALY_MAX_OUTPUT = 16384, 80
# Catch-up handoff threshold, scaled like the answers (PDD: 64 tokens of 1K; here of ~200).
CATCHUP_GAP = 16
PUBLISHED = {"pd_ttft_p50_s": 6.7, "pd_ttft_p90_s": 18.3, "pd_ttft_p99_s": 29.7, "pdd_ttft_reduction": 0.515,
             "source": "PDD (Infinigence, 2026): unoptimised cross-DC PD, 64K total length, 1K output"}


# ============================================================================ configuration
@dataclass
class DemoConfig:
    engine: str = "sim"
    out: str = "demo-out"
    requests: int = 240
    rate: float = 6.0  # requests per second
    seed: int = 1
    link_mbit: float = 400.0
    rtt_ms: float = 30.0
    jitter_ms: float = 2.0
    kv_bytes_per_token: int = 4096
    where: str = "auto"  # auto | netns | loopback
    runs: tuple[str, ...] = ("pd", "pdd")
    prefix: str = "pddw"  # namespace names (tests use their own)
    trace_overrides: dict = field(default_factory=dict)  # TraceConfig fields, for small test runs
    pool_mib: dict = field(default_factory=lambda: {"P": 512, "RLD": 384, "MD": 512})
    timeout_s: float | None = None  # per run, after the last arrival; None: 120 s
    quiet: bool = False


def add_demo_args(d: argparse.ArgumentParser) -> None:
    """The ``demo`` subcommand's options (``pdd_wire.cli``)."""
    c = DemoConfig()
    d.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                   help="sim: simulated engines (default); vllm: the vLLM flow (pdd_wire.adapters)")
    d.add_argument("--out", default=c.out, help="where figures.json, ttft_cdf.png and the logs go (default %(default)s)")
    d.add_argument("--requests", type=int, default=c.requests, help="requests in the trace (default %(default)s)")
    d.add_argument("--rate", type=float, default=c.rate, help="mean arrival rate, requests/s (default %(default)s)")
    d.add_argument("--seed", type=int, default=c.seed, help="trace seed (default %(default)s)")
    d.add_argument("--link-mbit", type=float, default=c.link_mbit, help="WAN rate, Mbit/s (default %(default)s)")
    d.add_argument("--rtt-ms", type=float, default=c.rtt_ms, help="WAN round trip, ms (default %(default)s)")
    d.add_argument("--jitter-ms", type=float, default=c.jitter_ms, help="WAN jitter each way, ms (default %(default)s)")
    d.add_argument("--kv-bytes-per-token", type=int, default=c.kv_bytes_per_token,
                   help="simulated KV size per token (default %(default)s)")
    d.add_argument("--where", choices=("auto", "netns", "loopback"), default="auto",
                   help="netns: two network namespaces (root); loopback: one namespace; auto: netns when root")
    d.add_argument("--runs", default="pd,pdd", help="which runs, comma-separated (default %(default)s)")


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    runs = tuple(r.strip() for r in args.runs.split(",") if r.strip())
    bad = [r for r in runs if r not in ("pd", "pdd")]
    if bad or not runs:
        raise SystemExit(f"pdd-wire demo: --runs takes pd and/or pdd, not {args.runs!r}")
    for key in ("requests", "rate", "link_mbit", "kv_bytes_per_token"):
        if not getattr(args, key) > 0:
            raise SystemExit(f"pdd-wire demo: --{key.replace('_', '-')} must be > 0")
    if args.rtt_ms < 0 or args.jitter_ms < 0:
        raise SystemExit("pdd-wire demo: --rtt-ms and --jitter-ms must be >= 0")
    return DemoConfig(engine=args.engine, out=args.out, requests=args.requests, rate=args.rate, seed=args.seed,
                      link_mbit=args.link_mbit, rtt_ms=args.rtt_ms, jitter_ms=args.jitter_ms,
                      kv_bytes_per_token=args.kv_bytes_per_token, where=args.where, runs=runs)


# ============================================================================ the two sites
@dataclass
class NodeSpec:
    role: str  # P | RLD | MD
    site: str
    node: str
    ns: str | None  # network namespace, None on loopback
    wan: tuple[str, int]  # where it listens
    admin: tuple[str, int]
    socket: str


@dataclass
class Layout:
    """Where every process of one run lives and how the agents reach each other."""

    netns: bool
    ns: dict[str, str | None]  # site -> namespace
    nodes: dict[str, NodeSpec]  # role -> node
    shaper_listen: tuple[str, int]
    shaper_target: tuple[str, int]
    shaper_rate_Bps: float | None
    wan_streams: int
    local_transport: str

    def exec_argv(self, site: str, argv: list[str]) -> list[str]:
        ns = self.ns[site]
        return ["ip", "netns", "exec", ns, *argv] if ns else argv


def _layout(cfg: DemoConfig, netns: bool, sock_dir: str, sites=None) -> Layout:
    from .harness import free_port

    ucx = importlib.util.find_spec("ucxx") is not None
    if netns:
        ns = {"A": sites.ns("a"), "B": sites.ns("b")}
        ports = {"P": (7611, 7711), "RLD": (7612, 7712), "MD": (7613, 7713)}
        hosts = {"P": "127.0.0.1", "RLD": "127.0.0.1", "MD": sites.addr("b")}
        shaper_listen = ("127.0.0.1", 7600)
    else:
        ns = {"A": None, "B": None}
        ports = {r: (free_port(), free_port()) for r in NODES}
        hosts = {r: "127.0.0.1" for r in NODES}
        shaper_listen = ("127.0.0.1", 0)
    nodes = {r: NodeSpec(r, s, n, ns[s], (hosts[r], ports[r][0]), ("127.0.0.1", ports[r][1]),
                         os.path.join(sock_dir, f"{n}.sock")) for r, (s, n) in NODES.items()}
    rate = cfg.link_mbit * 1e6 / 8
    return Layout(netns, ns, nodes, shaper_listen, nodes["MD"].wan,
                  None if netns else rate,  # netns: tbf on the veth does the rate
                  4 if netns else 1, "ucx" if ucx else "tcp")


def _agent_toml(lay: Layout, role: str, shaper_addr: tuple[str, int]) -> str:
    me = lay.nodes[role]
    peers = []
    for r, other in lay.nodes.items():
        if r == role:
            continue
        if other.site == me.site:
            addr, transport, streams = other.wan, lay.local_transport, 2
        elif me.site == "A":  # A dials B through the shaper
            addr, transport, streams = shaper_addr, "tcp", lay.wan_streams if role == "P" else 1
        else:  # B never dials (A's nodes sort first); the address is only for the record
            addr = ("10.77.0.1", other.wan[1]) if lay.netns else other.wan
            transport, streams = "tcp", lay.wan_streams if r == "P" else 1
        peers.append(f'[[peers]]\nsite = "{other.site}"\nnode = "{other.node}"\naddress = "{addr[0]}:{addr[1]}"\n'
                     f'transport = "{transport}"\nstreams = {streams}\n')
    return f"""# generated by pdd_wire.demo: node {me.node} ({role}) of site {me.site}
site = "{me.site}"
node = "{me.node}"

[listen]
wan = "{me.wan[0]}:{me.wan[1]}"
admin = "{me.admin[0]}:{me.admin[1]}"
engine_socket = "{me.socket}"

{chr(10).join(peers)}
[transfer]
chunk_bytes = {1 * MiB}
credit_bytes = {8 * MiB}
unposted_wait_s = 60.0

[timeouts]
handoff_s = 60.0

[policy.pipeline]
anomaly_min_input_tokens = {ANOMALY_MIN_INPUT}
anomaly_max_output_tokens = {ANOMALY_MAX_OUTPUT}

[policy.handoff]
catchup_gap_tokens = {CATCHUP_GAP}

[tls]
allow_plaintext = {"true" if lay.netns else "false"}

[log]
format = "json"
"""


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it if the demo dies without cleaning up (SIGKILL)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class _Procs:
    """Child processes, each in a session of its own; stopped (TERM, then KILL) whatever happens,
    and told by the kernel to stop should this process be killed outright."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, asyncio.subprocess.Process]] = []

    async def spawn(self, name: str, argv: list[str], log: Path, *, pipes: bool = False) -> asyncio.subprocess.Process:
        with open(log, "ab") as logf:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE if pipes else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE if pipes else logf, stderr=logf,
                start_new_session=True, preexec_fn=_die_with_parent, limit=64 * MiB)
        self.procs.append((name, proc))
        return proc

    async def stop_all(self, grace: float = 10.0) -> dict[str, int | None]:
        for _, proc in reversed(self.procs):
            if proc.returncode is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        codes = {}
        for name, proc in self.procs:
            try:
                codes[name] = await asyncio.wait_for(proc.wait(), grace)
            except (TimeoutError, asyncio.CancelledError):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                codes[name] = await proc.wait()
        self.procs.clear()
        return codes


# ============================================================================ one run
@dataclass
class RunResult:
    kind: str
    requests: list[dict]  # per request: arrival, pipeline, ttft_s, ok, ...
    stats: dict  # from the sites: metrics, engine figures
    wall_s: float
    failures: list[str]
    streams: dict[str, list[dict[int, int]]] = field(default_factory=dict)  # what each side emitted, per request

    def ttfts(self) -> list[float]:
        return [r["ttft_s"] for r in self.requests if r.get("ttft_s") is not None]


class _Replay:
    def __init__(self, trace, kind: str) -> None:
        self.trace = trace
        self.kind = kind
        self.pipeline: dict[str, str] = {}
        self.choice: dict[str, dict] = {}
        self.arrival: dict[str, float] = {}
        self.expect: dict[str, set[str]] = {}
        self.got: dict[str, dict[str, dict]] = {r.rid: {} for r in trace}
        self.open = len(trace)
        self.all_done = asyncio.Event()
        self.ready: dict[str, asyncio.Event] = {"A": asyncio.Event(), "B": asyncio.Event()}
        self.stats: dict[str, dict] = {}
        self.stats_in = asyncio.Event()
        self.failures: list[str] = []
        self.dead: asyncio.Future = asyncio.get_running_loop().create_future()
        self.dead.add_done_callback(lambda f: f.cancelled() or f.exception())  # raised where it matters
        self.closing = False  # the sites were told to finish: their exit is expected

    def on_event(self, site: str, ev: dict) -> None:
        kind = ev.get("ev")
        if kind == "ready":
            self.ready[site].set()
        elif kind in ("done", "prefill", "error"):
            rid = ev["request_id"]
            side = ev.get("side", "P" if kind == "prefill" else "?")
            if kind == "error":
                self.failures.append(f"{rid} on {site}: {ev['error']}")
                side = ev.get("side", "?")
            self.got.setdefault(rid, {})[side] = ev
            self._check(rid)
        elif kind == "stats":
            self.stats[site] = ev
            if len(self.stats) == 2:
                self.stats_in.set()

    def expect_sides(self, rid: str, pipeline: str) -> None:
        self.expect[rid] = {"P", *{"P-MD": ("MD",), "P-RLD-MD": ("RLD", "MD"), "P-RLD": ("RLD",)}[pipeline]}
        self._check(rid)

    def _check(self, rid: str) -> None:
        exp = self.expect.get(rid)
        if exp is not None and exp <= set(self.got[rid]) and not self.got[rid].get("_counted"):
            self.got[rid]["_counted"] = {}
            self.open -= 1
            if self.open == 0:
                self.all_done.set()


async def _read_site(site: str, proc: asyncio.subprocess.Process, rep: _Replay) -> None:
    while True:
        line = await proc.stdout.readline()
        if not line:
            break
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        rep.on_event(site, ev)
    code = await proc.wait()
    if not rep.dead.done() and not rep.closing:
        rep.dead.set_exception(RuntimeError(f"site {site}'s engine process exited ({code}) before the run ended; "
                                            f"see its log"))


def _send(proc: asyncio.subprocess.Process, msg: dict) -> None:
    proc.stdin.write((json.dumps(msg) + "\n").encode())


async def _until(fut_or_event, rep: _Replay, timeout: float, what: str) -> None:
    waiter = asyncio.ensure_future(fut_or_event.wait() if isinstance(fut_or_event, asyncio.Event) else fut_or_event)
    try:
        done, _ = await asyncio.wait({waiter, rep.dead}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not waiter.done():
            waiter.cancel()
    if rep.dead in done:
        rep.dead.result()
    if waiter not in done:
        raise TimeoutError(f"{what}: not within {timeout:.0f} s")


async def _run(cfg: DemoConfig, kind: str, trace, out: Path, sites=None) -> RunResult:
    from .engine.client import EngineClient
    from .engine.sim import check_stream
    from .progress import Progress

    run_dir = out / kind
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    sock_dir = tempfile.mkdtemp(prefix="pddd-")
    lay = _layout(cfg, sites is not None, sock_dir, sites)
    procs = _Procs()
    py = sys.executable
    t_start = time.monotonic()
    router = None
    rep = _Replay(trace, kind)
    readers = []
    # On a terminal: how far the replay is (nothing in logs or with --quiet).
    shown = Progress(lambda el: f"  {kind}: {len(trace) - rep.open}/{len(trace)} requests done, {el:.0f} s",
                     quiet=cfg.quiet)
    try:
        # The WAN's latency: one shaper in site A in front of MD's agent.
        argv = [py, "-m", "pdd_wire.shaper", "--listen", f"{lay.shaper_listen[0]}:{lay.shaper_listen[1]}",
                "--target", f"{lay.shaper_target[0]}:{lay.shaper_target[1]}", "--delay-ms", str(cfg.rtt_ms / 2),
                "--jitter-ms", str(cfg.jitter_ms), "--log-level", "warning", "--queue-mib", "16"]
        if lay.shaper_rate_Bps:
            argv += ["--rate-mbit", str(lay.shaper_rate_Bps * 8 / 1e6)]
        shaper = await procs.spawn("shaper", lay.exec_argv("A", argv), run_dir / "shaper.log", pipes=True)
        line = await asyncio.wait_for(shaper.stdout.readline(), 20)
        if not line.startswith(b"shaper listening on "):
            raise RuntimeError(f"the shaper did not start: {line!r}; see {run_dir}/shaper.log")
        host, _, port = line.split()[3].decode().rpartition(":")
        shaper_addr = (host, int(port))
        for role in ("MD", "RLD", "P"):
            n = lay.nodes[role]
            path = run_dir / f"{n.node}.toml"
            path.write_text(_agent_toml(lay, role, shaper_addr))
            await procs.spawn(f"agent-{n.node}", lay.exec_argv(n.site, [py, "-m", "pdd_wire", "--site", n.site,
                                                                        "--config", str(path)]),
                              run_dir / f"agent-{n.node}.log")
        site_procs = {}
        for site in ("A", "B"):
            spec = {"site": site, "kind": kind, "kv_bytes_per_token": cfg.kv_bytes_per_token,
                    "nodes": {r: {"socket": n.socket, "admin": f"{n.admin[0]}:{n.admin[1]}"}
                              for r, n in lay.nodes.items() if n.site == site},
                    "pool_mib": cfg.pool_mib}
            spec_path = run_dir / f"site-{site}.json"
            spec_path.write_text(json.dumps(spec, indent=1))
            proc = await procs.spawn(f"engines-{site}",
                                     lay.exec_argv(site, [py, "-m", "pdd_wire.demo", "--site-engines", str(spec_path)]),
                                     run_dir / f"engines-{site}.log", pipes=True)
            site_procs[site] = proc
            readers.append(asyncio.create_task(_read_site(site, proc, rep)))
        for site in ("A", "B"):
            await _until(rep.ready[site], rep, 60, f"site {site}'s engines and agents up")
        if kind == "pdd":
            router = await EngineClient(lay.nodes["P"].socket, "router").connect()
        setup_s = time.monotonic() - t_start
        if not cfg.quiet:
            print(f"  {kind}: agents, shaper and engines up in {setup_s:.1f} s; replaying {len(trace)} requests "
                  f"over {trace[-1].arrival_s:.0f} s ...", flush=True)

        t0 = time.monotonic() + 0.3
        shown.__enter__()
        for r in trace:
            delay = t0 + r.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if rep.dead.done():
                rep.dead.result()
            rep.arrival[r.rid] = t0 + r.arrival_s
            if router is None:
                pipeline = "P-MD"
            else:
                choice = await router.choose_pipeline(
                    r.rid, to=MD_PEER, input_tokens=r.input_tokens, prefix_hit_tokens=r.prefix_hit_tokens,
                    expected_output_tokens=r.output_tokens, kv_bytes_per_token=cfg.kv_bytes_per_token)
                pipeline = choice["pipeline"]
                rep.choice[r.rid] = {"reason": choice["reason"], "predicted_wan_s": choice["predicted_wan_s"],
                                     "bandwidth_Bps": choice["link"]["bandwidth_Bps"],
                                     "queue_bytes": choice["link"]["queue_bytes"]}
            rep.pipeline[r.rid] = pipeline
            rep.expect_sides(r.rid, pipeline)
            cmd = {"op": "req", "request_id": r.rid, "pipeline": pipeline, "n": r.output_tokens,
                   "kv_tokens": r.missing_tokens}
            _send(site_procs["A"], cmd)
            if pipeline != "P-RLD":
                _send(site_procs["B"], cmd)
        await _until(rep.all_done, rep, cfg.timeout_s or 120.0, f"{kind}: every request finished")
        rep.closing = True
        for proc in site_procs.values():
            _send(proc, {"op": "finish"})
        await _until(rep.stats_in, rep, 30, f"{kind}: the sites' figures")
    except TimeoutError as exc:
        rep.failures.append(str(exc))
    finally:
        shown.__exit__(None, None, None)
        rep.closing = True
        if router is not None:
            await router.close()
        await procs.stop_all()
        for t in readers:
            t.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        shutil.rmtree(sock_dir, ignore_errors=True)
    wall = time.monotonic() - t_start

    rows = []
    streams: dict[str, list[dict[int, int]]] = {}
    for r in trace:
        got = rep.got.get(r.rid, {})
        pipeline = rep.pipeline.get(r.rid)
        row = {"request_id": r.rid, "arrival_s": r.arrival_s, "input_tokens": r.input_tokens,
               "prefix_hit_tokens": r.prefix_hit_tokens, "output_tokens": r.output_tokens,
               "hit": round(r.hit, 4), "anomalous": r.anomalous, "pipeline": pipeline, "ok": False}
        row.update(rep.choice.get(r.rid, {}))
        sides = {s: got[s] for s in ("RLD", "MD") if s in got}
        errors = [e for s in sides.values() for e in s.get("errors", [])]
        errors += [got[s]["error"] for s in got if s not in ("_counted",) and "error" in got[s]]
        pre = got.get("P")
        if pre is not None:
            row["prefill_wait_s"] = _d(pre.get("started_at"), pre.get("submitted_at"))
            row["prefill_s"] = _d(pre.get("computed_at"), pre.get("started_at"))
            row["kv_s"] = {k: round(v, 4) for k, v in pre.get("sent", {}).items()}
            if pre.get("failed"):
                errors.append(f"KV send failed: {pre['failed']}")
        firsts = [s["first_at"] for s in sides.values() if s.get("first_at") is not None]
        if firsts and r.rid in rep.arrival:
            row["ttft_s"] = round(min(firsts) - rep.arrival[r.rid], 6)
        for s, ev in sides.items():
            row[f"{s.lower()}_tokens"] = len(ev["emitted"])
            if s == "RLD" and ev.get("handoff"):
                row["handoff"] = {"owner": ev["owner"], "reason": ev["reason"], "mode": ev["mode"],
                                  "position": ev["position"]}
        streams[r.rid] = [{int(k): v for k, v in ev["emitted"].items()} for ev in sides.values()]
        try:
            if pipeline is None or not (rep.expect.get(r.rid, {"?"}) <= set(got)):
                raise AssertionError(f"{r.rid}: did not finish (have {sorted(k for k in got if k != '_counted')})")
            check_stream(r.rid, r.output_tokens, *streams[r.rid])
            if errors:
                raise AssertionError(f"{r.rid}: {errors}")
            if "ttft_s" not in row:
                raise AssertionError(f"{r.rid}: no first token")
            row["ok"] = True
        except AssertionError as exc:
            row["error"] = str(exc)
            rep.failures.append(str(exc))
        rows.append(row)
    with open(run_dir / "requests.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return RunResult(kind, rows, rep.stats, wall, rep.failures, streams)


def _d(a, b):
    return round(a - b, 6) if a is not None and b is not None else None


# ============================================================================ a site's engines
async def _connect(path: str, name: str, timeout: float = 30.0):
    from .engine.client import EngineClient
    from .errors import TransportError

    deadline = time.monotonic() + timeout
    while True:
        try:
            return await EngineClient(path, name).connect()
        except TransportError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def _peers_up(clients, timeout: float = 40.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        ok = True
        for c in clients:
            st = await c.status()
            ok &= all(p["up"] and (p["bulk_streams_up"] == p["bulk_streams"] or p["data_path"] == "ucx")
                      for p in st["peers"])
        if ok:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the agents' peers are not up after {timeout:.0f} s")
        await asyncio.sleep(0.1)


def _metrics(admin: str) -> list:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=5) as r:
        text = r.read().decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def _site_figures(samples: list, site: str) -> dict:
    """WAN bytes (this node and peers of the other site), KV bytes sent there, and the handoff
    and pipeline counters, from one agent's metrics."""
    out: dict = {"wan_bytes": 0, "wan_kv_bytes_tx": 0, "wan_bytes_tx": 0, "handoff_modes": {}, "handoffs": {},
                 "pipelines": {}}
    for s in samples:
        peer = s.labels.get("peer", "")
        if s.name == "pddwire_bytes_total" and peer and not peer.startswith(f"{site}/"):
            out["wan_bytes"] += int(s.value)
            if s.labels.get("direction") == "tx":
                out["wan_bytes_tx"] += int(s.value)
                if s.labels.get("lane") == "bulk":
                    out["wan_kv_bytes_tx"] += int(s.value)
        elif s.name == "pddwire_handoff_modes_total" and s.value:
            out["handoff_modes"][f"{s.labels['mode']}/{s.labels['reason']}"] = int(s.value)
        elif s.name == "pddwire_handoffs_total" and s.value:
            key = f"{s.labels['role']}:{s.labels['mode']}/{s.labels['reason']}"
            out["handoffs"][key] = int(s.value)
        elif s.name == "pddwire_pipeline_choices_total" and s.value:
            out["pipelines"][f"{s.labels['pipeline']}/{s.labels['reason']}"] = int(s.value)
    return out


class _Out:
    def __init__(self) -> None:
        self.f = sys.stdout.buffer

    def send(self, msg: dict) -> None:
        self.f.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
        self.f.flush()


async def _site_main(spec: dict) -> int:
    from .engine.sim import BLOCK_TOKENS, GPU_A, GPU_B, DecodeSim, KvPool, PrefillSim

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=16 * MiB)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = _Out()
    site, kvb = spec["site"], spec["kv_bytes_per_token"]
    block = kvb * BLOCK_TOKENS
    nodes = spec["nodes"]
    clients, pools, engines = [], [], []
    tasks: set[asyncio.Task] = set()
    watch = None
    try:
        if site == "A":
            pc = await _connect(nodes["P"]["socket"], "prefill-sim")
            rc = await _connect(nodes["RLD"]["socket"], "rld-sim")
            clients += [pc, rc]
            pp = KvPool(spec["pool_mib"]["P"] * MiB, block, "prefill-kv")
            rp = KvPool(spec["pool_mib"]["RLD"] * MiB, block, "rld-kv")
            pools += [pp, rp]
            prefill = await PrefillSim(pc, pp, GPU_A, kv_bytes_per_token=kvb).start()
            rld = await DecodeSim(rc, rp, GPU_A, role="RLD", peer=MD_PEER, kv_from="A",
                                  kv_bytes_per_token=kvb).start()
            engines += [prefill, rld]
        else:
            mc = await _connect(nodes["MD"]["socket"], "md-sim")
            clients.append(mc)
            mp = KvPool(spec["pool_mib"]["MD"] * MiB, block, "md-kv")
            pools.append(mp)
            md = await DecodeSim(mc, mp, GPU_B, role="MD", peer=RLD_PEER, kv_from="A", kv_bytes_per_token=kvb).start()
            engines.append(md)
        await _peers_up(clients)
        out.send({"ev": "ready"})

        async def serve_a(cmd: dict) -> None:
            rid, pipe = cmd["request_id"], cmd["pipeline"]
            seq = None
            if pipe in ("P-RLD-MD", "P-RLD"):
                seq = await rld.submit(rid, cmd["n"], cmd["kv_tokens"], handoff=pipe == "P-RLD-MD")
            to = {"P-MD": [MD_PEER], "P-RLD-MD": [RLD_PEER, MD_PEER], "P-RLD": [RLD_PEER]}[pipe]
            job = prefill.submit(rid, cmd["kv_tokens"], to)
            await job.done
            out.send({"ev": "prefill", "request_id": rid, "submitted_at": job.submitted_at,
                      "started_at": job.started_at, "computed_at": job.computed_at, "done_at": job.done_at,
                      "sent": job.sent, "failed": job.failed})
            if seq is not None:
                await seq.result
                out.send({"ev": "done", "side": "RLD", **rld.result_of(seq)})

        async def serve_b(cmd: dict) -> None:
            seq = await md.submit(cmd["request_id"], cmd["n"], cmd["kv_tokens"], handoff=cmd["pipeline"] == "P-RLD-MD")
            await seq.result
            out.send({"ev": "done", "side": "MD", **md.result_of(seq)})

        async def serve(cmd: dict) -> None:
            try:
                await (serve_a if site == "A" else serve_b)(cmd)
            except Exception as exc:  # reported, the run goes on
                out.send({"ev": "error", "request_id": cmd["request_id"], "side": "RLD" if site == "A" else "MD",
                          "error": f"{type(exc).__name__}: {exc}"})

        # An engine connection that ends (its agent died) ends this process: the demo sees it at once.
        watch = asyncio.ensure_future(asyncio.wait([e._events_task for e in engines],
                                                   return_when=asyncio.FIRST_COMPLETED))
        while True:
            next_line = asyncio.ensure_future(reader.readline())
            await asyncio.wait({next_line, watch}, return_when=asyncio.FIRST_COMPLETED)
            if watch.done():
                next_line.cancel()
                dead = [e for e in engines if e._events_task.done()]
                why = [repr(e._events_task.exception()) if not e._events_task.cancelled() else "cancelled"
                       for e in dead]
                print(f"site {site}: an engine lost its agent: {why}", file=sys.stderr)
                return 1
            line = next_line.result()
            if not line:
                return 0
            cmd = json.loads(line)
            if cmd["op"] == "req":
                t = asyncio.create_task(serve(cmd))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            elif cmd["op"] == "finish":
                break
        figures = {}
        for role, n in nodes.items():
            samples = await asyncio.to_thread(_metrics, n["admin"])
            figures[role] = _site_figures(samples, site)
        eng = {}
        for e, pool in zip(engines, pools):
            name = "P" if isinstance(e, PrefillSim) else e.role
            d = {"busy_s": round(e.busy_s, 3), "pool_peak_mib": round(pool.peak_used * pool.block_bytes / MiB, 1),
                 "errors": e.errors}
            if isinstance(e, DecodeSim):
                d.update(steps=e.steps, tokens_generated=e.tokens_generated, max_batch=e.max_batch_seen,
                         mean_batch=round(e.batch_sum / e.steps, 2) if e.steps else 0, load_reports=e.load_reports)
            eng[name] = d
        out.send({"ev": "stats", "site": site, "agents": figures, "engines": eng})
        return 0
    finally:
        for t in (*tasks, *([watch] if watch is not None else [])):
            t.cancel()
        await asyncio.gather(*tasks, *([watch] if watch is not None else []), return_exceptions=True)
        for e in engines:
            await e.close()
        for c in clients:
            await c.close()
        for pool in pools:
            pool.close()


def _site_entry(argv: list[str]) -> int:
    from . import log

    ap = argparse.ArgumentParser(prog="python -m pdd_wire.demo")
    ap.add_argument("--site-engines", required=True, metavar="SPEC", help="JSON spec written by the demo")
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.site_engines).read_text())
    log.configure("warning", "console")
    import uvloop

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        return uvloop.run(_site_main(spec))
    except (KeyboardInterrupt, SystemExit):
        return 0


# ============================================================================ report
def _summary(res: RunResult) -> dict:
    t = res.ttfts()
    stats_a = res.stats.get("A", {}).get("agents", {})
    wan = sum(stats_a.get(r, {}).get("wan_bytes", 0) for r in ("P", "RLD"))
    wan_kv = sum(stats_a.get(r, {}).get("wan_kv_bytes_tx", 0) for r in ("P", "RLD"))
    pipes = {p: sum(1 for r in res.requests if r["pipeline"] == p) for p in PIPELINES}
    handoffs: dict[str, int] = {}
    for r in res.requests:
        h = r.get("handoff")
        if h:
            key = h["reason"] if h["owner"] == "RLD" else (h["mode"] or h["reason"])
            handoffs[key] = handoffs.get(key, 0) + 1
    rld_tok = sum(r.get("rld_tokens", 0) for r in res.requests)
    md_tok = sum(r.get("md_tokens", 0) for r in res.requests)
    return {
        "requests": len(res.requests), "ok": sum(r["ok"] for r in res.requests),
        "ttft_p50_s": _r(percentile(t, 50)), "ttft_p90_s": _r(percentile(t, 90)), "ttft_p99_s": _r(percentile(t, 99)),
        "ttft_mean_s": _r(sum(t) / len(t)) if t else None, "ttft_max_s": _r(max(t)) if t else None,
        "wan_bytes": wan, "wan_kv_bytes": wan_kv, "pipelines": pipes, "handoffs": handoffs,
        "handoff_mode_choices": stats_a.get("RLD", {}).get("handoff_modes", {}),
        "tokens_emitted": {"RLD": rld_tok, "MD": md_tok},
        "engines": {**res.stats.get("A", {}).get("engines", {}), **res.stats.get("B", {}).get("engines", {})},
        "wall_s": round(res.wall_s, 1),
    }


def _r(x):
    return None if x is None else round(x, 4)


def _table(fig: dict, cfg: DemoConfig) -> str:
    runs = [k for k in ("pd", "pdd") if k in fig]
    head = {"pd": "plain PD (P-MD only)", "pdd": "PDD"}
    rows: list[tuple[str, ...]] = []

    def row(label, fn):
        rows.append((label, *(fn(fig[k]) for k in runs)))

    def secs(key):
        return lambda f: "-" if f[key] is None else f"{f[key]:.3f} s"

    row("TTFT p50", secs("ttft_p50_s"))
    row("TTFT p90", secs("ttft_p90_s"))
    row("TTFT p99", secs("ttft_p99_s"))
    row("TTFT mean", secs("ttft_mean_s"))
    row("WAN bytes (both ways)", lambda f: f"{f['wan_bytes'] / 1e6:,.1f} MB")
    row("  of which KV", lambda f: f"{f['wan_kv_bytes'] / 1e6:,.1f} MB")
    for p in PIPELINES:
        row(f"pipeline {p}", lambda f, p=p: str(f["pipelines"][p]))
    row("handoffs by mode", lambda f: ", ".join(f"{k} {v}" for k, v in sorted(f["handoffs"].items())) or "-")
    row("  mode chosen because", lambda f: ", ".join(f"{k.split('/')[1]} {v}" for k, v in
                                                   sorted(f["handoff_mode_choices"].items())) or "-")
    row("output tokens by RLD / MD", lambda f: f"{f['tokens_emitted']['RLD']} / {f['tokens_emitted']['MD']}")
    row("requests ok", lambda f: f"{f['ok']}/{f['requests']}")
    row("run wall time", lambda f: f"{f['wall_s']:.1f} s")
    w0 = max(len(r[0]) for r in rows)
    ws = [max(len(head[k]), *(len(r[i + 1]) for r in rows)) for i, k in enumerate(runs)]
    lines = ["  ".join([" " * w0, *(head[k].rjust(w) for k, w in zip(runs, ws))])]
    lines += ["  ".join([r[0].ljust(w0), *(c.rjust(w) for c, w in zip(r[1:], ws))]) for r in rows]
    if "pd" in fig and "pdd" in fig and fig["pd"]["ttft_p99_s"] and fig["pdd"]["ttft_p99_s"]:
        cut = {q: 1 - fig["pdd"][f"ttft_{q}_s"] / fig["pd"][f"ttft_{q}_s"] for q in ("p50", "p90", "p99", "mean")
               if fig["pd"][f"ttft_{q}_s"]}
        lines.append("TTFT change with PDD: " + ", ".join(f"{q} {-v * 100:+.1f}%" for q, v in cut.items())
                     + "   (PDD paper: TTFT -51.5%; plain cross-DC PD p90 18.3 s, p99 29.7 s at 64K/1K)")
    return "\n".join(lines)


def _plot(results: dict[str, RunResult], path: Path, link: str) -> None:
    try:
        import matplotlib
    except ImportError:  # the agent does not need it: pip install 'pdd-wire[demo]'
        print(f"(no {path.name}: matplotlib is not installed; pip install 'pdd-wire[demo]')", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    colors = {"pd": "tab:red", "pdd": "tab:blue"}
    labels = {"pd": "plain cross-DC PD (P-MD)", "pdd": "PDD (P-MD / P-RLD-MD / P-RLD)"}
    for kind, res in results.items():
        xs = sorted(res.ttfts())
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", color=colors[kind], label=labels[kind])
        for q, ls in ((90, "--"), (99, ":")):
            v = percentile(xs, q)
            ax.axvline(v, color=colors[kind], ls=ls, lw=0.8)
            ax.annotate(f"p{q} {v:.2f}s", (v, 0.05 + (0.08 if q == 99 else 0) + (0.2 if kind == "pdd" else 0)),
                        color=colors[kind], fontsize=7, rotation=90, ha="right")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"TTFT CDF, simulated engines, real agents; WAN {link}", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ============================================================================ entry
async def run(cfg: DemoConfig) -> tuple[dict, dict[str, RunResult]]:
    """Both runs; returns (figures, results). Writes figures.json and ttft_cdf.png under cfg.out."""
    from . import trace as tracemod

    out = Path(cfg.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tr = tracemod.generate(n_requests=cfg.requests, rate_per_s=cfg.rate, seed=cfg.seed, **cfg.trace_overrides)
    tstats = tracemod.stats(tr, cfg.kv_bytes_per_token)
    netns = cfg.where == "netns" or (cfg.where == "auto" and os.geteuid() == 0)
    if netns and os.geteuid() != 0:
        raise PermissionError("--where netns needs root (network namespaces); use --where loopback")
    where = (f"two network namespaces ({cfg.prefix}-a, {cfg.prefix}-b), tbf {cfg.link_mbit:g} Mbit/s on the veth"
             if netns else f"loopback (not root), the shaper limits each connection to {cfg.link_mbit:g} Mbit/s")
    link = f"{cfg.link_mbit:g} Mbit/s, RTT {cfg.rtt_ms:g} ms ± {cfg.jitter_ms:g} ms"
    if not cfg.quiet:
        print(f"pdd-wire demo: {len(tr)} requests ({tstats['conversations']} conversations, mean prefix hit "
              f"{tstats['mean_hit'] * 100:.1f}%, {tstats['frac_hit_above_95'] * 100:.0f}% above 95%, "
              f"{tstats['anomalous_fraction'] * 100:.1f}% anomalous) over {tstats['span_s']:.0f} s; "
              f"KV {cfg.kv_bytes_per_token} B/token; WAN {link}; {where}", flush=True)
    results: dict[str, RunResult] = {}
    sites = None
    if netns:
        from .netns import TwoSites

        sites = TwoSites(cfg.prefix, rate_bps=int(cfg.link_mbit * 1e6))
        sites.up()
    try:
        for kind in cfg.runs:
            results[kind] = await _run(cfg, kind, tr, out, sites)
    finally:
        if sites is not None:
            sites.down()
    figures = {k: _summary(v) for k, v in results.items()}
    figures["link"] = {"rate_mbit": cfg.link_mbit, "rtt_ms": cfg.rtt_ms, "jitter_ms": cfg.jitter_ms,
                       "where": "netns" if netns else "loopback", "shape": where,
                       "kv_bytes_per_token": cfg.kv_bytes_per_token}
    figures["trace"] = {**tstats, "seed": cfg.seed, "rate_per_s_asked": cfg.rate}
    figures["published"] = PUBLISHED
    (out / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")
    _plot(results, out / "ttft_cdf.png", link)
    return figures, results


async def _main(cfg: DemoConfig) -> int:
    from . import log

    log.configure("warning", "console")
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    t0 = time.monotonic()
    try:
        figures, results = await run(cfg)
    except asyncio.CancelledError:
        print("\npdd-wire demo: interrupted; everything it started is stopped", file=sys.stderr)
        return 130
    except (OSError, RuntimeError, TimeoutError) as exc:
        print(f"\npdd-wire demo: failed: {exc}\n(everything it started is stopped; logs under {cfg.out}/)",
              file=sys.stderr)
        return 1
    print()
    print(_table(figures, cfg))
    out = Path(cfg.out)
    print(f"\nwrote {out / 'figures.json'}, {out / 'ttft_cdf.png'}, per-request figures and logs in {out}/<run>/ "
          f"(total {time.monotonic() - t0:.0f} s)")
    failures = [f for res in results.values() for f in res.failures]
    if failures:
        print(f"\n{len(failures)} failures, first: {failures[:5]}", file=sys.stderr)
        return 1
    return 0


def run_demo(args) -> int:
    cfg = config_from_args(args)
    if cfg.engine == "vllm":
        # Three tiny vLLM engines instead of simulated ones: pdd_wire.adapters.demo.
        from .adapters import demo as vllm_demo

        return vllm_demo.run_demo(args)
    import uvloop

    try:
        return uvloop.run(_main(cfg))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(_site_entry(sys.argv[1:]))
