"""The demo scaled to the tiny vLLM model (``scripts/demo --engine vllm``): its constants, the
trace shape, and the conversations' token ids.

The tiny Llama of ``scripts/vllm-env`` has a 512-token context, a 444-token vocabulary and 1,024
bytes of KV per token (2 layers x K and V x 2 KV heads x 32 dims x fp32); vLLM moves it in blocks
of 32 tokens (32 KiB). It prefills a whole prompt in about 10 ms and decodes a token in about
5 ms on this machine. PDD's traffic is 64K-token prompts, 1K-token answers, 10-80 KB of KV per
token and a 10-100 Gbps line, where a low-hit request's KV takes seconds to cross. Scaled down:

* prompts of at most :data:`MAX_PROMPT` tokens (answers up to 192 fit the context); multi-turn
  conversations whose every turn is the last prompt, the answer MD gave and a short new message,
  so MD's prefix cache (DRC) holds all but the new message's blocks; first turns hit only their
  system prompt; a few one-off long prompts with 2-7-token answers, which the agents'
  anomalous-traffic filter (>= :data:`ANOMALY_MIN_INPUT` in, < :data:`ANOMALY_MAX_OUTPUT` out;
  PDD: >= 32K in, < 500 out) finishes on RLD;
* the WAN at :data:`LINK_MBIT` Mbit/s, so that one 32 KiB block takes about 90 ms to cross and a
  full prompt's KV about a second: tens of token times, as PDD's KV takes against a real model's
  compute, and plain PD's KV uses about three quarters of the link (queueing in its tail, not
  an overloaded link); the agents' TTFT budget (:data:`TTFT_BUDGET_S`, their default) lets a
  request go P-MD when its missing KV and the queue ahead of it cross within about two blocks'
  time.

:class:`Conversations` makes each request's prompt as token ids: random tokens, seeded per run
and conversation, with each follow-up built from the answer the previous turn actually got.
"""

from __future__ import annotations

import random

from .. import trace as tracemod

CONTEXT = 512  # the tiny model's max_model_len (max_position_embeddings)
VOCAB = 444  # its vocabulary; ids 0-2 are <s>, </s>, <pad>
BLOCK = 32  # tokens per vLLM block (pdd_tools.vllm.serve.BLOCK)
KV_BYTES_PER_TOKEN = 1024  # 2 layers x (K, V) x 2 KV heads x 32 x 4 bytes
PREFIX_SALT = "tiny-llama/torch.float32"  # the connector's default: model directory + dtype
MAX_PROMPT = 320  # prompts stop growing here: 320 + up to 192 answer tokens = the context
ANOMALY_MIN_INPUT, ANOMALY_MAX_OUTPUT = 288, 8
LINK_MBIT = 3.0
RTT_MS = 30.0
TTFT_BUDGET_S = 0.2
REQUESTS, RATE = 64, 4.0
# PDD's RLD is a small pool: its load (running + waiting over this) picks the handoff mode.
RLD_MAX_NUM_SEQS = 6
# Catch-up when MD is more than this behind RLD (PDD: 64 tokens of 1K answers; here of ~100).
CATCHUP_GAP = 16

# pdd_tools.trace's knobs at this scale (its defaults are PDD's shape at 24K tokens).
TRACE = dict(
    system_prompts=(32, 64, 96),  # shared per conversation; MD holds them (warmed before a run)
    system_cached_p=1.0,
    first_message=(40.0, 1.0, 8, 224),  # lognormal median, sigma, min, max: a heavy tail of low-hit turns
    message=(8.0, 0.8, 2, 96),  # a follow-up's new tokens
    output=(96.0, 0.35, 48, 192),
    evict_p=0.0,  # MD's cache is large enough here: nothing is evicted during a run
    max_context=MAX_PROMPT,
    turns_mean=12.0,
    think_s=(1.0, 2.0),
    anomalous_fraction=0.05,
    anomalous_input=(ANOMALY_MIN_INPUT, MAX_PROMPT),
    anomalous_output=(2, ANOMALY_MAX_OUTPUT - 1),
)


def scale_note(link_mbit: float) -> str:
    """What was scaled and why, for the demo's header."""
    block_ms = BLOCK * KV_BYTES_PER_TOKEN * 8 / (link_mbit * 1e6) * 1e3
    full_s = MAX_PROMPT * KV_BYTES_PER_TOKEN * 8 / (link_mbit * 1e6)
    return (f"scaled to the tiny model (context {CONTEXT} tokens, KV {KV_BYTES_PER_TOKEN} B/token, blocks of "
            f"{BLOCK} tokens = {BLOCK * KV_BYTES_PER_TOKEN >> 10} KiB; ~10 ms prefill, ~5 ms per token): prompts "
            f"up to {MAX_PROMPT} tokens, answers 48-192, anomalous {ANOMALY_MIN_INPUT}-{MAX_PROMPT} in / 2-7 out "
            f"(filter: >= {ANOMALY_MIN_INPUT} in, < {ANOMALY_MAX_OUTPUT} out); WAN {link_mbit:g} Mbit/s so that "
            f"one block crosses in {block_ms:.0f} ms and a full prompt's KV in {full_s:.1f} s, tens of token "
            f"times as PDD's KV is against a real model; TTFT budget {TTFT_BUDGET_S * 1e3:.0f} ms")


def generate(n_requests: int, rate: float, seed: int, overrides: dict | None = None) -> list[tracemod.Request]:
    return tracemod.generate(n_requests=n_requests, rate_per_s=rate, seed=seed, **(TRACE | (overrides or {})))


class Conversations:
    """The token ids of a run's requests. ``salt`` (the run's name) makes each run's tokens its
    own: the same trace replayed twice on one MD must not find the first run's conversations in
    its prefix cache.

    - :meth:`warmup` the prompts MD should hold before the run: the system prompts, and for each
      conversation already under way at time 0 its history (earlier turns, before the trace).
    - :meth:`prompt` a request's prompt; a follow-up needs :meth:`answered` of its previous turn.
    """

    def __init__(self, trace: list[tracemod.Request], salt: str, seed: int) -> None:
        self.salt, self.seed = salt, seed
        self.trace = trace
        self._prev: dict[str, str] = {}  # request -> the previous turn of its conversation in the trace
        last: dict[int, str] = {}
        for r in trace:
            if r.conversation >= 0:
                if r.conversation in last:
                    self._prev[r.rid] = last[r.conversation]
                last[r.conversation] = r.rid
        self._prompt: dict[str, list[int]] = {}
        self._answer: dict[str, list[int]] = {}
        self._systems = {n: self._tokens(f"system-{n}", n) for n in TRACE["system_prompts"]}
        self._history: dict[int, list[int]] = {}
        for r in trace:
            if r.conversation >= 0 and r.conversation not in self._history:
                # The conversation's first request in the trace: turn 0 hits its system prompt;
                # a later turn hits the history before it, which MD served before time 0.
                self._history[r.conversation] = (self._systems.get(r.prefix_hit_tokens, []) if r.turn == 0 else
                                                 self._tokens(f"history-{r.conversation}", r.prefix_hit_tokens))

    def _tokens(self, what: str, n: int) -> list[int]:
        rng = random.Random(f"{self.seed}/{self.salt}/{what}")
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    def warmup(self) -> list[list[int]]:
        return [*self._systems.values(), *(h for h in self._history.values() if h)]

    def previous(self, rid: str) -> str | None:
        """The request whose answer ``rid``'s prompt continues (None: none in the trace)."""
        return self._prev.get(rid)

    def prompt(self, r: tracemod.Request) -> list[int]:
        """``r``'s prompt: for a one-off request its own tokens; for a conversation's first request
        in the trace its history and a new message; for a later one the previous prompt, the
        answer it got (:meth:`answered`) and a new message."""
        if r.conversation < 0:
            p = self._tokens(r.rid, r.input_tokens)
        else:
            prev = self._prev.get(r.rid)
            head = self._history[r.conversation] if prev is None else self._prompt[prev] + self._answer[prev]
            p = head + self._tokens(r.rid, max(0, r.input_tokens - len(head)))
        self._prompt[r.rid] = p
        return p

    def answered(self, rid: str, tokens: list[int]) -> None:
        self._answer[rid] = list(tokens)
