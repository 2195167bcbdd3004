"""The simulated decode engine (:class:`DecodeSim`): continuous batching of many requests, as
relay decode (RLD, site A) or main decode (MD, site B), with the handoff between them."""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field

from pdd_wire.engine import protocol as p
from pdd_wire.engine.client import EngineClient
from pdd_wire.errors import EngineRequestError

from .chip import KV_BYTES_PER_TOKEN, ChipProfile
from .engine import EventLoopEngine
from .kvpool import KvPool
from .model import token_at


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


class DecodeSim(EventLoopEngine):
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
        self.start_events()
        self._steps_task = asyncio.create_task(self._steps(), name=f"{self.role}-steps")
        await self._report_load()
        return self

    async def close(self) -> None:
        await self.stop_tasks(self._steps_task)

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
        seq = Seq(request_id, n_tokens, kv_tokens, handoff, time.monotonic())
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
    async def on_event(self, ev: p.Msg) -> None:
        seq = self.seqs.get(getattr(ev, "request_id", None))
        if seq is None:
            return
        if isinstance(ev, p.KvReceived):
            seq.kv_at = time.monotonic()
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
                    seq.first_at = time.monotonic()
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
                seq.admitted_at = time.monotonic()
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
        seq.finished_at = time.monotonic()
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
            seq.admitted_at = time.monotonic()
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
