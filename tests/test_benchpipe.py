"""The in-run baselines of ``scripts/bench`` (``pdd_tools.benchpipe``) measure what they say."""

from __future__ import annotations

import os

import pytest

from pdd_tools.benchpipe import bare_pipe, ipc_round_trip, ipc_round_trip_on

MiB = 1 << 20


def test_the_bare_pipe_moves_its_bytes_between_two_processes():
    gbps, cpu_per_gb = bare_pipe(4 * MiB, reps=4)
    assert gbps > 0 and cpu_per_gb > 0


def test_the_ipc_round_trip_is_timed_across_two_cpus_and_on_one():
    """Both runs complete, and each counts the echoing process's CPU (its own rusage) as well as
    the timing one's."""
    got = ipc_round_trip(200)
    if len(os.sched_getaffinity(0)) < 2:
        assert got is None
        return
    assert got is not None and set(got) == {"cross", "same"}
    for wall, cpu, child in got.values():
        assert wall > 0 and 0 < child < cpu


def test_an_echo_that_fails_is_an_error_not_a_hang():
    """A CPU the machine does not have: the echoing child fails at once, and the run says so
    (its end of the socket pair closes, so nobody waits in recv)."""
    with pytest.raises(RuntimeError, match="exited 1"):
        ipc_round_trip_on(200, (0, 4096))
