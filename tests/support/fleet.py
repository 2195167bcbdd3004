"""Helpers of the fleet tests: a module's etcd cluster, and an agent as a process of its own."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from pdd_tools.etcd import EtcdCluster


def etcd_cluster(size: int) -> Iterator[EtcdCluster]:
    """For a module-scoped fixture: ``size`` etcd members, closed after the module (fails
    naming Debian's etcd-server package when etcd is not installed)."""
    cluster = EtcdCluster(size)
    try:
        asyncio.run(cluster.start())
        yield cluster
    finally:
        cluster.close()


def spawn_agent(tmp: Path, toml: str, site: str, name: str) -> subprocess.Popen:
    """``pdd-wired --config`` as a process of its own (its log: ``tmp/<name>.log``)."""
    path = tmp / f"{name}.toml"
    path.write_text(toml)
    with open(tmp / f"{name}.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "pdd_wire", "--site", site, "--config", str(path)],
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
