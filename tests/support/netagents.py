"""Agents for sites A and B as ``pdd-wired`` processes in two network namespaces joined by a
veth "WAN" (``pdd_wire.netns.TwoSites``), for fault injection: ``kill -9``, ``SIGSTOP``, link
down/up. Engine sockets live in a shared directory, so engines (the test process, or engine
processes) reach both agents from the root namespace.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from pdd_wire import EngineClient
from pdd_wire.netns import TwoSites

NODES = {"A": ("a1", "a"), "B": ("b1", "b")}
PORT = 7611

TIMEOUTS = """[timeouts]
heartbeat_s = 0.2
dead_after_s = 1.0
reconnect_max_backoff_s = 0.2
peer_give_up_s = {give_up}
shutdown_grace_s = 1
"""


class NetAgents:
    """``async with NetAgents(prefix) as net``: namespaces up, both agents started and joined."""

    def __init__(self, prefix: str = "pddwf", *, rate_bps: int | None = None, give_up_s: float = 3.0,
                 chunk: int = 4 << 20, streams: int = 2) -> None:
        self.sites = TwoSites(prefix=prefix, rate_bps=rate_bps)
        self.dir = Path(tempfile.mkdtemp(prefix="pdw-f-"))
        os.chmod(self.dir, 0o700)
        self.procs: dict[str, subprocess.Popen] = {}
        self.give_up_s = give_up_s
        self.configs: dict[str, Path] = {}
        for site, (node, ns) in NODES.items():
            other = "B" if site == "A" else "A"
            onode, ons = NODES[other]
            text = (f'site = "{site}"\nnode = "{node}"\n\n[listen]\nwan = "{self.addr(site)}:{PORT}"\n'
                    f'admin = ""\nengine_socket = "{self.socket(site)}"\n\n'
                    f'[[peers]]\nsite = "{other}"\nnode = "{onode}"\naddress = "{self.addr(other)}:{PORT}"\n'
                    f'streams = {streams}\n\n[transfer]\nchunk_bytes = {chunk}\nstreams = {streams}\n\n'
                    f'[tls]\nallow_plaintext = true\n\n[log]\nformat = "json"\n\n'
                    + TIMEOUTS.format(give_up=give_up_s))
            path = self.dir / f"{site}.toml"
            path.write_text(text)
            self.configs[site] = path

    def addr(self, site: str) -> str:
        return "10.77.0.1" if site == "A" else "10.77.0.2"

    def socket(self, site: str) -> str:
        return str(self.dir / f"{site}.sock")

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

    async def __aenter__(self) -> "NetAgents":
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
        for p in self.dir.iterdir():
            p.unlink()
        self.dir.rmdir()
