"""A synthetic request trace shaped like PDD's traffic: multi-turn conversations, a skewed prefix
hit distribution, and a few "ultra-long input, ultra-short output" requests. Seeded, deterministic.

What it reproduces of the traffic PDD is designed for:

* **multi-turn conversations** (chat and agent traffic): each turn's prompt is the previous
  prompt, the previous answer and a new user message (or tool output); the main decoder (MD)
  decoded the previous answer, so its prefix cache holds everything but the new message. The
  first turn of a conversation hits only a shared system prompt (when MD has it cached); once
  in a while (``evict_p``) a follow-up finds its prefix evicted and hits only the system prompt.
* **the hit distribution**: mean prefix hit about 90% on MD, 70-80% of requests above 95%, and a
  few low-hit requests (first turns, evictions, the anomalous ones) that carry most of the KV
  bytes and all of the WAN's tail (``tests/test_sim.py`` holds the generator to these figures).
* **the anomalous traffic** PDD filters onto RLD: ``anomalous_fraction`` (3.5%) of requests are
  one-off long documents (no hit) with a short answer.

Scale: PDD's workload is 64K-token prompts and 1K-token answers on a 10-100 Gbps line; this
trace is scaled to one machine and a demo that runs in about a minute per pipeline: prompts up
to ``max_context`` (24K) tokens, answers of 96-480 tokens, anomalous prompts of 16-28K tokens
with 8-64-token answers. The demo's agent config scales the anomalous-traffic filter the same
way (PDD: input >= 32K and output < 500; here input >= 16K and output < 80).

The stream is stationary: conversations start (Poisson) well before the trace's time 0 and the
trace keeps the first ``n_requests`` requests from time 0 on, so most of them are follow-up
turns of conversations already under way, as in a live service. ``rate_per_s`` is the mean
request rate. Each request's ``prefix_hit_tokens`` is what MD's prefix cache would hold; the
simulated prefill engine reads it from the trace and ships only the missing suffix. This stands
in for the decode-side prefix inventory (:mod:`pdd_wire.desk.inventory`): running it for real would
keep every conversation's prefix resident on the simulated MD (about 5.7 GB at the demo's scale).

``python -m pdd_tools.trace [--requests N] [--seed S]`` prints the trace's statistics.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import random
import sys
from dataclasses import dataclass

__all__ = ["Request", "TraceConfig", "generate", "stats"]


@dataclass(frozen=True)
class Request:
    """One request of the trace."""

    rid: str
    arrival_s: float  # seconds after the trace's start
    input_tokens: int  # prompt length
    prefix_hit_tokens: int  # leading prompt tokens whose KV MD already holds
    output_tokens: int  # answer length (the router's estimate is taken to be exact)
    conversation: int = -1  # -1: a one-off (anomalous) request
    turn: int = 0
    anomalous: bool = False

    @property
    def hit(self) -> float:
        return self.prefix_hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def missing_tokens(self) -> int:
        """Prompt tokens MD lacks: the KV that must cross the WAN."""
        return self.input_tokens - self.prefix_hit_tokens

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Request":
        return cls(**d)


@dataclass(frozen=True)
class TraceConfig:
    """The trace's knobs; the defaults give PDD's hit distribution (see the module docstring)."""

    n_requests: int = 240
    rate_per_s: float = 6.0  # mean arrival rate of requests
    seed: int = 1
    turns_mean: float = 14.0  # turns per conversation (geometric)
    think_s: tuple[float, float] = (2.0, 6.0)  # gap between turns: fixed part + exponential mean
    system_prompts: tuple[int, ...] = (1024, 2048, 3072)  # shared prompts; one per conversation
    system_cached_p: float = 0.95  # MD's cache holds the conversation's system prompt
    first_message: tuple[float, float, int, int] = (1000.0, 0.8, 128, 12000)  # lognormal median, sigma, min, max
    message: tuple[float, float, int, int] = (90.0, 1.2, 8, 6000)  # a follow-up's new tokens (user or tool)
    output: tuple[float, float, int, int] = (180.0, 0.45, 96, 480)
    evict_p: float = 0.025  # a follow-up whose conversation prefix MD evicted
    max_context: int = 24576  # a conversation ends before its prompt would exceed this
    anomalous_fraction: float = 0.035
    anomalous_input: tuple[int, int] = (16384, 28672)
    anomalous_output: tuple[int, int] = (8, 64)

    def __post_init__(self) -> None:
        if self.n_requests < 1:
            raise ValueError("n_requests must be >= 1")
        if not (self.rate_per_s > 0 and math.isfinite(self.rate_per_s)):
            raise ValueError("rate_per_s must be > 0")
        if self.turns_mean < 1:
            raise ValueError("turns_mean must be >= 1")
        if not 0 <= self.anomalous_fraction < 1:
            raise ValueError("anomalous_fraction must be in [0, 1)")


def _lognormal(rng: random.Random, spec: tuple[float, float, int, int]) -> int:
    median, sigma, lo, hi = spec
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def _conversation(rng: random.Random, cfg: TraceConfig, cid: int, start: float) -> list[Request]:
    system = rng.choice(cfg.system_prompts)
    cached_system = system if rng.random() < cfg.system_cached_p else 0
    turns = 1
    while rng.random() > 1.0 / cfg.turns_mean:  # geometric, mean turns_mean
        turns += 1
    out = []
    t = start
    prompt = system + _lognormal(rng, cfg.first_message)
    hit = cached_system
    for k in range(turns):
        if prompt > cfg.max_context:
            break
        answer = _lognormal(rng, cfg.output)
        out.append(Request(f"c{cid}-t{k}", t, prompt, hit, answer, conversation=cid, turn=k))
        # Next turn: the whole previous exchange is MD's prefix (it decoded the answer itself),
        # unless it was evicted meanwhile.
        hit = prompt + answer
        if rng.random() < cfg.evict_p:
            hit = cached_system
        prompt = prompt + answer + _lognormal(rng, cfg.message)
        t += cfg.think_s[0] + rng.expovariate(1.0 / cfg.think_s[1])
    return out


def generate(cfg: TraceConfig | None = None, **kw) -> list[Request]:
    """The first ``cfg.n_requests`` requests from time 0 of a stationary stream, by arrival.
    Keyword arguments override fields of ``cfg`` (or of the default config)."""
    cfg = dataclasses.replace(cfg or TraceConfig(), **kw) if kw else (cfg or TraceConfig())
    rng = random.Random(cfg.seed)
    # Requests per conversation, roughly: turns_mean, fewer when max_context cuts it short.
    per_conv = _mean_turns(cfg)
    conv_rate = cfg.rate_per_s * (1 - cfg.anomalous_fraction) / per_conv
    gap_mean = cfg.think_s[0] + cfg.think_s[1]
    warmup = 4 * cfg.turns_mean * gap_mean  # long enough for the stream to be stationary at 0
    horizon = cfg.n_requests / cfg.rate_per_s * 1.5 + 10
    heap: list[tuple[float, int, Request]] = []
    seq = 0
    t = -warmup
    cid = 0
    while t < horizon:
        t += rng.expovariate(conv_rate)
        for r in _conversation(rng, cfg, cid, t):
            if r.arrival_s >= 0:
                heapq.heappush(heap, (r.arrival_s, seq, r))
                seq += 1
        cid += 1
    if cfg.anomalous_fraction > 0:
        arng = random.Random(cfg.seed * 1_000_003 + 7)  # its own stream: the fraction moves nothing else
        t, k = 0.0, 0
        while True:
            t += arng.expovariate(cfg.rate_per_s * cfg.anomalous_fraction)
            if t >= horizon:
                break
            n_in = arng.randint(*cfg.anomalous_input)
            heapq.heappush(heap, (t, seq, Request(f"x{k}", t, n_in, 0, arng.randint(*cfg.anomalous_output),
                                                  anomalous=True)))
            seq += 1
            k += 1
    out = [heapq.heappop(heap)[2] for _ in range(min(cfg.n_requests, len(heap)))]
    if len(out) < cfg.n_requests:  # cannot happen with the horizon above; be loud if it does
        raise RuntimeError(f"trace generator made {len(out)} requests, {cfg.n_requests} asked")
    return [dataclasses.replace(r, arrival_s=round(r.arrival_s, 6)) for r in out]


def _mean_turns(cfg: TraceConfig) -> float:
    """Requests per conversation, estimated from a fixed-seed sample of conversations."""
    rng = random.Random(12345)
    n = 400
    return max(1.0, sum(len(_conversation(rng, cfg, i, 0.0)) for i in range(n)) / n)


def stats(reqs: list[Request], kv_bytes_per_token: int = 4096) -> dict:
    """The figures PDD's traffic is described by, plus the KV bytes that would cross the WAN."""
    n = len(reqs)
    hits = [r.hit for r in reqs]
    missing = [r.missing_tokens * kv_bytes_per_token for r in reqs]
    low = sorted(missing, reverse=True)
    top10 = sum(low[: max(1, n // 10)])
    span = reqs[-1].arrival_s - reqs[0].arrival_s if n > 1 else 0.0
    return {
        "requests": n,
        "conversations": len({r.conversation for r in reqs if r.conversation >= 0}),
        "span_s": round(span, 3),
        "rate_per_s": round((n - 1) / span, 3) if span else None,
        "mean_hit": round(sum(hits) / n, 4),
        "frac_hit_above_95": round(sum(h > 0.95 for h in hits) / n, 4),
        "frac_hit_below_50": round(sum(h < 0.5 for h in hits) / n, 4),
        "anomalous_fraction": round(sum(r.anomalous for r in reqs) / n, 4),
        "mean_input_tokens": round(sum(r.input_tokens for r in reqs) / n, 1),
        "mean_output_tokens": round(sum(r.output_tokens for r in reqs) / n, 1),
        "missing_kv_bytes": sum(missing),
        "missing_kv_bytes_not_anomalous": sum(m for m, r in zip(missing, reqs) if not r.anomalous),
        "top10pct_share_of_bytes": round(top10 / sum(missing), 4) if sum(missing) else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdd_tools.trace", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=TraceConfig.n_requests)
    ap.add_argument("--rate", type=float, default=TraceConfig.rate_per_s)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kv-bytes-per-token", type=int, default=4096)
    ap.add_argument("--dump", action="store_true", help="print the requests as JSON lines too")
    args = ap.parse_args(argv)
    reqs = generate(n_requests=args.requests, rate_per_s=args.rate, seed=args.seed)
    print(json.dumps(stats(reqs, args.kv_bytes_per_token), indent=2))
    if args.dump:
        for r in reqs:
            print(json.dumps(r.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
