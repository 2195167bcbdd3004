"""The user's answer to one P-RLD-MD request, spliced from upstream streams at token positions.

Each upstream stream is a :class:`Segment`: RLD's from position 0, then MD's continuation (its
prompt the user's prompt plus the ``base`` tokens relayed before it), then, if MD fails, RLD's
or P's from where MD left it. :class:`Output` relays their events so that the user sees one
stream: every position once and in order, one ``id`` and ``created`` (the first segment's),
``prompt_token_ids`` once, logprobs' ``text_offset`` as one server counts it, ``usage`` counted
as one request's, ``system_fingerprint`` where vLLM puts it, one ending and one ``[DONE]``.
Token ids (null, as vLLM sends them unasked) and usage are stripped unless the client asked for
them (the router always asks: it continues from the ids and reads MD's usage).

What is not the user's: an upstream error event, an event that does not parse, and an ending
``finish_reason: "abort"`` (vLLM's own when it pauses or shuts down: the router never reads past
an abort it caused, it closes the stream) each fail the segment (:class:`SegmentFailed`), and
the output continues on another engine from the last position relayed.

Where another engine may continue (:meth:`Output.clean`): vLLM's detokenizer (0.32, the fast
path: a ``tokenizers`` ``DecodeStream`` primed with the prompt's ids) starts from the new
prompt, whose tail may end inside a character; the continuation's text then misses that
character. So a planned switch happens at position 0 or right after a token that came as one
event with whole text (no U+FFFD): the upstream's detokenizer had then written out every byte,
and the continuation's text continues it exactly (checked on the tiny model's byte-level
vocabulary, special tokens included: 12,000 random prompt/output/position cases, every one).

Sinks: :class:`StreamSink` writes SSE to the client as events come; :class:`CollectSink`
gathers them and answers one JSON body (a non-streamed request run P-RLD-MD).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
import structlog
from aiohttp import web

from .core import SSE_HEADERS, Core, Req
from .upstream import COMPLETIONS_MAX_TOKENS

log = structlog.get_logger("pdd_wire.router")

WHOLE_RUN = 1  # trailing one-token events with whole text before another engine may continue
STREAM = web.RequestKey("pdd_stream", web.StreamResponse)  # the client's stream, once started
DONE_SENT = web.RequestKey("pdd_done_sent", bool)  # its [DONE] written: nothing may follow
DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """Writing to the client failed: it is gone (not an upstream's failure)."""


class SegmentFailed(Exception):
    """An upstream stream failed: refused, an error status, an error event, an event that does
    not parse, an ``abort`` ending, silent for too long, or cut before its last token.
    ``cause``: what happened. The router's one failure type up to the request handler (502, or
    an error event once streaming)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(repr(cause))
        self.cause = cause


class UpstreamAborted(Exception):
    """An upstream ended the request with ``finish_reason: "abort"`` the router did not cause."""


class BadEvent(ValueError):
    """An upstream event that is not a vLLM completion chunk."""


@dataclass(eq=False)
class Segment:
    pool: str
    base: int  # output tokens relayed before this segment (its prompt = user's prompt + those)
    lp0: int  # logprobs' text_offset of its first token (vLLM's running offset at ``base``)
    tokens: int = 0
    first_at: float | None = None  # when its first token was relayed
    prompt_tokens: int | None = None  # from its own usage, before the splice's adjustment
    cached_tokens: int | None = None


class StreamSink:
    """SSE to the client, started at the first write."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.resp: web.StreamResponse | None = None

    async def write(self, data: bytes) -> None:
        try:
            if self.resp is None:
                self.resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
                await self.resp.prepare(self.request)
                self.request[STREAM] = self.resp
            await self.resp.write(data)
        except (ConnectionError, RuntimeError) as exc:  # aiohttp: "Cannot write to closing transport"
            raise ClientGone(repr(exc)) from exc

    async def chunk(self, ev: dict) -> None:
        await self.write(b"data: " + msgspec.json.encode(ev) + b"\n\n")

    async def finish(self, out: "Output") -> web.StreamResponse:
        await self.write(DONE)
        self.request[DONE_SENT] = True
        assert self.resp is not None
        await self.resp.write_eof()
        return self.resp


@dataclass(eq=False)
class CollectSink:
    """The chunks of a non-streamed request, answered as vLLM's ``CompletionResponse``."""

    chunks: list[dict] = field(default_factory=list)

    async def write(self, data: bytes) -> None:
        pass  # keep-alive comments: nothing to keep

    async def chunk(self, ev: dict) -> None:
        self.chunks.append(ev)

    async def finish(self, out: "Output") -> web.Response:
        return web.Response(body=msgspec.json.encode(whole_response(self.chunks, out)), status=200,
                            content_type="application/json")


def whole_response(chunks: list[dict], out: "Output") -> dict:
    """vLLM's non-streamed completion (its ``CompletionResponse`` fields) from streamed chunks."""
    text: list[str] = []
    ids: list[int] = []
    finish = stop = usage = fingerprint = None
    lp: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    has_lp = False
    for ev in chunks:
        usage = ev.get("usage") or usage
        fingerprint = ev.get("system_fingerprint") or fingerprint
        for c in ev.get("choices") or ():
            text.append(c.get("text") or "")
            ids += c.get("token_ids") or ()
            finish = c.get("finish_reason") or finish
            stop = c.get("stop_reason") if c.get("finish_reason") else stop
            if c.get("logprobs"):
                has_lp = True
                for k in lp:
                    lp[k] += c["logprobs"].get(k) or ()
    choice = {"index": 0, "text": "".join(text), "logprobs": lp if has_lp else None, "finish_reason": finish,
              "stop_reason": stop, "token_ids": ids if out.want_ids else None, "prompt_logprobs": None,
              "prompt_token_ids": out.prompt_ids if out.want_ids else None, "routed_experts": None}
    return {"id": out.head.get("id"), "object": "text_completion", "created": out.head.get("created"),
            "model": out.model, "choices": [choice], "service_tier": None, "system_fingerprint": fingerprint,
            "usage": usage, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def parse_chunk(data: bytes, decoder: msgspec.json.Decoder) -> dict:
    """An upstream ``data:`` payload as a completion chunk. BadEvent: not JSON, not an object,
    or a field of the wrong type; an error event (``{"error": ...}``) too."""
    try:
        ev = decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise BadEvent(f"not JSON: {exc}") from exc
    if not isinstance(ev, dict):
        raise BadEvent("not a JSON object")
    choices = ev.get("choices")
    if "error" in ev and not choices:
        raise BadEvent(f"an error event: {ev['error']}")
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise BadEvent("no list of choices")
    for c in choices:
        ids, text, lp = c.get("token_ids"), c.get("text"), c.get("logprobs")
        if ids is not None and not (isinstance(ids, list) and all(type(t) is int for t in ids)):
            raise BadEvent("token_ids is not a list of ints")
        if text is not None and not isinstance(text, str):
            raise BadEvent("text is not a string")
        if text and ids is None:
            raise BadEvent("text without token_ids (the router continues from the ids)")
        if lp is not None and not (isinstance(lp, dict) and isinstance(lp.get("text_offset", []), list)
                                   and isinstance(lp.get("tokens", []), list)):
            raise BadEvent("logprobs is not vLLM's (text_offset, tokens lists)")
        if not isinstance(c.get("finish_reason"), (str, type(None))):
            raise BadEvent("finish_reason is not a string")
    if not isinstance(ev.get("usage"), (dict, type(None))):
        raise BadEvent("usage is not an object")
    return ev


class Output:
    """One request's spliced output. ``ids``: every output token relayed, in position order."""

    def __init__(self, core: Core, req: Req, sink: StreamSink | CollectSink) -> None:
        body = req.read
        self.core, self.req, self.sink = core, req, sink
        self.want_ids = bool(body.get("return_token_ids"))
        self.streamed = isinstance(sink, StreamSink)
        self.want_usage = not self.streamed or bool((body.get("stream_options") or {}).get("include_usage"))
        # vLLM 0.32, /v1/completions (the only endpoint spliced): absent or null is 16
        # (normalize_null_max_tokens); the router's check_fields made any other value an int.
        mt = body.get("max_tokens")
        self.max_tokens: int = COMPLETIONS_MAX_TOKENS if mt is None else mt
        self.model = body.get("model")
        self.prompt_ids = req.trace.prompt_ids or []
        self.ids: list[int] = []
        self.head: dict = {}  # the first event's id and created: every event carries them
        self.whole_run = 0
        self.finished = False
        self.lp_next = 0  # vLLM's next text_offset: the last one plus its token's length
        self.last_at: float | None = None  # when the last token was relayed
        self.usage_sent = False
        self._prompt_ids_sent = False
        self._held: dict | None = None  # the ending chunk, until the usage chunk's fingerprint
        self.by_pool: dict[str, int] = {}

    def clean(self) -> bool:
        """Whether another engine may continue from here with the same text."""
        return not self.ids or self.whole_run >= WHOLE_RUN

    def left(self) -> int:
        """Output tokens still allowed."""
        return self.max_tokens - len(self.ids)

    def segment(self, pool: str) -> Segment:
        return Segment(pool, len(self.ids), self.lp_next)

    def body_from_here(self, path_body: dict) -> dict:
        """The body that continues the output from its current position: the user's request
        with the prompt's ids plus every id relayed, the rest of ``max_tokens``, one token per
        event (no ``stream_interval``), no KV params."""
        m = len(self.ids)
        cont = {**path_body, "prompt": self.prompt_ids + self.ids, "max_tokens": self.left(),
                "return_token_ids": True, "stream": True,
                "stream_options": {**(path_body.get("stream_options") or {}), "include_usage": True}}
        for k in ("kv_transfer_params", "prompt_logprobs", "max_completion_tokens", "stream_interval"):
            cont.pop(k, None)
        if self.req.read.get("min_tokens"):
            cont["min_tokens"] = max(0, self.req.read["min_tokens"] - m)
        return cont

    async def feed(self, event: bytes, seg: Segment) -> None:
        """One SSE event of ``seg``'s stream. SegmentFailed: an error event, an event that does
        not parse, an ``abort`` ending."""
        if event.startswith(b"data: [DONE]"):
            return  # one [DONE], at the very end (finish)
        if event.startswith(b"data:"):
            try:
                ev = parse_chunk(event[5:].strip(), self.core.decoder)
            except BadEvent as exc:
                raise SegmentFailed(BadEvent(f"{seg.pool} sent {exc}")) from exc
            await self.relay(ev, seg)
        elif event.startswith(b":"):
            await self.sink.write(event)  # a keep-alive comment
        # other SSE fields: vLLM sends none; ignored, as SSE says

    async def relay(self, ev: dict, seg: Segment) -> None:
        choices = ev.get("choices") or []
        aborted = False
        for c in choices:
            if c.get("finish_reason") == "abort":  # vLLM's own: the segment failed, not the output
                aborted, c["finish_reason"], c["stop_reason"] = True, None, None
        ids = [t for c in choices for t in c.get("token_ids") or ()]
        if not self.head:
            self.head = {"id": ev.get("id"), "created": ev.get("created")}
        else:
            ev.update({k: v for k, v in self.head.items() if v is not None})
        text = "".join(c.get("text") or "" for c in choices)
        if ids:
            whole = len(ids) == 1 and bool(text) and "\ufffd" not in text
            self.whole_run = self.whole_run + 1 if whole else 0
        keep_prompt = self.want_ids and seg.base == 0 and not self._prompt_ids_sent
        for c in choices:
            self.finished = self.finished or bool(c.get("finish_reason"))
            self._rebase_logprobs(c.get("logprobs"), seg)
            if not self.want_ids and "token_ids" in c:
                c["token_ids"] = None  # as vLLM sends it unasked
            if keep_prompt and c.get("prompt_token_ids") is not None:
                self._prompt_ids_sent = True
            elif "prompt_token_ids" in c:
                c["prompt_token_ids"] = None  # the first event's only
        usage_only = False
        if ev.get("usage"):
            self._usage(ev["usage"], seg)
            self.usage_sent = self.usage_sent or not choices
            if not self.want_usage:
                ev.pop("usage")
                usage_only = not choices  # the usage chunk the router asked for itself
        self.ids += ids
        if ids:
            now = self.last_at = time.monotonic()
            seg.first_at = seg.first_at or now
            seg.tokens += len(ids)
            self.by_pool[seg.pool] = self.by_pool.get(seg.pool, 0) + len(ids)
            self.core.metrics.output_tokens.labels(pool=seg.pool).inc(len(ids))
            if self.streamed:  # TTFT and TPOT are of what the client sees as it comes
                self.req.trace.saw(len(ids))
        if aborted:
            if ids or text:
                await self.sink.chunk(ev)  # its tokens are the output's; its ending is not
            raise SegmentFailed(UpstreamAborted(f"{seg.pool} ended the request with finish_reason abort"))
        await self._write(ev, usage_only)

    async def _write(self, ev: dict, usage_only: bool) -> None:
        """Relay ``ev``. Without ``include_usage`` vLLM stamps ``system_fingerprint`` on the
        ending chunk, but the router asked for usage, so the upstream put it on the usage chunk:
        the ending is held until that chunk (or the end) and takes its fingerprint."""
        if self._held is not None:
            held, self._held = self._held, None
            if usage_only and ev.get("system_fingerprint") is not None:
                held["system_fingerprint"] = ev["system_fingerprint"]
            await self.sink.chunk(held)
        if usage_only:
            return
        if self.streamed and not self.want_usage and any(c.get("finish_reason") for c in ev.get("choices") or ()):
            self._held = ev
            return
        await self.sink.chunk(ev)

    def _rebase_logprobs(self, lp: dict | None, seg: Segment) -> None:
        """vLLM's running ``text_offset``: each token's offset is the last one plus the length of
        the last token's string (not of the text: a special token, a character split across
        tokens make them differ). A segment's offsets start at 0: shifted by ``seg.lp0``."""
        if not lp or not lp.get("text_offset"):
            return
        if seg.lp0:
            lp["text_offset"] = [o + seg.lp0 for o in lp["text_offset"]]
        tokens = lp.get("tokens") or []
        if tokens and isinstance(tokens[-1], str):
            self.lp_next = lp["text_offset"][-1] + len(tokens[-1])

    def _usage(self, u: dict, seg: Segment) -> None:
        """As one request's: ``base`` more output tokens, ``base`` fewer prompt tokens."""
        details = u.get("prompt_tokens_details") or {}
        seg.prompt_tokens = u.get("prompt_tokens")
        seg.cached_tokens = details.get("cached_tokens")
        if seg.base:
            u["prompt_tokens"] = u.get("prompt_tokens", 0) - seg.base
            u["completion_tokens"] = u.get("completion_tokens", 0) + seg.base
            if details.get("cached_tokens") is not None:
                details["cached_tokens"] = min(details["cached_tokens"], u["prompt_tokens"])

    async def finish(self) -> web.StreamResponse:
        if self._held is not None:
            held, self._held = self._held, None
            await self.sink.chunk(held)
        if self.want_usage and not self.usage_sent:
            # The last segment was cut after its ending, before its usage chunk: the usage as
            # vLLM counts it, from what was relayed (no cached-token details).
            n, L = len(self.ids), len(self.prompt_ids)
            log.info("router_usage_counted", request_id=self.req.rid, prompt_tokens=L, completion_tokens=n)
            await self.sink.chunk({**self.head, "object": "text_completion", "model": self.model, "choices": [],
                                   "usage": {"prompt_tokens": L, "total_tokens": L + n, "completion_tokens": n}})
            self.usage_sent = True
        if self.ids:
            self.core.metrics.rld_share.observe(self.by_pool.get("RLD", 0) / len(self.ids))
        return await self.sink.finish(self)
