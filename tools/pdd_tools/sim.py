"""Simulated engines: no model, a deterministic token stream, real agents, real bytes.

:func:`token_at` plays the model: every engine that decodes request ``r`` produces the same
token at position ``i`` (as greedy decoding of one model does), so a test can check the stream a
user would see (:func:`check_stream`).

One request at a time, for the handoff tests and ``pdd-tools bench`` (group ``handoff``):
:class:`RldSim` decodes from position 0 and hands the output over; :class:`MdSim` absorbs
relayed tokens with simulated extend steps and takes over. Both emit only what their agent's
``emit`` events allow, and record it: ``emitted`` maps position to token. Timing: a decode step
takes ``step_s``; an extend of ``n`` tokens takes ``extend_s + n * extend_per_token_s``.

Many requests at once, for replaying a trace (``pdd_tools.demo``):

* :class:`ChipProfile`, the cost model: prefill at ``prefill_tokens_per_s`` (compute bound),
  a decode step of a batch of ``B`` sequences in ``step_base_s + B * step_per_seq_s`` (memory
  bound: the weights once, each sequence's KV), extends mixed into the step at the prefill
  rate. :data:`GPU_A` (prefill and relay decode) and :data:`GPU_B` (main decode) differ.
* :class:`KvPool`: an engine's KV memory, one :class:`~pdd_wire.memory.SharedMemory` region
  registered with its agent, handed out in blocks of ``block_tokens * kv_bytes_per_token``
  bytes; every block carries a stamp (request, index) that the receiver checks.
* :class:`PrefillSim`: prefills one request after another, writes the KV into its pool and
  ships it with ``send_kv`` (one destination, or two at once: the dual path to RLD and MD).
* :class:`DecodeSim`: a continuous-batching decoder serving many requests, as RLD (site A) or
  MD (site B): posts each request's receive, admits it once the KV is in (its position 0 is the
  prefill's token and is emitted then), steps the batch, reports its load with ``set_load``,
  and for handed-off requests drives the handoff (``handoff_rld`` / ``handoff_md``, extends
  mixed into its steps, ``handoff_tokens``), emitting only what ``emit`` events allow.

Prefix reuse: the trace says how much of each prompt MD's prefix cache holds, and the
simulated prefill ships only the missing suffix's blocks. That stands in for the decode-side
prefix inventory (:mod:`pdd_wire.desk.inventory`, ``send_kv(block_hashes=...)``), with which the agents
work the suffix out themselves; the demo does not use it, since MD would have to keep every
conversation's prefix resident.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import math
import os
import struct
import time
import zlib
from dataclasses import dataclass, field

from pdd_wire.errors import EngineRequestError
from pdd_wire.memory import SharedMemory
from pdd_wire.engine import protocol as p
from pdd_wire.engine.client import EngineClient, RegionHandle

HANDOFF_EVENTS = (p.Emit, p.Extend, p.StopGenerating, p.StartGenerating, p.HandoffDone)


def token_at(request_id: str, position: int, vocab: int = 32000) -> int:
    """The token a (simulated, greedy) model produces for ``request_id`` at ``position``."""
    h = hashlib.blake2b(f"{request_id}:{position}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") % vocab


class _Sim:
    def __init__(self, eng: EngineClient, request_id: str, n_tokens: int) -> None:
        if n_tokens < 1:
            raise ValueError("n_tokens must be >= 1")
        self.eng = eng
        self.rid = request_id
        self.n = n_tokens
        self.emitted: dict[int, int] = {}
        self.done: p.HandoffDone | None = None
        self.done_at: float | None = None
        self.events: list[str] = []

    async def _next(self, timeout: float | None) -> p.Msg:
        return await self.eng.wait(self.rid, kinds=HANDOFF_EVENTS, timeout=timeout)

    def _take(self) -> list[p.Msg]:
        return self.eng.take(self.rid, kinds=HANDOFF_EVENTS)

    def _on_emit(self, ev: p.Emit) -> None:
        for i, tok in enumerate(ev.tokens):
            pos = ev.first + i
            if pos in self.emitted:
                raise AssertionError(f"{self.rid}: position {pos} emitted twice on one side")
            self.emitted[pos] = tok

    def _on_done(self, ev: p.HandoffDone) -> None:
        self.done = ev
        self.done_at = time.monotonic()
        self.events.append(f"done:{ev.owner}:{ev.reason}")


class RldSim(_Sim):
    """Relay decode for one request: decodes ``n_tokens`` tokens from position 0, reporting
    each; stops and resumes as told. ``hold_at``: generate that many tokens, then wait for
    :meth:`release_hold` (to make MD exactly that far behind in a test or benchmark);
    ``burst_to_hold``: those first tokens take no step time."""

    def __init__(self, eng: EngineClient, request_id: str, md: str, *, n_tokens: int, step_s: float = 0.0,
                 epoch: int = 0, deadline_s: float | None = None, hold_at: int | None = None,
                 burst_to_hold: bool = False) -> None:
        super().__init__(eng, request_id, n_tokens)
        self.md = md
        self.step_s = step_s
        self.epoch = epoch
        self.deadline_s = deadline_s
        self.generated = 0
        self.generating = True
        self.hold_at = hold_at
        self.burst_to_hold = burst_to_hold  # the tokens before hold_at come at once (no step time)
        self.held = asyncio.Event()
        self._go = asyncio.Event()

    def release_hold(self) -> None:
        self._go.set()

    async def run(self, timeout: float = 60) -> "RldSim":
        async with asyncio.timeout(timeout):
            await self.eng.handoff_rld(self.rid, self.md, epoch=self.epoch, deadline_s=self.deadline_s)
            while True:
                for ev in self._take():
                    self._handle(ev)
                if self.done is not None and (self.done.owner == "MD" or self.generated == self.n):
                    return self
                if self.generating and self.generated < self.n:
                    if self.hold_at is not None and self.generated == self.hold_at and not self._go.is_set():
                        self.held.set()
                        await self._go.wait()
                        continue
                    burst = self.burst_to_hold and self.hold_at is not None and self.generated < self.hold_at
                    if self.step_s and not burst:
                        await asyncio.sleep(self.step_s)
                    pos = self.generated
                    self.generated += 1
                    await self.eng.handoff_tokens(self.rid, [token_at(self.rid, pos)], last=pos == self.n - 1)
                else:
                    self._handle(await self._next(None))

    def _handle(self, ev: p.Msg) -> None:
        if isinstance(ev, p.Emit):
            self._on_emit(ev)
        elif isinstance(ev, p.StopGenerating):
            self.generating = False
            self.events.append(f"stop@{self.generated}")
        elif isinstance(ev, p.StartGenerating):
            # Tokens of a step that was running when RLD was told to stop may already be
            # reported (the agent counts them once they arrive): resume after them.
            if ev.position > self.generated:
                raise AssertionError(f"{self.rid}: resume at {ev.position}, RLD generated {self.generated}")
            self.generating = True
            self.events.append(f"resume@{ev.position}")
        elif isinstance(ev, p.HandoffDone):
            self._on_done(ev)


class MdSim(_Sim):
    """Main decode for one request: absorbs relayed tokens with simulated extends, then decodes
    from the commit position to ``n_tokens``. ``fail_after_extends``: report a failure
    (``handoff_fail``) after that many extends instead of going on."""

    def __init__(self, eng: EngineClient, request_id: str, rld: str, *, n_tokens: int, step_s: float = 0.0,
                 extend_s: float = 0.0, extend_per_token_s: float = 0.0, epoch: int = 0,
                 deadline_s: float | None = None, fail_after_extends: int | None = None) -> None:
        super().__init__(eng, request_id, n_tokens)
        self.rld = rld
        self.step_s = step_s
        self.extend_s = extend_s
        self.extend_per_token_s = extend_per_token_s
        self.epoch = epoch
        self.deadline_s = deadline_s
        self.fail_after_extends = fail_after_extends
        self.extends: list[tuple[int, int]] = []  # (first, count)
        self.absorbed: list[int] = []
        self.first_extend_at: float | None = None  # ~ when MD was ready (the KV arrived)
        self.started_at: float | None = None  # StartGenerating: ownership passed
        self.position: int | None = None

    async def start(self) -> None:
        await self.eng.handoff_md(self.rid, self.rld, epoch=self.epoch, deadline_s=self.deadline_s)

    async def run(self, timeout: float = 60) -> "MdSim":
        """Call :meth:`start` first (before the KV can arrive, as an engine posting a receive does)."""
        async with asyncio.timeout(timeout):
            while True:
                ev = await self._next(None)
                if isinstance(ev, p.Extend):
                    if self.first_extend_at is None:
                        self.first_extend_at = time.monotonic()
                    if ev.first != len(self.absorbed):
                        raise AssertionError(f"{self.rid}: extend from {ev.first}, absorbed {len(self.absorbed)}")
                    expect = [token_at(self.rid, ev.first + i) for i in range(len(ev.tokens))]
                    if ev.tokens != expect:
                        raise AssertionError(f"{self.rid}: relayed tokens differ from the model's")
                    self.extends.append((ev.first, len(ev.tokens)))
                    if self.fail_after_extends is not None and len(self.extends) > self.fail_after_extends:
                        await self.eng.handoff_fail(self.rid, "simulated_failure")
                        continue
                    cost = self.extend_s + self.extend_per_token_s * len(ev.tokens)
                    if cost:
                        await asyncio.sleep(cost)
                    self.absorbed.extend(ev.tokens)
                    await self.eng.handoff_extended(self.rid, len(self.absorbed))
                elif isinstance(ev, p.StartGenerating):
                    self.started_at = time.monotonic()
                    self.position = ev.position
                    self.events.append(f"start@{ev.position}")
                    await self._decode(ev.position)
                    return self
                elif isinstance(ev, p.HandoffDone):
                    self._on_done(ev)
                    if ev.owner == "RLD":
                        return self
                elif isinstance(ev, p.Emit):
                    self._on_emit(ev)

    async def _decode(self, position: int) -> None:
        for pos in range(position, self.n):
            if self.step_s:
                await asyncio.sleep(self.step_s)
            await self.eng.handoff_tokens(self.rid, [token_at(self.rid, pos)], last=pos == self.n - 1)
            for ev in self._take():
                if isinstance(ev, p.Emit):
                    self._on_emit(ev)
                elif isinstance(ev, p.HandoffDone):
                    self._on_done(ev)
        for ev in self._take():
            if isinstance(ev, p.Emit):
                self._on_emit(ev)
            elif isinstance(ev, p.HandoffDone):
                self._on_done(ev)


def check_stream(request_id: str, n_tokens: int, *sides: dict[int, int]) -> None:
    """The ownership invariant over what the engines emitted: every position 0..n-1 emitted by
    exactly one side, with the model's token, and each side's positions contiguous."""
    seen: dict[int, int] = {}
    for side in sides:
        for pos, tok in side.items():
            if pos in seen:
                raise AssertionError(f"{request_id}: position {pos} emitted twice")
            seen[pos] = tok
        if side and sorted(side) != list(range(min(side), max(side) + 1)):
            raise AssertionError(f"{request_id}: one side's positions have a gap: {sorted(side)}")
    missing = [i for i in range(n_tokens) if i not in seen]
    if missing:
        raise AssertionError(f"{request_id}: positions never emitted: {missing[:10]} ({len(missing)})")
    extra = [i for i in seen if i >= n_tokens]
    if extra:
        raise AssertionError(f"{request_id}: positions past the end emitted: {extra[:10]}")
    wrong = [i for i in range(n_tokens) if seen[i] != token_at(request_id, i)]
    if wrong:
        raise AssertionError(f"{request_id}: wrong tokens at {wrong[:10]}")


# ================================================================== many requests: the cost model
@dataclass(frozen=True)
class ChipProfile:
    """How fast one simulated chip prefills and decodes.

    * prefill (and extend) is compute bound: ``prefill_overhead_s + tokens / prefill_tokens_per_s``;
    * a decode step of ``B`` sequences is memory bound: ``step_base_s + B * step_per_seq_s`` (the
      weights are read once per step, each sequence's KV once); an extend of ``n`` relayed tokens
      is mixed into a step and adds ``n / prefill_tokens_per_s``;
    * ``max_batch`` sequences decode at once; the load an engine reports is
      ``(running + waiting) / max_batch``.
    """

    name: str
    prefill_tokens_per_s: float
    step_base_s: float
    step_per_seq_s: float
    max_batch: int
    prefill_overhead_s: float = 0.005

    def __post_init__(self) -> None:
        for key in ("prefill_tokens_per_s", "step_base_s"):
            v = getattr(self, key)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{key} must be > 0, got {v}")
        if not (self.step_per_seq_s >= 0 and self.prefill_overhead_s >= 0):
            raise ValueError("step_per_seq_s and prefill_overhead_s must be >= 0")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")

    def prefill_s(self, tokens: int) -> float:
        """Time to prefill ``tokens`` prompt tokens (the ones not in the prefix cache)."""
        return self.prefill_overhead_s + max(0, tokens) / self.prefill_tokens_per_s

    def extend_s(self, tokens: int) -> float:
        """What an extend of ``tokens`` relayed tokens adds to the decode step it rides in."""
        return max(0, tokens) / self.prefill_tokens_per_s

    def step_s(self, batch: int, extend_tokens: int = 0) -> float:
        """One decode step of ``batch`` sequences carrying extends of ``extend_tokens`` tokens."""
        if batch <= 0 and extend_tokens <= 0:
            return 0.0
        return self.step_base_s + self.step_per_seq_s * max(0, batch) + self.extend_s(extend_tokens)

    def decode_tokens_per_s(self, batch: int) -> float:
        """Output tokens per second of the whole chip at batch size ``batch``."""
        return batch / self.step_s(batch) if batch > 0 else 0.0


# Scaled like the demo's trace and link (pdd_tools.trace): illustrative, not measured. GPU-A runs
# prefill (P) and relay decode (RLD, a small pool); GPU-B, main decode (MD), has half the
# compute but reads memory faster per sequence and holds a bigger batch.
GPU_A = ChipProfile("GPU-A", prefill_tokens_per_s=40_000, step_base_s=0.025, step_per_seq_s=0.0005,
                    max_batch=16, prefill_overhead_s=0.010)
GPU_B = ChipProfile("GPU-B", prefill_tokens_per_s=20_000, step_base_s=0.020, step_per_seq_s=0.00025,
                    max_batch=128, prefill_overhead_s=0.005)

# KV per token: PDD's 1T-class model has 10-80 KB (about 50 KB typical) on a 10-100 Gbps line;
# the demo's link is about 100x narrower and its prompts 3-4x shorter, so 4 KiB per token keeps
# a long prompt's KV crossing in seconds, as PDD's 1-20 s. A block holds BLOCK_TOKENS tokens.
KV_BYTES_PER_TOKEN = 4096
BLOCK_TOKENS = 16

_STAMP = struct.Struct("<IIQ")  # crc32(request id), block index in the request, magic
_MAGIC = 0x5044_442D_5349_4D4B


def _now() -> float:
    return time.monotonic()


class KvPool:
    """A simulated engine's KV memory: one shared-memory region registered with its agent,
    handed out in blocks (first fit, several extents when fragmented; waiters served in order).

    :meth:`stamp` writes (request, block index) at the start of each block of a request's KV;
    :meth:`verify` counts the blocks of a received request whose stamp is wrong."""

    def __init__(self, size: int, block_bytes: int, name: str = "pdd-sim-kv") -> None:
        if block_bytes < _STAMP.size:
            raise ValueError(f"block_bytes must be >= {_STAMP.size}")
        self.block_bytes = block_bytes
        self.n_blocks = size // block_bytes
        if self.n_blocks < 1:
            raise ValueError(f"a pool of {size} bytes holds no block of {block_bytes}")
        self.mem = SharedMemory(self.n_blocks * block_bytes, name)
        self.region: RegionHandle | None = None
        self._free: list[list[int]] = [[0, self.n_blocks]]  # [start, count], by start
        self.free_blocks = self.n_blocks
        self.peak_used = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    async def register(self, eng: EngineClient) -> RegionHandle:
        self.region = await eng.register(self.mem, block_bytes=self.block_bytes, name="sim-kv")
        return self.region

    def fill_incompressible(self, seed_bytes: bytes | None = None) -> None:
        """Fill the pool with bytes that look like KV to a compressor: real fp16 KV is about
        1.0x under lz4, while the zeros of fresh memory would shrink a thousandfold and make
        the WAN leg vanish. A 1 MiB random pattern, tiled (lz4 looks back 64 KiB at most)."""
        pattern = seed_bytes or os.urandom(1 << 20)
        buf, n, step = self.mem.buf, self.mem.size, len(pattern)
        for off in range(0, n, step):
            k = min(step, n - off)
            buf[off:off + k] = pattern[:k]

    def blocks_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.block_bytes))

    def try_alloc(self, n: int) -> list[tuple[int, int, int]] | None:
        """``n`` blocks as extents, or None when fewer are free."""
        if self.region is None:
            raise RuntimeError("register the pool first")
        if n < 1 or n > self.free_blocks:
            return None if n >= 1 else []
        taken: list[tuple[int, int]] = []
        for i, (start, count) in enumerate(self._free):
            if count >= n:  # first fit, one piece
                taken = [(start, n)]
                if count == n:
                    del self._free[i]
                else:
                    self._free[i] = [start + n, count - n]
                break
        else:  # fragmented: pieces in address order
            need = n
            while need:
                start, count = self._free[0]
                k = min(count, need)
                taken.append((start, k))
                need -= k
                if k == count:
                    del self._free[0]
                else:
                    self._free[0] = [start + k, count - k]
        self.free_blocks -= n
        self.peak_used = max(self.peak_used, self.n_blocks - self.free_blocks)
        return [(self.region.region, s, c) for s, c in taken]

    async def alloc(self, n: int) -> list[tuple[int, int, int]]:
        """``n`` blocks, waiting (in order of asking) until that many are free."""
        if n > self.n_blocks:
            raise ValueError(f"{n} blocks asked of a pool of {self.n_blocks}")
        if not self._waiters:
            got = self.try_alloc(n)
            if got is not None:
                return got
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        return await fut

    def release(self, extents: list[tuple[int, int, int]]) -> None:
        for _, start, count in extents:
            self._insert(start, count)
            self.free_blocks += count
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            got = self.try_alloc(n)
            if got is None:
                break
            self._waiters.popleft()
            fut.set_result(got)

    def _insert(self, start: int, count: int) -> None:
        lo, hi = 0, len(self._free)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._free[mid][0] < start:
                lo = mid + 1
            else:
                hi = mid
        self._free.insert(lo, [start, count])
        if lo + 1 < len(self._free) and start + count == self._free[lo + 1][0]:  # merge right
            self._free[lo][1] += self._free[lo + 1][1]
            del self._free[lo + 1]
        if lo > 0 and self._free[lo - 1][0] + self._free[lo - 1][1] == start:  # merge left
            self._free[lo - 1][1] += self._free[lo][1]
            del self._free[lo]

    def _blocks(self, extents):
        for _, start, count in extents:
            yield from range(start, start + count)

    def stamp(self, request_id: str, extents: list[tuple[int, int, int]]) -> None:
        key = zlib.crc32(request_id.encode())
        buf, bb = self.mem.buf, self.block_bytes
        for i, b in enumerate(self._blocks(extents)):
            _STAMP.pack_into(buf, b * bb, key, i, _MAGIC)

    def verify(self, request_id: str, extents: list[tuple[int, int, int]]) -> int:
        key = zlib.crc32(request_id.encode())
        buf, bb = self.mem.buf, self.block_bytes
        return sum(_STAMP.unpack_from(buf, b * bb) != (key, i, _MAGIC)
                   for i, b in enumerate(self._blocks(extents)))

    def close(self) -> None:
        self.mem.close()


class _EventLoopEngine:
    """One task takes every event of the engine connection and hands it to :meth:`_on_event`
    (O(1) per event, whatever the number of requests in flight)."""

    eng: EngineClient

    def _start_events(self) -> None:
        # Public: it ends when the engine connection does (the demo watches it).
        self.events_task = asyncio.create_task(self._event_loop(), name=f"{type(self).__name__}-events")
        self.errors: list[str] = []

    async def _event_loop(self) -> None:
        while True:
            ev = await self.eng.next_event()
            try:
                await self._on_event(ev)
            except (EngineRequestError, AssertionError) as exc:
                self.errors.append(f"{type(ev).__name__} {getattr(ev, 'request_id', '')}: {exc}")

    async def _on_event(self, ev: p.Msg) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    async def _stop_tasks(self, *tasks: asyncio.Task | None) -> None:
        live = [t for t in (*tasks, getattr(self, "events_task", None)) if t is not None]
        for t in live:
            t.cancel()
        await asyncio.gather(*live, return_exceptions=True)


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


class PrefillSim(_EventLoopEngine):
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
        self._start_events()
        self._worker = asyncio.create_task(self._work(), name="prefill-worker")
        return self

    async def close(self) -> None:
        await self._stop_tasks(self._worker)

    def submit(self, request_id: str, tokens: int, to: list[str]) -> PrefillJob:
        """Queue a prefill of ``tokens`` tokens whose KV goes to ``to`` (``["B/b1"]``, or the
        dual path ``["A/a2", "B/b1"]``). Await ``job.done`` for the outcome."""
        if request_id in self.jobs:
            raise ValueError(f"request {request_id!r} already submitted")
        job = PrefillJob(request_id, tokens, list(to), _now())
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
            job.started_at = _now()
            dt = self.chip.prefill_s(job.tokens)
            await asyncio.sleep(dt)
            self.busy_s += dt
            self.pool.stamp(job.request_id, job.extents)
            job.computed_at = _now()
            try:
                res = await self.eng.send_kv(job.request_id, job.extents, to=job.to, deadline_s=self.deadline_s)
            except EngineRequestError as exc:
                job.failed["*"] = f"send_kv: {exc}"
                self._finish(job)
                continue
            job.peers = [t["to"] for t in res]
            self._check(job)

    async def _on_event(self, ev: p.Msg) -> None:
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
        job.done_at = _now()
        self.jobs.pop(job.request_id, None)
        if not job.done.done():
            job.done.set_result(job)


@dataclass(eq=False)
class Seq:
    """One request on a :class:`DecodeSim`. ``emitted`` maps each position this engine was
    allowed to emit (by its agent's ``emit`` events, or by itself when not in a handoff) to the
    token; ``first_at`` is when position 0 was emitted here (None if the other side did)."""

    request_id: str
    n: int
    kv_tokens: int
    handoff: bool
    submitted_at: float
    extents: list | None = None
    started: bool = False  # posted (and the handoff opened)
    kv_at: float | None = None
    admitted_at: float | None = None
    first_at: float | None = None
    emitted: dict[int, int] = field(default_factory=dict)
    next: int = 0  # the next position this engine generates
    generated: int = 0  # tokens generated here (position 0 comes from prefill and is not counted)
    generating: bool = True
    extends: int = 0
    extend_tokens: int = 0
    done: p.HandoffDone | None = None
    bad_blocks: int = 0
    error: str | None = None
    soft_errors: list[str] = field(default_factory=list)
    finished_at: float | None = None
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class DecodeSim(_EventLoopEngine):
    """A continuous-batching decode engine on a :class:`ChipProfile`, serving many requests.

    ``role`` is ``"RLD"`` (relay decode, site A) or ``"MD"`` (main decode, site B); ``peer`` is
    the other decoder for handoffs (RLD: MD's ``"B/b1"``; MD: RLD's ``"A/a2"``); ``kv_from`` the
    site its KV comes from. :meth:`submit` posts a request's receive (and opens its handoff
    with ``handoff=True``). Without a handoff the engine decodes the request alone and emits
    every position itself. In a handoff, RLD reports each token with ``handoff_tokens`` and
    emits what ``emit`` events allow; MD absorbs relayed tokens with extends mixed into its
    steps and decodes from ``start_generating``. ``seq.result`` resolves when this engine has
    nothing more to emit for the request.
    """

    def __init__(self, eng: EngineClient, pool: KvPool, chip: ChipProfile, *, role: str, peer: str | None = None,
                 kv_from: str | None = "A", kv_bytes_per_token: int = KV_BYTES_PER_TOKEN,
                 handoff_deadline_s: float | None = None) -> None:
        if role not in ("RLD", "MD"):
            raise ValueError(f"role must be 'RLD' or 'MD', not {role!r}")
        self.eng = eng
        self.pool = pool
        self.chip = chip
        self.role = role
        self.peer = peer
        self.kv_from = kv_from
        self.kv_bytes_per_token = kv_bytes_per_token
        self.handoff_deadline_s = handoff_deadline_s
        self.seqs: dict[str, Seq] = {}
        self._running: dict[str, Seq] = {}  # insertion ordered: the batch
        self._waiting: collections.deque[Seq] = collections.deque()
        self._extends: list[tuple[Seq, int, list[int]]] = []
        self._wake = asyncio.Event()
        self._steps_task: asyncio.Task | None = None
        self._load = -1.0
        self.load_reports = 0
        self.steps = 0
        self.batch_sum = 0
        self.max_batch_seen = 0
        self.busy_s = 0.0
        self.tokens_generated = 0

    async def start(self) -> "DecodeSim":
        if self.pool.region is None:
            await self.pool.register(self.eng)
        self._start_events()
        self._steps_task = asyncio.create_task(self._steps(), name=f"{self.role}-steps")
        await self._report_load()
        return self

    async def close(self) -> None:
        await self._stop_tasks(self._steps_task)

    @property
    def load(self) -> float:
        return (len(self._running) + len(self._waiting)) / self.chip.max_batch

    async def submit(self, request_id: str, n_tokens: int, kv_tokens: int, *, handoff: bool = False) -> Seq:
        """Post the receive of the request's KV (``kv_tokens`` tokens' worth) and, with
        ``handoff``, open its handoff. Returns the :class:`Seq`; await ``seq.result``."""
        if n_tokens < 1:
            raise ValueError("n_tokens must be >= 1")
        if handoff and self.peer is None:
            raise ValueError("a handoff needs the peer decoder (peer=...)")
        if request_id in self.seqs:
            raise ValueError(f"request {request_id!r} already submitted")
        seq = Seq(request_id, n_tokens, kv_tokens, handoff, _now())
        self.seqs[request_id] = seq
        seq.extents = await self.pool.alloc(self.pool.blocks_for(kv_tokens * self.kv_bytes_per_token))
        try:
            await self.eng.post_recv(request_id, seq.extents, from_site=self.kv_from)
            if handoff and self.role == "RLD":
                await self.eng.handoff_rld(request_id, self.peer, deadline_s=self.handoff_deadline_s)
            elif handoff:
                await self.eng.handoff_md(request_id, self.peer, deadline_s=self.handoff_deadline_s)
        except EngineRequestError as exc:
            seq.error = f"submit: {exc}"
            await self.eng.abort(request_id, "submit failed")  # the agent drops the post first
            self._finish(seq)  # then the blocks may go to another request
            return seq
        seq.started = True
        if seq.kv_at is not None and not (handoff and self.role == "MD"):
            self._waiting.append(seq)
            await self._admit()
        return seq

    # ------------------------------------------------------------------ events
    async def _on_event(self, ev: p.Msg) -> None:
        seq = self.seqs.get(getattr(ev, "request_id", None))
        if seq is None:
            return
        if isinstance(ev, p.KvReceived):
            seq.kv_at = _now()
            if seq.extents is not None:
                seq.bad_blocks = self.pool.verify(seq.request_id, seq.extents)
                self.pool.release(seq.extents)
                seq.extents = None
            if seq.bad_blocks:
                seq.error = f"{seq.bad_blocks} KV blocks arrived with a wrong stamp"
            if seq.started and not (seq.handoff and self.role == "MD"):
                self._waiting.append(seq)
                await self._admit()
        elif isinstance(ev, p.TransferFailed):
            if seq.extents is not None:
                self.pool.release(seq.extents)
                seq.extents = None
            if seq.handoff and self.role == "MD":
                seq.soft_errors.append(f"KV transfer failed ({ev.code}: {ev.reason}); RLD keeps the request")
            else:
                seq.error = f"KV transfer failed: {ev.code}: {ev.reason}"
                if seq.handoff:
                    await self.eng.abort(seq.request_id, "kv_failed")
                self._finish(seq)
        elif isinstance(ev, p.Emit):
            for i, tok in enumerate(ev.tokens):
                pos = ev.first + i
                if pos in seq.emitted:
                    raise AssertionError(f"{seq.request_id}: position {pos} emitted twice on {self.role}")
                seq.emitted[pos] = tok
                if pos == 0:
                    seq.first_at = _now()
            self._check(seq)
        elif isinstance(ev, p.Extend):
            expect = [token_at(seq.request_id, ev.first + i) for i in range(len(ev.tokens))]
            if ev.tokens != expect:
                raise AssertionError(f"{seq.request_id}: relayed tokens differ from the model's")
            self._extends.append((seq, ev.first, list(ev.tokens)))
            self._wake.set()
        elif isinstance(ev, p.StopGenerating):
            seq.generating = False
            self._running.pop(seq.request_id, None)
        elif isinstance(ev, p.StartGenerating):
            seq.generating = True
            if self.role == "MD":
                # The extend that absorbed position-1 yielded this position's token: report it now.
                seq.next = ev.position + 1
                seq.admitted_at = _now()
                last = ev.position == seq.n - 1
                if not last:
                    self._running[seq.request_id] = seq
                    self._wake.set()
                await self.eng.handoff_tokens(seq.request_id, [token_at(seq.request_id, ev.position)], last=last)
            elif seq.next < seq.n:  # RLD resumes after MD released (tokens it held come as emits)
                self._running[seq.request_id] = seq
                self._wake.set()
        elif isinstance(ev, p.HandoffDone):
            seq.done = ev
            if ev.owner != self.role:
                self._running.pop(seq.request_id, None)
            self._check(seq)
        elif isinstance(ev, p.RequestAborted):
            seq.error = f"aborted: {getattr(ev, 'reason', '')}"
            self._running.pop(seq.request_id, None)
            self._finish(seq)

    def _check(self, seq: Seq) -> None:
        if not seq.handoff:
            complete = len(seq.emitted) == seq.n
        elif seq.done is None:
            complete = False
        elif seq.done.owner != self.role:
            complete = True  # the other side emits the rest (or everything)
        elif self.role == "RLD":
            complete = len(seq.emitted) == seq.n
        else:
            complete = len(seq.emitted) == seq.n - (seq.done.position or 0)
        if complete:
            self._finish(seq)

    def _finish(self, seq: Seq) -> None:
        self._running.pop(seq.request_id, None)
        self.seqs.pop(seq.request_id, None)
        if seq.extents is not None:
            self.pool.release(seq.extents)
            seq.extents = None
        seq.finished_at = _now()
        if not seq.result.done():
            seq.result.set_result(seq)

    # ------------------------------------------------------------------ batching
    async def _admit(self) -> None:
        """Move requests whose KV is in from the queue into the batch while it has room;
        position 0 (prefill's token) is emitted (or reported, in a handoff) at once."""
        calls = []
        while self._waiting and len(self._running) < self.chip.max_batch:
            seq = self._waiting.popleft()
            if seq.result.done():
                continue
            seq.admitted_at = _now()
            seq.next = 1
            tok = token_at(seq.request_id, 0)
            last = seq.n == 1
            if not last:
                self._running[seq.request_id] = seq
            if seq.handoff:
                calls.append(self._call(seq, self.eng.handoff_tokens(seq.request_id, [tok], last=last)))
            else:
                seq.emitted[0] = tok
                seq.first_at = seq.admitted_at
                self._check(seq)
        self._wake.set()
        if calls:
            await asyncio.gather(*calls)
        await self._report_load()

    async def _call(self, seq: Seq, coro) -> None:
        try:
            await coro
        except EngineRequestError as exc:
            seq.soft_errors.append(str(exc))  # judged when the request settles (see _steps)

    async def _report_load(self) -> None:
        load = round(self.load, 3)
        if abs(load - self._load) >= 0.01:
            self._load = load
            self.load_reports += 1
            await self.eng.set_load(load)

    async def _steps(self) -> None:
        while True:
            if self._waiting:
                await self._admit()
            if not self._running and not self._extends:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = list(self._running.values())
            exts, self._extends = self._extends, []
            dt = self.chip.step_s(len(batch), sum(len(t) for _, _, t in exts))
            await asyncio.sleep(dt)
            self.steps += 1
            self.batch_sum += len(batch)
            self.max_batch_seen = max(self.max_batch_seen, len(batch))
            self.busy_s += dt
            calls = []
            for seq in batch:
                if self._running.get(seq.request_id) is not seq:  # stopped, handed over or aborted meanwhile
                    continue
                pos = seq.next
                seq.next += 1
                seq.generated += 1
                self.tokens_generated += 1
                last = pos == seq.n - 1
                if last:
                    del self._running[seq.request_id]
                tok = token_at(seq.request_id, pos)
                if seq.handoff:
                    calls.append(self._call(seq, self.eng.handoff_tokens(seq.request_id, [tok], last=last)))
                else:
                    seq.emitted[pos] = tok
                    if last:
                        self._check(seq)
            for seq, first, toks in exts:
                if seq.result.done() or (seq.done is not None and seq.done.owner != self.role):
                    continue  # RLD kept the request meanwhile: nothing to report
                seq.extends += 1
                seq.extend_tokens += len(toks)
                calls.append(self._call(seq, self.eng.handoff_extended(seq.request_id, first + len(toks))))
            if calls:
                await asyncio.gather(*calls)
            await self._report_load()

    def result_of(self, seq: Seq) -> dict:
        """The request's outcome on this engine, as plain data."""
        d = seq.done
        errors = [seq.error] if seq.error else []
        if seq.soft_errors and not (d is not None and d.owner != self.role):
            errors += seq.soft_errors
        return {
            "request_id": seq.request_id, "role": self.role, "n": seq.n, "handoff": seq.handoff,
            "emitted": seq.emitted, "first_at": seq.first_at, "kv_at": seq.kv_at, "admitted_at": seq.admitted_at,
            "submitted_at": seq.submitted_at, "finished_at": seq.finished_at, "generated": seq.generated,
            "extends": seq.extends, "extend_tokens": seq.extend_tokens,
            "owner": d.owner if d else None, "reason": d.reason if d else None, "mode": d.mode if d else None,
            "position": d.position if d else None, "errors": errors,
        }
