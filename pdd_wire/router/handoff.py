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
back to an RLD member, else a P member, from where MD left it (``md_failed_after_switch``, at
most two tries).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import structlog
from aiohttp import web

from ..policy import choose_handoff_mode
from .core import Core, Req
from .output import Output, Segment, SegmentFailed
from .pools import Upstream
from .upstream import UpstreamError, sse_events

log = structlog.get_logger("pdd_wire.router")

_NET = (aiohttp.ClientError, OSError)


class Handoff:
    """One P-RLD-MD request from RLD's first token to its end: ``await run()``."""

    def __init__(self, core: Core, req: Req, out: Output, R: Upstream, M: Upstream, params: dict) -> None:
        self.core, self.req, self.out, self.R, self.M, self.params = core, req, out, R, M, params
        self.h = core.cfg.handoff
        self.L = len(req.trace.prompt_ids or ())
        self.mode: str | None = None  # decided once MD holds the KV and RLD may hand over
        self.committed = False  # catch-up: absorbing is over, the switch comes at a clean boundary
        self.stay = False  # MD failed or was too slow: RLD keeps the request to its end
        self.absorbed = 0  # output tokens MD holds in its prefix cache
        self.rounds = 0
        self.warm: asyncio.Task[bool] | None = None
        self.absorb: asyncio.Task[bool] | None = None
        self._absorb_k = 0
        self._absorb_t0 = 0.0
        self._outcome = ""

    # ------------------------------------------------------------------ the request
    async def run(self) -> web.StreamResponse:
        if self.h.mode == "auto":
            self.core.loads.kick(self.R)  # a fresh figure by the time MD holds the KV
        prefill_like = {**self.req.body, "max_tokens": 1, "n": 1, "stream": False,
                        "kv_transfer_params": self.params}
        for k in ("stream_options", "min_tokens", "max_completion_tokens"):
            prefill_like.pop(k, None)
        self.warm = asyncio.ensure_future(self._ok(self.M, prefill_like))
        ended = False
        try:
            out = await self._run()
            ended = True
            return out
        finally:
            if ended and not self.warm.done():
                # RLD finished first or MD was too slow: MD's receive goes on, so that P's KV is
                # delivered (not pinned until its lease ends) and MD's prefix cache keeps the
                # prompt for the next turn (PDD's DRC); bounded by what P holds the KV for.
                self.core.drain(self.warm, float(self.params.get("lease_s") or self.h.md_ready_s) + 5.0)
                self.warm = None
            for t in (self.warm, self.absorb):
                if t is not None and not t.done():
                    t.cancel()  # closes MD's request: vLLM aborts it (a receive is cancelled)
            await asyncio.gather(*(t for t in (self.warm, self.absorb) if t is not None), return_exceptions=True)

    async def _run(self) -> web.StreamResponse:
        failure = await self._from_rld()
        out, rid, m = self.out, self.req.rid, len(self.out.ids)
        if failure is not None and not out.finished:
            if self.stay:  # MD cannot take it either
                raise failure
            # RLD failed: MD takes the output over from where RLD left it, once it holds the KV.
            self.core.fallback(rid, "rld_failed", position=m, clean=out.clean(), error=repr(failure))
            assert self.warm is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.warm), max(0.0, self._md_ready_left()))
            if not (self.warm.done() and self.warm.result()):
                raise failure
            if not out.clean():
                self.core.metrics.unclean.inc()
            self.mode = self.mode or "one-shot"
            return await self._switch("rld_failed")
        if self._outcome != "switch":
            if not self.stay:
                self._count("rld_finished")
            return await out.finish()
        return await self._switch("switched")

    def _count(self, outcome: str) -> None:
        self.core.metrics.handoffs.labels(mode=self.mode or "undecided", outcome=outcome).inc()

    # ------------------------------------------------------------------ RLD's stream
    async def _from_rld(self) -> BaseException | None:
        """Relay RLD until the switch (``_outcome = "switch"``), its end, or its failure
        (returned)."""
        req = self.req
        body = {**req.body, "kv_transfer_params": self.params, "return_token_ids": True, "stream": True,
                "stream_options": {**(req.body.get("stream_options") or {}), "include_usage": True}}
        try:
            r = await self.core.http.post(f"{self.R.url}{req.path}", json=body)
        except _NET as exc:
            return exc
        async with r:  # leaving it closes RLD's stream: vLLM aborts the request there
            if r.status != 200:
                return UpstreamError(r.status, await r.read(), r.content_type or "application/json")
            seg = self.out.segment("RLD")
            events = sse_events(r.content)
            nxt: asyncio.Future | None = None
            try:
                while True:
                    if self.mode is None and self.h.mode == "auto":
                        self.core.loads.kick(self.R)  # at most one scrape per rld_load.interval_s
                    if self._step():
                        self._outcome = "switch"
                        return None
                    waits: list[asyncio.Future] = [t for t in (self.warm, self.absorb)
                                                   if t is not None and not t.done() and not self.stay]
                    if not (self._capped() and waits):
                        if nxt is None:
                            nxt = asyncio.ensure_future(anext(events, None))
                        waits.append(nxt)
                    await asyncio.wait(waits, timeout=self._until_deadline(), return_when=asyncio.FIRST_COMPLETED)
                    if nxt is None or not nxt.done():
                        continue
                    try:
                        event = nxt.result()
                    except _NET as exc:
                        return exc
                    nxt = None
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

    def _capped(self) -> bool:
        return self.h.max_rld_tokens is not None and len(self.out.ids) >= self.h.max_rld_tokens

    def _until_deadline(self) -> float | None:
        ends = []
        if self.warm is not None and not self.warm.done() and not self.stay:
            ends.append(self._md_ready_left())
        if self.absorb is not None and not self.absorb.done() and not self.stay:
            ends.append(self._absorb_t0 + self.h.absorb_s - time.monotonic())
        return max(0.0, min(ends)) if ends else None

    def _md_ready_left(self) -> float:
        return self.h.md_ready_s - (time.monotonic() - self.req.trace.t0)

    def _stay(self, kind: str, **fields) -> None:
        self.stay = True
        self.core.fallback(self.req.rid, kind, position=len(self.out.ids), **fields)
        self._count(kind)
        if self.absorb is not None and not self.absorb.done():
            self.absorb.cancel()  # closed now (awaited when the request ends)

    # ------------------------------------------------------------------ MD's side
    def _step(self) -> bool:
        """Advance MD's side on what has happened (non-blocking); True: switch now."""
        out, h = self.out, self.h
        if self.stay or out.finished:
            return False
        m = len(out.ids)
        assert self.warm is not None
        if not self.warm.done():
            if self._md_ready_left() < 0:
                self._stay("md_not_ready")
            return False
        if not self.warm.result():
            self._stay("md_failed")
            return False
        if m >= out.max_tokens or m < h.min_rld_tokens:
            return False
        if self.mode is None:
            self._decide(m)
        if self.mode == "catch-up" and not self.committed:
            if self.absorb is not None:
                if not self.absorb.done():
                    if self._absorb_t0 + h.absorb_s < time.monotonic():
                        self._stay("md_not_ready", absorbing=self._absorb_k)
                    return False
                ok, self.absorb = self.absorb.result(), None
                if not ok:
                    self._stay("md_failed", absorbing=self._absorb_k)
                    return False
                self.core.metrics.absorbed.inc(self._absorb_k - self.absorbed)
                self.absorbed, self.rounds = self._absorb_k, self.rounds + 1
            p = h.policy
            if m - self.absorbed <= p.catchup_gap_tokens or self.rounds >= p.max_catchup_rounds:
                self.committed = True
            elif self._capped() and h.mode == "auto":
                self.committed = True  # RLD waits at its cap: another round would only delay the switch
            elif (k := self._target(m)) > self.absorbed:
                self._start_round(k)
                return False
            elif self._capped():
                self.committed = True  # no block boundary left to absorb before the cap
            else:
                return False  # more tokens to the next block boundary
        return m == 0 or out.clean()

    def _target(self, m: int) -> int:
        """Output tokens the next absorb round covers: up to the last block boundary."""
        B = self.core.cfg.choice.block_tokens
        return max(0, (self.L + m) // B * B - self.L) if B else m

    def _decide(self, gap: int) -> None:
        load = None
        if self.h.mode != "auto":
            mode, reason, detail = self.h.mode, "configured", ""
        elif self._capped():
            mode, reason, detail = "one-shot", "rld_capped", f"RLD at handoff.max_rld_tokens ({gap})"
        elif (load := self.core.loads.fresh(self.R)) is None:
            mode, reason, detail = "one-shot", "rld_load_unknown", f"no figure of {self.R.url}'s load"
        else:
            d = choose_handoff_mode(load, gap, self.h.policy)
            mode, reason, detail = d.mode, d.reason, d.detail
        self.mode = mode
        self.core.metrics.modes.labels(mode=mode, reason=reason).inc()
        log.info("router_handoff_mode", request_id=self.req.rid, mode=mode, reason=reason, gap=gap,
                 rld=self.R.url, rld_load=load, detail=detail)

    def _start_round(self, k: int) -> None:
        body = {"model": self.req.body.get("model"), "prompt": (self.req.trace.prompt_ids or []) + self.out.ids[:k],
                "max_tokens": 1, "stream": False}
        for key in ("cache_salt", "priority"):  # what MD's prefix cache and scheduler key on
            if key in self.req.body:
                body[key] = self.req.body[key]
        self._absorb_k, self._absorb_t0 = k, time.monotonic()
        self.absorb = asyncio.ensure_future(self._ok(self.M, body))
        log.debug("router_catchup_round", request_id=self.req.rid, round=self.rounds + 1, absorb=k,
                  emitted=len(self.out.ids))

    async def _ok(self, u: Upstream, body: dict) -> bool:
        """Whether ``u`` answered ``body`` (a ``max_tokens=1`` request) with 200."""
        try:
            async with self.core.http.post(f"{u.url}{self.req.path}", json=body) as r:
                await r.read()
                return r.status == 200
        except _NET:
            return False

    # ------------------------------------------------------------------ after the switch
    async def _switch(self, outcome: str) -> web.StreamResponse:
        out, rid, m = self.out, self.req.rid, len(self.out.ids)
        if self.absorb is not None and not self.absorb.done():
            self.absorb.cancel()  # its blocks are not waited for: the continuation computes them
        t_switch = out.last_at if out.last_at is not None else time.monotonic()
        log.info("router_handoff", request_id=rid, mode=self.mode, position=m, md=self.M.url, outcome=outcome,
                 rounds=self.rounds, absorbed=self.absorbed)
        self._count(outcome)
        if self.mode == "catch-up":
            self.core.metrics.rounds.observe(self.rounds)
        seg = out.segment("MD")
        try:
            await continue_on(self.core, self.req, out, self.M, seg)
        except SegmentFailed as exc:
            self._stall(seg, t_switch)
            return await hand_back(self.core, self.req, out, exc)
        self._stall(seg, t_switch)
        return await out.finish()

    def _stall(self, seg: Segment, t_switch: float) -> None:
        mode = self.mode or "one-shot"
        if seg.first_at is not None:
            stall = seg.first_at - t_switch
            self.core.metrics.stall.labels(mode=mode).observe(stall)
            log.info("router_handoff_stall", request_id=self.req.rid, mode=mode, position=seg.base,
                     stall_ms=round(stall * 1e3, 3), rounds=self.rounds)
        if seg.prompt_tokens is not None and seg.cached_tokens is not None:
            self.core.metrics.extend.labels(mode=mode).observe(seg.prompt_tokens - seg.cached_tokens)


async def continue_on(core: Core, req: Req, out: Output, u: Upstream, seg: Segment) -> None:
    """Stream the output on from its current position on ``u`` (the prompt's ids plus every id
    relayed, no KV params). SegmentFailed: ``u`` failed before the output's last token."""
    try:
        async with core.http.post(f"{u.url}{req.path}", json=out.body_from_here(req.body)) as r:
            if r.status != 200:
                raise SegmentFailed(UpstreamError(r.status, await r.read(), r.content_type or "application/json"))
            async for event in sse_events(r.content):
                await out.feed(event, seg)
    except _NET as exc:
        raise SegmentFailed(exc) from exc
    if not out.finished:
        raise SegmentFailed(aiohttp.ClientPayloadError(f"{u.pool}'s stream ended before its last token"))


async def hand_back(core: Core, req: Req, out: Output, failed: SegmentFailed) -> web.StreamResponse:
    """MD failed after the switch: the least-loaded RLD member, else a P member, continues from
    where MD left it (at most two tries); nothing relayed is lost or repeated."""
    core.fallback(req.rid, "md_failed_after_switch", position=len(out.ids), clean=out.clean(),
                  error=repr(failed.cause))
    if not out.clean():
        core.metrics.unclean.inc()
    targets = (core.pools.ranked("RLD") + core.pools.ranked("P"))[:2]
    for u in targets:
        if out.finished:
            break
        seg = out.segment(u.pool)
        with core.pools.using(u):
            try:
                await continue_on(core, req, out, u, seg)
            except SegmentFailed as exc:
                failed = exc
                log.warning("router_hand_back_failed", request_id=req.rid, member=u.url, error=repr(exc.cause))
                continue
        log.info("router_handed_back", request_id=req.rid, member=u.url, position=seg.base)
        return await out.finish()
    if out.finished:
        return await out.finish()
    raise failed.cause


# Fields whose effect depends on the output so far, which a continuation sees as prompt:
# presence and frequency penalties count output tokens only; a structured-output grammar would
# restart at the switch.
_PENALTIES = ("presence_penalty", "frequency_penalty")
_GRAMMARS = ("structured_outputs", "response_format", "guided_json", "guided_regex", "guided_choice",
             "guided_grammar", "guided_decoding_backend")


def unfit(core: Core, req: Req) -> str | None:
    """Why this request cannot be handed from RLD to MD (None: it can). MD continues from token
    ids, so the prompt's must be known, and only completions can be spliced event by event."""
    body = req.body
    if not core.pools.members("RLD"):
        return "no_rld_member"
    if req.path != "/v1/completions":
        return "chat"
    if not body.get("stream") and not core.cfg.handoff.non_streamed:
        return "not_streamed"
    if req.trace.prompt_ids is None:
        return "no_prompt_ids"
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1:
        return "n"
    if body.get("echo") or body.get("stop"):
        return "echo_or_stop"  # a stop string may straddle the switch
    if any(body.get(k) for k in _PENALTIES):
        return "penalties"
    if any(body.get(k) is not None for k in _GRAMMARS):
        return "structured_output"
    if not body.get("stream") and body.get("prompt_logprobs") is not None:
        return "prompt_logprobs"  # a stream does not carry them
    return None
