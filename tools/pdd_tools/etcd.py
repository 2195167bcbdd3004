"""A real etcd cluster on loopback for the tests, the benchmark and the demo: Debian's
``etcd-server`` (``/usr/bin/etcd``), each member a process with its own data directory and
free ports, started, stopped (SIGTERM), killed (SIGKILL) and started again on the same data.

Readiness is awaited, never slept for: a member is up once its ``/health`` answers
``"health":"true"``; :meth:`EtcdCluster.start` returns when every member is.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .harness import free_port

PACKAGE = "etcd-server"  # Debian's package with /usr/bin/etcd


def etcd_binary() -> str:
    """The etcd server binary: ``$PDD_ETCD``, else ``etcd`` on PATH; FileNotFoundError naming
    the package to install when there is none."""
    path = os.environ.get("PDD_ETCD") or shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd")
                                                                  else None)
    if not path:
        raise FileNotFoundError(f"etcd not found: install Debian's {PACKAGE} (apt-get install {PACKAGE}) "
                                "or set PDD_ETCD to an etcd 3.4+ binary")
    return path


@dataclass(frozen=True)
class EtcdTls:
    """etcd's client port in TLS: its server certificate (naming 127.0.0.1), the CA that
    client certificates must chain to (``--client-cert-auth``), and a client certificate of it
    for the health checks."""

    ca: str
    cert: str
    key: str
    client_cert: str
    client_key: str


class EtcdMember:
    def __init__(self, name: str, root: Path, tls: EtcdTls | None = None) -> None:
        self.name = name
        self.data = root / name
        self.client_port = free_port()
        self.peer_port = free_port()
        self.log = root / f"{name}.log"
        self.tls = tls
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def spawn(self, cluster: str, state: str, token: str, extra: list[str]) -> None:
        args = [etcd_binary(), "--name", self.name, "--data-dir", str(self.data),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
                "--initial-cluster", cluster, "--initial-cluster-state", state,
                "--initial-cluster-token", token, "--logger", "zap", "--log-level", "warn",
                # a small machine: no fsync stalls of seconds in the tests' timing
                "--heartbeat-interval", "50", "--election-timeout", "500", *extra]
        if self.tls:
            args += ["--cert-file", self.tls.cert, "--key-file", self.tls.key, "--client-cert-auth",
                     "--trusted-ca-file", self.tls.ca]
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(args, stdout=f, stderr=f, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 15) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def healthy(self) -> bool:
        ctx = None
        if self.tls:
            ctx = ssl.create_default_context(cafile=self.tls.ca)
            ctx.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1, context=ctx) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False


class EtcdCluster:
    """``size`` etcd members on loopback. ``async with EtcdCluster(3) as etcd: etcd.endpoints``."""

    def __init__(self, size: int = 1, *, root: Path | None = None, extra: list[str] | None = None,
                 tls: EtcdTls | None = None) -> None:
        self.root = root or Path(tempfile.mkdtemp(prefix="pdd-etcd-"))
        self._own_root = root is None
        self.members = [EtcdMember(f"m{i}", self.root, tls) for i in range(size)]
        self.extra = extra or []
        self.token = f"pdd-{os.getpid()}-{id(self):x}"
        self._started = False

    @property
    def endpoints(self) -> list[str]:
        return [m.url for m in self.members]

    def _initial(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    async def start(self, timeout: float = 30) -> EtcdCluster:
        """Start every member (on its data, if it ran before) and wait until each is healthy."""
        state = "existing" if self._started else "new"
        for m in self.members:
            if not m.alive():
                m.spawn(self._initial(), state, self.token, self.extra)
        self._started = True
        await self.ready(timeout)
        return self

    async def ready(self, timeout: float = 30) -> None:
        try:
            async with asyncio.timeout(timeout):
                while True:
                    dead = [m for m in self.members if m.proc is not None and m.proc.poll() is not None]
                    if dead:
                        raise RuntimeError(f"etcd {dead[0].name} exited: {dead[0].log.read_text()[-2000:]}")
                    if all(await asyncio.gather(*(asyncio.to_thread(m.healthy) for m in self.members))):
                        return
                    await asyncio.sleep(0.05)
        except TimeoutError:
            raise RuntimeError(f"etcd not healthy within {timeout}s; logs in {self.root}") from None

    def stop(self) -> None:
        """SIGTERM every member and wait for it (the data stays: :meth:`start` resumes it). One
        at a time: signalled together, a leader tries to hand over to members that are going too
        and takes 6 s to give up; one by one each exits in tens of milliseconds."""
        for m in self.members:
            m.signal(signal.SIGTERM)
            m.wait()

    def wipe(self) -> None:
        """Stop every member and delete its data: the next :meth:`start` runs a new store on the
        same addresses (its revisions start again from 1)."""
        self.stop()
        for m in self.members:
            shutil.rmtree(m.data, ignore_errors=True)
        self._started = False

    def kill(self) -> None:
        """SIGKILL every member (the data stays)."""
        for m in self.members:
            m.signal(signal.SIGKILL)
        for m in self.members:
            m.wait()

    def close(self) -> None:
        self.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    async def __aenter__(self) -> EtcdCluster:
        try:
            return await self.start()
        except BaseException:
            self.close()
            raise

    async def __aexit__(self, *exc) -> None:
        self.close()
