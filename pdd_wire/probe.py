"""The active link probe (``pdd-wire probe``): it measures what KV will see, through the
agents' own WAN path. The live, passive estimate is :class:`~pdd_wire.session.estimator.LinkEstimator`.

The probe sends *probe transfers* (request ids starting with :data:`PROBE_PREFIX`, which
engines cannot use) from a scratch region of random bytes, through the same credits, chunks,
checksums and bulk connections as KV, first over 1 bulk connection and then over all of them;
the receiving agent lands them in its own scratch region and drops them. RTT, jitter and loss
come from 50 PINGs sent 10 ms apart.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

from .engine import protocol as p
from .session import PeerSession
from .session.estimator import LinkEstimator
from .stats import percentile

__all__ = ["PROBE_PREFIX", "PROBE_SCRATCH_BYTES", "PROBE_TRANSFER_BYTES", "LinkEstimator", "ProbeSink", "run_probe"]

PROBE_PREFIX = "\x00probe/"
PROBE_SCRATCH_BYTES = 64 << 20
PROBE_TRANSFER_BYTES = 16 << 20


class ProbeSink:
    """Stands in for an engine at both ends of probe transfers: it records the outcome."""

    name = "probe"
    closed = False
    closed_at = 0.0

    def __init__(self) -> None:
        self.waiters: dict[str, asyncio.Future] = {}

    def expect(self, request_id: str) -> asyncio.Future:
        fut = self.waiters[request_id] = asyncio.get_running_loop().create_future()
        return fut

    def send(self, msg) -> None:
        fut = self.waiters.pop(getattr(msg, "request_id", ""), None)
        if fut is not None and not fut.done():
            fut.set_result(msg)


async def run_probe(session: PeerSession, blocks, sink: ProbeSink, *, seconds: float, streams: int | None,
                    pings: int = 50) -> dict:
    """Measure the link to ``session``'s peer: RTT/jitter/loss from ``pings`` PINGs, then goodput
    over 1 bulk connection and over ``streams`` (default: all) for ``seconds / 2`` each."""
    rtts: list[float] = []
    lost = 0
    for _ in range(pings):
        rtt = await session.ping(timeout=1.0)
        if rtt is None:
            lost += 1
        else:
            rtts.append(rtt)
        await asyncio.sleep(0.01)
    n_all = max(1, min(streams or session.streams, session.streams))
    goodput = {}
    for n in sorted({1, n_all}):
        goodput[str(n)] = await _goodput(session, blocks, sink, seconds / 2, n)
    session.est.add_rate(goodput[str(n_all)], weight=0.5)  # an active measurement counts double
    def q(pc: float) -> float | None:
        v = percentile(rtts, pc)
        return None if v is None else round(v * 1e3, 3)

    return {"peer": session.key, "data_path": session.data.active,
            "rtt_ms": {"min": q(0), "p50": q(50), "p99": q(99)},
            "jitter_ms": round(statistics.fmean(abs(a - b) for a, b in zip(rtts, rtts[1:])) * 1e3, 3)
            if len(rtts) > 1 else 0.0,
            "loss": round(lost / pings, 4), "pings": pings,
            "goodput_Bps": {k: round(v) for k, v in goodput.items()},
            "goodput_Gbps": {k: round(v * 8 / 1e9, 4) for k, v in goodput.items()},
            "seconds": seconds, "streams": n_all}


async def _goodput(session: PeerSession, blocks, sink: ProbeSink, seconds: float, streams: int,
                   warmup: float = 0.25, depth: int = 3) -> float:
    """Keep ``depth`` probe transfers in flight for ``warmup + seconds``. The figure is the
    delivery rate between the first and the last acknowledgement inside the last ``seconds``
    (after TCP's slow start): exact at chunk granularity, whatever the chunk size."""
    t0 = time.monotonic()
    inflight: set[asyncio.Future] = set()
    i = 0
    with session.link.acks_recorded(1 << 16) as acks:
        while time.monotonic() - t0 < warmup + seconds:
            while len(inflight) < depth:
                rid = f"{PROBE_PREFIX}{os.getpid()}-{time.monotonic_ns()}-{i}"
                i += 1
                fut = sink.expect(rid)
                t = session.start_send(sink, rid, blocks, deadline_s=max(30.0, 4 * seconds))
                t.streams_limit = streams
                t.compressible = False
                inflight.add(fut)
            left = max(0.001, t0 + warmup + seconds - time.monotonic())
            done, inflight = await asyncio.wait(inflight, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            _check(done)
    log = [(t, n) for t, n in acks if t0 + warmup <= t <= t0 + warmup + seconds]
    # Chunks striped over streams are acked in clumps: the bytes of the first clump were
    # carried before the window opened (LinkEstimator.CLUMP_S, as in the live estimate).
    while len(log) > 2 and log[1][0] - log[0][0] < LinkEstimator.CLUMP_S:
        log.pop(0)
    if inflight:
        _check((await asyncio.wait(inflight))[0])
    if len(log) < 2 or log[-1][0] <= log[0][0]:
        raise RuntimeError(f"too few acknowledgements in {seconds} s to measure (link down, or too slow for "
                           f"{blocks.total >> 20} MiB probe transfers)")
    return (log[-1][1] - log[0][1]) / (log[-1][0] - log[0][0])


def _check(done) -> None:
    for fut in done:
        ev = fut.result()
        if not isinstance(ev, p.KvSent):
            raise RuntimeError(f"probe transfer failed: {getattr(ev, 'reason', ev)}")
