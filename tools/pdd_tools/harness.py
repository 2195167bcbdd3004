"""Two real agents as subprocesses on loopback, for the demo and the benchmarks.

Each agent is a ``pdd-wired`` process with a generated config (free ports, sockets in a
temporary directory); :class:`AgentPair` starts them, waits until they see each other, and
stops them with SIGTERM (then SIGKILL if they ignore it) whatever happens.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to, for a server started later.

    Picked below the kernel's ephemeral range where it can: a port from that range (``bind(0)``)
    can be taken, between this call and the server's bind, by any outgoing connection's source
    port or by any other ``bind(0)`` on the machine, which fails the later server with
    EADDRINUSE. Below the range only an explicit bind can take it. Never the same port twice
    in one process."""
    lo, _ = _ephemeral_range()
    first = 20000
    if lo - first >= 2048:
        rng = random.Random()
        for _ in range(200):
            port = rng.randrange(first, lo)
            if port in _HANDED_OUT:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as s:  # a narrow or unusual range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _HANDED_OUT.add(port)
    return port


def agent_toml(site: str, node: str, wan: int, admin: int, sock: str, peers: list[tuple[str, str, int]],
               *, streams: int = 4, chunk: int = 4 << 20, bulk_threads: int = 1, extra: str = "",
               transport: str = "tcp", local_transport: str | None = None) -> str:
    """One agent's TOML on loopback. ``local_transport``: for peers of the same site (else
    ``transport``)."""
    peer_txt = "".join(f'[[peers]]\nsite = "{s}"\nnode = "{n}"\naddress = "127.0.0.1:{p}"\nstreams = {streams}\n'
                       f'transport = "{local_transport if local_transport and s == site else transport}"\n\n'
                       for s, n, p in peers)
    return (f'site = "{site}"\nnode = "{node}"\n\n[listen]\nwan = "127.0.0.1:{wan}"\n'
            f'admin = "127.0.0.1:{admin}"\nengine_socket = "{sock}"\n\n{peer_txt}'
            f"[transfer]\nchunk_bytes = {chunk}\nstreams = {streams}\nbulk_threads = {bulk_threads}\n\n"
            f'[log]\nformat = "json"\n{extra}')


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (Prometheus text)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


class AgentPair:
    """Agents for sites A (a1) and B (b1) as ``pdd-wired`` subprocesses."""

    def __init__(self, *, streams: int = 4, chunk: int = 4 << 20, bulk_threads: int = 1, extra: str = "",
                 same_site_ucx: bool = False, extra_by_site: dict[str, str] | None = None) -> None:
        """``extra``: TOML appended to both agents' configs; ``extra_by_site``: to one's ("A" or
        "B"), after ``extra`` (the two must not declare the same table)."""
        if extra_by_site and not set(extra_by_site) <= {"A", "B"}:
            raise ValueError(f"extra_by_site: sites are 'A' and 'B', got {sorted(extra_by_site)}")
        self.dir = Path(tempfile.mkdtemp(prefix="pdd-wire-"))  # configs, sockets and agent logs
        self.procs: dict[str, subprocess.Popen] = {}
        ports = {s: (free_port(), free_port()) for s in "AB"}
        # same_site_ucx: the second agent is node a2 of site A, reached over UCX (the local path).
        nodes = {"A": "a1", "B": "a2" if same_site_ucx else "b1"}
        sites = self.sites = {"A": "A", "B": "A" if same_site_ucx else "B"}
        self.dest = f"{sites['B']}/{nodes['B']}"
        self.sockets = {s: str(self.dir / f"{s}.sock") for s in "AB"}
        self.admin = {s: f"127.0.0.1:{ports[s][1]}" for s in "AB"}
        self.configs = {}
        for s in "AB":
            other = "B" if s == "A" else "A"
            text = agent_toml(sites[s], nodes[s], ports[s][0], ports[s][1], self.sockets[s],
                              [(sites[other], nodes[other], ports[other][0])], streams=streams, chunk=chunk,
                              bulk_threads=bulk_threads,
                              extra=extra + "\n" + (extra_by_site or {}).get(s, ""),
                              transport="ucx" if same_site_ucx else "tcp")
            path = self.dir / f"{s}.toml"
            path.write_text(text)
            self.configs[s] = path

    async def start(self, timeout: float = 20) -> "AgentPair":
        for s in "AB":
            with open(self.dir / f"agent-{s}.log", "wb") as log:
                self.procs[s] = subprocess.Popen(
                    [sys.executable, "-m", "pdd_wire", "--site", self.sites[s], "--config", str(self.configs[s])],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        async with asyncio.timeout(timeout):
            while not all(self._peers_up(s) for s in "AB"):
                for s, pr in self.procs.items():
                    if pr.poll() is not None:
                        raise RuntimeError(f"agent {s} exited with {pr.returncode}; see {self.dir}/agent-{s}.log")
                await asyncio.sleep(0.05)
        return self

    def _peers_up(self, site: str) -> bool:
        try:
            st = self.status(site)
        except OSError:
            return False
        return all(p["up"] and (p["bulk_streams_up"] == p["bulk_streams"] or p["data_path"] == "ucx")
                   for p in st["peers"])

    def status(self, site: str) -> dict:
        with urllib.request.urlopen(f"http://{self.admin[site]}/v1/status", timeout=2) as r:
            return json.load(r)

    def cpu_seconds(self) -> float:
        """User and system CPU seconds the agents have used so far (/proc/<pid>/stat)."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for proc in self.procs.values():
            with open(f"/proc/{proc.pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        return total

    def metrics(self, site: str) -> str:
        with urllib.request.urlopen(f"http://{self.admin[site]}/metrics", timeout=2) as r:
            return r.read().decode()

    def stop(self) -> dict[str, int]:
        codes = {}
        for pr in self.procs.values():
            if pr.poll() is None:
                pr.send_signal(signal.SIGTERM)
        for s, pr in self.procs.items():
            try:
                codes[s] = pr.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(pr.pid, signal.SIGKILL)
                codes[s] = pr.wait()
        self.procs.clear()
        return codes

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    async def __aenter__(self) -> "AgentPair":
        try:
            return await self.start()
        except BaseException:
            self.cleanup()
            raise

    async def __aexit__(self, *exc) -> None:
        self.cleanup()


# ---------------------------------------------------------------------------------------------
# Agents in two network namespaces (root only): the fault-injection suite and the probe bench.
NODES = {"A": ("a1", "a"), "B": ("b1", "b")}
PORT = 7611
ADMIN = "127.0.0.1:7711"  # inside each namespace (its own loopback)

TIMEOUTS = """[timeouts]
heartbeat_s = 0.2
dead_after_s = 1.0
reconnect_max_backoff_s = 0.2
peer_give_up_s = {give_up}
shutdown_grace_s = 1
"""


class NetnsAgents:
    """Agents for sites A and B as ``pdd-wired`` processes in two network namespaces joined by
    a veth "WAN" (:class:`pdd_tools.netns.TwoSites`, optionally tbf-shaped), for fault injection
    (``kill -9``, ``SIGSTOP``, link down/up) and link measurements. Engine sockets live in a
    shared directory, so engines in the root namespace reach both agents. ``admin``: each agent
    serves its admin HTTP on ``ADMIN`` inside its own namespace (see :meth:`run_in`).

    ``async with NetnsAgents(prefix) as net``: namespaces up, both agents started and joined."""

    def __init__(self, prefix: str = "pddwf", *, rate_bps: int | None = None, give_up_s: float = 3.0,
                 chunk: int = 4 << 20, streams: int = 2, admin: bool = False, transfer: str = "") -> None:
        from .netns import TwoSites

        self.sites = TwoSites(prefix=prefix, rate_bps=rate_bps)
        self.dir = Path(tempfile.mkdtemp(prefix="pdw-f-"))
        os.chmod(self.dir, 0o700)
        self.procs: dict[str, subprocess.Popen] = {}
        self.give_up_s = give_up_s
        self.configs: dict[str, Path] = {}
        for site, (node, _) in NODES.items():
            other = "B" if site == "A" else "A"
            onode, ons = NODES[other]
            text = (f'site = "{site}"\nnode = "{node}"\n\n[listen]\nwan = "{self.addr(site)}:{PORT}"\n'
                    f'admin = "{ADMIN if admin else ""}"\nengine_socket = "{self.socket(site)}"\n\n'
                    f'[[peers]]\nsite = "{other}"\nnode = "{onode}"\naddress = "{self.addr(other)}:{PORT}"\n'
                    f'streams = {streams}\n\n[transfer]\nchunk_bytes = {chunk}\nstreams = {streams}\n{transfer}\n'
                    f'[tls]\nallow_plaintext = true\n\n[log]\nformat = "json"\n\n'
                    + TIMEOUTS.format(give_up=give_up_s))
            path = self.dir / f"{site}.toml"
            path.write_text(text)
            self.configs[site] = path

    def addr(self, site: str) -> str:
        return "10.77.0.1" if site == "A" else "10.77.0.2"

    def socket(self, site: str) -> str:
        return str(self.dir / f"{site}.sock")

    def run_in(self, site: str, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        """Run ``argv`` in ``site``'s namespace (e.g. ``pdd-wire probe`` against its agent)."""
        return subprocess.run(self.sites.exec_argv("a" if site == "A" else "b", argv), capture_output=True,
                              text=True, timeout=timeout)

    def log(self, site: str) -> Path:
        return self.dir / f"agent-{site}.log"

    # ------------------------------------------------------------------ processes
    def start(self, site: str) -> None:
        ns = "a" if site == "A" else "b"
        argv = self.sites.exec_argv(ns, [sys.executable, "-m", "pdd_wire", "--site", site,
                                         "--config", str(self.configs[site])])
        with open(self.log(site), "ab") as log:
            self.procs[site] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def signal(self, site: str, sig: int) -> None:
        os.kill(self.procs[site].pid, sig)

    def kill9(self, site: str) -> None:
        pr = self.procs.pop(site)
        os.killpg(pr.pid, signal.SIGKILL)
        pr.wait()

    async def status(self, site: str) -> dict:
        from pdd_wire.engine.client import EngineClient

        async with EngineClient(self.socket(site), "probe") as c:
            return await c.status()

    async def wait_up(self, timeout: float = 20) -> None:
        """Both agents serve their engine socket and see each other with every bulk stream."""
        async with asyncio.timeout(timeout):
            while True:
                for site, pr in self.procs.items():
                    if pr.poll() is not None:
                        raise RuntimeError(f"agent {site} exited with {pr.returncode}: "
                                           f"{self.log(site).read_text()[-2000:]}")
                try:
                    sts = [await self.status(s) for s in self.procs]
                    if all(p["up"] and p["bulk_streams_up"] == p["bulk_streams"] for st in sts for p in st["peers"]):
                        return
                except Exception:
                    pass
                await asyncio.sleep(0.1)

    def stop(self) -> None:
        for pr in self.procs.values():
            if pr.poll() is None:
                try:
                    os.killpg(pr.pid, signal.SIGCONT)
                    pr.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for pr in self.procs.values():
            try:
                pr.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(pr.pid, signal.SIGKILL)
                pr.wait()
        self.procs.clear()

    async def __aenter__(self) -> "NetnsAgents":
        try:
            self.sites.up()
            for site in NODES:
                self.start(site)
            await self.wait_up()
        except BaseException:
            self.cleanup()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        self.cleanup()

    def cleanup(self) -> None:
        self.stop()
        self.sites.down()
        shutil.rmtree(self.dir, ignore_errors=True)  # configs, logs, sockets, a generated PKI
