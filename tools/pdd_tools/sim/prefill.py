"""The simulated prefill engine (:class:`PrefillSim`): prefills one request after another,
writes the KV into its pool and ships it with ``send_kv`` (one destination, or two at once: the
dual path to RLD and MD)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pdd_wire.engine import protocol as p
from pdd_wire.engine.client import EngineClient
from pdd_wire.errors import EngineRequestError

from .chip import GPU_A, KV_BYTES_PER_TOKEN, ChipProfile
from .engine import EventLoopEngine
from .kvpool import KvPool


@dataclass(eq=False)
class PrefillJob:
    """One prefill: ``tokens`` computed and shipped to ``to``; ``sent`` maps each destination
    (``site/node``) to the transfer's seconds as its agent measured them, ``failed`` to a reason."""

    request_id: str
    tokens: int
    to: list[str]
    submitted_at: float
    started_at: float | None = None  # got its blocks and the chip
    computed_at: float | None = None  # KV written, send_kv asked
    sent: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    done_at: float | None = None
    bytes: int = 0
    extents: list | None = None
    peers: list[str] | None = None
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class PrefillSim(EventLoopEngine):
    """Prefill engine: one request after another (FIFO) on a :class:`ChipProfile`; writes each
    request's KV (``tokens * kv_bytes_per_token`` bytes of incompressible data, each block
    stamped) into its pool and ships it with
    one ``send_kv`` to every destination at once; frees the blocks when every destination has
    its outcome. A full pool holds the queue (the KV has nowhere to go)."""

    def __init__(self, eng: EngineClient, pool: KvPool, chip: ChipProfile = GPU_A, *,
                 kv_bytes_per_token: int = KV_BYTES_PER_TOKEN, deadline_s: float | None = None) -> None:
        self.eng = eng
        self.pool = pool
        self.chip = chip
        self.kv_bytes_per_token = kv_bytes_per_token
        self.deadline_s = deadline_s
        self.jobs: dict[str, PrefillJob] = {}
        self.busy_s = 0.0
        self._queue: asyncio.Queue[PrefillJob] = asyncio.Queue()
        self._worker: asyncio.Task | None = None

    async def start(self) -> "PrefillSim":
        if self.pool.region is None:
            self.pool.fill_incompressible()  # what the prefill would write: KV, not zeros
            await self.pool.register(self.eng)
        self.start_events()
        self._worker = asyncio.create_task(self._work(), name="prefill-worker")
        return self

    async def close(self) -> None:
        await self.stop_tasks(self._worker)

    def submit(self, request_id: str, tokens: int, to: list[str]) -> PrefillJob:
        """Queue a prefill of ``tokens`` tokens whose KV goes to ``to`` (``["B/b1"]``, or the
        dual path ``["A/a2", "B/b1"]``). Await ``job.done`` for the outcome."""
        if request_id in self.jobs:
            raise ValueError(f"request {request_id!r} already submitted")
        job = PrefillJob(request_id, tokens, list(to), time.monotonic())
        self.jobs[request_id] = job
        self._queue.put_nowait(job)
        return job

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            job.bytes = job.tokens * self.kv_bytes_per_token
            job.extents = await self.pool.alloc(self.pool.blocks_for(job.bytes))
            job.started_at = time.monotonic()
            dt = self.chip.prefill_s(job.tokens)
            await asyncio.sleep(dt)
            self.busy_s += dt
            self.pool.stamp(job.request_id, job.extents)
            job.computed_at = time.monotonic()
            try:
                res = await self.eng.send_kv(job.request_id, job.extents, to=job.to, deadline_s=self.deadline_s)
            except EngineRequestError as exc:
                job.failed["*"] = f"send_kv: {exc}"
                self._finish(job)
                continue
            job.peers = [t["to"] for t in res]
            self._check(job)

    async def on_event(self, ev: p.Msg) -> None:
        job = self.jobs.get(getattr(ev, "request_id", None))
        if job is None:
            return
        if isinstance(ev, p.KvSent):
            job.sent[ev.peer] = ev.seconds
        elif isinstance(ev, p.TransferFailed):
            job.failed[ev.peer] = f"{ev.code}: {ev.reason}"
        else:
            return
        self._check(job)

    def _check(self, job: PrefillJob) -> None:
        if job.peers is not None and all(peer in job.sent or peer in job.failed for peer in job.peers):
            self._finish(job)

    def _finish(self, job: PrefillJob) -> None:
        if job.extents is not None:
            self.pool.release(job.extents)
            job.extents = None
        job.done_at = time.monotonic()
        self.jobs.pop(job.request_id, None)
        if not job.done.done():
            job.done.set_result(job)
