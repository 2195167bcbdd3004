"""pdd_tools.netns: two namespaces joined by a veth pair, for real (these tests run as root).

They use the prefix "pddwt", never the demo's "pddw", and take the sites down whatever happens.
Traffic comes from small Python programs run in a site with ``ip netns exec``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from pdd_tools.netns import NetnsError, TwoSites, tbf_params

pytestmark = pytest.mark.root  # network namespaces

PREFIX = "pddwt"

# Run in site B: listen on B's address, print the port, serve one connection, then exit.
#   echo: send back what arrives until EOF;  sink: count bytes until EOF and print
#   "<bytes after the first read> <seconds from the first read to EOF>".
SERVER = r"""
import socket, sys, time
mode, host = sys.argv[1], sys.argv[2]
srv = socket.create_server((host, 0))
srv.settimeout(20)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.settimeout(20)
buf = bytearray(1 << 20)
if mode == "echo":
    while data := conn.recv(65536):
        conn.sendall(data)
else:
    first = conn.recv_into(buf)
    t0, n = time.perf_counter(), 0
    while k := conn.recv_into(buf):
        n += k
    print(n, time.perf_counter() - t0, flush=True)
conn.close()
"""

# Run in site A: connect to HOST:PORT (retrying for up to RETRY seconds), then send SIZE
# bytes (echo mode: check they come back), then print "ok" -- or "fail <error>" and exit 1.
CLIENT = r"""
import socket, sys, time
host, port, size, retry = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
deadline = time.monotonic() + retry
while True:
    try:
        s = socket.create_connection((host, port), timeout=2)
        break
    except OSError as exc:
        if time.monotonic() >= deadline:
            print("fail", exc, flush=True)
            sys.exit(1)
        time.sleep(0.05)
s.settimeout(20)
if size:
    s.sendall(bytes(size))
else:
    s.sendall(b"ping")
    assert s.recv(4) == b"ping"
s.shutdown(socket.SHUT_WR)
s.recv(1)
print("ok", flush=True)
"""


def _netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout


def _ours() -> set[str]:
    return {line.split()[0] for line in _netns_list().splitlines() if line.startswith(f"{PREFIX}-")}


@pytest.fixture
def sites() -> Iterator[TwoSites]:
    ts = TwoSites(PREFIX)
    try:
        ts.up()
        yield ts
    finally:
        ts.down()
        assert not _ours()


def _start_server(ts: TwoSites, mode: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(ts.exec_argv("b", [sys.executable, "-c", SERVER, mode, ts.addr("b")]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.strip():
        proc.kill()
        pytest.fail(f"server did not start: {proc.communicate(timeout=10)[1]}")
    return proc, int(line)


def _client(ts: TwoSites, port: int, size: int = 0, retry: float = 0.0) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-c", CLIENT, ts.addr("b"), str(port), str(size), str(retry)]
    return subprocess.run(ts.exec_argv("a", argv), check=False, capture_output=True, text=True, timeout=60)


def _stop(proc: subprocess.Popen) -> str:
    try:
        return proc.communicate(timeout=20)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_creates_and_down_removes_namespaces_and_veth():
    ts = TwoSites(PREFIX)
    try:
        ts.up()
        assert _ours() == {f"{PREFIX}-a", f"{PREFIX}-b"}
        assert ts.exists()
        for site in "ab":
            link = subprocess.run(["ip", "-n", ts.ns(site), "-br", "addr", "show", "dev", ts.dev(site)],
                                  check=True, capture_output=True, text=True).stdout
            assert "UP" in link and f"{ts.addr(site)}/24" in link, link
        ts.down()
        assert not _ours() and not ts.exists()
        ts.down()  # idempotent
    finally:
        ts.down()


def test_tcp_from_site_a_to_a_listener_in_site_b(sites):
    server, port = _start_server(sites, "echo")
    res = _client(sites, port)
    _stop(server)
    assert res.stdout.strip() == "ok", res.stderr


def _measure_rate(ts: TwoSites, size: int) -> float:
    """bits/s from site A to site B, measured by B from its first read to EOF."""
    server, port = _start_server(ts, "sink")
    res = _client(ts, port, size)
    out = _stop(server)
    assert res.returncode == 0, res.stdout + res.stderr
    nbytes, seconds = out.split()
    return int(nbytes) * 8 / float(seconds)


def test_tbf_rate_is_honoured(sites):
    sites.set_rate(200_000_000)
    assert "rate 200Mbit" in sites.qdisc("a") and "rate 200Mbit" in sites.qdisc("b")
    rate = _measure_rate(sites, 30_000_000)
    assert 0.85 * 200e6 <= rate <= 1.15 * 200e6, f"{rate / 1e6:.1f} Mbit/s"
    sites.set_rate(None)
    assert "tbf" not in sites.qdisc("a") + sites.qdisc("b")


def test_tbf_burst_covers_a_gso_packet_and_4ms_of_the_rate():
    assert tbf_params(200_000_000) == ["rate", "200000000bit", "burst", "100000", "latency", "20ms"]
    assert int(tbf_params(10_000_000)[3]) == 64 * 1024 + 1514


def test_link_down_makes_connects_fail_and_link_up_restores(sites):
    server, port = _start_server(sites, "echo")
    try:
        sites.link(False)
        t0 = time.monotonic()
        res = _client(sites, port)
        assert res.returncode == 1 and res.stdout.startswith("fail"), res.stdout + res.stderr
        assert time.monotonic() - t0 < 10
        sites.link(True)
        res = _client(sites, port, retry=5)
        assert res.stdout.strip() == "ok", res.stdout + res.stderr
    finally:
        _stop(server)


def test_down_cleans_up_after_a_crashed_run():
    crash = f"from pdd_tools.netns import TwoSites; import os; TwoSites({PREFIX!r}).up(); os.kill(os.getpid(), 9)"
    try:
        res = subprocess.run([sys.executable, "-c", crash], check=False, capture_output=True, text=True,
                             timeout=30)
        assert res.returncode == -signal.SIGKILL, res.stderr
        assert _ours() == {f"{PREFIX}-a", f"{PREFIX}-b"}  # SIGKILL: no atexit, leftovers
        TwoSites(PREFIX).down()
        assert not _ours()
    finally:
        TwoSites(PREFIX).down()


def test_up_refuses_without_root():
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop to nobody, try, report, and leave without pytest's clean-up
        code = 1
        try:
            os.close(read_fd)
            os.setuid(65534)
            TwoSites(PREFIX).up()
            os.write(write_fd, b"up() did not refuse")
        except PermissionError as exc:
            os.write(write_fd, str(exc).encode())
            code = 0
        except BaseException as exc:  # noqa: BLE001 - report anything else to the parent
            os.write(write_fd, repr(exc).encode())
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        msg = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, msg
    assert "needs root" in msg
    assert not _ours()


def test_a_failing_command_is_shown_with_its_stderr():
    ts = TwoSites(PREFIX)
    ts.down()
    with pytest.raises(NetnsError, match=r"`ip -n pddwt-a link set pddwt-va up` failed \(exit \d+\): .*pddwt-a"):
        ts.link(True)  # no such namespace
