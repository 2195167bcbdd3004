"""``scripts/demo --engine vllm``'s bookkeeping without servers: the rows matched to the router's
log, the run's figures from the router's metrics, the verdict against a single server, and the
conversations' prompts (each follow-up continues the answer its previous turn got)."""

from __future__ import annotations

from datetime import UTC, datetime

from prometheus_client.parser import text_string_to_metric_families

from pdd_tools.demo import RunResult, tiny
from pdd_tools.demo.report import router_summary, table
from pdd_tools.demo.vllm_runner import annotate, check_tokens

T0 = 1_800_000_000.0


def _ev(event: str, rid: str, at: float, **fields) -> dict:
    ts = datetime.fromtimestamp(T0 + at, UTC)
    return {"event": event, "request_id": rid, "timestamp": ts.isoformat().replace("+00:00", "Z"), **fields}


def _row(rid: str, at: float, prompt: int, out: int) -> dict:
    return {"request_id": rid, "sent_at": T0 + at, "prompt_tokens": prompt, "output_tokens": out, "ok": False,
            "pipeline": None, "ttft_s": 0.1}


def test_rows_get_their_pipeline_and_handoff_from_the_routers_log():
    rows = [_row("a", 0.00, 100, 40), _row("b", 0.01, 100, 40), _row("c", 0.02, 300, 5), _row("d", 0.50, 80, 30)]
    events = [
        # b's choice was logged before a's: matched by prompt length and send order all the same
        _ev("router_pipeline", "rtr-1", 0.003, pipeline="P-RLD-MD", reason="wan_over_budget", input_tokens=100,
            prefix_hit_tokens=64),
        _ev("router_pipeline", "rtr-2", 0.012, pipeline="P-RLD-MD", reason="wan_over_budget", input_tokens=100),
        _ev("router_pipeline", "rtr-3", 0.021, pipeline="P-RLD", reason="anomalous_long_input_short_output",
            input_tokens=300),
        _ev("router_handoff", "rtr-1", 0.3, mode="catch-up", position=12, outcome="switched"),
        _ev("router_handoff_stall", "rtr-1", 0.4, mode="catch-up", position=12, stall_ms=90.0),
        _ev("router_fallback", "rtr-2", 0.3, kind="md_not_ready"),
        _ev("router_pipeline", "rtr-4", 0.49, pipeline="P-MD", reason="wan_within_budget", input_tokens=80),
    ]
    annotate(rows, events)
    a, b, c, d = rows
    assert a["pipeline"] == "P-RLD-MD" and a["router_id"] == "rtr-1" and a["md_prefix_hit_tokens"] == 64
    assert a["handoff"] == {"owner": "MD", "mode": "catch-up", "reason": "switched", "position": 12, "stall_ms": 90.0}
    assert (a["rld_tokens"], a["md_tokens"]) == (12, 28)
    assert b["handoff"]["owner"] == "RLD" and b["handoff"]["reason"] == "md_not_ready" and b["rld_tokens"] == 40
    assert b["fallbacks"] == ["md_not_ready"]
    assert c["pipeline"] == "P-RLD" and (c["rld_tokens"], c["md_tokens"]) == (5, 0)
    # sent 0.5 s in, so not matched to an event logged before it was sent
    assert d["pipeline"] == "P-MD" and d["router_id"] == "rtr-4" and d["md_tokens"] == 30


def test_a_row_without_its_choice_keeps_no_pipeline():
    rows = [_row("a", 1.0, 100, 40)]
    annotate(rows, [_ev("router_pipeline", "rtr-1", 0.5, pipeline="P-MD", reason="ask_agent_off")])
    assert rows[0]["pipeline"] is None


METRICS = """
pddwire_router_pipeline_choices_total{pipeline="P-MD",reason="wan_within_budget"} 5
pddwire_router_pipeline_choices_total{pipeline="P-RLD-MD",reason="wan_over_budget"} 4
pddwire_router_pipeline_choices_total{pipeline="P-RLD",reason="anomalous_long_input_short_output"} 1
pddwire_router_handoffs_total{mode="one-shot",outcome="switched"} 2
pddwire_router_handoffs_total{mode="catch-up",outcome="switched"} 1
pddwire_router_handoffs_total{mode="undecided",outcome="rld_finished"} 1
pddwire_router_handoff_modes_total{mode="one-shot",reason="gap_small"} 2
pddwire_router_handoff_modes_total{mode="catch-up",reason="rld_headroom"} 1
pddwire_router_fallbacks_total{kind="md_not_ready"} 0
pddwire_router_output_tokens_total{pool="RLD"} 50
pddwire_router_output_tokens_total{pool="MD"} 450
"""


def test_the_runs_figures_come_from_the_routers_metrics():
    samples = [s for fam in text_string_to_metric_families(METRICS) for s in fam.samples]
    rows = [{"request_id": f"r{i}", "ok": True, "pipeline": None, "ttft_s": 0.1 * (i + 1)} for i in range(10)]
    rows[3]["mismatch_at"] = 7
    res = RunResult("pdd", rows, {"A": {"agents": {"P": {"wan_bytes": 9000, "wan_kv_bytes_tx": 8000},
                                                   "RLD": {"wan_bytes": 1000}}},
                                  "router": samples, "stalls_ms": {"one-shot": [100.0, 300.0], "catch-up": [80.0]}},
                    12.0, [])
    f = router_summary(res)
    assert f["pipelines"] == {"P-MD": 5, "P-RLD-MD": 4, "P-RLD": 1}
    assert f["handoffs"] == {"one-shot": 2, "catch-up": 1, "rld_finished": 1}
    assert f["handoff_mode_choices"] == {"one-shot/gap_small": 2, "catch-up/rld_headroom": 1}
    assert f["fallbacks"] == {}
    assert f["tokens_emitted"] == {"RLD": 50, "MD": 450} and f["rld_share"] == 0.1
    assert f["wan_bytes"] == 10000 and f["wan_bytes_per_request"] == 1000
    assert f["handoff_stall_ms"]["one-shot"] == {"n": 2, "p50": 200.0, "p99": 298.0}
    assert f["handoff_stall_ms"]["all"]["n"] == 3
    assert f["mismatches"] == 1 and f["ttft_p50_s"] == 0.55
    text = table({"pd": f, "pdd": f}, None)
    assert "RLD's share" in text and "10.0%" in text and "catch-up" in text and "9/10" in text


def test_each_request_is_held_to_the_single_servers_tokens():
    rows = [{"request_id": r, "ok": False, "ttft_s": 0.1} for r in ("same", "differs", "short", "failed")]
    rows[3]["error"] = "HTTP 502"
    res = RunResult("pd", rows, {}, 1.0, [])
    got = {"same": [5, 6, 7], "differs": [5, 9, 7], "short": [5, 6], "failed": []}
    refs = {f"pd/{r}": [5, 6, 7] for r in got}
    check_tokens({"pd": res}, {"pd": got}, refs)
    assert [r["ok"] for r in rows] == [True, False, False, False]
    assert rows[1]["mismatch_at"] == 1 and rows[2]["mismatch_at"] == 2 and "mismatch_at" not in rows[3]
    assert len(res.failures) == 3 and "position 1" in res.failures[0] and "HTTP 502" in res.failures[2]


def test_a_follow_up_continues_the_answer_its_previous_turn_got():
    trace = tiny.generate(64, 4.0, 1)
    conv = tiny.Conversations(trace, "pdd", 1)
    other = tiny.Conversations(trace, "pd", 1)
    by_conv: dict[int, list] = {}
    for r in trace:
        by_conv.setdefault(r.conversation, []).append(r)
    first, second = next(turns for c, turns in by_conv.items() if c >= 0 and len(turns) >= 2)[:2]
    assert conv.previous(second.rid) == first.rid and conv.previous(first.rid) is None
    p1 = conv.prompt(first)
    assert len(p1) == first.input_tokens and all(3 <= t < tiny.VOCAB for t in p1)
    answer = list(range(10, 10 + first.output_tokens))
    conv.answered(first.rid, answer)
    p2 = conv.prompt(second)
    assert p2[:len(p1) + len(answer)] == p1 + answer and len(p2) == second.input_tokens
    assert other.prompt(first) != p1  # each run its own tokens: PD's are not in MD's cache for PDD
    # MD is warmed with the system prompts and the histories of conversations under way at time 0
    warm = conv.warmup()
    started = [turns[0] for c, turns in by_conv.items() if c >= 0 and turns[0].turn > 0]
    assert started and {len(w) for w in warm} >= {r.prefix_hit_tokens for r in started}
    assert any(p1[:len(w)] == w for w in warm)  # a first turn starts with a warmed system prompt
