"""Link figures: a live estimate per peer (passive, from real traffic and heartbeats) and an
active probe (``pdd-wire probe``) that measures what KV will see, through the agents' own WAN
path.

:class:`LinkEstimator` is pure (it is fed times and byte counts):

* **bandwidth**: the delivery rate while the link is busy. Every acknowledgement of KV chunks
  is fed with the bytes it acknowledged and whether chunks are still in flight; over windows of
  at least ``window_s`` of busy time and ``min_acks`` acknowledgements, ``bytes acked / time``
  is one sample, folded into an EWMA.
  Idle time never counts, so a lightly used link is not mistaken for a slow one; a link limited
  by the credit window reads what KV gets through it.
* **RTT, jitter, loss**: from the control lane's PINGs (one per heartbeat, more while probing):
  RTT is the median of the last 16 answers, jitter the mean difference between consecutive
  ones, loss the share of the last 100 PINGs not answered within ``max(1 s, 4 x RTT)``.
* **queue**: KV bytes accepted for this peer and not yet acknowledged (given by the session).

``predict(nbytes, queue)``: how long ``nbytes`` to this peer would take now: ``RTT + (queue +
nbytes) / bandwidth`` (``None`` while the bandwidth is unknown).

The active probe sends *probe transfers* (request ids starting with :data:`PROBE_PREFIX`, which
engines cannot use) from a scratch region of random bytes, through the same credits, chunks,
checksums and bulk connections as KV, first over 1 bulk connection and then over all of them;
the receiving agent lands them in its own scratch region and drops them. RTT, jitter and loss
come from 50 PINGs sent 10 ms apart.
"""

from __future__ import annotations

import asyncio
import collections
import os
import statistics
import time
from typing import TYPE_CHECKING

from .engine import protocol as p
from .stats import percentile

if TYPE_CHECKING:
    from .session import PeerSession

PROBE_PREFIX = "\x00probe/"
PROBE_SCRATCH_BYTES = 64 << 20
PROBE_TRANSFER_BYTES = 16 << 20


class LinkEstimator:
    CLUMP_S = 0.005

    def __init__(self, *, window_s: float = 0.25, alpha: float = 0.3, min_acks: int = 4) -> None:
        self.window_s = window_s
        self.min_acks = min_acks
        self._acks = 0
        self.alpha = alpha
        self.bandwidth_Bps = 0.0
        self.samples = 0
        self._t0: float | None = None
        self._bytes = 0
        self.rtts: collections.deque[float] = collections.deque(maxlen=16)
        self._pings: dict[int, float] = {}  # nonce -> sent (monotonic)
        self._outcomes: collections.deque[bool] = collections.deque(maxlen=100)  # True = answered

    # -- bandwidth
    def on_ack(self, now: float, nbytes: int, busy: bool) -> None:
        """``nbytes`` of KV were acknowledged at ``now``; ``busy``: chunks are still in flight.

        Chunks striped over several connections finish in clumps; acks within ``CLUMP_S`` of
        the clock's start belong to the start (they were carried before it), and a sample
        needs ``min_acks`` acks, so a clump never counts twice into one window."""
        if self._t0 is None or (self._acks == 0 and now - self._t0 < self.CLUMP_S):
            if self._t0 is None:
                self._t0 = now  # the first ack of a busy spell starts the clock
            self._bytes, self._acks = 0, 0
        else:
            self._bytes += nbytes
            self._acks += 1
            dt = now - self._t0
            if dt >= self.window_s and self._acks >= self.min_acks:
                self.add_rate(self._bytes / dt)
                self._t0, self._bytes, self._acks = now, 0, 0
        if not busy:
            self._t0 = None  # idle from here: a partial window is dropped

    def add_rate(self, rate: float, weight: float | None = None) -> None:
        a = self.alpha if weight is None else weight
        self.bandwidth_Bps = rate if self.samples == 0 else (1 - a) * self.bandwidth_Bps + a * rate
        self.samples += 1

    # -- PINGs
    def ping_sent(self, nonce: int, now: float) -> None:
        self._pings[nonce] = now
        if len(self._pings) > 1000:  # never answered: counted lost by expire(); bound the table
            self._pings.pop(next(iter(self._pings)))

    def pong(self, nonce: int, rtt: float) -> None:
        if self._pings.pop(nonce, None) is not None:
            self._outcomes.append(True)
        self.rtts.append(rtt)

    def expire(self, now: float) -> None:
        limit = max(1.0, 4 * (self.rtt_s or 0.0))
        for nonce in [n for n, t in self._pings.items() if now - t > limit]:
            del self._pings[nonce]
            self._outcomes.append(False)

    def link_down(self) -> None:
        """The connection went: PINGs in flight went with it (not counted as loss)."""
        self._pings.clear()
        self._t0 = None

    @property
    def rtt_s(self) -> float | None:
        return statistics.median(self.rtts) if self.rtts else None

    @property
    def jitter_s(self) -> float:
        r = list(self.rtts)
        return statistics.fmean(abs(a - b) for a, b in zip(r, r[1:])) if len(r) > 1 else 0.0

    @property
    def loss(self) -> float:
        return self._outcomes.count(False) / len(self._outcomes) if self._outcomes else 0.0

    def predict(self, nbytes: int, queue_bytes: int, *, fallback_Bps: float = 0.0) -> float | None:
        """Seconds for ``nbytes`` behind ``queue_bytes``; ``fallback_Bps`` stands in for the
        bandwidth before any sample."""
        bw = self.bandwidth_Bps or fallback_Bps
        if bw <= 0:
            return None
        return (self.rtt_s or 0.0) + (queue_bytes + nbytes) / bw

    def describe(self, queue_bytes: int) -> dict:
        return {"bandwidth_Bps": round(self.bandwidth_Bps), "rtt_s": self.rtt_s, "jitter_s": self.jitter_s,
                "loss": self.loss, "queue_bytes": queue_bytes, "samples": self.samples}


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


async def run_probe(session: "PeerSession", blocks, sink: ProbeSink, *, seconds: float, streams: int | None,
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

    return {"peer": session.key, "data_path": "ucx" if session.over_ucx else "tcp",
            "rtt_ms": {"min": q(0), "p50": q(50), "p99": q(99)},
            "jitter_ms": round(statistics.fmean(abs(a - b) for a, b in zip(rtts, rtts[1:])) * 1e3, 3)
            if len(rtts) > 1 else 0.0,
            "loss": round(lost / pings, 4), "pings": pings,
            "goodput_Bps": {k: round(v) for k, v in goodput.items()},
            "goodput_Gbps": {k: round(v * 8 / 1e9, 4) for k, v in goodput.items()},
            "seconds": seconds, "streams": n_all}


async def _goodput(session: "PeerSession", blocks, sink: ProbeSink, seconds: float, streams: int,
                   warmup: float = 0.25, depth: int = 3) -> float:
    """Keep ``depth`` probe transfers in flight for ``warmup + seconds``. The figure is the
    delivery rate between the first and the last acknowledgement inside the last ``seconds``
    (after TCP's slow start): exact at chunk granularity, whatever the chunk size."""
    t0 = time.monotonic()
    inflight: set[asyncio.Future] = set()
    session.ack_log = collections.deque(maxlen=1 << 16)
    i = 0
    try:
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
        log = [(t, n) for t, n in session.ack_log if t0 + warmup <= t <= t0 + warmup + seconds]
        # Chunks striped over streams are acked in clumps: the bytes of the first clump were
        # carried before the window opened (LinkEstimator.CLUMP_S, as in the live estimate).
        while len(log) > 2 and log[1][0] - log[0][0] < LinkEstimator.CLUMP_S:
            log.pop(0)
    finally:
        session.ack_log = None
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
