"""The UCX path against what is not the peer: no tcp transport (so no worker listens on a TCP
port) unless configured, a bound on messages nobody asked for, and a message of the wrong
size for a posted chunk reported and asked for again instead of leaving the transfer hanging.

The "attacker" here is a UCX worker of its own (its own context, shared memory) that makes an
endpoint to an agent's worker from the address the agent would hand its peer, as a process
that learned or forged that address would (or, with two bare data paths and no agents, the
peer's own worker sending what the path would not). Its messages are small (eager) or drained while it
is still there: an agent must never be left holding a rendezvous message of a sender that is
gone (UCX then crashes the agent when it drains that message at the unclaimed-message expiry)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import re
import socket
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from conftest import fill_random, metric, same_bytes, until
from pdd_tools.harness import AgentPair
from pdd_wire import config as cfgmod
from pdd_wire import transport
from pdd_wire.engine import protocol as p
from pdd_wire.engine.client import EngineClient
from pdd_wire.errors import ConfigError, ErrorCode
from pdd_wire.memory import SharedMemory
from pdd_wire.transport import ucx
from pdd_wire.transport.route import Route
from pdd_wire.transport.ucx_path import AHEAD_TIDS, MAX_UNCLAIMED_CAP, unclaimed_limit
from support.agents import cluster_toml, run_agents
from test_transport_contract import CHUNK, Owner, blocks, settings

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


def junk_tags(n: int, seed: int = 7) -> list[int]:
    """Random tags, as a process without the key sends: of no transfer (transfer id bits far
    above any an agent allocates, each direction). Between keyed agents the receiver drains
    them on arrival (implausible)."""
    rnd = random.Random(seed)
    return [ucx.tag_for(rnd.randrange(2), (1 << 39) + rnd.randrange(1 << 39), rnd.randrange(1 << 20))
            for _ in range(n)]


def plausible_tags(path, n: int, seed: int = 7) -> list[int]:
    """Tags the receiving ``path`` keeps when no receive waits for them: keyed (when the path
    is) transfer ids the peer could be about to use, but whose transfers never come (one who
    knows the key, or sees the tags, could send these)."""
    rnd = random.Random(seed)
    return [path.tag_in(rnd.randrange(AHEAD_TIDS // 2, AHEAD_TIDS), rnd.randrange(1 << 20)) for _ in range(n)]


@contextlib.asynccontextmanager
async def bare_pair(*, keyed: bool = True, a_key_to_b: int | None = None, log=None):
    """Two UCX data paths on this loop, without agents (their owners stand where sessions
    stand, as in tests/test_transport_contract.py): ``(b, pa, pb)``, pa the dialer's, chunks
    going pa -> pb, their UCX lanes up. ``keyed``: as when both advertised ``ucx-keys.v1``;
    ``a_key_to_b``: the key pb takes for pa's instead of pa's own (0: as if pa had sent 0);
    ``log``: the paths' log (:class:`Said`)."""
    a, b = Owner(), Owner()
    a.loop = b.loop = asyncio.get_running_loop()
    pa = transport.data_path("ucx", a, dataclasses.replace(settings("a", True, None), log=log))
    pb = transport.data_path("ucx", b, dataclasses.replace(settings("b", False, None), log=log))
    if keyed:
        pa.use_tag_keys(pb.tag_key())
        pb.use_tag_keys(pa.tag_key() if a_key_to_b is None else a_key_to_b)
    pa.connected(pb.address(), streams=1)
    pb.connected(pa.address(), streams=1)
    try:
        await until(lambda: a.lanes and b.lanes, what="UCX lanes up")
        yield b, pa, pb
    finally:
        await pa.close()
        await pb.close()


class Said(list):
    """A log that keeps what it is told, at every level (the tests' structlog drops info)."""

    def __bool__(self) -> bool:   # a log, even while it has nothing
        return True

    def bind(self, **kw):
        return self

    def __getattr__(self, level: str):
        return lambda event, **kw: self.append({"event": event, "log_level": level, **kw})


def send_raw(path, tag: int, payload: bytes, sent: list) -> None:
    """Send one message of ``tag`` from ``path``'s worker, whatever the path would send;
    ``sent`` gets its outcome (None: completed)."""
    path.peer.start_send(tag, payload, sent.append)


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
SMALL_CREDIT = "[transfer]\nchunk_bytes = 1048576\ncredit_bytes = 8388608\n"   # a budget of 4096 messages


@contextlib.asynccontextmanager
async def ucx_agents(tmp, extra: str = ""):
    """Agents a1 and a2 of one site over UCX, both up: ``(agents, a2's data path to a1)``."""
    async with run_agents(cluster_toml(tmp, NODES, local_transport="ucx", extra=extra), wait_up=False) as ag:
        await wait_ucx(ag["a1"], "A/a2")
        await wait_ucx(ag["a2"], "A/a1")
        yield ag, ag["a2"].sessions["A/a1"].data


async def test_a_flood_of_random_tags_takes_no_room_from_early_chunks(tmp_sock_dir, engines):
    """More messages of random tags than the unclaimed budget holds, from a process without the
    key, and then transfers whose chunks may arrive before their receive is posted (offered
    transfers: they leave right behind the KV_BEGIN). Between keyed agents the flood is
    drained on arrival and counts toward no budget, so each transfer completes at once rather
    than after a resend at ``chunk_ack_s`` (15 s)."""
    async with ucx_agents(tmp_sock_dir, SMALL_CREDIT) as (ag, path):
        victim = path.peer
        assert victim.unclaimed_budget()["max_unclaimed"] == 4096
        att = Attacker(victim.local_address())
        n = 4096 + 300
        try:
            await att.send_all([(tag, b"F" * 64) for tag in junk_tags(n)])   # completes: drained, not held
            await until(lambda: victim.stats["drained_implausible"] >= n,
                        what=f"the victim drained the flood: {victim.pending()} {dict(victim.stats)}")
        finally:
            att.close()
        assert victim.pending()["unclaimed"] == 0 and victim.stats["drained_over_budget"] == 0
        prefill = await engines.connect(tmp_sock_dir / "a1.sock", "prefill")
        decode = await engines.connect(tmp_sock_dir / "a2.sock", "decode")
        src, dst = engines.memory(4 * MiB), engines.memory(4 * MiB)
        await fill_random(src)
        rs, rd = await prefill.register(src, block_bytes=MiB), await decode.register(dst, block_bytes=MiB)
        took = []
        for i in range(20):
            t0 = time.monotonic()
            await decode.post_recv(f"r{i}", [rd.blocks(0, 4)])
            await prefill.send_kv(f"r{i}", [rs.blocks(0, 4)], to=["A/a2"])
            ev = await decode.wait(f"r{i}", timeout=30)
            took.append(round(time.monotonic() - t0, 2))
            assert isinstance(ev, p.KvReceived), ev
            assert isinstance(await prefill.wait(f"r{i}", timeout=10), p.KvSent)
        assert await same_bytes(dst.buf, src.buf)
        assert max(took) < 5, f"a transfer waited for a resend: {took} {dict(victim.stats)}"
        assert victim.stats["drained_over_budget"] == 0 and victim.pending()["unclaimed"] == 0
        assert victim.stats["drained_implausible"] >= n


async def test_unclaimed_flood_of_plausible_tags_stops_at_the_message_budget(tmp_sock_dir):
    """More messages than the session's budget (here 4096) of tags the victim cannot tell from
    its peer's (sent by one who knows the key, or saw the tags): the rest are drained on
    arrival, the inbox never holds more."""
    async with ucx_agents(tmp_sock_dir, SMALL_CREDIT) as (ag, path):
        victim = path.peer
        att = Attacker(victim.local_address())
        try:
            n = 4096 + 300
            await att.send_all([(tag, b"F" * 64) for tag in plausible_tags(path, n)])
            await until(lambda: victim.pending()["unclaimed"] + victim.stats["drained_over_budget"] >= n,
                        what=f"the victim took the flood: {victim.pending()} {dict(victim.stats)}")
            assert victim.pending()["unclaimed"] == 4096
            assert victim.stats["drained_over_budget"] == 300 and victim.stats["drained_implausible"] == 0
            budget = victim.unclaimed_budget()
            assert budget["max_unclaimed"] == 4096 and budget["unclaimed_bytes"] == 4096 * 64
        finally:
            att.close()


def test_the_message_budget_holds_a_credit_window_of_the_smallest_chunks():
    """At least 4096 messages; else a credit window of the smallest chunks a peer may send
    (MIN_CHUNK, 4 KiB), twice; never more than MAX_UNCLAIMED_CAP (UCX holds about 9 KiB per
    message, however small: the count bounds memory that the byte budget does not)."""
    assert MAX_UNCLAIMED_CAP == 16384
    assert unclaimed_limit(8 * MiB) == 4096
    assert unclaimed_limit(MiB) == 4096
    assert unclaimed_limit(24 * MiB) == 2 * 24 * MiB // 4096 == 12288
    assert unclaimed_limit(256 * MiB) == MAX_UNCLAIMED_CAP
    assert unclaimed_limit(1 << 48) == MAX_UNCLAIMED_CAP


async def test_only_plausible_tags_wait_for_their_receive_keyed():
    """Between keyed paths, a message nobody waits for is kept only when its tag has the peer's
    direction and its transfer id (inverted under the receiver's key) is 1 .. AHEAD_TIDS past the
    highest one a receive was posted for; the rest are drained on arrival, in no budget."""
    async with bare_pair(keyed=True) as (b, pa, pb):
        victim = pb.peer
        keep = [pb.tag_in(1, 0), pb.tag_in(AHEAD_TIDS, 7), pb.tag_in(AHEAD_TIDS, 8)]
        later = pb.tag_in(AHEAD_TIDS + 5000, 0)                    # too far ahead, until a receive moves the mark
        drop = ([pb.tag_in(0, 0), pb.tag_in(AHEAD_TIDS + 1, 0), later,
                 pa.tag_in(1, 0),                                    # the other direction's (a's own transfers)
                 ucx.tag_for(pb._dir_out, pb._wire_in(1), 0)]       # a's transfer 1 with the other direction bit
                + junk_tags(500, seed=3)                             # random: each direction, no key
                + [ucx.tag_for(pb._dir_in, tid, 0) for tid in range(1, 201)])   # the plain tags of the first ids
        sent: list = []
        for tag in keep + drop:
            send_raw(pa, tag, b"x" * 64, sent)
        await until(lambda: len(sent) == len(keep + drop), what="the sends completed")
        await until(lambda: victim.pending()["unclaimed"] + victim.stats["drained_implausible"] == len(keep + drop),
                    what=f"the messages arrived: {victim.pending()} {dict(victim.stats)}")
        assert victim.pending()["unclaimed"] == len(keep)
        assert victim.stats["drained_implausible"] == len(drop) and victim.stats["drained_over_budget"] == 0
        # a receive posted for transfer 5000 moves the mark: transfer AHEAD_TIDS + 5000 is plausible now
        route = Route(blocks(CHUNK), CHUNK, asyncio.get_running_loop())
        b.routes[5000] = route
        pb.expect(5000, route)
        send_raw(pa, later, b"x" * 64, sent)
        await until(lambda: victim.pending()["unclaimed"] == len(keep) + 1, what="the message is kept now")
        assert victim.stats["drained_implausible"] == len(drop)
        # what was kept is taken by its receive when it comes
        got = bytearray(64)
        await pb.loop.run(victim.recv(keep[0], got))
        assert bytes(got) == b"x" * 64 and victim.pending()["unclaimed"] == len(keep)
        del b.routes[5000]
        await pb.forget(5000)
        await route.close()


async def test_plain_tags_of_the_peer_direction_wait_and_the_other_direction_is_drained():
    """Without keys any transfer id may be the peer's (as before keys), but not the direction
    of the transfers this side allocates."""
    async with bare_pair(keyed=False) as (b, pa, pb):
        victim = pb.peer
        rnd = random.Random(4)
        mine = [ucx.tag_for(pb._dir_in, rnd.randrange(1, 1 << 40), rnd.randrange(1 << 23)) for _ in range(50)]
        other = [ucx.tag_for(pb._dir_out, rnd.randrange(1, 1 << 40), rnd.randrange(1 << 23)) for _ in range(50)]
        sent: list = []
        for tag in mine + other:
            send_raw(pa, tag, b"y" * 32, sent)
        await until(lambda: victim.pending()["unclaimed"] + victim.stats["drained_implausible"] == 100,
                    what=f"the messages arrived: {victim.pending()} {dict(victim.stats)}")
        assert victim.pending()["unclaimed"] == 50 and victim.stats["drained_implausible"] == 50


async def test_unclaimed_bytes_and_oversize_messages_are_bounded(tmp_sock_dir, engines):
    """A message larger than any chunk is drained at once; unclaimed bytes stay under their
    budget; legitimate KV still moves (limits made small here to keep the test fast)."""
    async with ucx_agents(tmp_sock_dir) as (ag, path):
        victim = path.peer
        budget = victim.unclaimed_budget()
        credit = ag["a2"].sessions["A/a1"].cfg.transfer.credit_bytes
        assert budget["max_message"] == 64 * MiB
        assert budget["max_unclaimed_bytes"] == 2 * max(credit, 64 * MiB)
        assert budget["max_unclaimed"] == unclaimed_limit(credit) == min(2 * credit // 4096, MAX_UNCLAIMED_CAP)
        inbox = victim._inbox
        inbox.max_message, inbox.max_unclaimed_bytes = 64 << 10, 256 << 10
        att = Attacker(victim.local_address())
        try:
            tags = plausible_tags(path, 101, seed=11)
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
    async with ucx_agents(tmp_sock_dir) as (ag, path):
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
            with capture_logs() as logs:
                await decode.post_recv("r", [rd.blocks(0, 4)])
                await prefill.send_kv("r", [rs.blocks(0, 4)], to=["A/a2"])
                try:
                    got = await decode.wait("r", timeout=15)
                except TimeoutError:
                    got = None
                sent = await prefill.wait("r", timeout=5) if got is not None else None
            said = {"checksum_failures": metric(ag["a2"], "pddwire_checksum_failures_total", peer="A/a1"),
                    "CHUNK_CHECKSUM": metric(ag["a2"], "pddwire_errors_total", code="CHUNK_CHECKSUM"),
                    "SIZE_MISMATCH": metric(ag["a2"], "pddwire_errors_total", code="SIZE_MISMATCH"),
                    "logs": [e["event"] for e in logs if e.get("log_level") == "warning"]}
            return got, sent, dict(victim.stats) | said, await same_bytes(dst.buf, src.buf)
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
    # the receiver says what happened: a message of the wrong size, not a failed checksum
    assert stats["checksum_failures"] == 0 and stats["CHUNK_CHECKSUM"] == 0, stats
    assert stats["SIZE_MISMATCH"] == 1, stats
    assert any("wrong size" in e and "asking for it again" in e for e in stats["logs"]), stats["logs"]
    # (the sender, told KV_NACK CHUNK_CHECKSUM, says the chunk was refused, naming both causes)
    assert not any("payload checksum failed" in e for e in stats["logs"]), stats["logs"]


async def test_wrong_size_messages_past_the_limit_fail_the_transfer(tmp_sock_dir, engines):
    """More wrong-size messages than a transfer survives: it fails with a clear code at both
    ends (nothing written), not at its deadline."""
    got, sent, stats, _ = await _seeded_transfer(tmp_sock_dir, engines, wrong=4)
    assert isinstance(got, p.TransferFailed) and got.code == ErrorCode.MALFORMED_BODY, (got, stats)
    assert isinstance(sent, p.TransferFailed), sent
    assert stats["wrong_size"] == 4


async def test_a_wrong_size_failure_that_comes_while_its_transfer_is_forgotten_posts_nothing_again():
    """The race: chunk 0's receive meets a message of the wrong size already there (its failure
    comes on the next loop turn), and the transfer is forgotten meanwhile (cancelled: its
    waiting receives fail, while another of its chunks is still landing). The failure must not
    post chunk 0's receive again: nothing would ever cancel it, and the route would never
    quiesce (the cancelled transfer's blocks never handed back)."""
    async with bare_pair(keyed=True) as (b, pa, pb):
        victim, tid = pb.peer, 9
        sent: list = []
        send_raw(pa, pb.tag_in(tid, 0), b"w" * 100, sent)     # chunk 0, of the wrong size
        await until(lambda: victim.pending()["unclaimed"] == 1, what="the message arrived")
        quiesce = victim._quiesce

        async def landing(match):   # as when another chunk of the transfer is still being written
            await asyncio.sleep(0.05)
            await quiesce(match)

        victim._quiesce = landing
        route = Route(blocks(2 * CHUNK), CHUNK, asyncio.get_running_loop())
        b.routes[tid] = route
        pb.expect(tid, route)        # chunk 0 meets the message: its failure comes on the next turn
        del b.routes[tid]
        await pb.forget(tid)         # (cancel_transfer runs now, before that failure)
        assert victim.stats["wrong_size"] == 1
        assert victim.pending()["waiting"] == 0, "chunk 0's receive was posted again after its transfer went"
        await asyncio.wait_for(route.close(), 5)
        assert route.verified == set() and sent == [None]
