"""Link figures: the live estimate, the active probe (``pdd-wire probe``) and ``estimate``.

The probe's accuracy is checked against a tbf-shaped veth between two network namespaces: it
must report the configured rate within 10%.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdd_wire.engine import protocol as p
from pdd_wire.errors import EngineRequestError, ErrorCode
from pdd_wire.probe import LinkEstimator
from support.agents import run_agents, two_site_toml
from support.netagents import NetAgents

MiB = 1 << 20


def test_estimator_counts_busy_time_only_and_predicts():
    e = LinkEstimator(window_s=0.25, min_acks=1)
    assert e.predict(1000, 0) is None  # bandwidth unknown
    e.on_ack(0.0, 1 << 20, busy=True)  # starts the clock
    e.on_ack(0.5, 50 << 20, busy=False)  # 50 MiB in 0.5 s
    assert e.bandwidth_Bps == pytest.approx(100 << 20)
    e.on_ack(100.0, 1 << 20, busy=True)  # after a long idle spell: a new clock, not a slow link
    e.on_ack(100.25, 25 << 20, busy=True)
    assert e.bandwidth_Bps == pytest.approx(100 << 20)
    for i, rtt in enumerate((0.010, 0.012, 0.011, 0.013)):
        e.ping_sent(i, float(i))
        assert e.pong(i, i + rtt) == pytest.approx(rtt)
        assert e.pong(i, i + 1.0) is None  # a copy tells no round trip
    assert e.pong(55, 3.0) is None  # nor a PONG for a PING never sent
    slow = LinkEstimator()
    for i in range(3):
        slow.ping_sent(i, float(i))
        slow.expire(i + 1.2)  # counted lost before its PONG (a link slower than the limit) ...
        assert slow.pong(i, i + 1.5) == pytest.approx(1.5)  # ... still gives its round trip, once
        assert slow.pong(i, i + 1.6) is None
    # The first one's round trip raised the limit (4 x RTT): the later ones were answered in time.
    assert slow.rtt_s == pytest.approx(1.5) and slow.loss == pytest.approx(1 / 3)
    e.ping_sent(99, 10.0)
    e.expire(10.5)
    assert e.loss == 0.0  # not yet overdue
    e.expire(12.0)
    assert e.loss == pytest.approx(1 / 5)
    assert e.rtt_s == pytest.approx(0.0115) and e.jitter_s == pytest.approx((0.002 + 0.001 + 0.002) / 3)
    assert e.predict(100 << 20, 100 << 20) == pytest.approx(0.0115 + 2.0)
    # Acks that arrive in a clump (chunks striped over streams finish together) count once.
    c = LinkEstimator(window_s=0.25, min_acks=2)
    c.on_ack(0.0, 4 << 20, busy=True)
    c.on_ack(0.001, 4 << 20, busy=True)  # the same clump as the first: carried before the clock
    c.on_ack(0.5, 4 << 20, busy=True)
    c.on_ack(0.501, 4 << 20, busy=True)  # 8 MiB per 0.5 s (not 12: the first clump is not counted)
    assert c.bandwidth_Bps == pytest.approx(8 * (1 << 20) / 0.5, rel=0.01)


async def test_probe_between_agents_and_estimate_from_engines(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        # 2 s: 1 s windows per stream count, which hold acknowledgements though this process may
        # not run for a few hundred ms (a loaded machine; at 0.5 s windows: 409 too few to measure).
        res = await agents["A"].probe("B", seconds=2.0, streams=2)
        assert res["peer"] == "B/b1" and res["loss"] == 0 and res["pings"] == 50
        assert set(res["goodput_Bps"]) == {"1", "2"} and all(v > 0 for v in res["goodput_Bps"].values())
        assert res["rtt_ms"]["min"] <= res["rtt_ms"]["p50"] <= res["rtt_ms"]["p99"]
        a = await engines.connect(tmp_sock_dir / "A.sock")
        est = await a.estimate("B", 64 * MiB)
        assert est["peer"] == "B/b1" and est["bandwidth_Bps"] > 0 and est["seconds"] > 0
        assert est["seconds"] == pytest.approx(est["rtt_s"] + 64 * MiB / est["bandwidth_Bps"], rel=0.05)
        with pytest.raises(EngineRequestError) as ei:
            await agents["A"].probe("B", seconds=0)
        assert "seconds" in str(ei.value)
        with pytest.raises(EngineRequestError) as ei:
            await a.post_recv("\x00probe/x", [(1, 0, 1)])
        assert ei.value.code == ErrorCode.BAD_REQUEST and "reserved" in str(ei.value)
        # Probe transfers never reach engines, and leave nothing pinned.
        assert not [e for e in a.events() if isinstance(e, (p.KvReceived, p.KvSent))]
        assert agents["B"].audit() == ({"post": 0, "send": 0, "recv": 0}, 0)


@pytest.mark.root
@pytest.mark.parametrize("mbit", [200, 1000])
async def test_probe_reports_a_tbf_shaped_link_within_10_percent(mbit):
    async with NetAgents("pddwp", rate_bps=mbit * 1_000_000, admin=True, streams=2) as net:
        out = net.run_in("A", [sys.executable, "-c", "import sys; from pdd_wire.cli import tool_main; "
                          "sys.exit(tool_main(sys.argv[1:]))", "probe", "--site", "B", "--admin",
                          "127.0.0.1:7711", "--seconds", "4", "--json"])
        assert out.returncode == 0, out.stderr
        res = json.loads(out.stdout)
        rate = mbit * 1e6 / 8
        for n, bps in res["goodput_Bps"].items():
            assert abs(bps - rate) / rate < 0.10, (n, bps, rate, res)
        assert res["loss"] == 0
        st = await net.status("A")
        assert st["peers"][0]["link"]["bandwidth_Bps"] > 0.8 * rate


@pytest.mark.root
@pytest.mark.parametrize("mbit,pipeline", [(100, "P-RLD-MD"), (1000, "P-MD")])
async def test_pipeline_choice_follows_the_live_link_estimate(mbit, pipeline):
    """The same request (8 MiB of KV MD lacks, budget 0.2 s) goes P-MD on a 1 Gbit/s WAN and
    P-RLD-MD on a 100 Mbit/s one, from the link estimate the agent measured itself."""
    from pdd_wire import EngineClient

    async with NetAgents("pddwq", rate_bps=mbit * 1_000_000, admin=True) as net:
        out = net.run_in("A", [sys.executable, "-c", "import sys; from pdd_wire.cli import tool_main; "
                               "sys.exit(tool_main(sys.argv[1:]))", "probe", "--site", "B", "--admin",
                               "127.0.0.1:7711", "--seconds", "3", "--json"])
        assert out.returncode == 0, out.stderr
        async with EngineClient(net.socket("A"), "prefill") as eng:
            d = await eng.choose_pipeline("q1", to="B", input_tokens=2048, prefix_hit_tokens=0,
                                          expected_output_tokens=1000, kv_bytes_per_token=4096)
            est = await eng.estimate("B", 8 * MiB)
        # 8 MiB against the 0.2 s budget: ~0.07 s at 1 Gbit/s, ~0.7 s at 100 Mbit/s (3x margins).
        assert d["pipeline"] == pipeline, d
        assert d["predicted_wan_s"] == pytest.approx(est["seconds"], rel=0.2)
        # The estimate is the measured link, not a default (its accuracy is the bench's probe figures).
        assert 0.5 * mbit * 1e6 / 8 < est["bandwidth_Bps"] < 1.2 * mbit * 1e6 / 8


@pytest.mark.root
def test_bench_json_prints_the_figures_only():
    """``scripts/bench --json``: stdout is one JSON figure a line, to be piped as it is; the
    harness's log lines (the shaper's, the network namespaces' "sites up") go to stderr."""
    out = subprocess.run([sys.executable, "-m", "pdd_tools", "bench", "--json", "--only", "probe", "--quick"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    figs = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(figs) >= 3 and all({"figure", "value", "unit"} <= set(f) for f in figs), out.stdout
    assert "sites up" in out.stderr and "Traceback" not in out.stderr, out.stderr
