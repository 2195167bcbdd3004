"""The handoff driven by real agents: RLD's engine on site A, MD's on site B, the prompt's KV
crossing the WAN, token ids relayed on the control lane, HANDOFF_* frames between the agents.

Every test checks the ownership invariant on what the engines were allowed to emit: positions
0..n-1 each emitted exactly once, by RLD up to the commit position and by MD after it, with the
model's tokens (``pdd_tools.sim.check_stream``).
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import metric
from pdd_tools.sim import MdSim, RldSim, check_stream, token_at
from pdd_wire.engine import protocol as p
from pdd_wire.errors import EngineRequestError, ErrorCode
from support.agents import relayed_toml, run_agents, two_site_toml

MiB = 1 << 20
KV = 8 * MiB


async def setup(engines, agents, tmp):
    """Prefill P and relay decoder R on site A, main decoder M on site B; M posts the KV."""
    P = await engines.connect(tmp / "A.sock", "prefill")
    R = await engines.connect(tmp / "A.sock", "rld")
    M = await engines.connect(tmp / "B.sock", "md")
    pm, mm = engines.memory(KV), engines.memory(KV)
    pm.buf[:] = bytes(range(256)) * (KV // 256)
    preg = await P.register(pm, block_bytes=MiB)
    mreg = await M.register(mm, block_bytes=MiB)
    return P, R, M, preg, mreg, mm


async def posted_md(M, mreg, rid, **kw) -> MdSim:
    """MD's engine posts the request's blocks and registers its handoff (the KV is not sent yet)."""
    await M.post_recv(rid, [mreg.blocks(0, KV // MiB)], from_site="A")
    md = MdSim(M, rid, "A", **kw)
    await md.start()
    return md


async def handoff(engines, agents, tmp, rid, *, n, rld_load, behind=100, rld_step=0.0, md_step=0.0,
                  extend_s=0.0, per_token=0.0, fail_after=None):
    """One request through the handoff: RLD generates ``behind`` tokens, then the KV is sent to
    MD, which takes over (or fails). Returns the two simulated engines."""
    P, R, M, preg, mreg, mm = await setup(engines, agents, tmp)
    await R.set_load(rld_load)
    await M.post_recv(rid, [mreg.blocks(0, KV // MiB)], from_site="A")
    md = MdSim(M, rid, "A", n_tokens=n, step_s=md_step, extend_s=extend_s, extend_per_token_s=per_token,
               fail_after_extends=fail_after)
    await md.start()
    rld = RldSim(R, rid, "B", n_tokens=n, step_s=rld_step, hold_at=behind)
    rt = asyncio.create_task(rld.run(30))
    mt = asyncio.create_task(md.run(30))
    await asyncio.wait_for(rld.held.wait(), 10)
    await P.send_kv(rid, [preg.blocks(0, KV // MiB)], to=["B"])
    rld.release_hold()
    await asyncio.gather(rt, mt)
    assert bytes(mm.buf) == bytes(range(256)) * (KV // 256)
    return rld, md


async def test_one_shot_when_rld_is_busy(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        rld, md = await handoff(engines, agents, tmp_sock_dir, "r1", n=300, rld_load=0.95, rld_step=0.002)
        check_stream("r1", 300, rld.emitted, md.emitted)
        assert rld.done.owner == "MD" and rld.done.reason == "one_shot" and rld.done.mode == "one-shot"
        assert md.done.reason == "took_over" and md.position == rld.done.position == max(rld.emitted) + 1
        assert rld.done.position >= 100
        assert md.extends[0] == (0, md.extends[0][1]) and md.extends[0][1] >= 100  # one extend absorbs the gap
        assert metric(agents["A"], "pddwire_handoff_modes_total", mode="one-shot", reason="rld_busy") == 1
        assert metric(agents["A"], "pddwire_handoffs_total", role="RLD", mode="one-shot", reason="one_shot") == 1
        assert metric(agents["B"], "pddwire_handoffs_total", role="MD", mode="one-shot", reason="took_over") == 1
        assert metric(agents["B"], "pddwire_handoff_seconds_count", role="MD", mode="one-shot") == 1


async def test_catch_up_when_rld_has_headroom(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        # MD absorbs a 100-token gap in 50 ms while RLD makes ~10 more: it converges in round 2.
        rld, md = await handoff(engines, agents, tmp_sock_dir, "r2", n=400, rld_load=0.1, rld_step=0.005,
                                extend_s=0.01, per_token=0.0004)
        check_stream("r2", 400, rld.emitted, md.emitted)
        assert rld.done.mode == "catch-up" and rld.done.reason == "catch_up_converged"
        assert len(md.extends) >= 2  # the gap, then what RLD made meanwhile
        assert rld.done.position > 100 + 1  # RLD kept generating during the catch-up
        assert rld.done.position - sum(c for _, c in md.extends[:-1]) <= 64  # the last step was small
        assert metric(agents["A"], "pddwire_handoff_modes_total", mode="catch-up", reason="rld_headroom") == 1


async def test_md_failure_before_the_commit_leaves_rld_owning_everything(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        # Catch-up keeps RLD relaying across MD's extends; MD fails at its second one.
        rld, md = await handoff(engines, agents, tmp_sock_dir, "r3", n=250, rld_load=0.1, rld_step=0.002,
                                extend_s=0.05, fail_after=1)
        check_stream("r3", 250, rld.emitted)
        assert md.emitted == {}
        assert rld.done.owner == "RLD" and rld.done.reason == "md_released"
        assert md.done.owner == "RLD" and md.done.reason == "simulated_failure"
        # MD learns the mode from RLD's first commit: its failure may come before that (mode "none").
        # The engine's own text is counted as "other": no engine grows the metric's label set.
        assert sum(metric(agents["B"], "pddwire_handoffs_total", role="MD", mode=mode, reason="other")
                   for mode in ("catch-up", "none")) == 1


async def test_kv_cancelled_before_md_is_ready_releases_to_rld(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        P, R, M, preg, mreg, mm = await setup(engines, agents, tmp_sock_dir)
        md = await posted_md(M, mreg, "r4", n_tokens=60)
        rld = RldSim(R, "r4", "B", n_tokens=60, step_s=0.01)
        rt = asyncio.create_task(rld.run(30))
        mt = asyncio.create_task(md.run(30))
        # The prefill sends the wrong size: MD's agent refuses the KV and MD releases.
        await P.send_kv("r4", [preg.blocks(0, 4)], to=["B"])
        await asyncio.gather(rt, mt)
        check_stream("r4", 60, rld.emitted)
        assert md.done.reason == "kv_cancelled" and rld.done.reason == "md_released"


async def test_rld_deadline_keeps_the_output_and_md_drops_the_request(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        P, R, M, preg, mreg, mm = await setup(engines, agents, tmp_sock_dir)
        md = await posted_md(M, mreg, "r5", n_tokens=50)
        rld = RldSim(R, "r5", "B", n_tokens=50, step_s=0.02, deadline_s=0.3)  # the KV never comes
        await asyncio.gather(rld.run(30), md.run(30))
        check_stream("r5", 50, rld.emitted)
        assert rld.done.reason == "deadline" and md.done.owner == "RLD" and md.done.reason == "deadline"


async def test_request_that_finishes_on_rld_before_md_is_ready(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        P, R, M, preg, mreg, mm = await setup(engines, agents, tmp_sock_dir)
        md = await posted_md(M, mreg, "r6", n_tokens=20)
        rld = RldSim(R, "r6", "B", n_tokens=20)
        await asyncio.gather(rld.run(30), md.run(30))
        check_stream("r6", 20, rld.emitted)
        assert rld.done.reason == "finished_on_rld" and md.done.reason == "finished"
        # An abort of the settled request ends nothing there: it counts nothing (engine.md `abort`).
        assert await R.abort("r6") == 0


async def test_tokens_and_kv_that_arrive_before_md_registers_are_kept(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        P, R, M, preg, mreg, mm = await setup(engines, agents, tmp_sock_dir)
        await R.set_load(0.95)
        await M.post_recv("r7", [mreg.blocks(0, 8)], from_site="A")
        rld = RldSim(R, "r7", "B", n_tokens=200, step_s=0.002, hold_at=80)
        rt = asyncio.create_task(rld.run(30))
        await asyncio.wait_for(rld.held.wait(), 10)
        await P.send_kv("r7", [preg.blocks(0, 8)], to=["B"])
        await M.wait("r7", kinds=(p.KvReceived,), timeout=10)
        await asyncio.sleep(0.05)  # the 80 relayed tokens are at B too
        md = MdSim(M, "r7", "A", n_tokens=200)
        await md.start()  # only now: B kept the tokens and the KV outcome for it
        rld.release_hold()
        await asyncio.gather(rt, md.run(30))
        check_stream("r7", 200, rld.emitted, md.emitted)
        assert rld.done.owner == "MD" and md.extends[0] == (0, md.extends[0][1]) and md.extends[0][1] >= 80


async def test_many_concurrent_handoffs_in_both_modes_keep_the_invariant(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        P, R, M, preg, mreg, mm = await setup(engines, agents, tmp_sock_dir)
        R2 = await engines.connect(tmp_sock_dir / "A.sock", "rld-busy")
        await R.set_load(0.1)
        await R2.set_load(0.9)
        sims = []
        for i in range(12):
            rid = f"c{i}"
            eng = R if i % 2 else R2
            await M.post_recv(rid, [mreg.blocks(i % 8, 1)], from_site="A")
            md = MdSim(M, rid, "A", n_tokens=150 + 10 * i, extend_s=0.002, extend_per_token_s=0.0001,
                       fail_after_extends=1 if i % 5 == 4 else None)
            await md.start()
            rld = RldSim(eng, rid, "B", n_tokens=150 + 10 * i, step_s=0.002, hold_at=70 + 5 * i)
            sims.append((rid, rld, md))
        tasks = [asyncio.create_task(s.run(60)) for _, r, m in sims for s in (r, m)]
        for _, rld, _ in sims:
            await asyncio.wait_for(rld.held.wait(), 10)
        for i, (rid, rld, _) in enumerate(sims):
            await P.send_kv(rid, [preg.blocks(i % 8, 1)], to=["B"])
            rld.release_hold()
        await asyncio.gather(*tasks)
        modes = set()
        for rid, rld, md in sims:
            check_stream(rid, rld.n, rld.emitted, md.emitted)
            modes.add(rld.done.mode)
        assert modes >= {"one-shot", "catch-up"}
        for _, rld, md in sims:  # an MD that failed gave the request back; the others took over
            assert rld.done.owner == md.done.owner == ("RLD" if md.done.reason == "simulated_failure" else "MD")
        assert any(md.done.owner == "RLD" for _, _, md in sims)


async def test_link_drops_during_catch_up_change_nothing_for_the_user(tmp_sock_dir, engines):
    async with relayed_toml(tmp_sock_dir) as (relay, tomls):
        async with run_agents(tomls) as agents:
            P, R, M, preg, mreg, mm = await setup(engines, agents, tmp_sock_dir)
            await R.set_load(0.1)
            md = await posted_md(M, mreg, "r8", n_tokens=500, extend_s=0.02, extend_per_token_s=0.0005)
            rld = RldSim(R, "r8", "B", n_tokens=500, step_s=0.004, hold_at=150)
            rt = asyncio.create_task(rld.run(60))
            mt = asyncio.create_task(md.run(60))
            await asyncio.wait_for(rld.held.wait(), 10)
            await P.send_kv("r8", [preg.blocks(0, 8)], to=["B"])
            rld.release_hold()
            for _ in range(3):  # drop every connection a few times while MD catches up
                await asyncio.sleep(0.08)
                relay.abort_all()
            await asyncio.gather(rt, mt)
            check_stream("r8", 500, rld.emitted, md.emitted)
            assert rld.done.owner == "MD" and md.done.reason == "took_over"
            assert metric(agents["A"], "pddwire_reconnects_total", peer="B/b1") >= 1


async def test_md_agent_stopping_mid_handoff_leaves_rld_the_output(tmp_sock_dir, engines):
    tomls = two_site_toml(tmp_sock_dir)
    async with run_agents(tomls) as agents:
        P, R, M, preg, mreg, mm = await setup(engines, agents, tmp_sock_dir)
        await posted_md(M, mreg, "r9", n_tokens=100)  # MD registered; its agent goes away below
        rld = RldSim(R, "r9", "B", n_tokens=100, step_s=0.01)
        rt = asyncio.create_task(rld.run(30))
        await asyncio.sleep(0.1)
        await agents["B"].shutdown(0)  # MD's agent goes away before the KV came: it releases
        await rt
        check_stream("r9", 100, rld.emitted)
        assert rld.done.owner == "RLD" and rld.done.reason == "md_released"


async def test_rld_engine_gone_tells_md_to_drop_the_request(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        P, R, M, preg, mreg, mm = await setup(engines, agents, tmp_sock_dir)
        md = await posted_md(M, mreg, "r10", n_tokens=100)
        await R.handoff_rld("r10", "B")
        await R.handoff_tokens("r10", [token_at("r10", 0), token_at("r10", 1)])
        await R.close()
        await md.run(10)
        assert md.done.owner == "RLD" and md.done.reason == "engine_gone" and md.emitted == {}
        assert "r10" not in agents["A"].handoffs.live


async def test_engine_mistakes_are_refused_with_a_named_error(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)):
        R = await engines.connect(tmp_sock_dir / "A.sock", "rld")
        M = await engines.connect(tmp_sock_dir / "B.sock", "md")
        with pytest.raises(EngineRequestError) as ei:
            await R.handoff_tokens("nope", [1])
        assert ei.value.code == ErrorCode.UNKNOWN_REQUEST and "nope" in str(ei.value)
        await R.handoff_rld("e1", "B")
        with pytest.raises(EngineRequestError) as ei:
            await R.handoff_rld("e1", "B")
        assert ei.value.code == ErrorCode.DUPLICATE_TRANSFER
        with pytest.raises(EngineRequestError) as ei:
            await R.send_tokens("e1", "B", [1, 2])
        assert ei.value.code == ErrorCode.BAD_REQUEST and "handoff_tokens" in str(ei.value)
        with pytest.raises(EngineRequestError) as ei:
            await R.handoff_extended("e1", 3)
        assert ei.value.code == ErrorCode.BAD_REQUEST and "MD" in str(ei.value)
        with pytest.raises(EngineRequestError) as ei:
            await R.handoff_rld("e2", "Z")
        assert ei.value.code == ErrorCode.UNKNOWN_PEER_SITE
        with pytest.raises(EngineRequestError) as ei:
            await R.handoff_rld("e3", "B", deadline_s=float("nan"))
        assert ei.value.code == ErrorCode.BAD_REQUEST and "deadline_s" in str(ei.value)
        with pytest.raises(EngineRequestError) as ei:
            await R.set_load(-1)
        assert "load" in str(ei.value)
        await M.handoff_md("e4", "A")
        with pytest.raises(EngineRequestError) as ei:
            await M.handoff_extended("e4", 5)  # no extend in flight
        assert ei.value.code == ErrorCode.BAD_REQUEST and "extend" in str(ei.value)
        other = await engines.connect(tmp_sock_dir / "B.sock", "other")
        with pytest.raises(EngineRequestError) as ei:
            await other.handoff_fail("e4")
        assert "another engine" in str(ei.value)
        status = await M.status()
        assert [h["request_id"] for h in status["handoffs"]] == ["e4"]
