"""Helpers of the fleet tests: a module's etcd cluster, a client of the test's own, and an agent
as a process of its own."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from pdd_tools.etcd import EtcdCluster
from pdd_wire.fleet import EtcdClient


def etcd_cluster(size: int, **kw) -> Iterator[EtcdCluster]:
    """For a module-scoped fixture: ``size`` etcd members (``kw``: EtcdCluster's), closed after
    the module (fails naming Debian's etcd-server package when etcd is not installed)."""
    cluster = EtcdCluster(size, **kw)
    try:
        asyncio.run(cluster.start())
        yield cluster
    finally:
        cluster.close()


@contextlib.asynccontextmanager
async def etcd_client(etcd: EtcdCluster | list[str], **kw) -> AsyncIterator[EtcdClient]:
    """A client of the test's own (to change what the agents' etcd holds behind their backs);
    ``kw``: EtcdClient's."""
    client = await EtcdClient(etcd if isinstance(etcd, list) else etcd.endpoints, **kw).open()
    try:
        yield client
    finally:
        await client.close()


def spawn_agent(tmp: Path, toml: str, site: str, name: str) -> subprocess.Popen:
    """``pdd-wired --config`` as a process of its own (its log: ``tmp/<name>.log``)."""
    path = tmp / f"{name}.toml"
    path.write_text(toml)
    with open(tmp / f"{name}.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "pdd_wire", "--site", site, "--config", str(path)],
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
