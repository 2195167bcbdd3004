"""The pipeline and handoff-mode choices (pdd_wire/policy.py): every rule and its boundaries."""

from __future__ import annotations

import math

import msgspec
import pytest

from pdd_wire.policy import (
    Decision,
    HandoffPolicy,
    LinkFigures,
    ModeDecision,
    PipelineConfig,
    RequestFigures,
    choose_handoff_mode,
    choose_pipeline,
    missing_kv_bytes,
    predict_wan_s,
)

KB = 1000
GBPS = 1e9 / 8  # bytes per second in one Gbit/s
KV = 50 * KB  # a 1T-class model's KV per token (PDD.md: 10-80 KB)
WAN = LinkFigures(bandwidth_Bps=100 * GBPS, queue_bytes=0, rtt_s=0.020)
WAN10 = LinkFigures(bandwidth_Bps=10 * GBPS, queue_bytes=0, rtt_s=0.020)
CFG = PipelineConfig()  # budget 0.2 s, filter >= 32768 input and < 500 output

# Exact binary fractions for the budget boundary: 1 byte per token at 1024 B/s, RTT 1/8 s.
EXACT = LinkFigures(bandwidth_Bps=1024.0, queue_bytes=0, rtt_s=0.125)
QUARTER = PipelineConfig(ttft_budget_s=0.25)


def req(inp, hit, out=1000):
    return RequestFigures(input_tokens=inp, prefix_hit_tokens=hit, expected_output_tokens=out)


PIPELINE_CASES = [
    # --- the anomalous-traffic filter: the only way to P-RLD
    pytest.param(req(32768, 0, 499), WAN, KV, CFG, "P-RLD", "anomalous_long_input_short_output",
                 id="filter-at-both-bounds"),
    pytest.param(req(200_000, 0, 1), WAN, KV, CFG, "P-RLD", "anomalous_long_input_short_output",
                 id="filter-ultra-long"),
    pytest.param(req(32768, 32768, 10), WAN, KV, CFG, "P-RLD", "anomalous_long_input_short_output",
                 id="filter-whatever-the-hit"),
    pytest.param(req(32767, 32000, 499), WAN, KV, CFG, "P-MD", "wan_within_budget", id="filter-input-one-short"),
    pytest.param(req(32768, 32000, 500), WAN, KV, CFG, "P-MD", "wan_within_budget", id="filter-output-at-limit"),
    pytest.param(req(32768, 0, 500), WAN10, KV, CFG, "P-RLD-MD", "wan_over_budget",
                 id="filter-output-at-limit-low-hit"),
    pytest.param(req(65536, 0, 100), WAN, KV, PipelineConfig(anomaly_filter=False), "P-RLD-MD", "wan_over_budget",
                 id="filter-off-never-p-rld"),
    pytest.param(req(1000, 0, 10), WAN, KV, PipelineConfig(anomaly_min_input_tokens=1000,
                                                           anomaly_max_output_tokens=11),
                 "P-RLD", "anomalous_long_input_short_output", id="filter-configured"),
    # --- P-MD: the missing KV crosses within the budget
    pytest.param(req(65536, 62259), WAN, KV, CFG, "P-MD", "wan_within_budget", id="high-hit-95pct"),
    pytest.param(req(65536, 65536), WAN, KV, CFG, "P-MD", "wan_within_budget", id="full-hit"),
    pytest.param(req(0, 0), WAN, KV, CFG, "P-MD", "wan_within_budget", id="empty-prompt"),
    pytest.param(req(128, 0), EXACT, 1, QUARTER, "P-MD", "wan_within_budget", id="budget-exactly-met"),
    # --- P-RLD-MD: RLD masks the WAN
    pytest.param(req(129, 0), EXACT, 1, QUARTER, "P-RLD-MD", "wan_over_budget", id="budget-one-token-over"),
    pytest.param(req(65536, 0), WAN, KV, CFG, "P-RLD-MD", "wan_over_budget", id="no-hit-64k"),
    pytest.param(req(65536, 62259), WAN10, KV, CFG, "P-MD", "wan_within_budget", id="high-hit-10gbps"),
    pytest.param(req(65536, 62259), LinkFigures(bandwidth_Bps=10 * GBPS, queue_bytes=2 * 10**8, rtt_s=0.02), KV,
                 CFG, "P-RLD-MD", "wan_over_budget", id="high-hit-behind-a-queue"),
    pytest.param(req(65536, 65536), LinkFigures(bandwidth_Bps=100 * GBPS, rtt_s=0.3), KV, CFG, "P-RLD-MD",
                 "wan_over_budget", id="rtt-alone-over-budget"),
    pytest.param(req(100, 99), LinkFigures(bandwidth_Bps=0.0), KV, CFG, "P-RLD-MD", "wan_over_budget",
                 id="no-bandwidth-estimate"),
    pytest.param(req(65536, 0), WAN, KV, PipelineConfig(ttft_budget_s=1.0), "P-MD", "wan_within_budget",
                 id="larger-budget"),
    pytest.param(req(65536, 0), WAN, 0, CFG, "P-MD", "wan_within_budget", id="zero-kv-per-token"),
]


@pytest.mark.parametrize("request_, link, kv, cfg, pipeline, reason", PIPELINE_CASES)
def test_choose_pipeline(request_, link, kv, cfg, pipeline, reason):
    d = choose_pipeline(request_, link, kv, cfg)
    assert (d.pipeline, d.reason) == (pipeline, reason), d.detail
    if pipeline == "P-RLD":
        assert d.predicted_wan_s == 0.0  # nothing crosses
    else:
        assert d.predicted_wan_s == predict_wan_s(missing_kv_bytes(request_, kv), link)
        assert d.detail  # the figures, for a log line


def test_predicted_wan_time_formula():
    link = LinkFigures(bandwidth_Bps=1e9, queue_bytes=5 * 10**8, rtt_s=0.04)
    r = req(65536, 65536 - 10_000)
    assert missing_kv_bytes(r, KV) == 10_000 * KV
    # missing / bandwidth + queue / bandwidth + RTT
    assert predict_wan_s(missing_kv_bytes(r, KV), link) == pytest.approx(0.5 + 0.5 + 0.04)
    assert choose_pipeline(r, link, KV) == Decision("P-RLD-MD", "wan_over_budget", pytest.approx(1.04),
                                                    choose_pipeline(r, link, KV).detail)
    assert math.isinf(predict_wan_s(1, LinkFigures(bandwidth_Bps=0)))


MODE_CASES = [
    pytest.param(0.1, 0, HandoffPolicy(), "one-shot", "gap_small", id="no-gap"),
    pytest.param(0.1, 64, HandoffPolicy(), "one-shot", "gap_small", id="gap-at-threshold"),
    pytest.param(0.99, 64, HandoffPolicy(), "one-shot", "gap_small", id="gap-at-threshold-busy"),
    pytest.param(0.1, 65, HandoffPolicy(), "catch-up", "rld_headroom", id="gap-over-threshold-idle"),
    pytest.param(0.79, 65, HandoffPolicy(), "catch-up", "rld_headroom", id="load-just-under-busy"),
    pytest.param(0.8, 65, HandoffPolicy(), "one-shot", "rld_busy", id="load-at-busy"),
    pytest.param(1.5, 10_000, HandoffPolicy(), "one-shot", "rld_busy", id="overloaded"),
    pytest.param(0.0, 10_000, HandoffPolicy(), "catch-up", "rld_headroom", id="idle-long-gap"),
    pytest.param(0.5, 9, HandoffPolicy(busy_load=0.6, catchup_gap_tokens=8), "catch-up", "rld_headroom",
                 id="configured-catch-up"),
    pytest.param(0.6, 9, HandoffPolicy(busy_load=0.6, catchup_gap_tokens=8), "one-shot", "rld_busy",
                 id="configured-busy"),
    pytest.param(0.0, 1, HandoffPolicy(busy_load=0.0, catchup_gap_tokens=0), "one-shot", "rld_busy",
                 id="always-one-shot"),
]


@pytest.mark.parametrize("load, gap, policy, mode, reason", MODE_CASES)
def test_choose_handoff_mode(load, gap, policy, mode, reason):
    d = choose_handoff_mode(load, gap, policy)
    assert isinstance(d, ModeDecision) and (d.mode, d.reason) == (mode, reason) and d.detail


@pytest.mark.parametrize("make", [
    pytest.param(lambda: req(-1, 0), id="negative-input"),
    pytest.param(lambda: req(10, 11), id="hit-over-input"),
    pytest.param(lambda: req(10, -1), id="negative-hit"),
    pytest.param(lambda: req(10, 1, -1), id="negative-output"),
    pytest.param(lambda: LinkFigures(bandwidth_Bps=-1.0), id="negative-bandwidth"),
    pytest.param(lambda: LinkFigures(bandwidth_Bps=float("nan")), id="nan-bandwidth"),
    pytest.param(lambda: LinkFigures(bandwidth_Bps=1.0, queue_bytes=-1), id="negative-queue"),
    pytest.param(lambda: LinkFigures(bandwidth_Bps=1.0, rtt_s=-0.1), id="negative-rtt"),
    pytest.param(lambda: PipelineConfig(ttft_budget_s=-1.0), id="negative-budget"),
    pytest.param(lambda: PipelineConfig(anomaly_min_input_tokens=0), id="zero-filter-input"),
    pytest.param(lambda: HandoffPolicy(max_catchup_rounds=0), id="zero-rounds"),
    pytest.param(lambda: HandoffPolicy(catchup_gap_tokens=-1), id="negative-gap-threshold"),
    pytest.param(lambda: choose_pipeline(req(1, 0), WAN, -1), id="negative-kv-per-token"),
    pytest.param(lambda: choose_handoff_mode(-0.1, 1), id="negative-load"),
    pytest.param(lambda: choose_handoff_mode(0.1, -1), id="negative-gap"),
])
def test_nonsense_is_refused(make):
    with pytest.raises(ValueError):
        make()


def test_configs_decode_strictly():
    dec = msgspec.json.Decoder(PipelineConfig)
    assert dec.decode(b'{"ttft_budget_s": 0.5}') == PipelineConfig(ttft_budget_s=0.5)
    with pytest.raises(msgspec.ValidationError, match="ttf_budget_s"):
        dec.decode(b'{"ttf_budget_s": 0.5}')  # unknown key
    with pytest.raises(msgspec.ValidationError, match="anomaly_filter"):
        dec.decode(b'{"anomaly_filter": "yes"}')
    with pytest.raises(msgspec.ValidationError, match="ttft_budget_s"):
        dec.decode(b'{"ttft_budget_s": -1}')  # __post_init__ runs on decode too
    assert msgspec.json.decode(b'{"busy_load": 0.5}', type=HandoffPolicy) == HandoffPolicy(busy_load=0.5)
    with pytest.raises(AttributeError):
        CFG.ttft_budget_s = 1.0  # frozen
