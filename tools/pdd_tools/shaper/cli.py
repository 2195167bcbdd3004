"""``python -m pdd_tools.shaper``: the shaper as a process (the demo runs it inside a network
namespace). Exit status: 0 on SIGTERM or SIGINT, 1 when the listen address cannot be bound, 2
on a bad argument (named)."""

from __future__ import annotations

import argparse
import asyncio
import math
import signal

import structlog

from .link import QUEUE_LIMIT, check_address
from .relay import Shaper

log = structlog.get_logger("pdd_tools.shaper")


def _endpoint(what: str, listen: bool = False):
    def parse(text: str) -> tuple[str, int]:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
        try:
            return check_address(host, int(port), what=what, listen=listen)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = "HOST:PORT"
    return parse


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {text}")
    return value


def _positive(text: str) -> float:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m pdd_tools.shaper",
        description="TCP relay adding one-way delay, jitter and a rate limit (loopback/private only)",
    )
    ap.add_argument("--listen", required=True, type=_endpoint("listen address", listen=True),
                    metavar="HOST:PORT", help="where to listen (port 0: any free port)")
    ap.add_argument("--target", required=True, type=_endpoint("target"), metavar="HOST:PORT",
                    help="where to connect for each accepted connection")
    ap.add_argument("--delay-ms", type=_non_negative, default=0.0, help="one-way delay, each direction")
    ap.add_argument("--jitter-ms", type=_non_negative, default=0.0, help="jitter around the delay")
    ap.add_argument("--jitter-dist", choices=("uniform", "normal"), default="uniform")
    ap.add_argument("--rate-mbit", type=_positive, help="rate limit, Mbit/s (10^6 bit/s), each direction")
    ap.add_argument("--queue-mib", type=_positive, default=QUEUE_LIMIT / (1 << 20),
                    help="delay queue bound per direction")
    ap.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return ap


async def _serve(args: argparse.Namespace) -> int:
    shaper = Shaper(
        args.listen,
        args.target,
        delay_ms=args.delay_ms,
        jitter_ms=args.jitter_ms,
        jitter_dist=args.jitter_dist,
        rate_Bps=args.rate_mbit * 1e6 / 8 if args.rate_mbit else None,
        queue_limit=int(args.queue_mib * (1 << 20)),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await shaper.start()
    except OSError as exc:
        log.error("cannot listen", listen=args.listen, error=str(exc))
        return 1
    host, port = shaper.address
    print(f"shaper listening on {host}:{port} -> {args.target[0]}:{args.target[1]}", flush=True)
    try:
        await stop.wait()
    finally:
        await shaper.close()
    s = shaper.stats
    log.info("shaper stopped", connections=s.connections, bytes_c2s=s.bytes_c2s, bytes_s2c=s.bytes_s2c)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from pdd_wire import log as logmod

    logmod.configure(args.log_level)
    import uvloop  # a dependency of pdd-wire

    return uvloop.run(_serve(args))
