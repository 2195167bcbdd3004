"""The in-run baselines of ``scripts/bench`` (``pdd_tools.benchpipe``) measure what they say."""

from __future__ import annotations

import os

from pdd_tools.benchpipe import bare_pipe, ipc_round_trip

MiB = 1 << 20


def test_the_bare_pipe_moves_its_bytes_between_two_processes():
    gbps, cpu_per_gb = bare_pipe(4 * MiB, reps=4)
    assert gbps > 0 and cpu_per_gb > 0


def test_the_ipc_round_trip_is_timed_across_two_cpus_and_on_one():
    """Both runs complete (every message is echoed, or the loop would hang) and count CPU."""
    got = ipc_round_trip(200)
    if len(os.sched_getaffinity(0)) < 2:
        assert got is None
        return
    assert got is not None and set(got) == {"cross", "same"}
    assert all(wall > 0 and cpu > 0 for wall, cpu in got.values())
