"""Helpers of the router's request handling: errors from upstream, the per-request trace, and
OpenAI bodies and SSE streams."""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator

import aiohttp
import msgspec
from aiohttp import web

from .config import Member

MAX_EVENT_BYTES = 64 << 20  # one SSE event from an upstream (the router's client_max_size too)
COMPLETIONS_MAX_TOKENS = 16  # vLLM's default max_tokens for /v1/completions
# Fields of a chat request that change its prompt's tokens (passed to /tokenize).
CHAT_PROMPT_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
                      "tools", "documents", "add_special_tokens")
# The logprobs fields, dropped together where the router drops logprobs: vLLM refuses
# ``top_logprobs`` and ``logprob_token_ids`` without ``logprobs``.
LOGPROBS = ("logprobs", "top_logprobs", "logprob_token_ids")


class UpstreamError(Exception):
    """A vLLM server answered with an error status: relayed to the client as it came."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.body, self.content_type = status, body, content_type


#: The most of one upstream answer the router reads to parse it (prefill's answer, a probe's, an
#: error body): more is an upstream failure, not the router's memory. A non-streamed answer it
#: relays whole to the user may be larger (server.RELAY_MAX_BODY).
MAX_UPSTREAM_BODY = 64 << 20


def bad_gateway(message: str) -> UpstreamError:
    """An upstream answer the router cannot use, relayed as 502 (an upstream failed)."""
    return UpstreamError(502, msgspec.json.encode(_error(502, message, "BadGatewayError")), "application/json")


async def read_capped(r: aiohttp.ClientResponse, limit: int | None = None) -> bytes:
    """``r``'s body, at most ``limit`` bytes (default :data:`MAX_UPSTREAM_BODY`; more:
    :func:`bad_gateway`)."""
    limit = MAX_UPSTREAM_BODY if limit is None else limit
    if r.content_length is not None and r.content_length > limit:
        raise bad_gateway(f"the upstream answer is {r.content_length} bytes, over the router's {limit}")
    buf = bytearray()
    async for chunk in r.content.iter_chunked(1 << 16):
        buf += chunk
        if len(buf) > limit:
            raise bad_gateway(f"the upstream answer is over the router's {limit} bytes")
    return bytes(buf)


async def error_of(r: aiohttp.ClientResponse) -> UpstreamError:
    """``r``'s answer, not 200, as the UpstreamError to relay (one over the limit: a bad gateway)."""
    try:
        return UpstreamError(r.status, await read_capped(r), r.content_type or "application/json")
    except UpstreamError as exc:
        return exc


class BadField(ValueError):
    """A request field vLLM would refuse (``param``: the field): the router's own 400."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def _error(status: int, message: str, kind: str, param: str | None = None) -> dict:
    """An error body shaped like vLLM's."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> web.Response:
    """An error answer shaped like vLLM's (``{"error": {...}}``)."""
    return web.json_response(_error(status, message, kind, param), status=status)


def token_count(ev: dict) -> int:
    """Output tokens in one streamed chunk (completions or chat): the token ids when vLLM returns
    them, else 1 for a chunk that carries text."""
    n = 0
    for c in ev.get("choices") or ():
        ids = c.get("token_ids")
        if ids:
            n += len(ids)
            continue
        text = c.get("text")
        if text is None:
            text = (c.get("delta") or {}).get("content")
        if text:
            n += 1
    return n


class Trace:
    """Per-request timing for the metrics."""

    def __init__(self, pipeline: str) -> None:
        self.pipeline = pipeline
        self.t0 = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.prompt_ids: list[int] | None = None  # the prompt's token ids, when the choice needed them

    def saw(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
        self.last = now
        self.tokens += n



def batched(body: dict) -> bool:
    """Several prompts in one /v1/completions request (a list of texts or of token lists)."""
    prompt = body.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(x, (str, list)) for x in prompt)


def dest(m: Member) -> str:
    """Where P's agent sends a decode member's KV (``send_to``, ``choose_pipeline(to=)``)."""
    if m.site and m.node:
        return f"{m.site}/{m.node}"
    return m.site


# pydantic's lax mode (vLLM's request models): a string is stripped of Rust's whitespace (Python's
# less \x1c-\x1f), then read as ASCII digits, with a sign, ``_`` between digits, and a ``.0`` tail.
_SPACE = "".join(c for c in map(chr, range(0x3001)) if c.isspace() and not "\x1c" <= c <= "\x1f")
_INT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")
_TRUE, _FALSE = {"1", "on", "t", "true", "y", "yes"}, {"0", "off", "f", "false", "n", "no"}


def lax_int(v: object) -> int:
    """``v`` as vLLM reads an ``int`` field (pydantic, lax): an int, a bool, a float without a
    fraction, or a string of one (``" 16 "``, ``"+16"``, ``"1_6"``, ``"16.0"``). ValueError:
    what vLLM refuses (``16.5``, ``"1e1"``, ``"0x10"``, ``"abc"``, ``[1]``, null)."""
    if isinstance(v, int):  # a bool too
        return int(v)
    if isinstance(v, float) and math.isfinite(v) and v.is_integer() and abs(v) < 2.0 ** 63:
        return int(v)
    if isinstance(v, str) and _INT.fullmatch(s := v.strip(_SPACE)):
        return int(s.split(".")[0].replace("_", ""))
    raise ValueError("Input should be a valid integer")


def lax_bool(v: object) -> bool:
    """``v`` as vLLM reads a ``bool`` field (pydantic, lax): a bool, 0 or 1, or one of pydantic's
    words (``"true"``, ``"no"``, ``"1"``, any case, no whitespace). ValueError: anything else."""
    if isinstance(v, (bool, int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and (w := v.lower()) in _TRUE | _FALSE:
        return w in _TRUE
    raise ValueError("Input should be a valid boolean")


# vLLM 0.32's types (completion/ and chat_completion/protocol.py) of the fields the router
# computes with: field -> (reader, whether null is allowed).
_COMMON = {"max_tokens": (lax_int, True), "min_tokens": (lax_int, False), "stream": (lax_bool, True),
           "return_token_ids": (lax_bool, True), "skip_special_tokens": (lax_bool, False),
           "spaces_between_special_tokens": (lax_bool, False)}
_FIELDS = {"/v1/completions": {**_COMMON, "n": (lax_int, False), "echo": (lax_bool, True)},
           "/v1/chat/completions": {**_COMMON, "n": (lax_int, True), "max_completion_tokens": (lax_int, True),
                                    "echo": (lax_bool, False)}}


def check_fields(path: str, body: dict) -> dict:
    """``body`` with the fields the router computes with read as vLLM reads them (``"16"`` is
    16): what the router decides with. ``body`` itself goes upstream as it came, since vLLM runs
    some checks on the values as sent. BadField: a value vLLM would refuse."""
    opts = body.get("stream_options")
    if opts and not body.get("stream"):  # vLLM's check, on the values as they came
        raise BadField("stream_options", "Stream options can only be defined when `stream=True`.")
    if opts is not None and not isinstance(opts, dict):
        raise BadField("stream_options", f"Input should be a valid dictionary, got {_shown(opts)}")
    read = dict(body)
    if opts is not None:
        read["stream_options"] = opts = dict(opts)
    fields = [(read, k, *how) for k, how in _FIELDS[path].items()]
    if opts is not None:
        fields.append((opts, "include_usage", lax_bool, True))
    for d, k, reader, nullable in fields:
        if k not in d or (d[k] is None and nullable):
            continue
        try:
            d[k] = reader(d[k])
        except ValueError as exc:
            name = f"stream_options.{k}" if d is opts else k
            raise BadField(name, f"{exc}, got {_shown(d[k])}") from None
    return read


def _shown(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 200 else text[:200] + "...[truncated]"


def expected_output(path: str, body: dict, input_tokens: int, max_len: int | None) -> int:
    """The output length the pipeline choice assumes: what the request allows (vLLM's defaults
    when it names none; ``max_completion_tokens`` is chat's only)."""
    n = body.get("max_completion_tokens") if path != "/v1/completions" else None
    n = body.get("max_tokens") if n is None else n
    if isinstance(n, int) and n > 0:
        return n
    if path == "/v1/completions":
        return COMPLETIONS_MAX_TOKENS
    return max(0, max_len - input_tokens) if max_len else COMPLETIONS_MAX_TOKENS


async def sse_events(content: aiohttp.StreamReader):
    """The SSE events of a stream (vLLM ends each with a blank line, ``\\n\\n``), each with its
    terminator, bytes as they came; up to :data:`MAX_EVENT_BYTES` each (a first event carries
    the prompt's ids). ClientPayloadError: the stream ended inside an event (it was cut), or an
    event is longer."""
    buf = bytearray()
    async for chunk in content.iter_any():
        start = max(0, len(buf) - 1)  # what was there had no terminator
        buf += chunk
        while (i := buf.find(b"\n\n", start)) >= 0:
            yield bytes(buf[:i + 2])
            del buf[:i + 2]
            start = 0
        if len(buf) > MAX_EVENT_BYTES:
            raise aiohttp.ClientPayloadError(f"an event longer than {MAX_EVENT_BYTES} bytes")
    if buf.strip():
        raise aiohttp.ClientPayloadError(f"the stream ended inside an event ({len(buf)} bytes unterminated)")


async def paced_events(events: AsyncIterator[bytes], silent_s: float, what: str) -> AsyncGenerator[bytes, None]:
    """``events`` as they come: the first whenever it comes (a queued request, a prompt's KV still
    on its way), each later one within ``silent_s`` of the one before. A stream silent that long
    after its first event has failed: ``aiohttp.ServerTimeoutError`` naming ``what`` and the key."""
    limit = asyncio.timeout(None)  # the first event: no limit
    while True:
        try:
            async with limit:
                event = await anext(events)
        except StopAsyncIteration:
            return
        except TimeoutError:
            if not limit.expired():
                raise  # not ours (an aiohttp read timeout)
            raise aiohttp.ServerTimeoutError(f"{what} went silent mid-stream: no event for "
                                             f"{silent_s:g} s (request.stream_silent_s)") from None
        yield event
        limit = asyncio.timeout(silent_s)


def tokenize_request(path: str, body: dict) -> tuple[list[int] | None, dict]:
    """(the prompt's token ids when the request gives them, else None; the body of a
    ``/tokenize`` request that gives them). ValueError: a prompt neither text nor token ids."""
    prompt = body.get("prompt")
    if path != "/v1/completions":
        return None, {"model": body.get("model"), "messages": body.get("messages"),
                      **{k: body[k] for k in CHAT_PROMPT_FIELDS if k in body}}
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt, {}
    if not isinstance(prompt, str):
        raise ValueError("the prompt is neither text nor token ids")
    req = {"model": body.get("model"), "prompt": prompt}
    if "add_special_tokens" in body:
        req["add_special_tokens"] = body["add_special_tokens"]
    return None, req
