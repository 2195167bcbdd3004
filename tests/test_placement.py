"""CPU placement (``[cpus]``: ``main``, ``bulk``): the cpulist syntax and its errors, the check
against the CPUs the process may use, and real agents whose threads the kernel reports on the
CPUs the config names while a transfer runs through them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from conftest import engine_pair
from pdd_tools.harness import AgentPair
from pdd_wire import config as cfgmod
from pdd_wire import placement
from pdd_wire.agent import Agent
from pdd_wire.engine import protocol as p
from pdd_wire.engine.client import EngineClient
from pdd_wire.errors import ConfigError
from pdd_wire.memory import HostRegion, SharedMemory, register_async
from pdd_wire.placement import check_allowed, format_cpus, parse_cpus
from pdd_wire.transport.bulk_loop import BulkLoop
from support.agents import two_site_toml

ALLOWED = sorted(os.sched_getaffinity(0))
MAIN, BULK = ALLOWED[0], ALLOWED[-1]  # one CPU each where there are two (the same one otherwise)
NOT_ALLOWED = ALLOWED[-1] + 1  # a CPU number this process may not use (online or not)
# A CPU the kernel cannot have: past every possible one (the kernel refuses it, whatever the mask).
NOT_POSSIBLE = max(parse_cpus(Path("/sys/devices/system/cpu/possible").read_text(), "possible")) + 1


@pytest.mark.parametrize(("text", "cpus"), [
    ("", set()), ("0", {0}), ("0-3", {0, 1, 2, 3}), ("0-3,8", {0, 1, 2, 3, 8}), (" 2 , 4-5 ", {2, 4, 5}),
    ("7-7", {7}), ("1,1,0-1", {0, 1}), ("8191", {8191}),
])
def test_cpulists_parse_as_taskset_writes_them(text, cpus):
    assert parse_cpus(text, "cpus.bulk") == cpus


@pytest.mark.parametrize(("text", "says"), [
    ("a", "'a' is not a CPU number"), ("1-", "'1-' is not a CPU number"), ("-1", "'-1' is not a CPU number"),
    ("3-1", "range '3-1' ends before it starts"), ("0,,1", "'' is not a CPU number"),
    ("8192", "CPU 8192 is beyond 8191"), ("1-0x3", "is not a CPU number"), ("1 -2", "is not a CPU number"),
    ("+1", "'+1' is not a CPU number"), ("1_0", "'1_0' is not a CPU number"), ("\u0663", "is not a CPU number"),
    (",".join(["0-8191"] * 700), "characters: a cpulist is at most 4096"),
])
def test_bad_cpulists_name_the_key_and_the_part(text, says):
    with pytest.raises(ConfigError) as e:
        parse_cpus(text, "cpus.main")
    assert e.value.key == "cpus.main" and says in str(e.value)


@pytest.mark.parametrize("cpus", [{0}, {0, 1, 2, 8}, {1, 3, 5}, {0, 1, 2, 3, 4, 5, 6, 7, 100, 101}])
def test_format_folds_ranges_and_parses_back(cpus):
    assert parse_cpus(format_cpus(cpus), "k") == cpus
    assert format_cpus({0, 1, 2, 8}) == "0-2,8"


def test_a_bad_cpulist_in_the_file_is_a_config_error_on_its_key(tmp_sock_dir):
    toml = two_site_toml(tmp_sock_dir, extra='[cpus]\nbulk = "2-x"\n')["A"]
    with pytest.raises(ConfigError) as e:
        cfgmod.loads(toml)
    assert e.value.key == "cpus.bulk"
    with pytest.raises(ConfigError) as e:
        cfgmod.loads(two_site_toml(tmp_sock_dir, extra='[cpus]\nmian = "0"\n')["A"])
    assert "mian" in str(e.value)


def test_cpus_the_process_may_not_use_are_named_with_those_it_may():
    check_allowed(frozenset(ALLOWED), "cpus.main")
    with pytest.raises(ConfigError) as e:
        check_allowed(frozenset({MAIN, NOT_ALLOWED}), "cpus.bulk")
    assert e.value.key == "cpus.bulk"
    assert f"CPU {NOT_ALLOWED} is not among the CPUs this process may use ({format_cpus(ALLOWED)}" in str(e.value)


def test_check_refuses_a_config_naming_cpus_the_node_lacks(tmp_sock_dir):
    path = tmp_sock_dir / "A.toml"
    bad = f"{NOT_ALLOWED}-{NOT_ALLOWED + 1}"
    path.write_text(two_site_toml(tmp_sock_dir, extra=f'[cpus]\nmain = "{MAIN}"\nbulk = "{bad}"\n')["A"])
    r = subprocess.run([sys.executable, "-m", "pdd_wire", "--site", "A", "--config", str(path), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "cpus.bulk" in r.stderr and f"CPUs {NOT_ALLOWED}-{NOT_ALLOWED + 1} are not among" in r.stderr
    path.write_text(two_site_toml(tmp_sock_dir, extra=f'[cpus]\nmain = "{MAIN}"\nbulk = "{BULK}"\n')["A"])
    r = subprocess.run([sys.executable, "-m", "pdd_wire", "--site", "A", "--config", str(path), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "config OK" in r.stdout, r.stdout + r.stderr


def test_an_agent_that_cannot_place_its_threads_does_not_start(tmp_sock_dir):
    """Started (no --check), it names the key and exits 1 before it listens."""
    path = tmp_sock_dir / "A.toml"
    path.write_text(two_site_toml(tmp_sock_dir, extra=f'[cpus]\nmain = "{NOT_ALLOWED}"\n')["A"])
    r = subprocess.run([sys.executable, "-m", "pdd_wire", "--site", "A", "--config", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "cannot start" in out and "cpus.main" in out and f"CPU {NOT_ALLOWED} is not among" in out
    assert not (tmp_sock_dir / "A.sock").exists()


def test_a_bulk_thread_that_cannot_be_placed_raises_and_ends():
    loop = BulkLoop("pdd-bulk-x", frozenset({NOT_POSSIBLE}))
    try:
        with pytest.raises(OSError):
            loop.start()
        assert not loop._thread.is_alive()
    finally:
        loop.stop()


def _thread_cpus(pid: int) -> dict[str, set[str]]:
    """``{comm: {Cpus_allowed_list, ...}}`` of ``pid``'s threads, the main thread as ``main``."""
    out: dict[str, set[str]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except FileNotFoundError:
            continue
        cpus = next(line.split(":", 1)[1].strip() for line in status.splitlines()
                    if line.startswith("Cpus_allowed_list"))
        out.setdefault("main" if int(tid) == pid else comm, set()).add(cpus)
    return out


async def test_daemons_run_their_threads_where_cpus_puts_them_and_move_kv():
    """Two pdd-wired processes with [cpus]: the kernel reports the event loop's thread on
    ``main`` and every bulk thread on ``bulk`` (also after 64 MiB moved through them),
    /v1/status and ``pdd-wire status`` say the same, and the log says what is placed badly."""
    async with AgentPair(bulk_threads=2, extra=f'[cpus]\nmain = "{MAIN}"\nbulk = "{BULK}"\n') as pair:
        for s in "AB":
            assert pair.status(s)["cpus"] == {"main": str(MAIN), "bulk": str(BULK)}
        async with EngineClient(pair.sockets["A"], "place-A") as ea, EngineClient(pair.sockets["B"], "place-B") as eb:
            size = 64 << 20
            src, dst = SharedMemory(size), SharedMemory(size)
            try:
                src.buf[:] = os.urandom(size)
                ra = await ea.register(src, block_bytes=1 << 20)
                rb = await eb.register(dst, block_bytes=1 << 20)
                await eb.post_recv("placed", [rb.blocks(0, 64)])
                await ea.send_kv("placed", [ra.blocks(0, 64)], to=["B"])
                assert isinstance(await eb.wait("placed", timeout=60), p.KvReceived)
                assert isinstance(await ea.wait("placed", timeout=60), p.KvSent)
                assert bytes(dst.buf) == bytes(src.buf)
                await ea.deregister(ra)
                await eb.deregister(rb)
            finally:
                src.close()
                dst.close()
        for s, proc in pair.procs.items():
            threads = _thread_cpus(proc.pid)
            assert threads["main"] == {str(MAIN)}, (s, threads)
            assert threads["pdd-bulk-0"] == threads["pdd-bulk-1"] == {str(BULK)}, (s, threads)
        code = "import sys; from pdd_wire.cli import tool_main; sys.exit(tool_main())"
        r = subprocess.run([sys.executable, "-c", code, "status", "--admin", pair.admin["A"]],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and f"cpus: event loop {MAIN}, bulk threads {BULK}" in r.stdout, r.stdout + r.stderr
        log = (pair.dir / "agent-A.log").read_text()
        assert "threads placed" in log
        # Two bulk threads on one CPU, said at start; main and bulk apart unless the host has one CPU.
        assert "more bulk threads than bulk CPUs" in log
        assert ("cpus.main and cpus.bulk share CPUs" in log) == (MAIN == BULK)


async def test_agents_sharing_a_thread_share_its_placement_and_the_last_to_stop_gives_it_back(
        tmp_sock_dir, engines):
    """In-process (as the tests run agents), two agents on the test's thread: the thread runs on
    cpus.main from the first start to the last stop, whichever stops first; the default
    executor's workers run on cpus.bulk; a transfer moves; a placement that differs from the one
    the thread has is refused, naming the key."""
    before = os.sched_getaffinity(0)
    for order in ((0, 1), (1, 0)):
        tomls = two_site_toml(tmp_sock_dir, extra=f'[cpus]\nmain = "{MAIN}"\nbulk = "{BULK}"\n')
        agents = [Agent(cfgmod.loads(tomls[s])) for s in "AB"]
        running: list[Agent] = []
        try:
            for a in agents:
                running.append(a)
                await a.start()
            assert os.sched_getaffinity(0) == {MAIN}
            assert agents[0].describe()["cpus"] == {"main": str(MAIN), "bulk": str(BULK)}
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(agents[0].work_executor, placement.this_thread) == {BULK}
            with pytest.raises(ConfigError) as e:
                placement.pin_main(frozenset({NOT_POSSIBLE}), "cpus.main")
            assert e.value.key == "cpus.main" and f"another agent of this thread runs it on CPUs {MAIN}" in str(e.value)
            ea, eb, src, dst, ra, rb = await engine_pair(engines, tmp_sock_dir, 8 << 20, 1 << 20)
            await eb.post_recv(f"r{order}", [rb.blocks(0, 8)])
            await ea.send_kv(f"r{order}", [ra.blocks(0, 8)], to=["B"])
            assert isinstance(await eb.wait(f"r{order}", timeout=30), p.KvReceived)
            assert bytes(dst.buf) == bytes(src.buf)
            await engines.close()
            engines.clients.clear()
            engines.mems.clear()
            first, second = agents[order[0]], agents[order[1]]
            await first.shutdown(0)
            running.remove(first)
            assert os.sched_getaffinity(0) == {MAIN}  # the other agent still runs on this thread
            assert second.describe()["cpus"]["main"] == str(MAIN)
        finally:
            for a in running:
                await a.shutdown(0)
        assert os.sched_getaffinity(0) == before


async def test_main_without_bulk_keeps_the_bulk_threads_off_it_and_says_so(tmp_sock_dir):
    """cpus.main alone: the bulk threads (and the default executor's workers) run on the CPUs the
    process was started on, not on main's, which they would inherit; the agent warns."""
    a = Agent(cfgmod.loads(two_site_toml(tmp_sock_dir, extra=f'[cpus]\nmain = "{MAIN}"\n')["A"]))
    try:
        with capture_logs() as logs:
            await a.start()
        assert os.sched_getaffinity(0) == {MAIN}
        assert a.describe()["cpus"] == {"main": str(MAIN), "bulk": format_cpus(ALLOWED)}
        assert await asyncio.get_running_loop().run_in_executor(a.work_executor, placement.this_thread) == set(ALLOWED)
        assert any(r["event"].startswith("cpus.main without cpus.bulk") and r["log_level"] == "warning"
                   for r in logs), logs
    finally:
        await a.shutdown(0)
    assert os.sched_getaffinity(0) == set(ALLOWED)


async def test_the_benchmarks_placed_token_figure_measures_placed_agents():
    """``token_latency_under_load_p99_placed`` (scripts/bench --only latency, quick): its agents
    run where [cpus] puts them (it checks /v1/status and refuses otherwise), its samples come from
    under the transfers and from idle, and this process's CPUs are given back."""
    from pdd_tools.bench import Figures
    from pdd_tools.bench_goodput import placed_latency_figures, placed_layout

    figs = Figures(as_json=False)
    before = os.sched_getaffinity(0)
    await placed_latency_figures(figs, True, 2.5, 7.0)
    assert os.sched_getaffinity(0) == before
    if len(ALLOWED) < 2:  # one CPU: nothing to place apart, no figure (said on stdout)
        assert figs.rows == []
        return
    (row,) = figs.rows
    assert row["figure"] == "token_latency_under_load_p99_placed" and row["unit"] == "ms"
    assert row["value"] > 0 and row["baseline_value"] > 0 and row["ratio"] == pytest.approx(
        row["value"] / row["baseline_value"], rel=0.01)
    layout, engines, how = placed_layout(ALLOWED)
    for site, c in layout.items():
        assert f'{site}: main = "{c["main"]}", bulk = "{c["bulk"]}"' in row["note"]
    assert f"the engines' process on CPU {format_cpus(engines)}: {how}" in row["note"] and "100 samples" in row["note"]
    assert "unplaced, in this run: 2.50 GB/s and 7.0x" in row["note"]


def _alone(cpu: int) -> frozenset[int]:  # no hyperthreads: each CPU a core
    return frozenset({cpu})


def _check_layout(cpus: list[int], siblings) -> tuple[dict, list[int], str, int]:
    """The invariants of placed_layout on ``cpus``; returns its answer and the cores counted."""
    from pdd_tools.bench_goodput import placed_layout

    layout, engines, how = placed_layout(cpus, siblings)
    core = {c: frozenset(siblings(c) | {c}) & set(cpus) for c in cpus}
    ncores = len(set(core.values()))
    sets = {s: (set(parse_cpus(c["main"], "main")), set(parse_cpus(c["bulk"], "bulk"))) for s, c in layout.items()}
    (ma, ba), (mb, bb) = sets["A"], sets["B"]
    token_path = ma | mb | set(engines)
    assert ba and bb and not (ba | bb) & token_path
    if ncores >= 2:  # no bulk CPU on a core of the token path's (its hyperthread siblings included)
        assert not {c for b in ba | bb for c in core[b]} & token_path
    units = ncores if ncores >= 2 else len(cpus)
    assert ba.isdisjoint(bb) == (units >= 3)
    assert (ma.isdisjoint(mb) and ma.isdisjoint(engines) and mb.isdisjoint(engines)) == (units >= 5)
    assert ma | mb | ba | bb | set(engines) == set(cpus)
    return layout, engines, how, units


@pytest.mark.parametrize("cpus", [list(range(10, 10 + n)) for n in (2, 3, 4, 5, 6, 16)] + [[0, 2, 5, 7, 9]],
                         ids=lambda c: format_cpus(c))
def test_the_placed_figure_comes_as_close_to_two_nodes_as_the_cpus_allow(cpus):
    """No bulk thread on a CPU of an event loop or of the engines; from 3 CPUs the two agents'
    bulk threads apart (neither can switch the other out holding its GIL); from 5 each agent's
    event loop on a CPU of its own and the engines on another; the bulk CPUs split evenly
    (A takes the odd one); every CPU used; the note's text says which layout it is."""
    layout, engines, how, units = _check_layout(cpus, _alone)
    ba, bb = (parse_cpus(layout[s]["bulk"], "bulk") for s in "AB")
    assert how.endswith(", no bulk thread on a core of the token path's")
    if units >= 3:
        assert 0 <= len(ba) - len(bb) <= 1
    if units >= 5:
        assert len(parse_cpus(layout["A"]["main"], "main")) == 1 and len(engines) == 1
        assert how.startswith("each agent's event loop, the engines and each agent's bulk threads on cores")
    elif units >= 3:
        assert how.startswith("the event loops and the engines on one of the cores, each agent's bulk")
    else:
        assert how.startswith("the event loops and the engines on one of the two cores, both agents' bulk")


def test_the_placed_figure_counts_cores_not_hyperthreads():
    """16 logical CPUs as 8 cores of two (siblings c and c + 8): whole cores are placed, so no
    bulk thread runs on the twin of an event loop's or the engines' CPU. Two hyperthreads of a
    single core are placed as CPUs (there is nothing better), and the note says so."""
    layout, engines, how, units = _check_layout(list(range(16)), lambda c: frozenset({c % 8, c % 8 + 8}))
    assert units == 8 and layout["A"]["main"] == "0,8" and layout["B"]["main"] == "1,9" and engines == [2, 10]
    layout, engines, how, units = _check_layout([4, 5], lambda c: frozenset({4, 5}))
    assert layout["A"] == layout["B"] == {"main": "4", "bulk": "5"} and "hyperthreads of one core" in how
    assert "share the token path's core" in how and "no bulk thread on a core" not in how


def test_the_placed_figure_needs_two_cpus():
    from pdd_tools.bench_goodput import placed_layout

    with pytest.raises(ValueError, match="two CPUs or more"):
        placed_layout([3, 3], _alone)


async def test_agent_pair_gives_each_site_its_own_config():
    """AgentPair(extra_by_site=...): A's text reaches A only (its bulk threads on one CPU, B's
    where the process runs); a site other than A and B is refused."""
    with pytest.raises(ValueError, match="sites are 'A' and 'B'"):
        AgentPair(extra_by_site={"a": ""})
    last = ALLOWED[-1]
    async with AgentPair(extra_by_site={"A": f'[cpus]\nbulk = "{last}"\n'}) as pair:
        assert pair.status("A")["cpus"]["bulk"] == str(last)
        assert pair.status("B")["cpus"]["bulk"] == format_cpus(ALLOWED)


async def test_bulk_without_main_places_the_kv_work_and_leaves_the_loop_where_it_was(tmp_sock_dir):
    """cpus.bulk alone: bulk threads and the agent's workers on it, the event loop's thread as it was."""
    a = Agent(cfgmod.loads(two_site_toml(tmp_sock_dir, extra=f'[cpus]\nbulk = "{BULK}"\n')["A"]))
    try:
        await a.start()
        assert os.sched_getaffinity(0) == set(ALLOWED) and not placement.pinned_here()
        assert a.describe()["cpus"] == {"main": format_cpus(ALLOWED), "bulk": str(BULK)}
        assert await asyncio.get_running_loop().run_in_executor(a.work_executor, placement.this_thread) == {BULK}
    finally:
        await a.shutdown(0)
    assert a.work_executor is None


async def test_an_unplaced_agent_on_a_placed_thread_keeps_its_bulk_threads_off_it(tmp_sock_dir):
    """In-process, an agent without [cpus] started on a thread another agent placed: its bulk
    threads run where the process was started, not on the CPUs they would inherit."""
    tomls = two_site_toml(tmp_sock_dir, extra="")
    placed = Agent(cfgmod.loads(tomls["A"].replace("[timeouts]", f'[cpus]\nmain = "{MAIN}"\n[timeouts]')))
    plain = Agent(cfgmod.loads(tomls["B"]))
    running: list[Agent] = []
    try:
        for a in (placed, plain):
            running.append(a)
            await a.start()
        assert plain.describe()["cpus"] == {"main": str(MAIN), "bulk": format_cpus(ALLOWED)}
    finally:
        for a in running:
            await a.shutdown(0)
    assert os.sched_getaffinity(0) == set(ALLOWED)


def test_a_loop_the_kernel_cannot_place_is_refused_on_cpus_main():
    """The kernel's refusal (a CPU past every possible one) names the key; the thread is as it was."""
    got: list = []

    def run() -> None:
        try:
            placement.pin_main(frozenset({NOT_POSSIBLE}), "cpus.main")
        except ConfigError as exc:
            got.append(exc)
        got.append((placement.pinned_here(), placement.this_thread()))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    exc, (pinned, cpus) = got
    assert exc.key == "cpus.main" and f"the event loop cannot run on CPUs {NOT_POSSIBLE}" in str(exc)
    assert not pinned and cpus == set(ALLOWED)


async def test_page_in_threads_run_on_the_work_cpus():
    """Memory registration pages a region in on a thread of its own, placed on the CPUs given
    (the agent's cpus.bulk); the region is then mapped and paged in."""
    seen: list[frozenset[int]] = []

    class Watched(HostRegion):
        def populate(self, *args, **kw) -> bool:
            seen.append(placement.this_thread())
            return super().populate(*args, **kw)

    shm = SharedMemory(8 << 20)
    try:
        region = await register_async(Watched(1, os.dup(shm.fd), 8 << 20, 1 << 20, owner=None), lambda: False,
                                      cpus=frozenset({BULK}))
        try:
            assert seen == [{BULK}]
            assert len(region.view()) == 8 << 20
        finally:
            region.close()
    finally:
        shm.close()


@pytest.fixture(autouse=True)
def _thread_left_as_found():
    """No test here leaves the pytest thread placed (or an agent's placement record behind)."""
    yield
    assert not placement.pinned_here() and os.sched_getaffinity(0) == set(ALLOWED)
