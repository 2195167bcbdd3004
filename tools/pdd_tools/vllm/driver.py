"""PDD roles around offline vLLM engines: prefill (P), relay decode (RLD), main decode (MD).

The KV moves through :class:`~pdd_wire.adapters.vllm_connector.PddWireConnector` (real vLLM
KV cache blocks, zero-copy through the agents). The handoff of a request's output from RLD to
MD is driven here, outside vLLM's scheduler, with the engine socket's handoff ops
(``proto/engine.md`` §7) around a hand-stepped ``LLMEngine`` (one request at a time per
engine; ``VLLM_ENABLE_V1_MULTIPROCESSING=0``):

- :func:`prefill`: the prompt with ``max_tokens=1``; the connector sends its KV to the
  destinations and the call returns once every destination has answered.
- :func:`decode`: plain P-MD decode: the prompt's KV comes from the agent, vLLM recomputes the
  last prompt token and decodes on.
- :class:`RelayDecode`: ``handoff_rld``, then the request with the prompt's KV from P; one
  engine step per token, each reported with ``handoff_tokens``; ``emit`` events say what reaches
  the user. ``stop_generating`` pauses the request (vLLM keeps its KV, nothing is stepped);
  ``handoff_done`` (owner MD) aborts it; ``start_generating`` resumes it.
- :class:`MainDecode`: ``handoff_md``, then a *load* request (the prompt, ``max_tokens=1``)
  whose KV lands from P; vLLM's prefix cache keeps its full blocks. Each ``extend`` event starts
  a request ``prompt + absorbed relay tokens``: a suffix prefill over the cached prompt blocks
  (the extend step: the relay tokens' KV is computed, not shipped), stepped once; its sampled
  token is MD's token at ``absorbed``. ``handoff_extended`` follows. On ``start_generating``
  that same request is stepped on (MD decodes from the commit position), each token reported
  with ``handoff_tokens``; a later ``extend`` replaces it by a longer one.

Simplified here (see the README section): one request per engine at a time; the prompt's
partial last block (fewer than ``block_size`` tokens) is recomputed by MD's first extend rather
than taken from the shipped KV (vLLM's prefix cache keeps full blocks only); greedy sampling.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

from pdd_wire.adapters.loop_thread import LoopThread
from pdd_wire.engine import protocol as p
from pdd_wire.engine.client import EngineClient

KV_CACHE_BYTES = 64 << 20  # each tiny engine's KV cache: the tiny Llama's blocks for a few requests
HANDOFF_EVENTS = (p.Emit, p.Extend, p.StopGenerating, p.StartGenerating, p.HandoffDone)


def connector_config(socket: str, role: str, **extra: Any) -> dict:
    """The ``kv_transfer_config`` dict for :class:`PddWireConnector` (role: producer/consumer/both)."""
    return {"kv_connector": "PddWireConnector",
            "kv_connector_module_path": "pdd_wire.adapters.vllm_connector",
            "kv_role": {"producer": "kv_producer", "consumer": "kv_consumer", "both": "kv_both"}[role],
            "kv_connector_extra_config": {"engine_socket": socket, **extra}}


@dataclasses.dataclass
class Result:
    tokens: list[int]
    num_cached_tokens: int | None
    kv_transfer_params: dict | None
    finish_reason: str | None
    seconds: float


class Engine:
    """An in-process offline vLLM engine, stepped by hand. ``kv`` is :func:`connector_config`'s
    dict or None; other keyword arguments go to ``vllm.LLM``."""

    def __init__(self, model: str, *, kv: dict | None = None, **llm_kwargs: Any) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        from vllm.config import KVTransferConfig

        kw = dict(dtype="float32", enforce_eager=True, block_size=32, max_model_len=512, seed=0,
                  kv_cache_memory_bytes=KV_CACHE_BYTES, enable_prefix_caching=False)
        kw.update(llm_kwargs)
        if kv is not None:
            kw["kv_transfer_config"] = KVTransferConfig(**kv)
        self.llm = LLM(model=model, **kw)
        self.engine = self.llm.llm_engine
        self._n = 0

    def add(self, prompt: list[int], max_tokens: int, kv_params: dict | None = None) -> str:
        from vllm import SamplingParams

        self._n += 1
        req_id = f"r{self._n}"
        extra = {"kv_transfer_params": kv_params} if kv_params else None
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        self.engine.add_request(req_id, {"prompt_token_ids": list(prompt)}, sp)
        return req_id

    def step(self) -> dict[str, Any]:
        """One engine step; the latest (cumulative) output per external request id."""
        return {o.request_id: o for o in self.engine.step()}

    def abort(self, req_id: str) -> None:
        self.engine.abort_request([req_id])

    def settle(self, timeout: float = 30) -> None:
        """Step until nothing is left, e.g. a producer's blocks held until its sends are done."""
        end = time.monotonic() + timeout
        while self.engine.has_unfinished_requests():
            if time.monotonic() > end:
                raise TimeoutError("vLLM still has unfinished requests (KV sends not confirmed?)")
            if not self.engine.step():
                time.sleep(0.002)

    def run(self, prompt: list[int], max_tokens: int, kv_params: dict | None = None, *,
            timeout: float = 60) -> Result:
        t0 = time.monotonic()
        req_id = self.add(prompt, max_tokens, kv_params)
        out = None
        end = t0 + timeout
        while out is None or not out.finished:
            if time.monotonic() > end:
                self.abort(req_id)
                raise TimeoutError(f"request {kv_params} did not finish in {timeout} s")
            o = self.step().get(req_id)
            if o is None:
                time.sleep(0.002)  # e.g. waiting for remote KV: the engine only polls
            else:
                out = o
        self.settle(max(1.0, end - time.monotonic()))
        c = out.outputs[0]
        return Result(list(c.token_ids), out.num_cached_tokens, out.kv_transfer_params, c.finish_reason,
                      time.monotonic() - t0)

    def reset_prefix_cache(self) -> bool:
        return self.llm.reset_prefix_cache()


def prefill(engine: Engine, rid: str, prompt: list[int], to: list[str], *, deadline_s: float | None = None,
            timeout: float = 60) -> Result:
    """P: compute the prompt's KV and send it to ``to``; returns once every destination answered."""
    kv = {"pdd_request_id": rid, "send_to": list(to)}
    if deadline_s is not None:
        kv["deadline_s"] = deadline_s
    return engine.run(prompt, 1, kv, timeout=timeout)


def decode(engine: Engine, rid: str, prompt: list[int], n_tokens: int, *, from_site: str | None = None,
           timeout: float = 60) -> Result:
    """MD in the P-MD pipeline: the prompt's KV from the agent, then ``n_tokens`` greedy tokens."""
    return engine.run(prompt, n_tokens, {"pdd_request_id": rid, "from_site": from_site,
                                         "num_tokens": len(prompt)}, timeout=timeout)


class Agent:
    """A synchronous handle on an :class:`EngineClient` for the handoff (own loop thread)."""

    def __init__(self, socket: str, name: str) -> None:
        self.lt = LoopThread(f"pdd-wire-{name}")
        self.eng = self.lt.run(EngineClient(socket, name).connect())

    def call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        return self.lt.run(getattr(self.eng, op)(*args, **kwargs))

    def take(self, rid: str) -> list[p.Msg]:
        async def take():
            return self.eng.take(rid, kinds=HANDOFF_EVENTS)

        return self.lt.run(take())

    def next(self, rid: str, timeout: float) -> p.Msg:
        return self.lt.run(self.eng.wait(rid, kinds=HANDOFF_EVENTS, timeout=timeout), timeout + 5)

    def close(self) -> None:
        self.lt.close(self.eng.close())


@dataclasses.dataclass
class HandoffResult:
    emitted: dict[int, int]  # position -> token: what this engine sent to the user
    generated: list[int]  # the tokens it computed, from its first position
    first_position: int
    done: dict | None  # the handoff_done event
    events: list[str]
    detail: dict = dataclasses.field(default_factory=dict)


def _done(ev: p.HandoffDone) -> dict:
    return {"owner": ev.owner, "reason": ev.reason, "mode": ev.mode, "position": ev.position}


class RelayDecode:
    """RLD for one request: decode from position 0 on the prompt's KV from P and hand over to
    MD at ``md`` (its site or site/node). ``step_delay_s`` paces decoding (a stand-in for a
    bigger model's step time, so that MD can catch up mid-stream); ``on_token(position)`` is
    called after each reported token."""

    def __init__(self, engine: Engine, agent: Agent, rid: str, prompt: list[int], n_tokens: int, md: str, *,
                 from_site: str | None = None, step_delay_s: float = 0.0,
                 on_token: Callable[[int], None] | None = None) -> None:
        self.engine, self.agent, self.rid = engine, agent, rid
        self.prompt, self.n, self.md = list(prompt), n_tokens, md
        self.from_site, self.step_delay_s, self.on_token = from_site, step_delay_s, on_token

    def run(self, timeout: float = 120) -> HandoffResult:
        res = HandoffResult({}, [], 0, None, [])
        end = time.monotonic() + timeout
        self.agent.call("handoff_rld", self.rid, self.md)
        req = self.engine.add(self.prompt, self.n, {"pdd_request_id": self.rid, "from_site": self.from_site,
                                                    "num_tokens": len(self.prompt)})
        generating, live, seen = True, True, 0
        try:
            while True:
                for ev in self.agent.take(self.rid):
                    generating = self._handle(ev, res, generating)
                if res.done is not None and (res.done["owner"] == "MD" or len(res.generated) == self.n):
                    return res
                if time.monotonic() > end:
                    raise TimeoutError(f"RLD {self.rid}: no handoff outcome in {timeout} s ({res.events})")
                if generating and len(res.generated) < self.n:
                    out = self.engine.step().get(req)
                    if out is None:
                        time.sleep(0.001)
                        continue
                    if out.num_cached_tokens is not None:
                        res.detail["num_cached_tokens"] = out.num_cached_tokens
                    toks = list(out.outputs[0].token_ids)
                    live = not out.finished
                    for tok in toks[seen:]:
                        pos = len(res.generated)
                        res.generated.append(tok)
                        self.agent.call("handoff_tokens", self.rid, [tok], last=pos == self.n - 1)
                        if self.on_token is not None:
                            self.on_token(pos)
                    seen = len(toks)
                    if self.step_delay_s:
                        time.sleep(self.step_delay_s)
                else:
                    generating = self._handle(self.agent.next(self.rid, max(0.1, end - time.monotonic())), res,
                                              generating)
        finally:
            if live:
                self.engine.abort(req)  # MD took over (or we failed): free the request's KV

    def _handle(self, ev: p.Msg, res: HandoffResult, generating: bool) -> bool:
        if isinstance(ev, p.Emit):
            for i, tok in enumerate(ev.tokens):
                res.emitted[ev.first + i] = tok
        elif isinstance(ev, p.StopGenerating):
            res.events.append(f"stop@{len(res.generated)}")
            return False
        elif isinstance(ev, p.StartGenerating):
            res.events.append(f"resume@{ev.position}")
            return True
        elif isinstance(ev, p.HandoffDone):
            res.done = _done(ev)
            res.events.append(f"done:{ev.owner}:{ev.reason}")
        return generating


class MainDecode:
    """MD for one request: load the prompt's KV from P (site ``from_site``), absorb RLD's tokens
    with extend steps, take over at the commit position and decode to ``n_tokens``."""

    def __init__(self, engine: Engine, agent: Agent, rid: str, prompt: list[int], n_tokens: int, rld: str, *,
                 from_site: str | None = None) -> None:
        self.engine, self.agent, self.rid = engine, agent, rid
        self.prompt, self.n, self.rld = list(prompt), n_tokens, rld
        self.from_site = from_site if from_site is not None else rld.split("/")[0]

    def run(self, timeout: float = 120) -> HandoffResult:
        res = HandoffResult({}, [], 0, None, [])
        end = time.monotonic() + timeout
        self.agent.call("handoff_md", self.rid, self.rld)
        load = self.engine.run(self.prompt, 1, {"pdd_request_id": self.rid, "from_site": self.from_site,
                                                "num_tokens": len(self.prompt)}, timeout=timeout)
        res.detail.update(load_cached_tokens=load.num_cached_tokens, load_token=load.tokens[0],
                          load_s=round(load.seconds, 3), extends=[])
        absorbed: list[int] = []
        req: str | None = None  # the latest extend request, paused after its first token
        nxt: int | None = None  # its sampled token: MD's token at position len(absorbed)
        seen = 0
        try:
            while res.done is None or res.done["owner"] != "RLD":
                remaining = end - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"MD {self.rid}: no takeover in {timeout} s ({res.events})")
                ev = self.agent.next(self.rid, remaining)
                if isinstance(ev, p.Extend):
                    if ev.first != len(absorbed):
                        raise AssertionError(f"MD {self.rid}: extend from {ev.first}, absorbed {len(absorbed)}")
                    absorbed.extend(ev.tokens)
                    if req is not None:
                        self.engine.abort(req)
                    t0 = time.monotonic()
                    req = self.engine.add(self.prompt + absorbed, max(1, self.n - len(absorbed)))
                    out = self._step_until_token(req, end)
                    nxt, seen = out.outputs[0].token_ids[0], 1
                    res.detail["extends"].append({"first": ev.first, "count": len(ev.tokens),
                                                  "cached": out.num_cached_tokens,
                                                  "ms": round(1000 * (time.monotonic() - t0), 1)})
                    res.events.append(f"extend:{ev.first}+{len(ev.tokens)}")
                    self.agent.call("handoff_extended", self.rid, len(absorbed))
                elif isinstance(ev, p.StartGenerating):
                    res.events.append(f"start@{ev.position}")
                    if ev.position != len(absorbed) or req is None:
                        raise AssertionError(f"MD {self.rid}: start at {ev.position}, absorbed {len(absorbed)}")
                    res.first_position = ev.position
                    self._decode(req, nxt, seen, ev.position, res, end)
                    req = None
                    self._drain(res, end)
                    return res
                else:
                    self._other(ev, res)
            return res  # RLD kept the request
        finally:
            if req is not None:
                self.engine.abort(req)

    def _step_until_token(self, req: str, end: float):
        while True:
            if time.monotonic() > end:
                raise TimeoutError(f"MD {self.rid}: extend step timed out")
            out = self.engine.step().get(req)
            if out is not None and out.outputs[0].token_ids:
                return out
            if out is None:
                time.sleep(0.001)

    def _decode(self, req: str, first_tok: int, seen: int, position: int, res: HandoffResult, end: float) -> None:
        pending = [first_tok]
        pos = position
        finished = self.n - position <= 1
        while True:
            for tok in pending:
                res.generated.append(tok)
                self.agent.call("handoff_tokens", self.rid, [tok], last=pos == self.n - 1)
                pos += 1
            for ev in self.agent.take(self.rid):
                self._other(ev, res)
            if pos >= self.n or finished:
                return
            if time.monotonic() > end:
                raise TimeoutError(f"MD {self.rid}: decode timed out at {pos}")
            out = self.engine.step().get(req)
            if out is None:
                pending = []
                time.sleep(0.001)
                continue
            toks = list(out.outputs[0].token_ids)
            pending, seen = toks[seen:], len(toks)
            finished = out.finished

    def _drain(self, res: HandoffResult, end: float) -> None:
        """Until every position this engine reported was allowed out (emit) and the handoff is done."""
        while res.done is None or len(res.emitted) < len(res.generated):
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"MD {self.rid}: emitted {len(res.emitted)} of {len(res.generated)}")
            self._other(self.agent.next(self.rid, remaining), res)

    def _other(self, ev: p.Msg, res: HandoffResult) -> None:
        if isinstance(ev, p.Emit):
            for i, tok in enumerate(ev.tokens):
                res.emitted[ev.first + i] = tok
        elif isinstance(ev, p.HandoffDone):
            res.done = _done(ev)
            res.events.append(f"done:{ev.owner}:{ev.reason}")
        elif isinstance(ev, (p.Extend, p.StartGenerating)):
            raise AssertionError(f"MD {self.rid}: unexpected {type(ev).__name__} while decoding")
