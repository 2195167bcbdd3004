"""The wake probe of ``scripts/bench --only latency`` (``pdd_tools.wakeprobe``) measures what it
says: every message through the whole chain of processes, timed from its send, and nothing of it
left running after its run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pdd_tools.wakeprobe import WakeProbe, run


def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(name))
    return pids


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdd_tools.wakeprobe", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _ready(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"ready"  # the first message crossed the chain


def _consecutive(samples: list, t0: float, t1: float) -> None:
    seqs = [seq for seq, _, _ in samples]
    assert seqs == list(range(len(seqs)))  # none lost, none reordered, from the first one sent
    sent = [when for _, when, _ in samples]
    assert sent == sorted(sent) and t0 < sent[0] and sent[-1] < t1
    assert all(0 < ms < (t1 - t0) * 1e3 for _, _, ms in samples)


@pytest.mark.parametrize("hops", [1, 3])
def test_every_message_crosses_the_whole_chain_and_closing_its_input_ends_it(hops):
    t0 = time.perf_counter()
    proc = _start("--hops", str(hops), "--seconds", "60")
    try:
        _ready(proc)
        assert len(_group(proc.pid)) == 1 + hops  # this reader, the writer, hops - 1 relays
        time.sleep(0.3)
        out, err = proc.communicate(b"", timeout=30)  # closes its input: it prints and exits
        t1 = time.perf_counter()
        assert proc.returncode == 0, err.decode()
        samples = json.loads(out)
        assert len(samples) >= 10
        _consecutive(samples, t0, t1)
        assert _group(proc.pid) == []  # the whole chain is gone with it
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_without_a_pipe_on_its_input_it_runs_its_seconds():
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pdd_tools.wakeprobe", "--seconds", "0.5"],
                         stdin=subprocess.DEVNULL, capture_output=True, timeout=60, check=True).stdout
    t1 = time.perf_counter()
    ready, samples = out.splitlines()
    assert ready == b"ready"
    _consecutive(json.loads(samples), t0, t1)


def test_a_process_of_the_chain_that_dies_is_an_error_not_a_short_run():
    proc = _start("--hops", "3", "--seconds", "60")
    try:
        _ready(proc)
        child = next(pid for pid in _group(proc.pid) if pid != proc.pid)  # the writer or a relay
        os.kill(child, signal.SIGKILL)
        proc.wait(timeout=30)  # the chain breaks: the run ends by itself, its input still open
        out, err = proc.communicate(timeout=30)
        assert proc.returncode != 0
        assert b"was killed by signal 9" in err
        assert _group(proc.pid) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_chain_of_no_process_is_refused_before_any_fork():
    with pytest.raises(ValueError, match="hops must be >= 1"):
        run(hops=0)


async def test_the_asyncio_handle_gives_the_samples_of_its_run():
    import asyncio

    t0 = time.perf_counter()
    probe = await WakeProbe.start(max_s=30, hops=2)
    await asyncio.sleep(0.3)
    samples = await probe.stop()
    _consecutive(samples, t0, time.perf_counter())
    assert _group(probe.proc.pid) == []


async def test_the_benchmark_times_it_during_the_agents_transfers_and_before_them():
    """``wake_under_load`` as ``scripts/bench --only latency`` runs it, between two real agents:
    samples from inside the transfers' windows and from the quiet second before them, and the
    transfers did move their bytes."""
    from pdd_tools.bench_goodput import load_pools, wake_under_load
    from pdd_tools.harness import AgentPair
    from pdd_wire.engine.client import EngineClient

    pair = AgentPair()
    await pair.start()
    try:
        async with EngineClient(pair.sockets["A"], "wake-A") as ea, EngineClient(pair.sockets["B"], "wake-B") as eb:
            async with load_pools(ea, eb, 256 << 20) as pools:
                under, quiet, gbps = await wake_under_load(ea, eb, pools, 6, quiet_s=0.3)
    finally:
        pair.stop()
    assert under and len(quiet) >= 10 and gbps > 0
    assert all(ms > 0 for ms in under + quiet)
