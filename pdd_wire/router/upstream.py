"""Helpers of the router's request handling: errors from upstream, the per-request trace, and
OpenAI bodies and SSE streams."""

from __future__ import annotations

import time

import aiohttp
from aiohttp import web

from .config import Member

MAX_EVENT_BYTES = 64 << 20  # one SSE event from an upstream (the router's client_max_size too)
COMPLETIONS_MAX_TOKENS = 16  # vLLM's default max_tokens for /v1/completions
# Fields of a chat request that change its prompt's tokens (passed to /tokenize).
CHAT_PROMPT_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
                      "tools", "documents", "add_special_tokens")


class UpstreamError(Exception):
    """A vLLM server answered with an error status: relayed to the client as it came."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.body, self.content_type = status, body, content_type


def error_response(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    """An error body shaped like vLLM's (``{"error": {...}}``)."""
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                             status=status)


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


def expected_output(path: str, body: dict, input_tokens: int, max_len: int | None) -> int:
    """The output length the pipeline choice assumes: what the request allows (vLLM's defaults
    when it names none)."""
    n = body.get("max_completion_tokens") or body.get("max_tokens")
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
