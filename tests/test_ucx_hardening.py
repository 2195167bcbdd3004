"""The UCX path against what is not the peer: no tcp transport (so no worker listens on a TCP
port) unless configured, a bound on messages nobody asked for, and a message of the wrong
size for a posted chunk reported and asked for again instead of leaving the transfer hanging.

The "attacker" here is a UCX worker of its own (its own context, shared memory) that makes an
endpoint to an agent's worker from the address the agent would hand its peer, as a process
that learned or forged that address would. Its messages are small (eager) or drained while it
is still there: an agent must never be left holding a rendezvous message of a sender that is
gone (UCX then crashes the agent when it drains that message at the unclaimed-message expiry)."""

from __future__ import annotations

import asyncio
import os
import re
import socket
from pathlib import Path

import pytest

from conftest import fill_random, same_bytes
from pdd_tools.harness import AgentPair
from pdd_wire import config as cfgmod
from pdd_wire.engine import protocol as p
from pdd_wire.engine.client import EngineClient
from pdd_wire.errors import ConfigError, ErrorCode
from pdd_wire.memory import SharedMemory
from pdd_wire.transport import ucx
from support.agents import cluster_toml, run_agents

pytestmark = pytest.mark.ucx

MiB = 1 << 20
NODES = [("A", "a1"), ("A", "a2")]   # a1 sends, a2 receives, over UCX


# -- helpers ------------------------------------------------------------------------------------
def tcp_listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that process ``pid`` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] != "0A" or int(parts[9]) not in inodes:
                continue
            ip_hex, port_hex = parts[1].split(":")
            raw = bytes.fromhex(ip_hex)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))   # per 32-bit word, host order
            found.add((socket.inet_ntop(family, raw), int(port_hex, 16)))
    return found


class Attacker:
    """A UCX worker that is not the peer, on a context and a thread of its own, with an
    endpoint to a victim worker's address."""

    def __init__(self, address: bytes) -> None:
        self.loop = ucx.UcxLoop("attacker", options={"TLS": "sm,self"}, unclaimed_ttl_s=30)
        self.loop.start()
        self.peer = ucx.UcxPeer(self.loop, "attacker")
        self.loop.submit(self.peer.connect(address)).result(10)

    async def send_all(self, messages: list[tuple[int, bytes]], timeout: float = 20) -> None:
        """Send every (tag, payload); returns once each send completed (the victim took or
        drained it)."""
        async def go() -> None:
            await asyncio.gather(*(self.peer.send(tag, buf) for tag, buf in messages))
        await asyncio.wait_for(asyncio.wrap_future(self.loop.submit(go())), timeout)

    def close(self) -> None:
        self.peer.close()
        self.loop.stop()


async def wait_ucx(agent, peer: str) -> None:
    async with asyncio.timeout(15):
        while not agent.sessions[peer].over_ucx:
            await asyncio.sleep(0.01)


async def until(pred, timeout: float = 10, what: str = "") -> None:
    try:
        async with asyncio.timeout(timeout):
            while not pred():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"not within {timeout} s: {what}") from None


def junk_tags(n: int, seed: int = 7) -> list[int]:
    """Tags of no transfer (transfer ids far above any an agent allocates)."""
    import random

    rnd = random.Random(seed)
    return [ucx.tag_for(rnd.randrange(2), (1 << 39) + rnd.randrange(1 << 39), rnd.randrange(1 << 20))
            for _ in range(n)]


# -- M1: which transports -----------------------------------------------------------------------
def test_ucx_tls_config_key():
    base = cfgmod.default_config("A")
    assert base.transfer.ucx_tls == "^tcp"
    text = cfgmod.default_toml("A").replace("[transfer]\n", '[transfer]\nucx_tls = "sm,self"\n')
    assert cfgmod.loads(text).transfer.ucx_tls == "sm,self"
    text = cfgmod.default_toml("A").replace("[transfer]\n", '[transfer]\nucx_tls = ""\n')
    assert cfgmod.loads(text).transfer.ucx_tls == ""
    for bad in ("sm, self", "^tcp\n", " "):
        text = cfgmod.default_toml("A").replace("[transfer]\n", f"[transfer]\nucx_tls = {bad!r}\n".replace("'", '"'))
        with pytest.raises(ConfigError) as e:
            cfgmod.loads(text)
        assert e.value.key == "transfer.ucx_tls"


def test_tls_option_wins_over_ucx_tls_environment(monkeypatch):
    """The configured transports are what the context gets, whatever UCX_TLS says; "" leaves
    it to UCX_TLS."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    loop = ucx.UcxLoop("tls-option", options={"TLS": "^tcp"})
    loop.start()
    try:
        assert loop.transports and not [t for t in loop.transports if t.startswith("tcp/")], loop.transports
    finally:
        loop.stop()
    loop = ucx.UcxLoop("tls-env")   # no TLS option: the environment's
    loop.start()
    try:
        assert {t.split("/")[0] for t in loop.transports} <= {"tcp", "self"}, loop.transports
    finally:
        loop.stop()


async def test_default_agents_listen_on_no_tcp_port_and_move_kv_over_ucx():
    """Real agents (processes) over UCX with the default transports: no UCX worker listens on
    a TCP port (nothing for a forged address to point at), and KV still goes over UCX intact."""
    async with AgentPair(same_site_ucx=True) as pair:
        async with asyncio.timeout(20):
            while not all(pe["data_path"] == "ucx" for s in "AB" for pe in pair.status(s)["peers"]):
                await asyncio.sleep(0.05)
        for s in "AB":
            own = {int(x) for x in re.findall(r'127\.0\.0\.1:(\d+)"', pair.configs[s].read_text())}
            extra = {(ip, port) for ip, port in tcp_listeners(pair.procs[s].pid) if port not in own}
            assert not extra, f"agent {s} listens on {extra} besides its WAN and admin ports"
            log = (pair.dir / f"agent-{s}.log").read_text(errors="replace")
            line = next(ln for ln in log.splitlines() if '"UCX context"' in ln)
            assert '"tls": "^tcp"' in line and "tcp/" not in line, line
        ea = await EngineClient(pair.sockets["A"], "prefill").connect()
        eb = await EngineClient(pair.sockets["B"], "decode").connect()
        src, dst = SharedMemory(16 * MiB), SharedMemory(16 * MiB)
        try:
            await fill_random(src)
            ra, rb = await ea.register(src, block_bytes=MiB), await eb.register(dst, block_bytes=MiB)
            await eb.post_recv("r", [rb.blocks(0, 16)])
            await ea.send_kv("r", [ra.blocks(0, 16)], to=[pair.dest])
            ev = await eb.wait("r", timeout=30)
            assert isinstance(ev, p.KvReceived), ev
            assert await same_bytes(dst.buf, src.buf)
            st = pair.status("B")["peers"][0]
            assert st["data_path"] == "ucx"
        finally:
            await ea.close()
            await eb.close()
            src.close()
            dst.close()


# -- M3: messages nobody asked for ---------------------------------------------------------------
async def test_unclaimed_flood_stops_at_the_message_budget(tmp_sock_dir):
    """More messages of tags of no transfer than the session's budget (4096): the rest are
    drained on arrival, the inbox never holds more."""
    async with run_agents(cluster_toml(tmp_sock_dir, NODES, local_transport="ucx"), wait_up=False) as ag:
        await wait_ucx(ag["a1"], "A/a2")
        await wait_ucx(ag["a2"], "A/a1")
        victim = ag["a2"].sessions["A/a1"].data.peer
        att = Attacker(victim.local_address())
        try:
            n = 4096 + 300
            await att.send_all([(tag, b"F" * 64) for tag in junk_tags(n)])
            await until(lambda: victim.pending()["unclaimed"] + victim.stats["drained_over_budget"] >= n,
                        what=f"the victim took the flood: {victim.pending()} {dict(victim.stats)}")
            assert victim.pending()["unclaimed"] == 4096
            assert victim.stats["drained_over_budget"] == 300
            budget = victim.unclaimed_budget()
            assert budget["max_unclaimed"] == 4096 and budget["unclaimed_bytes"] == 4096 * 64
        finally:
            att.close()


async def test_unclaimed_bytes_and_oversize_messages_are_bounded(tmp_sock_dir, engines):
    """A message larger than any chunk is drained at once; unclaimed bytes stay under their
    budget; legitimate KV still moves (limits made small here to keep the test fast)."""
    async with run_agents(cluster_toml(tmp_sock_dir, NODES, local_transport="ucx"), wait_up=False) as ag:
        await wait_ucx(ag["a1"], "A/a2")
        await wait_ucx(ag["a2"], "A/a1")
        victim = ag["a2"].sessions["A/a1"].data.peer
        budget = victim.unclaimed_budget()
        assert budget["max_message"] == 64 * MiB
        assert budget["max_unclaimed_bytes"] == 2 * max(ag["a2"].sessions["A/a1"].cfg.transfer.credit_bytes, 64 * MiB)
        inbox = victim._inbox
        inbox.max_message, inbox.max_unclaimed_bytes = 64 << 10, 256 << 10
        att = Attacker(victim.local_address())
        try:
            tags = junk_tags(101, seed=11)
            await att.send_all([(tags[0], b"O" * ((64 << 10) + 1))])   # completes: drained, not held
            assert victim.stats["drained_oversize"] == 1
            assert victim.pending()["unclaimed"] == 0
            await att.send_all([(tag, b"B" * (4 << 10)) for tag in tags[1:]])
            await until(lambda: victim.pending()["unclaimed"] + victim.stats["drained_over_budget"] >= 100,
                        what=f"the victim took the messages: {victim.pending()} {dict(victim.stats)}")
            assert victim.unclaimed_budget()["unclaimed_bytes"] <= 256 << 10
            assert victim.pending()["unclaimed"] == 64 and victim.stats["drained_over_budget"] == 36
        finally:
            att.close()
        # the budget is for what nobody asked for: a real transfer is not refused
        prefill = await engines.connect(tmp_sock_dir / "a1.sock", "prefill")
        decode = await engines.connect(tmp_sock_dir / "a2.sock", "decode")
        src, dst = engines.memory(4 * MiB), engines.memory(4 * MiB)
        await fill_random(src)
        rs, rd = await prefill.register(src, block_bytes=MiB), await decode.register(dst, block_bytes=MiB)
        inbox.max_message = 64 * MiB
        await decode.post_recv("ok", [rd.blocks(0, 4)])
        await prefill.send_kv("ok", [rs.blocks(0, 4)], to=["A/a2"])
        ev = await decode.wait("ok", timeout=20)
        assert isinstance(ev, p.KvReceived), ev
        assert await same_bytes(dst.buf, src.buf)


# -- M4: a message of the wrong size for a posted chunk -----------------------------------------
async def _seeded_transfer(tmp_sock_dir, engines, wrong: int):
    """``wrong`` messages of the wrong size for chunk 0 of the next transfer a1 -> a2, sent to
    a2's worker before the transfer starts; then the transfer. Its outcome at both engines."""
    async with run_agents(cluster_toml(tmp_sock_dir, NODES, local_transport="ucx"), wait_up=False) as ag:
        await wait_ucx(ag["a1"], "A/a2")
        await wait_ucx(ag["a2"], "A/a1")
        path = ag["a2"].sessions["A/a1"].data
        victim = path.peer
        prefill = await engines.connect(tmp_sock_dir / "a1.sock", "prefill")
        decode = await engines.connect(tmp_sock_dir / "a2.sock", "decode")
        src, dst = engines.memory(4 * MiB), engines.memory(4 * MiB)
        await fill_random(src)
        rs, rd = await prefill.register(src, block_bytes=MiB), await decode.register(dst, block_bytes=MiB)
        tid = ag["a1"]._tids + 1                   # the transfer id a1 allocates next
        tag = path.tag_in(tid, 0)    # its chunk 0 (its only one), tagged as the peer does (ucx-keys.v1)
        att = Attacker(victim.local_address())
        try:
            await att.send_all([(tag, b"EVIL" * 25)] * wrong)
            await until(lambda: victim.pending()["unclaimed"] == wrong, what="the seeded messages arrived")
            await decode.post_recv("r", [rd.blocks(0, 4)])
            await prefill.send_kv("r", [rs.blocks(0, 4)], to=["A/a2"])
            try:
                got = await decode.wait("r", timeout=15)
            except TimeoutError:
                got = None
            sent = await prefill.wait("r", timeout=5) if got is not None else None
            return got, sent, dict(victim.stats), await same_bytes(dst.buf, src.buf)
        finally:
            att.close()


async def test_wrong_size_message_for_a_posted_chunk_is_received_again(tmp_sock_dir, engines):
    """The chunk is asked for again (as for a checksum failure) and lands: the transfer
    completes intact instead of waiting for its deadline."""
    got, sent, stats, intact = await _seeded_transfer(tmp_sock_dir, engines, wrong=1)
    assert isinstance(got, p.KvReceived), (got, stats)
    assert isinstance(sent, p.KvSent), sent
    assert intact
    assert stats["wrong_size"] == 1


async def test_wrong_size_messages_past_the_limit_fail_the_transfer(tmp_sock_dir, engines):
    """More wrong-size messages than a transfer survives: it fails with a clear code at both
    ends (nothing written), not at its deadline."""
    got, sent, stats, _ = await _seeded_transfer(tmp_sock_dir, engines, wrong=4)
    assert isinstance(got, p.TransferFailed) and got.code == ErrorCode.MALFORMED_BODY, (got, stats)
    assert isinstance(sent, p.TransferFailed), sent
    assert stats["wrong_size"] == 4
