"""What one peer link is doing: the live estimate, finished transfers' goodput, and whether
chunks to it are worth compressing. Fed by the session; read by the policy and status pages."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .. import policy
from ..config import Config
from ..transport.bulk import Compression
from ..wire import FrameType
from ..wire import messages as m
from .estimator import LinkEstimator

if TYPE_CHECKING:
    from ..metrics import Metrics
    from ..transfer import OutTransfer


class LinkState:
    def __init__(self, cfg: Config, metrics: "Metrics", key: str, log: Any) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.key = key
        self.log = log
        self.est = LinkEstimator()
        self.rtt_s: float | None = None  # the last PING's round trip
        self.acked_bytes = 0  # KV bytes acknowledged by the peer, ever
        self.goodput_Bps = 0.0  # EWMA of finished transfers' goodput
        self.lz = Compression(shuffle=cfg.transfer.compress_shuffle)
        self.lz.on = cfg.transfer.compress == "on"
        self._ack_log: collections.deque[tuple[float, int]] | None = None  # while a probe records

    def pong(self, nonce: int, now: float) -> None:
        rtt = self.est.pong(nonce, now)
        if rtt is not None:
            self.rtt_s = rtt
            self.metrics.rtt_seconds.labels(peer=self.key).observe(rtt)

    def acks_landed(self, now: float, nbytes: int, *, busy: bool) -> None:
        self.acked_bytes += nbytes
        if self._ack_log is not None:
            self._ack_log.append((now, self.acked_bytes))
        self.est.on_ack(now, nbytes, busy=busy)

    @contextlib.contextmanager
    def acks_recorded(self, maxlen: int) -> Iterator[collections.deque[tuple[float, int]]]:
        self._ack_log = collections.deque(maxlen=maxlen)
        try:
            yield self._ack_log
        finally:
            self._ack_log = None

    def transfer_goodput(self, rate_Bps: float) -> None:
        self.goodput_Bps = rate_Bps if not self.goodput_Bps else 0.8 * self.goodput_Bps + 0.2 * rate_Bps

    def compression_for(self, t: "OutTransfer", remote_caps: frozenset[str] | None) -> Compression | None:
        if self.cfg.transfer.compress == "off" or "lz4.v1" not in (remote_caps or ()):
            return None
        return self.lz if t.compressible else None

    def decide_compression(self) -> None:
        """Each heartbeat: compress when it raises goodput on this link (transfer.compress)."""
        mode = self.cfg.transfer.compress
        lz = self.lz
        if mode != "auto":
            lz.on = mode == "on"
        else:
            bw = self.est.bandwidth_Bps or self.goodput_Bps
            if lz.on and lz.est.ratio:
                bw /= lz.est.ratio  # while compressing, KV delivered outruns the wire by the ratio
            was, lz.on = lz.on, bw > 0 and lz.est.decide(bw)
            if was != lz.on:
                self.log.info("lz4 compression " + ("on" if lz.on else "off"), link_Bps=round(bw),
                              ratio=round(lz.est.ratio or 0, 3), compress_Bps=round(lz.est.compress_Bps or 0))
        self.metrics.compression_on.labels(peer=self.key).set(1 if lz.on else 0)
        self.metrics.compression_ratio.labels(peer=self.key).set(lz.est.ratio or 0)
        self.metrics.compressed_chunks.labels(peer=self.key).set(lz.chunks)
        self.metrics.compression_saved.labels(peer=self.key).set(lz.saved)

    def figures(self, up: bool, queue_bytes: int) -> policy.LinkFigures:
        bw = self.est.bandwidth_Bps or self.goodput_Bps
        return policy.LinkFigures(bandwidth_Bps=bw if up else 0.0, queue_bytes=queue_bytes,
                                  rtt_s=self.est.rtt_s or self.rtt_s or 0.0)

    def predict(self, nbytes: int, queue_bytes: int) -> float | None:
        return self.est.predict(nbytes, queue_bytes, fallback_Bps=self.goodput_Bps)

    def describe(self, queue_bytes: int) -> dict:
        lz = self.lz
        return {"goodput_Bps": round(self.goodput_Bps), "link": self.est.describe(queue_bytes),
                "compression": {"mode": self.cfg.transfer.compress, "on": lz.on, "chunks": lz.chunks,
                                "bytes_saved": lz.saved, "ratio": lz.est.ratio, "compress_Bps": lz.est.compress_Bps},
                "rtt_ms": round(self.rtt_s * 1e3, 3) if self.rtt_s is not None else None}


class Pings:
    """PING and PONG on one session's control lane: each round trip feeds the link's estimate,
    and :meth:`ping` waits for one (the probes' RTT)."""

    def __init__(self, session: Any) -> None:  # its PeerSession (typed loosely: peer imports this module)
        self.s = session
        self._nonce = itertools.count(1)
        self._waiters: dict[int, asyncio.Future] = {}

    def send(self) -> int:
        nonce = next(self._nonce)
        if self.s.send_frame(FrameType.PING, m.Ping(nonce, time.monotonic_ns())):
            self.s.est.ping_sent(nonce, time.monotonic())
            self.s.outbox.ping_written(nonce)
        return nonce

    def pong(self, msg: m.Pong) -> None:
        now = time.monotonic()
        self.s.link.pong(msg.nonce, now)
        self.s.outbox.pong(msg.nonce)
        w = self._waiters.pop(msg.nonce, None)
        if w is not None and not w.done():
            w.set_result(now)

    async def ping(self, timeout: float = 1.0) -> float | None:
        """One PING; its round trip in seconds, or None if unanswered within ``timeout``."""
        fut = asyncio.get_running_loop().create_future()
        sent = time.monotonic()
        nonce = self.send()
        self._waiters[nonce] = fut
        try:
            async with asyncio.timeout(timeout):
                return await fut - sent
        except TimeoutError:
            return None
        finally:
            self._waiters.pop(nonce, None)
