"""Each request's pipeline, and its MD member, from P's agent (``choose_pipeline``).

The router asks P's agent as an engine named ``router`` (one connection per P member), with the
prompt's token count, the expected output and, with ``choice.block_tokens`` and
``choice.prefix_salt``, the prompt's block hashes as PddWireConnector names them. P's agent asks
the MD node in ``to`` (PREFIX_QUERY) how much of the prompt its prefix inventory holds, and
decides from that and the live link (:func:`pdd_wire.policy.choose_pipeline`).

**MD by prefix**: with several MD members (and block hashes), the agent is asked once for each
of the ``choice.md_candidates`` least-loaded members, at once; the member holding the longest
prefix wins, least-loaded among equals, and its answer is the request's pipeline. Members that
did not answer within ``choice.timeout_s`` are left out; none answering: P-MD on the
least-loaded member (``choice_failed``). Each ask is one choice at P's agent (its
``pddwire_pipeline_choices_total``) and leases the matched blocks on that MD node for the
request; the members not chosen keep theirs until ``transfer.prefix_lease_s`` runs out.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import aiohttp
import structlog

from ..engine.client import EngineClient
from ..engine.hashes import chain_hashes, layer_hashes
from ..errors import PddWireError
from .core import Core, Req
from .pools import NoMember, Upstream
from .upstream import UpstreamError, batched, dest, expected_output, tokenize_request

log = structlog.get_logger("pdd_wire.router")

_FAILURES = (PddWireError, aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, TypeError,
             UpstreamError, NoMember)
PIPELINES = ("P-MD", "P-RLD", "P-RLD-MD")


def well_formed(d: object, input_tokens: int) -> bool:
    """An answer of ``choose_pipeline`` the router can act on (another agent version's, or a
    broken one's, is not): a prefix hit within the prompt."""
    if not (isinstance(d, dict) and d.get("pipeline") in PIPELINES and isinstance(d.get("reason"), str)):
        return False
    hit = d.get("prefix_hit_tokens") or 0
    return type(hit) is int and 0 <= hit <= input_tokens


class Chooser:
    def __init__(self, core: Core) -> None:
        self.core = core
        self._engines: dict[Upstream, EngineClient] = {}  # P member -> its agent, as engine "router"
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        engines, self._engines = list(self._engines.values()), {}
        for eng in engines:
            await eng.close()

    async def forget(self, P: Upstream) -> None:
        """A P member left its pool: close its agent connection."""
        eng = self._engines.pop(P, None)
        if eng is not None:
            await eng.close()

    async def choose(self, req: Req) -> None:
        """Set the request's pipeline (``req.trace.pipeline``), prompt ids and MD member; logged
        (``router_pipeline``) and counted with the reason."""
        fields: dict[str, Any] = {}
        if batched(req.body):
            # Several prompts in one request would share one transfer name: MD computes them.
            pipeline, reason = "MD", "batched_prompts"
        elif not self.core.cfg.choice.ask_agent:
            pipeline, reason = "P-MD", "ask_agent_off"
        else:
            pipeline, reason, fields = await self._ask(req)
        req.trace.pipeline = pipeline
        self.core.metrics.pipelines.labels(pipeline=pipeline, reason=reason).inc()
        log.info("router_pipeline", request_id=req.rid, pipeline=pipeline, reason=reason, **fields)

    async def _ask(self, req: Req) -> tuple[str, str, dict]:
        ch, core = self.core.cfg.choice, self.core
        P = core.pools.pick("P")
        if not P.member.engine_socket:
            return "P-MD", "no_engine_socket", {}
        candidates = core.pools.ranked("MD")[:ch.md_candidates]
        deadline = time.monotonic() + ch.timeout_s
        try:
            async with asyncio.timeout(ch.timeout_s):
                toks, max_len = await self._prompt_tokens(P, req.path, req.body)
                eng = await self._engine(P)
            expected = expected_output(req.path, req.read, len(toks), max_len)
            # PddWireConnector names one agent block per vLLM block and layer; a vLLM block
            # is in MD's prefix inventory when its layer 0 is (a match counts whole blocks).
            hashes = layer_hashes(chain_hashes(toks, ch.block_tokens, model=ch.prefix_salt), 1) \
                if ch.block_tokens and ch.prefix_salt else []
            if not hashes:
                candidates = candidates[:1]  # no inventory to ask: the least-loaded one
            answers = await self._ask_each(P, eng, req.rid, candidates, len(toks), expected, hashes,
                                           deadline - time.monotonic())
        except _FAILURES as exc:
            core.fallback(req.rid, "choice_failed", error=repr(exc))
            return "P-MD", "choice_failed", {}
        # The longest prefix held; least-loaded among equals (candidates are in that order).
        M, d = max(answers, key=lambda a: int(a[1].get("prefix_hit_tokens") or 0))
        req.p, req.md, req.trace.prompt_ids = P, M, toks
        hit = int(d.get("prefix_hit_tokens") or 0)
        core.metrics.prompt_tokens.labels(source="md_prefix").inc(hit)
        core.metrics.prompt_tokens.labels(source="missing").inc(len(toks) - hit)
        req.planned_wan_bytes = self._planned_bytes(len(toks), hit)
        fields = {"input_tokens": len(toks), "expected_output_tokens": expected, "md": M.url,
                  "prefix_hit_tokens": hit, "prefix_source": d.get("prefix_source"),
                  "predicted_wan_s": d.get("predicted_wan_s")}
        if len(candidates) > 1:
            fields["md_prefixes"] = {u.url: int(a.get("prefix_hit_tokens") or 0) for u, a in answers}
        return d["pipeline"], d["reason"], fields

    async def _ask_each(self, P: Upstream, eng: EngineClient, rid: str, candidates: list[Upstream],
                        input_tokens: int, expected: int, hashes: list[int],
                        left_s: float) -> list[tuple[Upstream, dict]]:
        """P's agent's answer for each MD candidate that answered within ``left_s`` (in the
        candidates' order), a malformed one left out; TimeoutError: none did; ValueError: none
        was well formed."""
        ch = self.core.cfg.choice
        if not candidates:
            raise NoMember("pool MD has no member")
        tasks = [asyncio.ensure_future(eng.choose_pipeline(
            rid, to=dest(M.member), input_tokens=input_tokens, expected_output_tokens=expected,
            kv_bytes_per_token=ch.kv_bytes_per_token, block_hashes=hashes or None,
            block_tokens=ch.block_tokens if hashes else 0)) for M in candidates]
        try:
            await asyncio.wait(tasks, timeout=max(0.0, left_s))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        answers, errors = [], []
        for M, t in zip(candidates, tasks):
            if t.cancelled():
                continue
            if (exc := t.exception()) is not None:
                errors.append(exc)
                if isinstance(exc, OSError):  # the agent went away: connect again next time
                    await self.forget(P)
                continue
            if not well_formed(d := t.result(), input_tokens):
                errors.append(ValueError(f"a malformed answer from P's agent: {d!r:.300}"))
                continue
            answers.append((M, d))
        if not answers:
            if errors:
                raise errors[0]
            raise TimeoutError(f"P's agent answered for none of {len(candidates)} MD members in time")
        return answers

    def _planned_bytes(self, input_tokens: int, hit: int) -> int:
        """KV bytes the prefill sends to MD's site: the blocks MD's inventory lacks."""
        ch = self.core.cfg.choice
        if ch.block_tokens:
            blocks = math.ceil(input_tokens / ch.block_tokens) - hit // ch.block_tokens
            return max(blocks, 1 if input_tokens else 0) * ch.block_tokens * ch.kv_bytes_per_token
        return (input_tokens - hit) * ch.kv_bytes_per_token

    async def _engine(self, P: Upstream) -> EngineClient:
        """P's agent, as engine "router" (one connection per P member, opened when first asked)."""
        async with self._lock:
            eng = self._engines.get(P)
            if eng is not None and eng.broken is not None:  # the agent ended it (restarted, err id 0)
                self._engines.pop(P, None)
                await eng.close()
                eng = None
            if eng is None:
                eng = self._engines[P] = await EngineClient(P.member.engine_socket, "router").connect()
            return eng

    async def _prompt_tokens(self, P: Upstream, path: str, body: dict) -> tuple[list[int], int | None]:
        """The prompt's token ids (asked of P's ``/tokenize`` unless the request gives them), and
        the model's context length when P told it."""
        ids, tok = tokenize_request(path, body)
        if ids is not None:
            return ids, None
        got = await self.core.post_json(P, "/tokenize", tok)
        return list(got["tokens"]), got.get("max_model_len")
