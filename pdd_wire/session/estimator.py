"""A live estimate of one peer link, from real traffic and heartbeats. Pure: it is fed times
and byte counts.

* **bandwidth**: the delivery rate while the link is busy. Each KV acknowledgement is fed with
  the bytes it acknowledged and whether chunks are still in flight; over windows of at least
  ``window_s`` of busy time and ``min_acks`` acknowledgements, ``bytes acked / time`` is one
  sample, folded into an EWMA. Idle time never counts, so a lightly used link is not mistaken
  for a slow one.
* **RTT, jitter, loss**: from the control lane's PINGs: RTT is the median of the last 16
  answers, jitter the mean difference between consecutive ones, loss the share of the last 100
  PINGs not answered within ``max(1 s, 4 x RTT)``.

``predict(nbytes, queue)``: ``RTT + (queue + nbytes) / bandwidth`` (None while unknown).
"""

from __future__ import annotations

import collections
import statistics


class LinkEstimator:
    CLUMP_S = 0.005
    LATE_KEPT = 64  # PINGs counted lost whose PONG still gives a round trip

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
        self._late: dict[int, float] = {}  # the last LATE_KEPT counted lost, still timed if answered
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

    def pong(self, nonce: int, now: float) -> float | None:
        """The PONG for PING ``nonce`` came at ``now``: its round trip, timed by this side's own
        clock (one counted lost already still gives its round trip: a link slower than the loss
        limit must show in the RTT), or None for a PONG that answers no PING of this side's (a
        copy, or the peer's own numbers): it tells no round trip (the peer's echoed ``sent_ns``
        is not read, so a peer cannot set the RTT routing reads)."""
        sent = self._pings.pop(nonce, None)
        if sent is not None:
            self._outcomes.append(True)
        elif (sent := self._late.pop(nonce, None)) is None:
            return None
        rtt = now - sent
        self.rtts.append(rtt)
        return rtt

    def expire(self, now: float) -> None:
        limit = max(1.0, 4 * (self.rtt_s or 0.0))
        for nonce in [n for n, t in self._pings.items() if now - t > limit]:
            self._late[nonce] = self._pings.pop(nonce)
            self._outcomes.append(False)
        while len(self._late) > self.LATE_KEPT:
            self._late.pop(next(iter(self._late)))

    def link_down(self) -> None:
        """The connection went: PINGs in flight went with it (not counted as loss)."""
        self._pings.clear()
        self._late.clear()
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
