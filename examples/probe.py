"""Measure the WAN path between two agents, then ask the live estimate what an engine would.

With two agents running (``pdd-wired --site A`` and ``pdd-wired --site B``):

    python examples/probe.py                 # from A's agent to site B, 4 seconds
    python examples/probe.py --admin 10.0.0.5:7701 --peer B --socket /run/pdd-wire/pdd-wire-A.sock

1. ``GET /v1/status`` on the local agent's admin address: which agent this is.
2. ``POST /v1/probe``: 50 PINGs on the control lane (RTT, jitter, loss), then probe transfers
   over 1 and N bulk connections, through the same path KV takes (what ``pdd-wire probe`` does).
3. ``EngineClient.estimate``: how long 1 GiB of KV would take to the peer now, from the agent's
   live link estimate (the figure the pipeline choice uses).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.request

from pdd_wire import EngineClient
from pdd_wire.config import default_config, default_engine_socket


def http(admin: str, path: str, body: dict | None = None, timeout: float = 60) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{admin}{path}", data=data, method="POST" if data else "GET",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


async def estimate(socket: str, peer: str, nbytes: int) -> dict:
    async with EngineClient(socket, "probe-example") as eng:
        return await eng.estimate(peer, nbytes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--admin", default=default_config("A").listen.admin, help="the local agent's admin HOST:PORT")
    ap.add_argument("--socket", default=default_engine_socket("A"), help="the local agent's engine socket")
    ap.add_argument("--peer", default="B", help="the peer site (or site/node) to measure")
    ap.add_argument("--seconds", type=float, default=4.0, help="goodput time, split over 1 and N streams")
    args = ap.parse_args(argv)

    st = http(args.admin, "/v1/status")
    print(f"agent {st['site']}/{st['node']} (pid {st.get('pid')}) at {args.admin}; "
          f"peers: {', '.join(p['peer'] + (' up' if p['up'] else ' down') for p in st['peers'])}")
    print(f"probing {args.peer} for about {args.seconds + 0.5:.0f} s ...", flush=True)
    res = http(args.admin, "/v1/probe", {"peer": args.peer, "seconds": args.seconds, "streams": None},
               timeout=args.seconds + 60)
    rtt = res["rtt_ms"]
    print(f"rtt min {rtt['min']} ms, p50 {rtt['p50']} ms, p99 {rtt['p99']} ms; jitter {res['jitter_ms']} ms; "
          f"loss {res['loss'] * 100:.1f}%")
    for n, gbps in res["goodput_Gbps"].items():
        print(f"goodput over {n} stream(s): {gbps:.3f} Gbit/s")

    est = asyncio.run(estimate(args.socket, args.peer, 1 << 30))
    if est["seconds"] is None:  # no bandwidth measured on that link yet
        print(f"1 GiB of KV to {args.peer} now: unknown (the link has not been measured)")
    else:
        print(f"1 GiB of KV to {args.peer} now: {est['seconds']:.3f} s (bandwidth "
              f"{est['bandwidth_Bps'] / 1e9:.2f} GB/s, rtt {(est.get('rtt_s') or 0) * 1e3:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
