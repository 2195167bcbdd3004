"""The in-run baselines of ``scripts/bench`` (``pdd_tools.benchpipe``) measure what they say."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdd_tools.benchpipe import bare_pipe, bare_pipe_split, ipc_round_trip, ipc_round_trip_on

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


def test_the_pipe_takes_a_send_size_and_a_receiver_mode():
    """Blocking MSG_WAITALL reads fill 4 MiB a call (the kernel waits for the whole buffer);
    sends of 256 KiB move the same bytes. Every byte sent arrives (bare_pipe_split checks the
    receiver's count against the sender's)."""
    block = bare_pipe_split(4 * MiB, reps=4, rx="block", xxh3=True)
    assert block["rx_reads_per_4MiB"] == 1.0
    loop = bare_pipe_split(4 * MiB, reps=4, write=256 << 10)
    for r in (block, loop):
        assert r["gbps"] > 0 and r["tx_s_per_gb"] > 0 and r["rx_s_per_gb"] > 0 and r["t1"] > r["t0"]


def test_a_timed_pipe_streams_for_its_seconds():
    r = bare_pipe_split(4 * MiB, reps=0, seconds=0.5)
    assert 0.5 <= r["t1"] - r["t0"] < 5


def test_bad_pipe_settings_are_refused():
    with pytest.raises(ValueError, match="rx mode must be one of"):
        bare_pipe_split(4 * MiB, reps=1, rx="spin")
    with pytest.raises(ValueError, match="write must be > 0"):
        bare_pipe_split(4 * MiB, reps=1, write=0)


def test_pipesizes_prints_a_line_per_configuration_and_the_medians():
    """Each 'writes' run samples the probe for the same time whatever the pipe's speed (all but
    the first 0.5 s of 1.5 s: about 500 messages, the tool refuses fewer than 100)."""
    out = subprocess.run([sys.executable, "-m", "pdd_tools.pipesizes", "--rounds", "2", "--writes", "4194304",
                          "--seconds", "1.5"], capture_output=True, text=True, timeout=300, check=True)
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    runs = [f for f in lines if "round" in f]
    medians = [f for f in lines if "median_of" in f]
    assert len(runs) == 2 * (1 + 4) and len(medians) == 1 + 4
    writes = [f for f in runs if f["experiment"] == "writes"]
    assert all(f["write_bytes"] == 4 * MiB and f["wake_p99_ms"] >= f["wake_p50_ms"] > 0 for f in writes)
    reads = {(f["rx"], f["xxh3"]) for f in runs if f["experiment"] == "reads"}
    assert reads == {("loop", False), ("loop", True), ("block", False), ("block", True)}
    assert all(f["rx_reads_per_4MiB"] == 1.0 for f in runs if f.get("rx") == "block")


def test_pipesizes_refuses_bad_arguments():
    for args in (["--writes", "0"], ["--writes", "4M"], ["--rounds", "0"], ["--seconds", "-1"]):
        run = subprocess.run([sys.executable, "-m", "pdd_tools.pipesizes", *args], capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 2 and "error" in run.stderr, args
