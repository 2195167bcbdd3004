"""The demo end to end at small scale: real agents (subprocesses), the simulated engines in their
own processes, a shaped WAN, the trace replayed as plain PD and as PDD.

One run on loopback (the shaper does delay and rate), one in two network namespaces (tbf on the
veth, the shaper in site A in front of MD's agent). These tests run as root, as CI does.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from pdd_tools import demo
from pdd_tools.sim import check_stream

# A short trace: answers of ~100 tokens, more anomalous requests than usual so that a few are
# in 20-30 requests, anomalous prompts small enough for small pools.
TRACE = dict(output=(110.0, 0.2, 96, 140), anomalous_fraction=0.1, anomalous_input=(16384, 20000))
POOLS = {"P": 192, "RLD": 192, "MD": 192}
PNG = b"\x89PNG\r\n\x1a\n"


def _cfg(tmp_path, **kw) -> demo.DemoConfig:
    base = dict(out=str(tmp_path / "out"), requests=30, rate=8.0, seed=3, link_mbit=300, rtt_ms=30, jitter_ms=2,
                trace_overrides=TRACE, pool_mib=POOLS, quiet=True, timeout_s=60)
    return demo.DemoConfig(**(base | kw))


def _check(figures: dict, results: dict, out) -> None:
    assert set(results) == {"pd", "pdd"}
    for res in results.values():
        assert res.failures == [], res.failures[:5]
        assert len(res.requests) == len(res.streams) > 0
        for row in res.requests:
            assert row["ok"], row
            # every position emitted exactly once, in order, with the model's token, across RLD and MD
            check_stream(row["request_id"], row["output_tokens"], *res.streams[row["request_id"]])
            assert row["ttft_s"] > 0
    pd, pdd = results["pd"].requests, results["pdd"].requests
    assert all(r["pipeline"] == "P-MD" for r in pd)
    pipes = {r["pipeline"] for r in pdd}
    assert "P-RLD-MD" in pipes  # at least the first request (no bandwidth estimate yet)
    assert ("P-RLD" in pipes) == any(r["anomalous"] for r in pdd)
    handed = [r for r in pdd if r["pipeline"] == "P-RLD-MD"]
    assert all(r["handoff"]["owner"] in ("MD", "RLD") for r in handed)
    assert figures["pdd"]["tokens_emitted"]["RLD"] > 0
    # PDD never ships more across the WAN: the anomalous requests stay in A.
    assert 0 < figures["pdd"]["wan_bytes"] <= figures["pd"]["wan_bytes"]
    saved = json.loads((out / "figures.json").read_text())
    for kind in ("pd", "pdd"):
        for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "wan_bytes"):
            assert isinstance(saved[kind][key], (int, float)), (kind, key)
        assert saved[kind]["ttft_p50_s"] <= saved[kind]["ttft_p90_s"] <= saved[kind]["ttft_p99_s"]
    assert saved["link"]["rate_mbit"] == 300 and saved["link"]["rtt_ms"] == 30
    png = (out / "ttft_cdf.png").read_bytes()
    assert png.startswith(PNG) and len(png) > 5000
    for kind in ("pd", "pdd"):
        lines = (out / kind / "requests.jsonl").read_text().splitlines()
        assert len(lines) == len(results[kind].requests)


def _leftovers(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [ln for ln in out.splitlines() if ln.startswith(f"{prefix}-")]


def _our_processes(out) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    return [ln for ln in ps.splitlines() if str(out) in ln]


async def test_demo_on_loopback_with_a_shaper(tmp_path):
    cfg = _cfg(tmp_path, where="loopback")
    figures, results = await demo.run(cfg)
    out = tmp_path / "out"
    _check(figures, results, out)
    assert figures["link"]["where"] == "loopback"
    assert 'address = "127.0.0.1:' in (out / "pdd" / "a1.toml").read_text()
    assert _our_processes(out) == []  # agents, shaper and engine processes all stopped


@pytest.mark.root
async def test_demo_across_two_network_namespaces(tmp_path):
    prefix = "pddwd"  # not the demo's pddw nor test_netns's pddwt
    cfg = _cfg(tmp_path, where="netns", prefix=prefix, requests=24)
    figures, results = await demo.run(cfg)
    out = tmp_path / "out"
    _check(figures, results, out)
    assert figures["link"]["where"] == "netns"
    # MD's agent listened on site B's veth address; A's agents reached it through the shaper in A.
    assert 'wan = "10.77.0.2:' in (out / "pdd" / "b1.toml").read_text()
    assert 'address = "127.0.0.1:7600"' in (out / "pdd" / "a1.toml").read_text()
    assert _leftovers(prefix) == []
    assert _our_processes(out) == []
