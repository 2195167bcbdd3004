"""P-RLD-MD through the router: RLD streams at once, then the output moves to MD.

P has sent the prompt's KV to RLD (same site) and MD (across the WAN). The router streams the
request from RLD and, at the same time, asks MD the prompt with P's params and ``max_tokens=1``
(the *warm* request): MD answers once it holds the KV, which its prefix cache then keeps. That
answer is all a stock ``vllm serve`` tells of it. Then the mode (:func:`pdd_wire.policy.
choose_handoff_mode` from RLD's live load and the gap, unless ``handoff.mode`` forces one):

- **one-shot**: between two RLD events (at a clean text boundary, :meth:`Output.clean`), RLD's
  stream is closed at position m (vLLM aborts it there) and MD streams from the prompt's ids
  plus the m emitted ids: its prefix cache holds the prompt's full blocks, the rest is one
  extend step.
- **catch-up**: while RLD keeps streaming, MD *absorbs* the emitted tokens in rounds: each an
  ``max_tokens=1`` request of the prompt plus the tokens emitted so far, cut at the last block
  boundary (``choice.block_tokens``; vLLM's prefix cache keeps full blocks only), without KV
  params (MD's connector leaves such a request alone: it computes only what its prefix cache
  lacks, and the blocks stay cached after it ends, LRU). Once the gap (emitted minus absorbed)
  is at most ``catchup_gap_tokens``, or after ``max_catchup_rounds``, the switch is one-shot's,
  and MD's last extend is that gap.

Failures, each a named fallback: MD failing or not ready before the switch leaves the request
on RLD (``md_failed``, ``md_not_ready``); RLD failing hands the output to MD from where RLD
left it (``rld_failed``; from position 0 that is P-MD); MD failing after the switch hands it
back to an RLD member, else a P member, from where MD left it (:mod:`.continuation`). Each
request's ending is counted once (``pddwire_router_handoffs_total{outcome}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import structlog
from aiohttp import web

from ..policy import choose_handoff_mode
from .continuation import NET, continue_on, hand_back, warm_ok
from .core import Core, Req
from .output import ClientGone, Output, Segment, SegmentFailed
from .pools import Upstream
from .upstream import LOGPROBS, UpstreamError, error_of, sse_events

log = structlog.get_logger("pdd_wire.router")

CLIENT_ERRORS = (400, 422)  # vLLM's answers to a bad request: the client's error, whoever serves it


class Handoff:
    """One P-RLD-MD request from RLD's first token to its end: ``await run()``."""

    def __init__(self, core: Core, req: Req, out: Output, rld: Upstream, md: Upstream, params: dict) -> None:
        self.core, self.req, self.out, self.rld, self.md, self.params = core, req, out, rld, md, params
        self.cfg = core.cfg.handoff
        self.prompt_len = len(req.trace.prompt_ids or ())
        self.mode: str | None = None  # decided once MD holds the KV and RLD may hand over
        self.committed = False  # catch-up: absorbing is over, the switch comes at a clean boundary
        self.stay: str | None = None  # why RLD keeps the request to its end (MD failed or too slow)
        self.absorbed = 0  # output tokens MD holds in its prefix cache
        self.rounds = 0
        self.deferred = 0  # RLD events after which a due switch waited for a clean text boundary
        self.outcome = ""  # how the output ended (the handoffs_total outcome)
        self.warm: asyncio.Task[bool] | None = None
        self._warm_s: float | None = None  # when MD's warm request ended, from the request's start
        self.absorb: asyncio.Task[bool] | None = None
        self._absorb_k = 0
        self._absorb_t0 = 0.0
        self._deferred_at = -1
        self._rld_seg: Segment | None = None
        self._load_wake: asyncio.Future | float | None = None  # a load figure on its way

    # ------------------------------------------------------------------ the request
    async def run(self) -> web.StreamResponse:
        if self.cfg.mode == "auto":
            self.core.loads.kick(self.rld)
        warm = {**self.req.body, "max_tokens": 1, "n": 1, "stream": False, "kv_transfer_params": self.params}
        # Logprobs of the prompt make vLLM skip the prefix cache and the connector's KV
        # (SamplingParams.skip_reading_prefix_cache): MD would recompute the prompt.
        for k in ("stream_options", "min_tokens", "max_completion_tokens", "prompt_logprobs", *LOGPROBS,
                  "stream_interval"):
            warm.pop(k, None)
        self.warm = asyncio.ensure_future(warm_ok(self.core, self.md, self.req.path, warm))
        self.warm.add_done_callback(self._warm_ended)
        ended = False
        try:
            resp = await self._run()
        except (asyncio.CancelledError, ClientGone):
            self._count("cancelled")  # the client went away, or the deadline passed
            raise
        except BaseException:
            self._count("failed")  # the client got an error instead of the output's end
            raise
        else:
            ended = True
            self._count(self.outcome)  # now: a cancellation while the tasks below end cannot skip it
        finally:
            if ended and not self.warm.done():
                # RLD finished first or MD was too slow: MD's receive goes on, so that P's KV is
                # delivered (not pinned until its lease ends) and MD's prefix cache keeps the
                # prompt for the next turn (PDD's DRC); bounded by what P holds the KV for.
                self.core.drain(self.warm, float(self.params.get("lease_s") or self.cfg.md_ready_s) + 5.0)
                self.warm = None
            for t in (self.warm, self.absorb):
                if t is not None and not t.done():
                    t.cancel()  # closes MD's request: vLLM aborts it (a receive is cancelled)
            await asyncio.gather(*(t for t in (self.warm, self.absorb) if t is not None), return_exceptions=True)
        return resp

    async def _run(self) -> web.StreamResponse:
        failure = await self._from_rld()
        out, rid, m = self.out, self.req.rid, len(self.out.ids)
        if failure is None or out.finished:
            if self.outcome == "switched":
                return await self._switch()
            self.outcome = self.stay or ("no_clean_boundary" if self.deferred else "rld_finished")
            return await out.finish()
        if isinstance(failure, UpstreamError) and failure.status in CLIENT_ERRORS:
            raise failure  # MD would refuse it too: vLLM's answer, as it gave it
        if self.stay:  # MD cannot take it either
            raise SegmentFailed(failure)
        # RLD failed: MD takes the output over from where RLD left it, once it holds the KV.
        self.core.fallback(rid, "rld_failed", position=m, clean=out.clean(), error=repr(failure))
        assert self.warm is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.warm), max(0.0, self._md_ready_left()))
        if not (self.warm.done() and self.warm.result()):
            raise SegmentFailed(failure)
        if not out.clean():
            self.core.metrics.unclean.inc()
        self.mode = self.mode or "one-shot"
        self.outcome = "rld_failed"
        return await self._switch()

    def _count(self, outcome: str) -> None:
        self.core.metrics.handoffs.labels(mode=self.mode or "undecided", outcome=outcome).inc()

    # ------------------------------------------------------------------ RLD's stream
    async def _from_rld(self) -> BaseException | None:
        """Relay RLD until the switch (``outcome = "switched"``), its end, or its failure
        (returned)."""
        req = self.req
        body = {**req.body, "kv_transfer_params": self.params, "return_token_ids": True, "stream": True,
                "stream_options": {**(req.body.get("stream_options") or {}), "include_usage": True}}
        for k in ("prompt_logprobs", "stream_interval"):  # a stream carries no prompt logprobs;
            body.pop(k, None)  # one token per event gives the handoff its clean boundaries
        silent = self.cfg.rld_silent_s  # a hung RLD is a failed one: MD takes over
        try:
            async with asyncio.timeout(silent):
                r = await self.core.http.post(f"{self.rld.url}{req.path}", json=body)
        except TimeoutError:
            return self._silent()
        except NET as exc:
            return exc
        async with r:  # leaving it closes RLD's stream: vLLM aborts the request there
            if r.status != 200:
                return await error_of(r)
            seg = self._rld_seg = self.out.segment("RLD")
            events = sse_events(r.content)
            nxt: asyncio.Future | None = None
            heard = time.monotonic()  # RLD's last data event taken (or its answer)
            try:
                while True:
                    if self.mode is None and self.cfg.mode == "auto":
                        self.core.loads.kick(self.rld)  # at most one scrape per rld_load.interval_s
                    if self._step():
                        self.outcome = "switched"
                        return None
                    waits: list[asyncio.Future] = [t for t in (self.warm, self.absorb)
                                                   if t is not None and not t.done() and not self.stay]
                    if isinstance(self._load_wake, asyncio.Future):
                        waits.append(self._load_wake)
                    if not (self._capped() and waits):
                        if nxt is None:
                            nxt = asyncio.ensure_future(anext(events, None))
                        waits.append(nxt)
                    # RLD's silence counts while it is read, and only while MD could take over.
                    reading = nxt is not None and not nxt.done() and not self.stay
                    await asyncio.wait(waits, timeout=self._wait_limit(heard + silent if reading else None),
                                       return_when=asyncio.FIRST_COMPLETED)
                    if nxt is None or not nxt.done():
                        if reading and not self.stay and time.monotonic() - heard >= silent:
                            return self._silent()
                        continue
                    try:
                        event = nxt.result()
                    except NET as exc:
                        return exc
                    nxt = None
                    if event is not None and event.startswith(b"data:"):  # (keep-alives do not count)
                        heard = time.monotonic()
                    if event is None:
                        return None if self.out.finished else \
                            aiohttp.ClientPayloadError("RLD's stream ended before its last token")
                    try:
                        await self.out.feed(event, seg)
                    except SegmentFailed as exc:
                        return exc.cause
            finally:
                if nxt is not None and not nxt.done():
                    nxt.cancel()
                    await asyncio.gather(nxt, return_exceptions=True)

    def _silent(self) -> TimeoutError:
        return TimeoutError(f"RLD {self.rld.url} sent nothing for {self.cfg.rld_silent_s} s (handoff.rld_silent_s)")

    def _capped(self) -> bool:
        return self.cfg.max_rld_tokens is not None and len(self.out.ids) >= self.cfg.max_rld_tokens

    def _wait_limit(self, rld_silent_at: float | None = None) -> float | None:
        """How long RLD's loop may wait before ``_step`` must look again (MD's limits, a load
        figure's retry, ``rld_silent_at``: when RLD's silence becomes its failure); None: until
        something happens."""
        ends = [] if rld_silent_at is None else [rld_silent_at - time.monotonic()]
        if self.warm is not None and not self.warm.done() and not self.stay:
            ends.append(self._md_ready_left())
        if self.absorb is not None and not self.absorb.done() and not self.stay:
            ends.append(self._absorb_t0 + self.cfg.absorb_s - time.monotonic())
        if isinstance(self._load_wake, float):
            ends.append(self._load_wake)
        return max(0.0, min(ends)) if ends else None

    def _md_ready_left(self) -> float:
        return self.cfg.md_ready_s - (time.monotonic() - self.req.trace.t0)

    def _warm_ended(self, _task: asyncio.Task) -> None:
        self._warm_s = time.monotonic() - self.req.trace.t0

    def _md_late(self) -> bool:
        """MD's warm request ended after ``md_ready_s``: it did not hold the KV in time, however
        soon after RLD's loop looks (a busy router may look late)."""
        return self._warm_s is not None and self._warm_s > self.cfg.md_ready_s

    def _stay(self, kind: str, **fields) -> None:
        self.stay = kind
        self.core.fallback(self.req.rid, kind, position=len(self.out.ids), **fields)
        if self.absorb is not None and not self.absorb.done():
            self.absorb.cancel()  # closed now (awaited when the request ends)

    # ------------------------------------------------------------------ MD's side
    def _step(self) -> bool:
        """Advance MD's side on what has happened (non-blocking); True: switch now."""
        out, cfg = self.out, self.cfg
        self._load_wake = None  # set again below while the mode waits for a load figure
        if self.stay or out.finished:
            return False
        m = len(out.ids)
        assert self.warm is not None
        if not self.warm.done():
            if self._md_ready_left() < 0:
                self._stay("md_not_ready")
            return False
        if self._md_late():
            self._stay("md_not_ready")
            return False
        if not self.warm.result():
            self._stay("md_failed")
            return False
        if out.left() == 0 or m < cfg.min_rld_tokens:
            return False
        if self.mode is None and not self._decide(m):
            return False  # a load figure is on its way
        if self.mode == "catch-up" and not self.committed:
            if self.absorb is not None:
                if not self.absorb.done():
                    if self._absorb_t0 + cfg.absorb_s < time.monotonic():
                        self._stay("md_not_ready", absorbing=self._absorb_k)
                    return False
                ok, self.absorb = self.absorb.result(), None
                if not ok:
                    self._stay("md_failed", absorbing=self._absorb_k)
                    return False
                self.core.metrics.absorbed.inc(self._absorb_k - self.absorbed)
                self.absorbed, self.rounds = self._absorb_k, self.rounds + 1
            p = cfg.policy
            if m - self.absorbed <= p.catchup_gap_tokens or self.rounds >= p.max_catchup_rounds:
                self.committed = True
            elif self._capped() and cfg.mode == "auto":
                self.committed = True  # RLD's relaying waits at its cap: another round would delay the switch
            elif (k := self._target(m)) > self.absorbed:
                self._start_round(k)
                return False
            elif self._capped():
                self.committed = True  # no block boundary left to absorb before the cap
            else:
                return False  # more tokens to the next block boundary
        if m == 0 or out.clean():
            return True
        if self._deferred_at != m:  # a switch is due, but not inside a character
            self._deferred_at, self.deferred = m, self.deferred + 1
            self.core.metrics.deferred.inc()
        return False

    def _target(self, m: int) -> int:
        """Output tokens the next absorb round covers: up to the last block boundary (with
        ``choice.block_tokens`` 0: everything emitted, which a prefix cache keeps only in part)."""
        B = self.core.cfg.choice.block_tokens
        return max(0, (self.prompt_len + m) // B * B - self.prompt_len) if B else m

    def _decide(self, gap: int) -> bool:
        """Choose the mode (False: not yet, RLD's load is being read)."""
        load = None
        p = self.cfg.policy
        if self.cfg.mode != "auto":
            mode, reason, detail = self.cfg.mode, "configured", ""
        elif self._capped():
            mode, reason, detail = "one-shot", "rld_capped", f"RLD at handoff.max_rld_tokens ({gap})"
        elif gap <= p.catchup_gap_tokens:
            d = choose_handoff_mode(0.0, gap, p)  # gap_small: whatever RLD's load
            mode, reason, detail = d.mode, d.reason, d.detail
        else:
            # A figure read after RLD started streaming this request: it counts this request.
            since = self._rld_seg.first_at if self._rld_seg is not None and self._rld_seg.first_at else 0.0
            load, self._load_wake = self.core.loads.since(self.rld, since)
            if load is None and self._load_wake is not None:
                return False
            if load is None:
                mode, reason, detail = "one-shot", "rld_load_unknown", f"no figure of {self.rld.url}'s load"
            else:
                d = choose_handoff_mode(load, gap, p)
                mode, reason, detail = d.mode, d.reason, d.detail
        self.mode, self._load_wake = mode, None
        self.core.metrics.modes.labels(mode=mode, reason=reason).inc()
        log.info("router_handoff_mode", request_id=self.req.rid, mode=mode, reason=reason, gap=gap,
                 rld=self.rld.url, rld_load=load, detail=detail)
        return True

    def _start_round(self, k: int) -> None:
        body = {"model": self.req.body.get("model"), "prompt": (self.req.trace.prompt_ids or []) + self.out.ids[:k],
                "max_tokens": 1, "stream": False}
        for key in ("cache_salt", "priority"):  # what MD's prefix cache and scheduler key on
            if key in self.req.body:
                body[key] = self.req.body[key]
        self._absorb_k, self._absorb_t0 = k, time.monotonic()
        self.absorb = asyncio.ensure_future(warm_ok(self.core, self.md, self.req.path, body))
        log.debug("router_catchup_round", request_id=self.req.rid, round=self.rounds + 1, absorb=k,
                  emitted=len(self.out.ids))

    # ------------------------------------------------------------------ after the switch
    async def _switch(self) -> web.StreamResponse:
        out, rid, m = self.out, self.req.rid, len(self.out.ids)
        if self.absorb is not None and not self.absorb.done():
            self.absorb.cancel()  # its blocks are not waited for: the continuation computes them
        t_switch = out.last_at if out.last_at is not None else time.monotonic()
        log.info("router_handoff", request_id=rid, mode=self.mode, position=m, md=self.md.url, outcome=self.outcome,
                 rounds=self.rounds, absorbed=self.absorbed)
        if self.mode == "catch-up":
            self.core.metrics.rounds.observe(self.rounds)
        seg = out.segment("MD")
        try:
            await continue_on(self.core, self.req, out, self.md, seg)
        except SegmentFailed as exc:
            self._stall(seg, t_switch)
            return await hand_back(self.core, self.req, out, exc)
        self._stall(seg, t_switch)
        return await out.finish()

    def _stall(self, seg: Segment, t_switch: float) -> None:
        """RLD's last token to MD's first, for a planned switch (after RLD failed, the wait
        includes MD's receive of the KV: logged only)."""
        mode = self.mode or "one-shot"
        if seg.first_at is not None:
            stall = seg.first_at - t_switch
            if self.outcome == "switched":
                self.core.metrics.stall.labels(mode=mode).observe(stall)
            log.info("router_handoff_stall", request_id=self.req.rid, mode=mode, position=seg.base,
                     stall_ms=round(stall * 1e3, 3), rounds=self.rounds, outcome=self.outcome)
        if seg.prompt_tokens is not None and seg.cached_tokens is not None:
            self.core.metrics.extend.labels(mode=mode).observe(seg.prompt_tokens - seg.cached_tokens)
