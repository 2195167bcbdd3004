"""The agent's pipeline choice for engines: the policy table (tests/test_policy.py) fed with the
live link figures of a real session, and recorded in metrics."""

import pytest

from conftest import fill_random, metric
from pdd_wire.engine import protocol as p
from pdd_wire.errors import EngineRequestError, ErrorCode
from support.agents import run_agents, two_site_toml

MiB = 1 << 20


async def test_choice_uses_live_link_figures_and_is_counted(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as ag:
        ea = await engines.connect(tmp_sock_dir / "A.sock", "router")
        eb = await engines.connect(tmp_sock_dir / "B.sock", "md")
        figures = dict(input_tokens=65536, prefix_hit_tokens=65000, expected_output_tokens=1000,
                       kv_bytes_per_token=50_000)
        # No transfer has finished yet: bandwidth unknown, so RLD must mask the WAN.
        d = await ea.choose_pipeline("r0", to="B", **figures)
        assert d["pipeline"] == "P-RLD-MD" and d["link"]["bandwidth_Bps"] == 0 and d["link"]["peer"] == "B/b1"
        est = await ea.estimate("B", 8 * MiB)
        assert est["seconds"] is None and est["bandwidth_Bps"] == 0 and est["bandwidth_source"] is None, est
        # One real 32 MiB transfer gives the session a goodput estimate.
        src, dst = engines.memory(32 * MiB), engines.memory(32 * MiB)
        await fill_random(src)
        ra, rb = await ea.register(src, block_bytes=MiB), await eb.register(dst, block_bytes=MiB)
        await eb.post_recv("warm", [rb.blocks(0, 32)])
        await ea.send_kv("warm", [ra.blocks(0, 32)], to=["B"])
        assert isinstance(await ea.wait("warm", timeout=30), p.KvSent)
        d = await ea.choose_pipeline("r1", to="B", **figures)
        bw = d["link"]["bandwidth_Bps"]
        assert bw > 0 and d["link"]["rtt_s"] > 0
        # estimate reports the bandwidth its seconds come from: the live estimate once it has a
        # sample (a transfer busy long enough gives it one), else the finished transfer's goodput.
        est = await ea.estimate("B", 8 * MiB)
        assert est["bandwidth_source"] == ("link_estimate" if est["samples"] else "goodput"), est
        assert est["bandwidth_Bps"] == round(bw), est
        assert est["seconds"] == pytest.approx((est["rtt_s"] or 0) + (est["queue_bytes"] + 8 * MiB) / bw), est
        # 536 missing tokens x 50 kB = 26.8 MB: within the 0.2 s budget at >= 134 MB/s.
        want = "P-MD" if 536 * 50_000 / bw + d["link"]["rtt_s"] <= 0.2 else "P-RLD-MD"
        assert d["pipeline"] == want and abs(d["predicted_wan_s"] - (536 * 50_000 / bw + d["link"]["rtt_s"])) < 1e-9
        # A low hit rate crosses far more bytes: masked by RLD.
        d = await ea.choose_pipeline("r2", to="B", **(figures | {"prefix_hit_tokens": 0}))
        assert d["pipeline"] == "P-RLD-MD" and d["reason"] == "wan_over_budget"
        # Ultra-long input, short output: the anomalous-traffic filter keeps it on RLD.
        d = await ea.choose_pipeline("r3", to="B", **(figures | {"expected_output_tokens": 100}))
        assert d["pipeline"] == "P-RLD"
        assert metric(ag["A"], "pddwire_pipeline_choices_total", pipeline="P-RLD-MD", reason="wan_over_budget") >= 2
        assert metric(ag["A"], "pddwire_pipeline_choices_total", pipeline="P-RLD",
                      reason="anomalous_long_input_short_output") == 1


async def test_bad_figures_are_refused_with_the_field_named(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)):
        ea = await engines.connect(tmp_sock_dir / "A.sock", "router")
        with pytest.raises(EngineRequestError) as ei:
            await ea.choose_pipeline("x", to="B", input_tokens=10, prefix_hit_tokens=20,
                                     expected_output_tokens=5, kv_bytes_per_token=1)
        assert ei.value.code == ErrorCode.BAD_REQUEST and "prefix_hit_tokens" in str(ei.value)
