import asyncio
import itertools
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from pdd_wire import EngineClient, SharedMemory, log  # noqa: E402

log.configure(os.environ.get("PDD_TEST_LOG", "warning"), "console")


def metric(agent, name: str, **labels) -> float:
    """A sample's value from an agent's registry (0 when it was never set)."""
    return agent.metrics.registry.get_sample_value(name, labels) or 0.0


_clusters = itertools.count(1)


@pytest.fixture(scope="module")
def etcd():
    """A one-member etcd on loopback, one per test module (a module that needs more members, or
    other flags, defines its own)."""
    from support.fleet import etcd_cluster

    yield from etcd_cluster(1)


@pytest.fixture
def cluster_name() -> str:
    """A fleet cluster of its own for each test (its etcd key prefix)."""
    return f"c{os.getpid()}-{next(_clusters)}"


async def until(pred, timeout: float = 10, what: str = "") -> None:
    """Poll ``pred`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    try:
        async with asyncio.timeout(timeout):
            while not pred():
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"not within {timeout}s: {what or pred}") from None


async def wait_rx_chunks(agent, peer: str, n: int, timeout: float = 30) -> None:
    """Until ``agent`` has verified ``n`` chunks from ``peer`` (a transfer is under way)."""
    async with asyncio.timeout(timeout):
        while metric(agent, "pddwire_chunks_total", peer=peer, direction="rx") < n:
            await asyncio.sleep(0.0005)


async def fill_random(mem: SharedMemory) -> None:
    """Random bytes, filled off the loop (in-process agents must keep their heartbeats)."""

    def work():
        step = 16 << 20
        for off in range(0, mem.size, step):
            n = min(step, mem.size - off)
            mem.buf[off:off + n] = os.urandom(n)

    await asyncio.to_thread(work)


async def same_bytes(a: memoryview, b: memoryview) -> bool:
    return await asyncio.to_thread(lambda: a == b)


@pytest.fixture
def info_logs():
    """What the agents started in the test log at info (the suite's level is warning), as JSON
    lines (configured before the agents bind their loggers)."""
    import io

    out = io.StringIO()
    log.configure("info", "json", stream=out)
    yield out
    log.configure(os.environ.get("PDD_TEST_LOG", "warning"), "console")


@pytest.fixture
def tmp_sock_dir(tmp_path_factory):
    # Unix socket paths are limited to 107 bytes; pytest's tmp paths can be longer.
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="pdw-"))
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)  # sockets, and the agents' generated PKI (pdd-wire-pki-<uid>/)


class Engines:
    """Engine clients with registered shared memory, closed at the end."""

    def __init__(self) -> None:
        self.clients: list[EngineClient] = []
        self.mems: list[SharedMemory] = []

    async def connect(self, path, name="engine") -> EngineClient:
        c = await EngineClient(str(path), name).connect()
        self.clients.append(c)
        return c

    def memory(self, size: int) -> SharedMemory:
        m = SharedMemory(size)
        self.mems.append(m)
        return m

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
        for m in self.mems:
            m.close()


async def engine_pair(engines: Engines, tmp, size: int, block: int):
    """A prefill engine on A's socket and a decode engine on B's, each with a region of ``size``
    bytes in ``block``-byte blocks (the source filled with random bytes): (ea, eb, src, dst, ra, rb)."""
    ea = await engines.connect(tmp / "A.sock", "prefill")
    eb = await engines.connect(tmp / "B.sock", "decode")
    src, dst = engines.memory(size), engines.memory(size)
    await fill_random(src)
    ra = await ea.register(src, block_bytes=block)
    rb = await eb.register(dst, block_bytes=block)
    return ea, eb, src, dst, ra, rb


@pytest.fixture
async def engines():
    e = Engines()
    try:
        yield e
    finally:
        await e.close()
