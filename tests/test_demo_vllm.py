"""``scripts/demo --engine vllm`` end to end at small scale: three real ``vllm serve`` (the tiny
model) on three real agents, ``pdd-wire router`` in front, the WAN between two network
namespaces (tbf on the veth, the shaper's delay), the trace replayed as plain PD and as PDD.

One stack for both runs, as the demo runs it; every request's tokens are compared with a single
server's greedy answer by the demo itself, and again here through its rows.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from pdd_tools.demo import DemoConfig, tiny, vllm_runner
from pdd_tools.vllm.serve import missing

pytestmark = [pytest.mark.vllm, pytest.mark.root]

# Eight requests over about two seconds: a conversation's follow-up turn, two anomalous
# requests (P-RLD), a first turn with a long message (P-RLD-MD on the link's live estimate).
SEED = 22
TRACE = {"anomalous_fraction": 0.12}
PNG = b"\x89PNG\r\n\x1a\n"


def _our_processes(out) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    return [ln for ln in ps.splitlines() if str(out) in ln]


async def test_the_demo_through_the_router_gives_one_servers_tokens(tmp_path):
    why = missing()
    if why:
        pytest.fail(f"the vLLM venv is needed for this test ({why}): run scripts/vllm-env", pytrace=False)
    prefix = "pddvt"  # not the demo's pddv
    cfg = DemoConfig(engine="vllm", out=str(tmp_path / "out"), requests=8, rate=4.0, seed=SEED, link_mbit=3.0,
                     rtt_ms=30.0, jitter_ms=2.0, where="netns", prefix=prefix, ttft_budget_s=tiny.TTFT_BUDGET_S,
                     trace_overrides=TRACE, quiet=True, timeout_s=60)
    figures, results = await vllm_runner.run(cfg)
    out = tmp_path / "out" / "vllm"
    assert set(results) == {"pd", "pdd"}
    trace = tiny.generate(8, 4.0, SEED, TRACE)
    for kind, res in results.items():
        assert res.failures == [], res.failures[:5]
        assert len(res.requests) == 8
        for row in res.requests:
            # the tokens were the single server's (the demo compared them), every one of them
            assert row["ok"] and "mismatch_at" not in row, row
            assert row["finish_reason"] == "length" and row["ttft_s"] > 0
        f = figures[kind]
        assert f["ok"] == 8 and f["mismatches"] == 0
        assert f["tokens_emitted"]["RLD"] + f["tokens_emitted"]["MD"] == sum(r.output_tokens for r in trace)
        assert f["ttft_p50_s"] <= f["ttft_p90_s"] <= f["ttft_p99_s"]
    pd, pdd = figures["pd"], figures["pdd"]
    assert pd["pipelines"] == {"P-MD": 8, "P-RLD-MD": 0, "P-RLD": 0} and pd["tokens_emitted"]["RLD"] == 0
    assert pd["rld_share"] == 0 and pd["handoffs"] == {}
    anomalous = sum(r.anomalous for r in trace)
    assert anomalous == 2 and pdd["pipelines"]["P-RLD"] == anomalous
    assert pdd["pipelines"]["P-RLD-MD"] >= 1
    # every P-RLD-MD request ended one way: handed to MD, or finished on RLD
    assert sum(pdd["handoffs"].values()) == pdd["pipelines"]["P-RLD-MD"]
    assert 0 < pdd["rld_share"] < 1
    # the anomalous requests' KV stays in site A: PDD sends less across the WAN
    assert 0 < pdd["wan_kv_bytes"] < pd["wan_kv_bytes"]
    saved = json.loads((out / "figures.json").read_text())
    for kind in ("pd", "pdd"):
        for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s", "wan_bytes", "rld_share"):
            assert isinstance(saved[kind][key], (int, float)), (kind, key)
        lines = (out / kind / "requests.jsonl").read_text().splitlines()
        assert [json.loads(x)["request_id"] for x in lines] == [r.rid for r in trace]
        assert "router_pipeline" in (out / kind / "router.log").read_text()
    assert saved["link"]["where"] == "netns" and saved["link"]["rate_mbit"] == 3.0
    assert saved["scale"]["context"] == tiny.CONTEXT
    png = (out / "ttft_cdf.png").read_bytes()
    assert png.startswith(PNG) and len(png) > 5000
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [ln for ln in left.splitlines() if ln.startswith(f"{prefix}-")]
    assert _our_processes(out) == []
