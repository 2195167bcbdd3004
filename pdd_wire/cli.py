"""Command lines. Exit status: 0 ok, 1 runtime failure, 2 bad configuration or usage.

``pdd-wired --site A [--config FILE] [--node NAME]`` runs one agent.
``pdd-wire`` is the operator's tool: ``config``, ``status``, ``probe``. (The demo and the
benchmarks are tools, not product: ``pdd-tools demo|bench``, distribution ``pdd-wire-tools``.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import urllib.error
import urllib.request

from . import config as cfgmod
from .errors import ConfigError


def _load_config(args) -> cfgmod.Config:
    overrides = {"site": args.site, "node": getattr(args, "node", None)}
    if args.config:
        return cfgmod.load(args.config, overrides=overrides)
    return cfgmod.default_config(args.site, **{k: v for k, v in overrides.items() if v and k != "site"})


def daemon_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdd-wired", description="pdd-wire agent: one per serving node")
    ap.add_argument("--site", required=True, help="this node's site (datacenter), e.g. A")
    ap.add_argument("--config", help="TOML config file; without it, the embedded loopback default")
    ap.add_argument("--node", help="node name (overrides the config's)")
    ap.add_argument("--check", action="store_true", help="validate the config and exit")
    args = ap.parse_args(argv)
    try:
        cfg = _load_config(args)
    except ConfigError as exc:
        print(f"pdd-wired: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(f"pdd-wired: config OK (site {cfg.site}, node {cfg.node}, {len(cfg.peers)} peers)")
        return 0
    from . import log

    log.configure(cfg.log.level, cfg.log.format)
    import uvloop

    # Bulk threads hold the GIL only in short callbacks; a 1 ms switch interval (default 5 ms)
    # bounds how long the control loop can wait for it behind them.
    sys.setswitchinterval(0.001)
    try:
        return uvloop.run(_serve(cfg))
    except KeyboardInterrupt:
        return 0


async def _serve(cfg: cfgmod.Config) -> int:
    import structlog

    from .agent import Agent

    agent = Agent(cfg)
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
    await stop.wait()
    await agent.shutdown()
    return 0


def _probe(args) -> int:
    admin = args.admin
    if not admin:
        local = args.local
        if not local and not args.config:
            others = [s for s in cfgmod.DEFAULT_SITES if s != args.site.split("/")[0]]
            if len(others) != 1:
                raise ConfigError("--from", "name the local agent's site (or give --config / --admin)")
            local = others[0]
        admin = _load_config(argparse.Namespace(site=local or args.site, config=args.config, node=None)).listen.admin
    body = json.dumps({"peer": args.site, "seconds": args.seconds, "streams": args.streams}).encode()
    req = urllib.request.Request(f"http://{admin}/v1/probe", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=args.seconds + 60) as r:
            res = json.load(r)
    except urllib.error.HTTPError as exc:
        print(f"pdd-wire: probe refused: {exc.read().decode(errors='replace')}", file=sys.stderr)
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


def tool_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdd-wire", description="pdd-wire operator tool")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("config", help="print the embedded default config of a site")
    c.add_argument("--site", required=True)
    st = sub.add_parser("status", help="an agent's /v1/status")
    st.add_argument("--site", required=True)
    st.add_argument("--config")
    pr = sub.add_parser("probe", help="measure the WAN path to a peer site through the running agents")
    pr.add_argument("--site", required=True, help="the peer site (or site/node) to probe")
    pr.add_argument("--from", dest="local", help="the local agent's site (embedded default: the other one)")
    pr.add_argument("--config", help="the local agent's config file (for its admin address)")
    pr.add_argument("--admin", help="the local agent's admin HOST:PORT (overrides --config)")
    pr.add_argument("--seconds", type=float, default=4.0, help="goodput time, split over 1 and N streams")
    pr.add_argument("--streams", type=int, help="bulk connections for the N-stream figure (default: all)")
    pr.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "config":
            print(cfgmod.default_toml(args.site), end="")
            return 0
        if args.cmd == "status":
            cfg = _load_config(args)
            with urllib.request.urlopen(f"http://{cfg.listen.admin}/v1/status", timeout=5) as r:
                print(json.dumps(json.load(r), indent=2))
            return 0
        if args.cmd == "probe":
            return _probe(args)
    except ConfigError as exc:
        print(f"pdd-wire: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"pdd-wire: {exc}", file=sys.stderr)
        return 1
    return 2
