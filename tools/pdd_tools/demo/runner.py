"""One run (plain PD or PDD) of the trace, driven from this process as the router and the user,
and both runs end to end (:func:`run`, :func:`run_demo`)."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from .config import MD_PEER, PUBLISHED, DemoConfig, config_from_args
from .layout import Procs, agent_toml, layout_for, wan_of
from .report import RunResult, plot_cdf, summary, table


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
    from pdd_wire.engine.client import EngineClient
    from pdd_wire.progress import Progress

    from ..sim import check_stream

    run_dir = out / kind
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    sock_dir = tempfile.mkdtemp(prefix="pddd-")
    lay = layout_for(cfg, sites is not None, sock_dir, sites)
    procs = Procs()
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
        argv = [py, "-m", "pdd_tools.shaper", "--listen", f"{lay.shaper_listen[0]}:{lay.shaper_listen[1]}",
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
            path.write_text(agent_toml(lay, role, shaper_addr))
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
            argv = lay.exec_argv(site, [py, "-m", "pdd_tools.demo", "--site-engines", str(spec_path)])
            proc = await procs.spawn(f"engines-{site}", argv,
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


async def run(cfg: DemoConfig) -> tuple[dict, dict[str, RunResult]]:
    """Both runs; returns (figures, results). Writes figures.json and ttft_cdf.png under cfg.out."""
    from .. import trace as tracemod

    out = Path(cfg.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tr = tracemod.generate(n_requests=cfg.requests, rate_per_s=cfg.rate, seed=cfg.seed, **cfg.trace_overrides)
    tstats = tracemod.stats(tr, cfg.kv_bytes_per_token)
    netns, where, link = wan_of(cfg)
    if not cfg.quiet:
        print(f"pdd-tools demo: {len(tr)} requests ({tstats['conversations']} conversations, mean prefix hit "
              f"{tstats['mean_hit'] * 100:.1f}%, {tstats['frac_hit_above_95'] * 100:.0f}% above 95%, "
              f"{tstats['anomalous_fraction'] * 100:.1f}% anomalous) over {tstats['span_s']:.0f} s; "
              f"KV {cfg.kv_bytes_per_token} B/token; WAN {link}; {where}", flush=True)
    results: dict[str, RunResult] = {}
    sites = None
    if netns:
        from ..netns import TwoSites

        sites = TwoSites(cfg.prefix, rate_bps=int(cfg.link_mbit * 1e6))
        sites.up()
    try:
        for kind in cfg.runs:
            results[kind] = await _run(cfg, kind, tr, out, sites)
    finally:
        if sites is not None:
            sites.down()
    figures = {k: summary(v) for k, v in results.items()}
    figures["link"] = {"rate_mbit": cfg.link_mbit, "rtt_ms": cfg.rtt_ms, "jitter_ms": cfg.jitter_ms,
                       "where": "netns" if netns else "loopback", "shape": where,
                       "kv_bytes_per_token": cfg.kv_bytes_per_token}
    figures["trace"] = {**tstats, "seed": cfg.seed, "rate_per_s_asked": cfg.rate}
    figures["published"] = PUBLISHED
    (out / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")
    plot_cdf(results, out / "ttft_cdf.png", link)
    return figures, results


async def _main(cfg: DemoConfig, run_fn=run, out: Path | None = None,
                what: str = "per-request figures and logs") -> int:
    """Run ``run_fn(cfg)`` (both runs), print the table and where things went; the exit status."""
    from pdd_wire import log

    log.configure("warning", "console")
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    t0 = time.monotonic()
    out = out or Path(cfg.out)
    try:
        figures, results = await run_fn(cfg)
    except asyncio.CancelledError:
        print("\npdd-tools demo: interrupted; everything it started is stopped", file=sys.stderr)
        return 130
    except (OSError, RuntimeError, TimeoutError) as exc:
        print(f"\npdd-tools demo: failed: {exc}\n(everything it started is stopped; logs under {out}/)",
              file=sys.stderr)
        return 1
    print()
    print(table(figures, cfg))
    print(f"\nwrote {out / 'figures.json'}, {out / 'ttft_cdf.png'}, {what} in {out}/<run>/ "
          f"(total {time.monotonic() - t0:.0f} s)")
    failures = [f for res in results.values() for f in res.failures]
    if failures:
        print(f"\n{len(failures)} failures, first: {failures[:5]}", file=sys.stderr)
        return 1
    return 0


def run_demo(args) -> int:
    cfg = config_from_args(args)
    if cfg.engine == "vllm" and cfg.side_by_side:
        # Three prompts' tokens side by side, the handoff driven by the agents: pdd_tools.vllm.demo.
        from ..vllm import demo as vllm_demo

        return vllm_demo.run_demo(args)
    import uvloop

    if cfg.engine == "vllm":
        # The trace through pdd-wire router over real vllm serve instances.
        from . import vllm_runner

        main = _main(cfg, vllm_runner.run, Path(cfg.out) / "vllm",
                     "per-request rows and the router's log (the servers' and agents' logs in logs/)")
    else:
        main = _main(cfg)
    try:
        return uvloop.run(main)
    except KeyboardInterrupt:
        return 130
