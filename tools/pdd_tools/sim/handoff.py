"""Simulated engines for one request at a time, for the handoff tests and ``pdd-tools bench``
(group ``handoff``).

:class:`RldSim` decodes from position 0 and hands the output over; :class:`MdSim` absorbs
relayed tokens with simulated extend steps and takes over. Both emit only what their agent's
``emit`` events allow, and record it: ``emitted`` maps position to token. Timing: a decode step
takes ``step_s``; an extend of ``n`` tokens takes ``extend_s + n * extend_per_token_s``.
"""

from __future__ import annotations

import asyncio
import time

from pdd_wire.engine import protocol as p
from pdd_wire.engine.client import EngineClient

from .model import token_at

HANDOFF_EVENTS = (p.Emit, p.Extend, p.StopGenerating, p.StartGenerating, p.HandoffDone)


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
