"""Command lines. Exit status: 0 ok, 1 runtime failure, 2 bad configuration or usage.

``pdd-wired --site A [--config FILE] [--node NAME]`` runs one agent.
``pdd-wire`` is the operator's tool: ``config``, ``status``, ``probe``, ``router``. (The demo and the
benchmarks are tools, not product: ``pdd-tools demo|bench``, distribution ``pdd-wire-tools``.)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import sys
import urllib.error
import urllib.request

from . import config as cfgmod
from . import placement
from ._version import __version__
from .errors import ConfigError
from .progress import Progress, bar
from .rundir import engine_access_problems


def _load_config(args) -> cfgmod.Config:
    """The config ``--config``/``--site``/``--node`` name. A ``--site`` that contradicts the
    file's ``site`` is an error, not an override: the agent would run as a site its peers do not
    know it as."""
    node = getattr(args, "node", None)
    if args.config:
        cfg = cfgmod.load(args.config, overrides={"node": node})
        if args.site and args.site != cfg.site:
            raise ConfigError("site", f"--site {args.site} contradicts site = {cfg.site!r} in {args.config}; "
                                      f"give --site {cfg.site}, or the config file of site {args.site}")
        return cfg
    return cfgmod.default_config(args.site, **({"node": node} if node else {}))


def daemon_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdd-wired", description="pdd-wire agent: one per serving node")
    ap.add_argument("--site", required=True, help="this node's site (datacenter), e.g. A")
    ap.add_argument("--config", help="TOML config file; without it, the embedded loopback default")
    ap.add_argument("--node", help="node name (overrides the config's)")
    ap.add_argument("--check", action="store_true", help="validate the config and exit")
    ap.add_argument("--version", action="version", version=f"pdd-wired {__version__}")
    args = ap.parse_args(argv)
    try:
        cfg = _load_config(args)
        if cfg.tls.mode == "files":  # what TLS would refuse at start, named by its key (exit 2, no restart)
            from .pki import check_files

            check_files(cfg.tls.cert, cfg.tls.key, cfg.tls.ca)
        if args.check:  # on the node it will run on: the CPUs it names are there (the agent checks at start too)
            from .pki import check_dirs

            dir_warnings = check_dirs(cfg)  # the directories the agent would refuse at start (exit 1), named now
            placement.check_allowed(cfg.cpus.main_set, "cpus.main")
            placement.check_allowed(cfg.cpus.bulk_set, "cpus.bulk")
            if cfg.fleet.enabled:  # what the agent would refuse at start (exit 1), named now (exit 2)
                from .agent import check_member_record

                check_member_record(cfg)
    except ConfigError as exc:
        print(f"pdd-wired: {exc}", file=sys.stderr)
        return 2
    if args.check:
        for problem in dir_warnings + engine_access_problems(cfg.listen.engine_socket, cfg.listen.engine_socket_mode,
                                              cfg.listen.engine_uid, cfg.listen.engine_gid):
            print(f"pdd-wired: warning: {problem}", file=sys.stderr)
        print(f"pdd-wired: config OK (site {cfg.site}, node {cfg.node}, {len(cfg.peers)} peers)")
        return 0
    from . import log

    log.configure(cfg.log.level, cfg.log.format)
    import uvloop

    # Bulk threads hold the GIL only in short callbacks; a 1 ms switch interval (default 5 ms)
    # bounds how long the control loop can wait for it behind them.
    sys.setswitchinterval(0.001)
    try:
        return uvloop.run(_serve(cfg, os.path.abspath(args.config) if args.config else None))
    except KeyboardInterrupt:
        return 0


async def _serve(cfg: cfgmod.Config, config_path: str | None = None) -> int:
    import structlog

    from .agent import Agent

    agent = Agent(cfg)
    agent.config_path = config_path
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    from .errors import PddWireError

    try:
        await agent.start()
    except (OSError, PddWireError) as exc:
        structlog.get_logger("pdd_wire").error("cannot start", error=str(exc))
        await agent.shutdown(0)
        return 1
    # What start-up made lives as long as the daemon: frozen, the cyclic collector no longer
    # walks it at each full collection (a pause on the loop that carries token frames). No
    # gc.collect() first: that is one such pause, while the sessions' handshakes run.
    gc.freeze()
    await stop.wait()
    await agent.shutdown()
    return 0


# ---------------------------------------------------------------------------------- operator tool
class Unreachable(OSError):
    """No agent answered at an admin address; the message says where and what to try."""


def _admin_target(args, site: str | None) -> tuple[str, str]:
    """(admin HOST:PORT, where that address came from) for ``--admin``/``--config``/``site``."""
    if args.admin:
        cfgmod.parse_hostport(args.admin, "--admin")  # HOST:PORT, named if not
        return args.admin, "--admin"
    if not args.config and not site:
        raise ConfigError("--site", "name the agent: --site S (embedded default), --config FILE or --admin HOST:PORT")
    # With --config, a --site (--from) that contradicts the file is the flags' error (exit 2).
    cfg = _load_config(argparse.Namespace(site=site, config=args.config, node=None))
    if not cfg.listen.admin:
        raise ConfigError("listen.admin", f"is empty in {args.config}: that agent serves no admin address")
    where = f"listen.admin in {args.config}" if args.config else f"the embedded default of site {cfg.site}"
    return cfg.listen.admin, where


def agent_processes() -> list[dict]:
    """The ``pdd-wired`` processes on this host (read from /proc): pid, uid, --site, --config."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            uid = os.stat(f"/proc/{entry.name}").st_uid
        except OSError:
            continue
        named = any(os.path.basename(a) == "pdd-wired" for a in argv[:2])
        module = any(a == "-m" and b == "pdd_wire" for a, b in zip(argv, argv[1:]))
        if not (named or module) or int(entry.name) == os.getpid():
            continue
        opts = {a: b for a, b in zip(argv, argv[1:]) if a in ("--site", "--config")}
        out.append({"pid": int(entry.name), "uid": uid, "site": opts.get("--site"), "config": opts.get("--config")})
    return sorted(out, key=lambda p: p["pid"])


def _who_runs() -> str:
    procs = agent_processes()
    if not procs:
        return "no pdd-wired process runs on this host"
    return "pdd-wired on this host: " + "; ".join(
        f"pid {p['pid']} (uid {p['uid']}" + (f", --site {p['site']}" if p["site"] else "")
        + (f", --config {p['config']}" if p["config"] else "") + ")" for p in procs)


def _http(admin: str, where: str, path: str, body: dict | None = None, timeout: float = 5) -> dict:
    """GET (or POST ``body``) ``http://ADMIN/PATH``'s JSON. A refused or timed-out connection
    raises :class:`Unreachable` naming the address, where it came from, and which agents run."""
    url = f"http://{admin}{path}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError:
        raise
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        reason = getattr(reason, "strerror", None) or str(reason)
        raise Unreachable(f"no agent answered at {admin} ({where}): {reason}; {_who_runs()}; "
                          "name another agent with --admin HOST:PORT or --config FILE") from None


def _identity(st: dict, admin: str) -> str:
    who = f"agent {st['site']}/{st['node']}"
    bits = [f"pid {st['pid']}" if st.get("pid") else None,
            f"uid {st['uid']}" if st.get("uid") is not None else None,
            f"config {st.get('config') or 'embedded default'}", f"admin {admin}",
            f"pdd-wire {st['version']}" if st.get("version") else None]
    return f"{who} ({', '.join(b for b in bits if b)})"


def _check_site(st: dict, site: str | None, admin: str) -> None:
    if site and st["site"] != site:
        raise Unreachable(f"the agent at {admin} is site {st['site']} (node {st['node']}, pid {st.get('pid')}), "
                          f"not site {site}: another agent holds that address. {_who_runs()}; "
                          "name yours with --admin HOST:PORT or --config FILE")


def _table(rows: list[list], head: list[str]) -> list[str]:
    cells = [head] + [["-" if c is None else str(c) for c in r] for r in rows]
    width = [max(len(r[i]) for r in cells) for i in range(len(head))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip() for r in cells]


def _status_text(st: dict, admin: str) -> str:
    lines = [_identity(st, admin)]
    if st.get("uid") is not None and st["uid"] != os.getuid():
        lines.append(f"  note: it runs as uid {st['uid']}, not as you (uid {os.getuid()})")
    up = sum(p["up"] for p in st["peers"])
    state = "stopping" if st.get("stopping") else "listening"
    lines.append(f"  {state}; {up}/{len(st['peers'])} peers up; uptime {st.get('uptime_s', 0):.0f} s")
    lines.append(f"  wan {st.get('wan')}   engine socket {st.get('engine_socket')}")
    if st.get("cpus"):
        lines.append(f"  cpus: event loop {st['cpus']['main']}, bulk threads {st['cpus']['bulk'] or '-'}")
    if st["peers"]:
        lines.append("peers")
        lines += _table([[p["peer"], "up" if p["up"] else "DOWN", p["role"], p.get("data_path"), p["address"],
                          p["rtt_ms"], f"{p['bulk_streams_up']}/{p['bulk_streams']}",
                          p["transfers_out"], p["transfers_in"]] for p in st["peers"]],
                        ["PEER", "STATE", "ROLE", "PATH", "ADDRESS", "RTT_MS", "STREAMS", "OUT", "IN"])
    if st.get("engines"):
        lines.append("engines")
        lines += _table([[e["name"], e["pid"], e["regions"]] for e in st["engines"]], ["ENGINE", "PID", "REGIONS"])
    lines.append(f"transfers {len(st.get('transfers', []))} open; regions {st.get('regions', 0)}; "
                 f"posted receives {st.get('posted_receives', 0)}; stranded blocks {st.get('stranded_blocks', 0)}")
    return "\n".join(lines)


def _status(args) -> int:
    admin, where = _admin_target(args, args.site)
    st = _http(admin, where, "/v1/status")
    _check_site(st, args.site, admin)
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        print(_status_text(st, admin))
    return 0


def _probe(args) -> int:
    site = args.local
    if not (args.admin or args.config or site):
        target = args.site.split("/")[0]
        if target not in cfgmod.DEFAULT_SITES:
            raise ConfigError("--site", f"the embedded default has sites {sorted(cfgmod.DEFAULT_SITES)}, not "
                                        f"{target!r}: name the local agent with --from, --config or --admin")
        others = [s for s in cfgmod.DEFAULT_SITES if s != target]
        if len(others) != 1:
            raise ConfigError("--from", "name the local agent's site (or give --config / --admin)")
        site = others[0]
    admin, where = _admin_target(args, site)
    st = _http(admin, where, "/v1/status")
    _check_site(st, site, admin)
    if not args.json:
        print(f"from {_identity(st, admin)}", file=sys.stderr)
    body = {"peer": args.site, "seconds": args.seconds, "streams": args.streams}
    # 50 PINGs 10 ms apart, then the goodput over 1 and N streams.
    expected = 0.5 + args.seconds + 1
    with Progress(lambda el: f"probing {args.site} {bar(el / expected)} {el:4.1f} s of ~{expected:.0f} s",
                  quiet=args.json):
        try:
            res = _http(admin, where, "/v1/probe", body, timeout=args.seconds + 60)
        except urllib.error.HTTPError as exc:
            print(f"pdd-wire: probe refused by {admin}: {exc.read().decode(errors='replace')}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(res))
        return 0
    rtt = res["rtt_ms"]
    print(f"probe {res['peer']} over {res['data_path']}: {res['pings']} pings, loss {res['loss'] * 100:.1f}%")
    print(f"  rtt      min {rtt['min']} ms   p50 {rtt['p50']} ms   p99 {rtt['p99']} ms   jitter {res['jitter_ms']} ms")
    for n, gbps in res["goodput_Gbps"].items():
        print(f"  goodput  {n} stream{'s' if n != '1' else ''}: {gbps:.3f} Gbit/s "
              f"({res['goodput_Bps'][n] / 1e6:.1f} MB/s)")
    return 0


def _agent_args(p: argparse.ArgumentParser, site_help: str) -> None:
    p.add_argument("--site", help=site_help)
    p.add_argument("--config", help="the agent's config file (its listen.admin address)")
    p.add_argument("--admin", help="the agent's admin HOST:PORT (overrides --site and --config)")
    p.add_argument("--json", action="store_true", help="machine-readable output, no progress")


def tool_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdd-wire", description="pdd-wire operator tool")
    ap.add_argument("--version", action="version", version=f"pdd-wire {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("config", help="print the embedded default config of a site")
    c.add_argument("--site", required=True)
    st = sub.add_parser("status", help="which agent answers, its peers, engines and transfers (/v1/status)")
    _agent_args(st, "the agent's site (embedded default's admin address; checked against the answer)")
    pr = sub.add_parser("probe", help="measure the WAN path to a peer site through the running agents")
    pr.add_argument("--site", required=True, help="the peer site (or site/node) to probe")
    pr.add_argument("--from", dest="local", help="the local agent's site (embedded default: the other one)")
    pr.add_argument("--config", help="the local agent's config file (for its admin address)")
    pr.add_argument("--admin", help="the local agent's admin HOST:PORT (overrides --config)")
    pr.add_argument("--seconds", type=float, default=4.0, help="goodput time, split over 1 and N streams")
    pr.add_argument("--streams", type=int, help="bulk connections for the N-stream figure (default: all)")
    pr.add_argument("--json", action="store_true", help="one JSON object on stdout, no progress")
    ro = sub.add_parser("router", help="OpenAI-compatible front over vllm serve instances (docs/router.md)")
    ro.add_argument("--config", help="router TOML; without it, the embedded default")
    ro.add_argument("--check", action="store_true", help="validate the config and exit")
    ro.add_argument("--print-default", action="store_true", help="print the embedded default config")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "config":
            print(cfgmod.default_toml(args.site, for_file=True), end="")
            return 0
        if args.cmd == "status":
            if not (args.site or args.config or args.admin):
                st.error("name the agent: --site S (embedded default), --config FILE or --admin HOST:PORT")
            return _status(args)
        if args.cmd == "probe":
            return _probe(args)
        if args.cmd == "router":
            from .router.cli import main as router_main

            return router_main(args)
    except ConfigError as exc:
        print(f"pdd-wire: {exc}", file=sys.stderr)
        return 2
    except urllib.error.HTTPError as exc:
        print(f"pdd-wire: {exc.url}: HTTP {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # stdout's reader went away (`pdd-wire status --json | head`): quiet, as SIGPIPE would be
        # (stdout pointed at /dev/null so that the interpreter's own flush at exit says nothing).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:
        print(f"pdd-wire: {exc}", file=sys.stderr)
        return 1
    return 2
