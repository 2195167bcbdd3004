"""The user's answer to one P-RLD-MD request, spliced from upstream streams at token positions.

Each upstream stream is a :class:`Segment`: RLD's from position 0, then MD's continuation (its
prompt the user's prompt plus the ``base`` tokens relayed before it), then, if MD fails, RLD's
or P's from where MD left it. :class:`Output` relays their events so that the user sees one
stream: every position once and in order, one ``id`` and ``created`` (the first segment's),
``usage`` counted as one request's, one ending and one ``[DONE]``. Token ids are stripped
unless the client asked for them (the router always asks: it continues from them).

Where another engine may continue (:meth:`Output.clean`): vLLM's detokenizer (0.32: a
``tokenizers`` ``DecodeStream`` primed with the prompt's ids) starts from the new prompt, whose
tail may end inside a character; the continuation's text then misses that character. So a
planned switch happens at position 0 or where the last :data:`WHOLE_RUN` tokens each came as
one event with whole text (no U+FFFD): the upstream's detokenizer had then written out every
byte, and the continuation's text continues it exactly (checked on the tiny model's byte-level
vocabulary, special tokens included: 12,000 random prompt/output/position cases, every one).

Sinks: :class:`StreamSink` writes SSE to the client as events come; :class:`CollectSink`
gathers them and answers one JSON body (a non-streamed request run P-RLD-MD).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from .core import SSE_HEADERS, Core, Req
from .upstream import COMPLETIONS_MAX_TOKENS

WHOLE_RUN = 1  # trailing one-token events with whole text before another engine may continue
STREAM = web.RequestKey("pdd_stream", web.StreamResponse)  # the client's stream, once started
DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """Writing to the client failed: it is gone (not an upstream's failure)."""


class SegmentFailed(Exception):
    """An upstream stream failed: refused, an error status, an error event, or cut before its
    last token. ``cause``: what happened."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(repr(cause))
        self.cause = cause


@dataclass(eq=False)
class Segment:
    pool: str
    base: int  # output tokens relayed before this segment (its prompt = user's prompt + those)
    text0: int  # characters of output text relayed before it (logprobs' text_offset)
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


class Output:
    """One request's spliced output. ``ids``: every output token relayed, in position order."""

    def __init__(self, core: Core, req: Req, sink: StreamSink | CollectSink) -> None:
        body = req.body
        self.core, self.req, self.sink = core, req, sink
        self.want_ids = bool(body.get("return_token_ids"))
        self.streamed = isinstance(sink, StreamSink)
        self.want_usage = not self.streamed or bool((body.get("stream_options") or {}).get("include_usage"))
        self.max_tokens = body.get("max_tokens") or COMPLETIONS_MAX_TOKENS
        self.model = body.get("model")
        self.prompt_ids = req.trace.prompt_ids or []
        self.ids: list[int] = []
        self.head: dict = {}  # the first event's id and created: every event carries them
        self.whole_run = 0
        self.finished = False
        self.text_chars = 0
        self.last_at: float | None = None  # when the last token was relayed
        self._prompt_ids_sent = False
        self.by_pool: dict[str, int] = {}

    def clean(self) -> bool:
        """Whether another engine may continue from here with the same text."""
        return not self.ids or self.whole_run >= WHOLE_RUN

    def segment(self, pool: str) -> Segment:
        return Segment(pool, len(self.ids), self.text_chars)

    def body_from_here(self, path_body: dict) -> dict:
        """The body that continues the output from its current position: the user's request
        with the prompt's ids plus every id relayed, the rest of ``max_tokens``, no KV params."""
        m = len(self.ids)
        cont = {**path_body, "prompt": self.prompt_ids + self.ids, "max_tokens": self.max_tokens - m,
                "return_token_ids": True, "stream": True,
                "stream_options": {**(path_body.get("stream_options") or {}), "include_usage": True}}
        for k in ("kv_transfer_params", "prompt_logprobs", "max_completion_tokens"):
            cont.pop(k, None)
        if path_body.get("min_tokens"):
            cont["min_tokens"] = max(0, path_body["min_tokens"] - m)
        return cont

    async def feed(self, event: bytes, seg: Segment) -> None:
        """One SSE event of ``seg``'s stream. SegmentFailed: an error event."""
        if event.startswith(b"data: {"):
            ev = self.core.decoder.decode(event[6:])
            if "error" in ev and not ev.get("choices"):
                raise SegmentFailed(RuntimeError(f"{seg.pool} sent an error event: {ev['error']}"))
            await self.relay(ev, seg)
        elif event.startswith(b"data: [DONE]"):
            return  # one [DONE], at the very end (finish)
        elif event.strip():
            await self.sink.write(event)  # a keep-alive comment

    async def relay(self, ev: dict, seg: Segment) -> None:
        choices = ev.get("choices") or []
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
            lp = c.get("logprobs")
            if seg.text0 and lp and lp.get("text_offset"):
                lp["text_offset"] = [o + seg.text0 for o in lp["text_offset"]]
            if not self.want_ids:
                c.pop("token_ids", None)
            if keep_prompt and c.get("prompt_token_ids") is not None:
                self._prompt_ids_sent = True
            elif "prompt_token_ids" in c:
                c.pop("prompt_token_ids")
        if ev.get("usage"):
            self._usage(ev["usage"], seg)
            if not self.want_usage:
                ev.pop("usage")
                if not choices:
                    return  # the usage chunk the router asked for itself
        self.ids += ids
        self.text_chars += len(text)
        if ids:
            now = self.last_at = time.monotonic()
            seg.first_at = seg.first_at or now
            seg.tokens += len(ids)
            self.by_pool[seg.pool] = self.by_pool.get(seg.pool, 0) + len(ids)
            self.core.metrics.output_tokens.labels(pool=seg.pool).inc(len(ids))
            if self.streamed:  # TTFT and TPOT are of what the client sees as it comes
                self.req.trace.saw(len(ids))
        await self.sink.chunk(ev)

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
        if self.ids:
            self.core.metrics.rld_share.observe(self.by_pool.get("RLD", 0) / len(self.ids))
        return await self.sink.finish(self)
