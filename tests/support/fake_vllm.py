"""A scripted stand-in for ``vllm serve`` (``/v1/completions``, ``/metrics``; non-streamed
``/v1/chat/completions`` and ``/v1/models``): a real aiohttp server whose answers have vLLM
0.32's shapes, for the router's splice tests (no vLLM needed).

Shapes, from ``vllm/entrypoints/openai/completion/serving.py`` and ``protocol.py``:

- a streamed chunk (``model_dump_json(exclude_unset=True)``): ``id``, ``object``, ``created``,
  ``model``, ``choices`` of one ``{index, text, logprobs, finish_reason, stop_reason,
  prompt_token_ids, token_ids}`` (``prompt_token_ids`` on the first chunk only, with
  ``return_token_ids``); ``system_fingerprint`` on the ending chunk only when no usage chunk
  follows;
- the usage chunk (``exclude_none=True``): ``choices: []``, ``usage`` (``prompt_tokens``,
  ``total_tokens``, ``completion_tokens``, ``prompt_tokens_details.cached_tokens``) and
  ``system_fingerprint``; then ``data: [DONE]``;
- logprobs: ``text_offset`` starts at 0 in each stream and advances by the length of each
  token's string (``tokens``), not of the text;
- an error event: ``data: {"error": {"message", "type", "param", "code"}}``, then ``[DONE]``;
- an abort: a chunk with ``finish_reason: "abort"`` (vLLM's own, when it pauses or shuts
  down), then the usage chunk and ``[DONE]``;
- a whole response: every ``CompletionResponse`` field;
- vLLM's request checks the router must not trip: ``max_tokens`` absent or null is 16
  (``normalize_null_max_tokens``), below 1 a 400; ``logprob_token_ids`` (and, for chat, a
  ``top_logprobs``) without ``logprobs`` a 400 (``check_logprobs``).

Chat is a sketch: any ``messages`` are the model's prompt (the fake's chat template), answered
whole (``ChatCompletionResponse``'s fields).

The model is a script: for a prompt it knows, its greedy output (:class:`Model`); a prompt of
that prompt plus the first m output tokens continues from position m, as a real engine's greedy
output would. Its detokenizer is ``DecodeStream``'s: a token's text is written out only when
every byte so far forms whole characters; primed with a prompt that ends inside a character,
the continuation misses that character (what vLLM 0.32 does). Faults are scripted per server
(:class:`Script`); every request body and every stream's fate are recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pdd_wire.router.upstream import lax_bool, lax_int  # pinned to pydantic's results in test_router_splice

FINGERPRINT = "fp_fake0032"
EOS = 2
# Token ids and their bytes: letters, a special token (no text unless skip_special_tokens is
# false; "</s>" as a logprobs token), and characters split across tokens.
VOCAB: dict[int, bytes] = {EOS: b"</s>", **{10 + i: bytes([97 + i]) for i in range(26)},
                           40: b" ", 50: b"\xc3", 51: b"\xa9", 60: b"\xe2\x82", 61: b"\xac"}


def piece(t: int) -> str:
    """The token's own string (logprobs' ``tokens``)."""
    return VOCAB[t].decode(errors="replace")


class Detok:
    """DecodeStream's rule: text comes out only as whole characters; primed with ``prompt``."""

    def __init__(self, prompt: list[int]) -> None:
        self.pending, self.lost = b"", False
        for t in prompt:
            self.step(t)
        self.lost = bool(self.pending)  # the prompt ended inside a character: it is lost

    def step(self, t: int) -> str:
        if t == EOS:
            return ""  # skip_special_tokens
        self.pending += VOCAB[t]
        try:
            text = self.pending.decode()
        except UnicodeDecodeError as exc:
            if exc.reason != "unexpected end of data":
                text = self.pending.decode(errors="replace")
            else:
                return ""
        self.pending = b""
        if self.lost:
            self.lost, text = False, text[1:]
        return text


@dataclass
class Model:
    """``prompt`` -> ``out``: the greedy output of one prompt the fake knows."""

    prompt: list[int]
    out: list[int]

    def position(self, prompt: list[int]) -> int:
        """m for a prompt of ``self.prompt + out[:m]``; ValueError: not such a prompt."""
        L = len(self.prompt)
        if prompt[:L] != self.prompt or prompt[L:] != self.out[:len(prompt) - L]:
            raise ValueError("the fake does not know this prompt")
        return len(prompt) - L


@dataclass
class Script:
    """What one server does. Positions are absolute output positions (0 = the first token)."""

    events: list[int] | None = None  # tokens per event, in turn (default 1 each), then 1s
    hold: dict[int, asyncio.Event] = field(default_factory=dict)  # wait before the event at k
    error_at: int | None = None  # an error event before position k (then [DONE])
    abort_at: int | None = None  # the event with the token at k ends "abort" (then usage, [DONE])
    abort_empty: bool = False  # ... and carries no token (k is not sent)
    garbage_at: int | None = None  # an undecodable event before k
    cut_at: int | None = None  # the connection closed before k
    cut_inside_at: int | None = None  # half an event at k, then the connection closed
    stall_at: int | None = None  # nothing more from k on (until the client goes)
    cut_after_end: bool = False  # the ending chunk, then the connection closed (no usage, no [DONE])
    done_then_stall: bool = False  # [DONE], then the connection kept open, silent
    status: int = 200  # streamed requests answered with this (an error body) instead
    answer_gate: asyncio.Event | None = None  # a streamed request waits for it before its headers
    warm_ok: bool = True  # a non-streamed request with KV params: 200, else 500
    warm_finish: str = "length"
    warm_gate: asyncio.Event | None = None  # such a request waits for it


@dataclass
class Record:
    body: dict
    kind: str  # "stream"; not streamed: "prefill" (do_remote_decode), "warm" (P's params), "whole"
    sent: list[int] = field(default_factory=list)  # token ids written
    closed_by_client: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    raw: dict = field(default_factory=dict)  # the body as it was sent (``body``: as read)


class FakeVllm:
    """One fake ``vllm serve`` on 127.0.0.1 (``url``); ``async with``."""

    def __init__(self, name: str, model: Model, script: Script | None = None) -> None:
        self.name, self.model, self.script = name, model, script or Script()
        self.requests: list[Record] = []
        self.scrapes = 0
        self.scraped = asyncio.Event()
        self.running = 0  # streams that have sent their first token and not ended
        self._runner: web.AppRunner | None = None
        self.url = ""
        self._n = 0

    async def __aenter__(self) -> "FakeVllm":
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    def streams(self) -> list[Record]:
        return [r for r in self.requests if r.kind == "stream"]

    # ------------------------------------------------------------------ endpoints
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        page = (f"# HELP vllm:num_requests_running x\nvllm:num_requests_running{{engine=\"0\"}} {self.running}.0\n"
                f"vllm:num_requests_waiting{{engine=\"0\"}} 0.0\nvllm:kv_cache_usage_perc{{engine=\"0\"}} 0.0\n")
        self.scraped.set()
        return web.Response(text=page)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "vllm",
                                                              "root": "tiny", "parent": None, "max_model_len": 2048}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.json()
        if raw.get("stream_options") and not raw.get("stream"):  # vLLM's check, on the values as sent
            return error(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
        try:  # then vLLM's lax reading (pydantic): "16" is 16, "false" is False
            body = {**raw, "stream": lax_bool(raw.get("stream") or False),
                    **({"max_tokens": lax_int(raw["max_tokens"])} if raw.get("max_tokens") is not None else {})}
        except ValueError as exc:
            return error(400, str(exc))
        rec = self._record(body, raw)
        if (refused := logprobs_refused(body, chat=False)) is not None:
            return refused
        try:
            m = self.model.position(list(body["prompt"]))
        except (ValueError, KeyError, TypeError) as exc:
            return error(400, str(exc))
        max_tokens = body.get("max_tokens")
        max_tokens = 16 if max_tokens is None else max_tokens
        if max_tokens < 1:
            return error(400, f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        end = min(len(self.model.out), m + max_tokens)
        try:
            if rec.kind != "stream":
                return await self._whole(request, rec, m, end)
            return await self._stream(request, rec, m, end)
        except asyncio.CancelledError:
            rec.closed_by_client = True  # the client went away (handler_cancellation)
            raise
        finally:
            rec.ended.set()

    def _record(self, body: dict, raw: dict | None = None) -> Record:
        """``body`` as read; ``raw`` as it was sent."""
        kv = body.get("kv_transfer_params") or {}
        kind = "stream" if body.get("stream") else "prefill" if kv.get("do_remote_decode") else \
            "warm" if kv else "whole"
        rec = Record(body, kind, raw=raw if raw is not None else body)
        self.requests.append(rec)
        return rec

    async def _chat(self, request: web.Request) -> web.Response:
        """Not streamed: the model's output for any ``messages`` (up to ``max_completion_tokens``,
        else ``max_tokens``, else the whole output: the rest of the context)."""
        body = await request.json()
        rec = self._record(body)
        rec.ended.set()
        if (refused := logprobs_refused(body, chat=True)) is not None:
            return refused
        if body.get("stream"):
            return error(400, "the fake streams /v1/completions only")
        limit = body.get("max_completion_tokens")
        limit = body.get("max_tokens") if limit is None else limit
        ids = self.model.out[:limit]
        det, prompt = Detok(self.model.prompt), self.model.prompt
        top = body.get("top_logprobs") or 0
        lp = {"content": [{"token": piece(t), "logprob": -0.01 * t, "bytes": list(VOCAB[t]),
                           "top_logprobs": [{"token": piece(t), "logprob": -0.01 * t, "bytes": list(VOCAB[t])}][:top]}
                          for t in ids]} if body.get("logprobs") else None
        kv = body.get("kv_transfer_params")
        resp = {"id": "chat" + self._id(), "object": "chat.completion", "created": int(time.time()), "model": "tiny",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(det.step(t) for t in ids),
                                                     "refusal": None, "annotations": None, "audio": None,
                                                     "function_call": None, "tool_calls": [], "reasoning": None},
                             "logprobs": lp, "finish_reason": "length", "stop_reason": None, "token_ids": None}],
                "service_tier": None, "system_fingerprint": None,
                "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(ids),
                          "completion_tokens": len(ids), "prompt_tokens_details": None},
                "prompt_logprobs": None, "prompt_token_ids": None,
                "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": self.name} if kv else None}
        return web.json_response(resp)

    async def _whole(self, request: web.Request, rec: Record, m: int, end: int) -> web.Response:
        s = self.script
        if rec.kind == "warm":
            if s.warm_gate is not None:
                await s.warm_gate.wait()
            if not s.warm_ok:
                return error(500, "the fake's warm request failed", "InternalServerError")
        ids = self.model.out[m:end]
        det = Detok(list(rec.body["prompt"]))
        text = "".join(det.step(t) for t in ids)
        finish = s.warm_finish if rec.kind == "warm" else "length"
        prompt = list(rec.body["prompt"])
        kv = ({"do_remote_prefill": True, "remote_engine_id": self.name, "pdd_request_id":
               rec.body["kv_transfer_params"].get("pdd_request_id")} if rec.body.get("kv_transfer_params") else None)
        resp = {"id": self._id(), "object": "text_completion", "created": int(time.time()), "model": "tiny",
                "choices": [{"index": 0, "text": text, "logprobs": logprobs(ids, 0)[0] if rec.body.get("logprobs")
                             is not None else None, "finish_reason": finish, "stop_reason": None,
                             "token_ids": ids if rec.body.get("return_token_ids") else None, "prompt_logprobs": None,
                             "prompt_token_ids": prompt if rec.body.get("return_token_ids") else None,
                             "routed_experts": None}],
                "service_tier": None, "system_fingerprint": FINGERPRINT,
                "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(ids),
                          "completion_tokens": len(ids), "prompt_tokens_details": None,
                          "completion_tokens_details": None},
                "kv_transfer_params": kv, "ec_transfer_params": None, "metrics": None}
        return web.json_response(resp)

    async def _stream(self, request: web.Request, rec: Record, m: int, end: int) -> web.StreamResponse:
        s, body = self.script, rec.body
        if s.status != 200:
            return error(s.status, f"the fake answers {s.status}")
        if s.answer_gate is not None:
            await s.answer_gate.wait()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        rid, created, prompt = self._id(), int(time.time()), list(body["prompt"])
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        det, want_ids, lp_n = Detok(prompt), bool(body.get("return_token_ids")), body.get("logprobs")
        sizes, pos, offset, first = list(s.events or []), m, 0, True
        started = False
        try:
            while pos < end:
                if pos in s.hold:
                    await s.hold[pos].wait()
                if s.error_at == pos:
                    await resp.write(b"data: " + json.dumps({"error": {"message": "the fake failed",
                                     "type": "InternalServerError", "param": None, "code": 500}}).encode()
                                     + b"\n\ndata: [DONE]\n\n")
                    return resp
                if s.garbage_at == pos:
                    await resp.write(b'data: {"id": "cmpl-x", "choices": [\n\n')
                if s.cut_at == pos:
                    return self._cut(request, resp)
                if s.stall_at == pos:
                    await asyncio.Event().wait()
                n = min(sizes.pop(0) if sizes else 1, end - pos)
                aborted = s.abort_at is not None and pos <= s.abort_at < pos + n
                if aborted and s.abort_empty:
                    n = 0
                ids = self.model.out[pos:pos + n]
                text = "".join(det.step(t) for t in ids)
                finish = "abort" if aborted else "length" if pos + n == end else None
                choice: dict[str, Any] = {
                    "index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                    "prompt_token_ids": prompt if want_ids and first else None, "token_ids": ids if want_ids else None}
                if lp_n is not None:
                    choice["logprobs"], offset = logprobs(ids, offset)
                chunk = {"id": rid, "object": "text_completion", "created": created, "model": "tiny",
                         "choices": [choice]}
                if finish and not include_usage:
                    chunk["system_fingerprint"] = FINGERPRINT
                data = b"data: " + json.dumps(chunk).encode() + b"\n\n"
                if s.cut_inside_at == pos:
                    await resp.write(data[:len(data) // 2])
                    return self._cut(request, resp)
                await resp.write(data)
                rec.sent += ids
                if not started:
                    started, self.running = True, self.running + 1
                pos, first = pos + n, False
                if aborted:
                    break
                await asyncio.sleep(0)  # one event per write, as a server's stream comes
            if s.cut_after_end:
                return self._cut(request, resp)
            if include_usage:
                usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + pos - m,
                         "completion_tokens": pos - m,
                         # a continuation's prompt is in the prefix cache but for its last token
                         "prompt_tokens_details": {"cached_tokens": (len(prompt) - 1) // 4 * 4 if m else 0}}
                await resp.write(b"data: " + json.dumps({"id": rid, "object": "text_completion", "created": created,
                                 "model": "tiny", "choices": [], "usage": usage,
                                 "system_fingerprint": FINGERPRINT}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            if s.done_then_stall:
                await asyncio.Event().wait()
            await resp.write_eof()
        except ConnectionError:
            rec.closed_by_client = True
        finally:
            if started:
                self.running -= 1
        return resp

    def _cut(self, request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.abort()
        return resp

    def _id(self) -> str:
        self._n += 1
        return f"cmpl-{self.name}-{self._n}"


def logprobs(ids: list[int], offset: int) -> tuple[dict, int]:
    """vLLM's ``_create_completion_logprobs`` for one chunk, and the next chunk's offset."""
    out: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for t in ids:
        out["text_offset"].append(offset)
        out["token_logprobs"].append(-0.01 * t)
        out["tokens"].append(piece(t))
        out["top_logprobs"].append({piece(t): -0.01 * t})
        offset += len(piece(t))
    return out, offset


def logprobs_refused(body: dict, *, chat: bool) -> web.Response | None:
    """vLLM 0.32's ``check_logprobs`` (chat_completion/ and completion/protocol.py): the 400 for
    ``logprob_token_ids`` or (chat) ``top_logprobs`` without ``logprobs``; None: accepted."""
    lp = body.get("logprobs")
    if body.get("logprob_token_ids") and (not lp if chat else lp is None):
        return error(400, "when using `logprob_token_ids`, `logprobs` must be set" + (" to true." if chat else "."),
                     param="logprob_token_ids")
    top = body.get("top_logprobs")
    if chat and top is not None and (top == -1 or top > 0) and not lp:
        return error(400, "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    return None


def error(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": status}},
                             status=status)


@contextlib.asynccontextmanager
async def fakes(model: Model, **scripts: Script):
    """``P``, ``RLD`` and ``MD`` fakes of one model (``scripts`` by role)."""
    async with FakeVllm("P", model, scripts.get("P")) as P, FakeVllm("RLD", model, scripts.get("RLD")) as RLD, \
            FakeVllm("MD", model, scripts.get("MD")) as MD:
        yield P, RLD, MD
