"""Continuing a spliced output on another engine, and what a continuation cannot splice.

:func:`continue_on` streams the output on from its current position on one member (the
prompt's ids plus every id relayed, no KV params): MD after the switch, or, when MD fails after
it, :func:`hand_back`'s RLD or P member. A continuation silent for ``handoff.continue_s`` (its
first token, or between two events) has failed. :func:`unfit` says why a request cannot be
handed over at all (then it runs P-MD).
"""

from __future__ import annotations

import asyncio

import aiohttp
import structlog
from aiohttp import web

from .core import Core, Req
from .output import Output, Segment, SegmentFailed
from .pools import Upstream
from .upstream import UpstreamError, error_of, read_capped, sse_events

log = structlog.get_logger("pdd_wire.router")

NET = (aiohttp.ClientError, OSError)
_ENDED = ("length", "stop")  # a max_tokens=1 request that did its work ("abort": vLLM stopped it)


async def warm_ok(core: Core, u: Upstream, path: str, body: dict) -> bool:
    """Whether ``u`` answered ``body`` (a non-streamed ``max_tokens=1`` request) with 200 and an
    ending of its own (not vLLM's ``abort``)."""
    try:
        async with core.http.post(f"{u.url}{path}", json=body) as r:
            data = await read_capped(r)
            if r.status != 200:
                return False
    except (*NET, UpstreamError):
        return False
    try:
        choices = core.decoder.decode(data).get("choices") or [{}]
        return choices[0].get("finish_reason") in _ENDED
    except (ValueError, AttributeError, TypeError, IndexError):
        return False


async def continue_on(core: Core, req: Req, out: Output, u: Upstream, seg: Segment) -> None:
    """Stream the output on from its current position on ``u``. SegmentFailed: ``u`` refused,
    erred, aborted, was silent for ``handoff.continue_s``, or its stream was cut before the
    output's last token (a cut after it is its end: the usage is then counted by the router)."""
    limit = core.cfg.handoff.continue_s
    try:
        async with asyncio.timeout(limit):
            r = await core.http.post(f"{u.url}{req.path}", json=out.body_from_here(req.body))
        async with r:
            if r.status != 200:
                raise SegmentFailed(await error_of(r))
            events = sse_events(r.content)
            while True:
                async with asyncio.timeout(limit):  # a data event within it (keep-alives do not count)
                    while (event := await anext(events, None)) is not None and not event.startswith(b"data:"):
                        await out.feed(event, seg)
                if event is None:
                    break
                await out.feed(event, seg)
    except TimeoutError as exc:
        raise SegmentFailed(TimeoutError(f"{u.pool} {u.url} sent no token for {limit} s "
                                         "(handoff.continue_s)")) from exc
    except NET as exc:
        if not out.finished:
            raise SegmentFailed(exc) from exc
        log.info("router_cut_after_the_end", request_id=req.rid, member=u.url, error=repr(exc))
    if not out.finished:
        raise SegmentFailed(aiohttp.ClientPayloadError(f"{u.pool}'s stream ended before its last token"))


async def hand_back(core: Core, req: Req, out: Output, failed: SegmentFailed) -> web.StreamResponse:
    """MD failed after the switch: the least-loaded RLD member, else a P member, continues from
    where MD left it (at most two tries); nothing relayed is lost or repeated. SegmentFailed:
    every try failed."""
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
    raise failed


# Fields whose effect depends on the output so far, which a continuation sees as prompt:
# presence and frequency penalties count output tokens only; a structured-output grammar would
# restart at the switch; bad words and repetition detection match output tokens only (one
# straddling the switch would escape); a thinking budget counts output tokens.
_PENALTIES = ("presence_penalty", "frequency_penalty")
_GRAMMARS = ("structured_outputs", "response_format", "guided_json", "guided_regex", "guided_choice",
             "guided_grammar", "guided_decoding_backend")
_OUTPUT_MATCHED = ("bad_words", "repetition_detection", "thinking_token_budget")


def unfit(core: Core, req: Req) -> str | None:
    """Why this request cannot be handed from RLD to MD (None: it can). MD continues from token
    ids, so the prompt's must be known, and only completions can be spliced event by event."""
    body = req.read
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
    if body.get("truncate_prompt_tokens") is not None:
        return "truncate_prompt_tokens"  # MD would truncate prompt + output from the left
    if any(body.get(k) not in (None, [], -1) for k in _OUTPUT_MATCHED):
        return "output_matched"
    if body.get("skip_special_tokens") is False and body.get("spaces_between_special_tokens") is False:
        return "special_tokens"  # MD's detokenizer would start as if no special token came before
    return None
