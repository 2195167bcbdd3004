"""``pdd-wire router [--config FILE] [--check] [--print-default]``: run the router until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys

from .. import log as logmod
from . import config as rcfg


def main(args) -> int:
    if args.print_default:
        print(rcfg.default_toml(), end="")
        return 0
    cfg = rcfg.load(args.config) if args.config else rcfg.default_config()  # ConfigError: exit 2 (caller)
    if args.check:
        print(f"pdd-wire router: config OK ({cfg.listen.address}; P {len(cfg.pools.P)}, "
              f"RLD {len(cfg.pools.RLD)}, MD {len(cfg.pools.MD)})")
        return 0
    logmod.configure(cfg.log.level, cfg.log.format)
    try:
        return asyncio.run(_serve(cfg))
    except KeyboardInterrupt:
        return 0


async def _serve(cfg: rcfg.RouterConfig) -> int:
    from .discovery import discovered
    from .server import Router

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    router = Router(cfg)
    try:
        await router.start()
    except OSError as exc:
        print(f"pdd-wire router: cannot listen on {cfg.listen.address}: {exc}", file=sys.stderr)
        return 1
    try:
        async with discovered(router, cfg.fleet):  # [fleet]: the pools follow etcd's membership
            await stop.wait()
    finally:
        await router.stop()
    return 0
