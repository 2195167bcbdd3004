"""The event loop watch (pdd_wire.loopwatch): a loop that does not turn for
``timeouts.loop_stall_warn_s`` is reported once, with the stack of the code that blocks it, and
counted when it turns again; one watch per loop however many agents share it."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import structlog
from structlog.testing import capture_logs

from pdd_wire import loopwatch
from support.agents import run_agents, two_site_toml


def a_blocking_call_on_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # what a slow callback does to the loop


async def test_a_blocked_loop_is_logged_with_the_blocking_stack_and_counted():
    stalls: list[float] = []
    with capture_logs() as logs:
        # warn_s 1 s (the default), not less: on a loaded machine (CI) the test's own process may
        # not be scheduled for a few hundred ms, and the watch rightly reports that stall too.
        unwatch = loopwatch.watch(structlog.get_logger("t"), stalls.append, warn_s=1.0, period_s=0.05)
        try:
            await asyncio.sleep(0.2)  # turning: nothing reported
            assert not [e for e in logs if "event loop" in e["event"]]
            a_blocking_call_on_the_loop(2.5)  # the watch thread has 1.5 s to see it, on a loaded machine too
            await asyncio.sleep(0.2)
        finally:
            unwatch()
    blocked = [e for e in logs if e["event"] == "event loop blocked"]
    again = [e for e in logs if e["event"] == "event loop turning again"]
    assert len(blocked) == 1 and blocked[0]["log_level"] == "warning", logs
    assert "a_blocking_call_on_the_loop" in blocked[0]["stack"]
    assert 1.0 <= blocked[0]["blocked_s"] < 2.5
    assert len(again) == 1 and again[0]["blocked_s"] >= 2.4, again
    assert len(stalls) == 1 and stalls[0] >= 2.4
    assert not [t for t in threading.enumerate() if t.name == "pdd-loopwatch"]  # stopped with its last owner


async def test_agents_sharing_a_loop_share_one_watch_and_each_counts_the_stall(tmp_sock_dir):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        assert len([t for t in threading.enumerate() if t.name == "pdd-loopwatch"]) == 1
        with capture_logs() as logs:
            a_blocking_call_on_the_loop(2.5)  # past the default warn_s (1 s): the watch has 1.5 s to see it
            await asyncio.sleep(0.3)
        assert len([e for e in logs if e["event"] == "event loop blocked"]) == 1, logs
        for a in agents.values():
            text = a.metrics.render().decode()
            assert "pddwire_loop_stalls_total 1.0" in text
            assert "pddwire_loop_stall_seconds_count 1.0" in text


async def test_a_process_that_did_not_run_keeps_its_sessions_up(tmp_sock_dir):
    """Both agents' loop blocked past ``dead_after_s`` (1.5 s): the peers' heartbeats of that
    time are in the sockets, unread. The first late tick gives no verdict on silence; the loop
    reads them and no session is dropped (before: every session dropped and reconnected)."""
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        sessions = [s for a in agents.values() for s in a.sessions.values()]
        with capture_logs() as logs:
            a_blocking_call_on_the_loop(2.5)
            await asyncio.sleep(1.0)  # five heartbeats
        assert all(s.is_up for s in sessions)
        assert not [e for e in logs if e["event"] == "peer silent; dropping the control connection"], logs
        for a in agents.values():
            reconnects = re.findall(r"^pddwire_reconnects_total\{.*\} (\S+)$", a.metrics.render().decode(), re.M)
            assert all(float(v) == 0 for v in reconnects), reconnects



CHILD = """
import asyncio, sys, structlog
from pdd_wire import loopwatch
structlog.configure(processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
                    logger_factory=structlog.PrintLoggerFactory(sys.stdout))
async def main():
    unwatch = loopwatch.watch(structlog.get_logger("t"), lambda s: print(f"STALL {s:.3f}", flush=True),
                              warn_s=1.0, period_s=0.05)
    print("READY", flush=True)
    await asyncio.sleep(5)
    unwatch()
asyncio.run(main())
"""


async def test_a_stall_of_the_whole_process_is_logged_when_it_runs_again():
    """SIGSTOP stops the watch thread with the loop, so nothing reports the stall while it lasts:
    it is logged once when the process runs again (and counted)."""
    import json
    import os
    import signal
    import sys

    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    assert (await asyncio.wait_for(proc.stdout.readline(), 20)).strip() == b"READY"
    await asyncio.sleep(0.3)
    # Stopped 2.5 s, watched from 1 s: a loaded machine (CI) may leave the child unscheduled
    # for a few hundred ms besides, which a shorter warn_s reports as a second stall.
    os.kill(proc.pid, signal.SIGSTOP)
    await asyncio.sleep(2.5)
    os.kill(proc.pid, signal.SIGCONT)
    out = (await asyncio.wait_for(proc.stdout.read(), 20)).decode()
    await proc.wait()
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    blocked = [e for e in events if e["event"] == "event loop blocked"]
    # One report, whichever thread ran first after SIGCONT: the loop's (it says why there is no
    # stack) or the watch thread's (the stack of the loop's wait). Before, the loop's first left none.
    assert len(blocked) == 1 and blocked[0]["blocked_s"] >= 2.2, out
    assert "did not run" in blocked[0].get("cause", "") or "stack" in blocked[0], out
    assert [float(line.split()[1]) >= 2.2 for line in out.splitlines() if line.startswith("STALL")] == [True], out


async def test_warn_s_0_watches_nothing():
    """``timeouts.loop_stall_warn_s = 0`` (documented as "not watched"): no watch thread, no report."""
    before = [t for t in threading.enumerate() if t.name == "pdd-loopwatch"]
    stalls: list[float] = []
    with capture_logs() as logs:
        unwatch = loopwatch.watch(structlog.get_logger("t"), stalls.append, warn_s=0, period_s=0.05)
        assert [t for t in threading.enumerate() if t.name == "pdd-loopwatch"] == before
        a_blocking_call_on_the_loop(0.3)
        await asyncio.sleep(0.1)
        unwatch()
    assert not stalls and not [e for e in logs if "event loop" in e["event"]]
