"""``scripts/bench --only router``'s figures assembled without servers: the overhead as the
router's percentile minus direct's, the stalls of planned switches only and by mode, PDD's TTFT
against plain PD's of the same run, and no figure from a run that failed."""

from __future__ import annotations

import pytest

from pdd_tools import bench_router
from pdd_tools.demo import DemoConfig, RunResult


def _by_name(rows: list[dict]) -> dict[str, dict]:
    return {r["figure"]: r for r in rows}


def test_the_overhead_is_the_routers_percentile_minus_directs():
    direct = [0.001 * (i + 1) for i in range(100)]  # 1..100 ms per token
    routed = [d + 0.0005 for d in direct]  # half a millisecond more on each
    rows = _by_name(bench_router.overhead_rows(direct, routed))
    assert set(rows) == {"router_token_overhead_p50_ms", "router_token_overhead_p99_ms"}
    p99 = rows["router_token_overhead_p99_ms"]
    assert p99["value"] == pytest.approx(0.5, abs=1e-3) and p99["unit"] == "ms"
    assert p99["baseline_value"] == pytest.approx(99.01, abs=1e-2) and "direct p99" in p99["baseline"]
    assert "100 requests each way" in p99["note"]


def _stall(mode: str, ms: float, outcome: str = "switched", rounds: int = 0) -> dict:
    return {"event": "router_handoff_stall", "mode": mode, "stall_ms": ms, "outcome": outcome, "rounds": rounds}


def test_stalls_count_planned_switches_only_by_mode():
    logs = [_stall("one-shot", 10.0), _stall("one-shot", 30.0),
            _stall("one-shot", 900.0, outcome="rld_failed"),  # MD's receive in it: not a switch's stall
            _stall("catch-up", 4.0, rounds=2), _stall("catch-up", 6.0, rounds=5),
            {"event": "router_handoff", "mode": "catch-up", "stall_ms": 1000.0, "outcome": "switched"}]
    tpot = {"one-shot": [0.002, 0.004], "catch-up": [0.003, 0.003]}
    rows = _by_name(bench_router.stall_rows(logs, tpot, {"one-shot": 3, "catch-up": 2}))
    assert set(rows) == {f"router_handoff_stall_{m}_p{q}_ms" for m in ("oneshot", "catchup") for q in (50, 99)}
    assert rows["router_handoff_stall_oneshot_p50_ms"]["value"] == 20.0
    assert rows["router_handoff_stall_oneshot_p99_ms"]["value"] == pytest.approx(29.8)
    assert rows["router_handoff_stall_oneshot_p99_ms"]["baseline_value"] == pytest.approx(3.98)
    assert rows["router_handoff_stall_catchup_p50_ms"]["value"] == 5.0
    assert "2 one-shot handoffs" in rows["router_handoff_stall_oneshot_p50_ms"]["note"]
    assert "absorb rounds per switch: 2-5" in rows["router_handoff_stall_catchup_p99_ms"]["note"]


def test_no_stall_figure_without_a_handoff_in_each_mode():
    logs = [_stall("one-shot", 10.0), _stall("catch-up", 5.0, outcome="rld_failed")]
    with pytest.raises(SystemExit, match="catch-up"):
        bench_router.stall_rows(logs, {"one-shot": [0.002], "catch-up": [0.002]}, {"one-shot": 1, "catch-up": 0})


def _figures() -> dict:
    return {"link": {"where": "loopback"},
            "pd": {"ttft_p50_s": 0.4, "ttft_p99_s": 2.0},
            "pdd": {"ttft_p50_s": 0.2, "ttft_p99_s": 0.8, "pipelines": {"P-MD": 10, "P-RLD-MD": 6},
                    "handoffs": {"one-shot": 4, "catch-up": 2}, "rld_share": 0.12}}


def test_pdds_ttft_has_plain_pds_of_the_same_run_as_its_baseline():
    cfg = DemoConfig(engine="vllm", requests=16, link_mbit=3.0, rtt_ms=40.0)
    ok = {k: RunResult(k, [], {}, 1.0, []) for k in ("pd", "pdd")}
    rows = _by_name(bench_router.pdd_rows(_figures(), ok, cfg))
    p99 = rows["router_pdd_ttft_p99"]
    assert (p99["value"], p99["baseline_value"], p99["unit"]) == (0.8, 2.0, "s")
    assert "plain PD" in p99["baseline"] and "P-RLD-MD 6" in p99["note"] and "3 Mbit/s RTT 40 ms" in p99["note"]
    assert rows["router_pdd_ttft_p50"]["value"] == 0.2


def test_no_pdd_figure_from_a_run_with_a_mismatch():
    cfg = DemoConfig(engine="vllm", requests=16)
    bad = {"pd": RunResult("pd", [], {}, 1.0, []),
           "pdd": RunResult("pdd", [], {}, 1.0, ["pdd r3: tokens differ from the single server's at position 7"])}
    with pytest.raises(SystemExit, match="position 7"):
        bench_router.pdd_rows(_figures(), bad, cfg)
