"""The operator's tools against real ``pdd-wired`` processes: which agent ``pdd-wire status``
reached and what went wrong when none did, a ``--site`` that contradicts the config, config
errors that suggest the key meant and list an enum's values, ``/readyz`` telling "listening"
from "peers up", the first connect not logged as resumed, and identical warnings rate-limited.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import threading

import pytest

from pdd_wire import config as cfgmod
from pdd_wire.log import Repeats
from pdd_wire.progress import Progress, bar
from support.agents import free_port
from test_daemon import (  # noqa: F401
    GOOD,
    _good,
    cli,
    daemons,
    get,
    http_get,
    json_lines,
    pair_configs,
    short_dir,
    tool,
    wait_peers_up,
    wait_ready,
    write,
)


# ---------------------------------------------------------------------------------- the config
def test_site_contradicting_the_config_is_an_error(short_dir):
    path = write(short_dir, "a.toml", _good(short_dir))
    r = cli("--site", "B", "--config", str(path), "--check")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "--site B contradicts site = 'A'" in r.stderr and str(path) in r.stderr, r.stderr
    assert r.stdout == ""
    r = cli("--site", "A", "--config", str(path), "--check")
    assert r.returncode == 0 and "site A" in r.stdout, r.stderr


@pytest.mark.parametrize("change, key, hint", [
    ('[transfer]\nchunk_byte = 1\n', "transfer.chunk_byte", "did you mean 'chunk_bytes'"),
    ('[timeout]\nheartbeat_s = 1\n', "timeout", "did you mean 'timeouts'"),
    ('[policy.handoff]\nbusy = 0.5\n', "policy.handoff.busy", "did you mean 'busy_load'"),
    ('[log]\nlevel = "loud"\n', "log.level", "valid values: 'debug', 'info', 'warning', 'error'"),
    ('[transfer]\ncompress = "yes"\n', "transfer.compress", "valid values: 'auto', 'on', 'off'"),
    ('[transfer]\nzzz = 1\n', "transfer.zzz", "valid keys here: chunk_bytes,"),
], ids=["near-key", "near-table", "nested", "log-level", "compress", "far-key"])
def test_config_errors_suggest_the_key_and_list_enum_values(short_dir, change, key, hint):
    path = write(short_dir, "a.toml", _good(short_dir) + change)
    r = cli("--site", "A", "--config", str(path), "--check")
    assert r.returncode == 2 and f"'{key}'" in r.stderr and hint in r.stderr, r.stderr


def test_peer_transport_enum_lists_its_values(short_dir):
    text = _good(short_dir).replace('address = "127.0.0.1:', 'transport = "rdma"\naddress = "127.0.0.1:')
    with pytest.raises(cfgmod.ConfigError) as exc:
        cfgmod.loads(text)
    assert exc.value.key == "peers[0].transport" and "valid values: 'tcp', 'ucx'" in str(exc.value)


def test_default_engine_socket_is_the_daemons():
    for site in cfgmod.DEFAULT_SITES:
        assert cfgmod.default_config(site).listen.engine_socket == cfgmod.default_engine_socket(site)


# ---------------------------------------------------------------------------------- status
def test_status_with_no_agent_names_the_address_and_who_runs(short_dir):
    port = free_port()
    r = tool("status", "--admin", f"127.0.0.1:{port}")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"no agent answered at 127.0.0.1:{port} (--admin)" in r.stderr, r.stderr
    assert "refused" in r.stderr.lower() and "Traceback" not in r.stderr
    # It says whether a daemon runs on this host (other tests' agents may).
    assert "no pdd-wired process runs on this host" in r.stderr or "pdd-wired on this host: pid" in r.stderr
    cfg = write(short_dir, "a.toml", _good(short_dir).replace('admin = ""', f'admin = "127.0.0.1:{port}"'))
    r = tool("status", "--config", str(cfg))
    assert r.returncode == 1 and f"listen.admin in {cfg}" in r.stderr, r.stderr
    r = tool("status")
    assert r.returncode == 2 and "--admin" in r.stderr, r.stderr


def test_a_reader_that_goes_away_is_no_error():
    """``pdd-wire config --site A | head -1``: stdout's reader is gone before the tool writes. It
    ends quietly, as SIGPIPE would (141), not with "[Errno 32] Broken pipe" on stderr."""
    r, w = os.pipe()
    os.close(r)
    code = "import sys; from pdd_wire.cli import tool_main; sys.exit(tool_main())"
    try:
        p = subprocess.run([sys.executable, "-c", code, "config", "--site", "A"], stdout=w,
                           stderr=subprocess.PIPE, text=True, timeout=30, stdin=subprocess.DEVNULL)
    finally:
        os.close(w)
    assert p.returncode == 141 and p.stderr == "", (p.returncode, p.stderr)


async def test_status_names_the_agent_and_refuses_another_sites(daemons, short_dir):
    cfg = pair_configs(short_dir)
    a = daemons(["--site", "A", "--config", str(cfg["A"])], name="A")
    await wait_ready(cfg["admin"]["A"], a)

    # B is not running: A listens (ready) but not every peer is up.
    code, body = await get(f"http://{cfg['admin']['A']}/readyz")
    assert code == 200 and json.loads(body) == {"ready": True, "listening": True, "peers_up": 0, "peers": 1,
                                                "all_peers_up": False}
    code, body = await get(f"http://{cfg['admin']['A']}/readyz?peers=all")
    assert code == 503 and json.loads(body)["ready"] is False

    r = tool("status", "--config", str(cfg["A"]))
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    for want in ("agent A/a1", f"pid {a.pid}", f"config {cfg['A']}", f"admin {cfg['admin']['A']}"):
        assert want in first, r.stdout
    assert "0/1 peers up" in r.stdout and "B/b1" in r.stdout and "DOWN" in r.stdout, r.stdout

    r = tool("status", "--admin", cfg["admin"]["A"], "--json")
    st = json.loads(r.stdout)
    assert (st["site"], st["node"], st["pid"], st["config"]) == ("A", "a1", a.pid, str(cfg["A"]))
    assert st["admin"] == cfg["admin"]["A"] and st["version"]

    # An agent of another site at that address is not reported as the one asked for.
    r = tool("status", "--site", "B", "--admin", cfg["admin"]["A"])
    assert r.returncode == 1 and "is site A" in r.stderr and "not site B" in r.stderr, r.stderr

    r = tool("probe", "--site", "B", "--from", "B", "--admin", cfg["admin"]["A"])
    assert r.returncode == 1 and "is site A" in r.stderr and "not site B" in r.stderr, r.stderr

    b = daemons(["--site", "B", "--config", str(cfg["B"])], name="B")
    await wait_peers_up(cfg["admin"]["A"], a)
    code, body = await get(f"http://{cfg['admin']['A']}/readyz?peers=all")
    assert code == 200 and json.loads(body)["all_peers_up"] is True

    # probe names the agent it measured from (stderr), the figures go to stdout.
    r = tool("probe", "--site", "B", "--config", str(cfg["A"]), "--seconds", "1")
    assert r.returncode == 0, r.stderr
    assert f"from agent A/a1 (pid {a.pid}" in r.stderr and r.stdout.startswith("probe B"), (r.stdout, r.stderr)
    assert "goodput  1 stream:" in r.stdout, r.stdout

    # The first connect is not a resume.
    await wait_peers_up(cfg["admin"]["B"], b)
    a.terminate()
    assert await a.wait() == 0
    ups = [r for r in json_lines(a.text()) if r["event"] == "peer up"]
    assert ups and ups[0]["resumed"] is False, ups
    # While B was not yet there A tried many times, and said so once.
    unreachable = [r for r in json_lines(a.text()) if r["event"] == "peer not reachable"]
    assert len(unreachable) == 1, unreachable


# ---------------------------------------------------------------------------------- log repeats
def test_identical_lines_are_held_back_and_counted():
    now = [0.0]
    out = []
    rep = Repeats(every_s=30, clock=lambda: now[0])

    def info(event, **kw):
        out.append((event, kw))

    assert rep(info, "peer not reachable", error="refused")
    for t in range(1, 20):
        now[0] = t
        assert not rep(info, "peer not reachable", error="refused")
    # Another message, or the same event with other fields, goes out at once.
    assert rep(info, "peer not reachable", error="timed out")
    now[0] = 31
    assert rep(info, "peer not reachable", error="refused")
    assert out == [("peer not reachable", {"error": "refused"}),
                   ("peer not reachable", {"error": "timed out"}),
                   ("peer not reachable", {"error": "refused", "repeated": 19})]


def test_more_distinct_lines_than_are_kept_still_come_once_per_period():
    """64 lines are kept per owner. Evicting the oldest live one made it new when it came back:
    with 65 or more lines in rotation every call was written (10,000 lines a second). Lines past
    their period go first now, and while 64 are live a newcomer shares one more slot."""
    now = [0.0]
    out = []
    rep = Repeats(every_s=1.0, clock=lambda: now[0])
    for i in range(10_000):
        now[0] = i / 10_000  # 10,000 calls within one period, 80 lines in rotation
        rep(lambda event, **kw: out.append(kw), "transfer failed", peer=f"p{i % 80}")
    assert len(out) == 65, len(out)  # 64 lines, and one for all the others
    now[0] = 1.5  # a period later: each comes back once, with what was held back
    for i in range(80):
        rep(lambda event, **kw: out.append(kw), "transfer failed", peer=f"p{i}")
    assert 65 < len(out) <= 65 + 80 and out[65].get("repeated")


WRONG = "sha256:" + "0" * 64
REFUSALS = ("handshake refused", "inbound connection refused", "inbound connection failed", "peer reported an error")


@pytest.mark.parametrize("pins", ["B", "A"], ids=["listener-pins-a-wrong-fingerprint",
                                                  "dialer-pins-a-wrong-fingerprint"])
async def test_a_refused_handshake_retried_for_seconds_is_logged_once(daemons, short_dir, pins):
    """A (the dialer) retries every 0.1 s against a peer whose certificate is not the pinned one:
    each refusal line is written once per 30 s, not once per attempt."""
    cfg = pair_configs(short_dir, extra="[timeouts]\nreconnect_max_backoff_s = 0.1\n")
    path = cfg[pins]
    path.write_text(path.read_text().replace("streams = 2\n[transfer]", f'streams = 2\nfingerprint = "{WRONG}"\n'
                                                                         "[transfer]", 1))
    b = daemons(["--site", "B", "--config", str(cfg["B"])], name="B")
    a = daemons(["--site", "A", "--config", str(cfg["A"])], name="A")
    for admin, d in ((cfg["admin"]["B"], b), (cfg["admin"]["A"], a)):
        await wait_ready(admin, d)
    async with asyncio.timeout(30):  # many attempts refused, on both sides
        while min(_errors(cfg["admin"][s], "IDENTITY_MISMATCH" if s == pins or s == "A" else "") for s in "AB") < 8:
            await asyncio.sleep(0.1)
    for d in (a, b):
        d.terminate()
        assert await d.wait() == 0
    lines = {s: [r for r in json_lines(d.text()) if r["event"] in REFUSALS] for s, d in (("A", a), ("B", b))}
    assert sorted(r["event"] for r in lines["A"]) == (["handshake refused"] if pins == "A" else
                                                      ["handshake refused", "peer reported an error"]), lines
    assert WRONG in lines["A" if pins == "A" else "B"][0]["error"] and "not the registered" not in str(lines), lines
    events = [r["event"] for r in lines["B"]]
    assert events and len(events) == len(set(events)), lines  # each at most once


def _errors(admin: str, code: str) -> float:
    """pddwire_errors_total{code=...} of the agent at ``admin`` (any code's connections: "")."""
    _, body = http_get(f"http://{admin}/metrics")
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith("pddwire_errors_total{") and f'code="{code}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total if code else float("inf")


# ---------------------------------------------------------------------------------- progress
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_on_a_terminal_and_erases_its_line():
    term = _Terminal()
    seen = threading.Event()

    def line(elapsed_s: float) -> str:
        seen.set()
        return f"replay {bar(0.5, 10)}"

    with Progress(line, stream=term, every_s=0.001):
        assert seen.wait(10)
    out = term.getvalue()
    assert "\r\033[Kreplay [#####.....]" in out and out.endswith("\r\033[K"), out


def test_progress_is_silent_off_a_terminal_and_when_quiet():
    for stream, quiet in ((io.StringIO(), False), (_Terminal(), True)):
        with Progress(lambda el: "never shown", stream=stream, quiet=quiet, every_s=0.001) as p:
            assert not p.on
        assert stream.getvalue() == ""
