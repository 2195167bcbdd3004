"""The fault-injection suite: agents as processes in two network namespaces joined by a veth WAN
(tbf-shaped), faults injected with ``kill -9``, ``SIGSTOP`` and link down/up.

For each fault: what each side's engine is told, how long that took, and that nothing is lost,
duplicated, stranded or decoded unverified. Detection times are recorded in ``TABLE`` and printed
at the end of the module (``pytest -s tests/test_faults.py``); the README's fault table comes
from such a run. Byte flips, truncated and dropped connections and delays on the wire are
injected with the user-space relay in tests/test_transfer.py and tests/test_handoff_agents.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import time

import pytest

from pdd_tools.harness import PORT
from pdd_tools.sim import MdSim, RldSim, check_stream
from pdd_wire import EngineClient, SharedMemory
from pdd_wire.engine import protocol as p
from pdd_wire.errors import ErrorCode, TransportError
from support.netagents import NetAgents

pytestmark = pytest.mark.root  # agents in two network namespaces

MiB = 1 << 20
RATE = 200_000_000  # 200 Mbit/s: a 64 MiB transfer takes ~2.8 s, long enough to hit mid-way
GIVE_UP = 3.0
TABLE: list[dict] = []


@pytest.fixture(scope="module", autouse=True)
def print_table():
    yield
    if TABLE:
        print("\n| fault | sender's engine | receiver's engine | detected after | released |")
        print("|---|---|---|---|---|")
        for r in TABLE:
            print(f"| {r['fault']} | {r['a']} | {r['b']} | {r['t']} | {r['released']} |")


class Ends:
    """A sending engine on A and a receiving engine on B, each with a 64 MiB region."""

    async def open(self, net: NetAgents, size: int = 64 * MiB) -> "Ends":
        self.net = net
        self.size = size
        self.src = SharedMemory(size)
        self.src.buf[:] = random.Random(size).randbytes(size)
        self.dst = SharedMemory(size)
        self.a = await EngineClient(net.socket("A"), "sender").connect()
        self.ra = await self.a.register(self.src, block_bytes=MiB)
        await self.connect_b()
        return self

    async def connect_b(self) -> None:
        self.b = await EngineClient(self.net.socket("B"), "receiver").connect()
        self.rb = await self.b.register(self.dst, block_bytes=MiB)

    async def start(self, rid: str) -> None:
        self.dst.buf[:] = bytes(self.size)
        await self.b.post_recv(rid, [self.rb.blocks(0, self.size // MiB)], from_site="A")
        await self.a.send_kv(rid, [self.ra.blocks(0, self.size // MiB)], to=["B"])

    async def midway(self, rid: str) -> None:
        """Until B has verified some chunks of ``rid`` (and not all)."""
        async with asyncio.timeout(20):
            while True:
                st = await self.net.status("B")
                t = [t for t in st["transfers"] if t["request_id"] == rid]
                if t and t[0].get("verified_chunks", 0) >= 2:
                    return
                await asyncio.sleep(0.05)

    def landed(self) -> bool:
        return bytes(self.dst.buf) == bytes(self.src.buf)

    async def close(self) -> None:
        for c in (self.a, self.b):
            await c.close()
        self.src.close()
        self.dst.close()


@contextlib.asynccontextmanager
async def mid_transfer(rid: str):
    """Agents in two namespaces (a 200 Mbit/s WAN) and a 64 MiB transfer ``rid`` from A's engine
    to B's, hit mid-way: yields ``(net, ends)``."""
    async with NetAgents(rate_bps=RATE, give_up_s=GIVE_UP) as net:
        e = await Ends().open(net)
        try:
            await e.start(rid)
            await e.midway(rid)
            yield net, e
        finally:
            await e.close()


async def released(net: NetAgents, *sites: str) -> str:
    """Both agents hold no blocks for peers and none is stranded (their own audit)."""
    for s in sites:
        st = await net.status(s)
        assert st["stranded_blocks"] == 0, st
        assert st["pinned_blocks"] == {"post": 0, "send": 0, "recv": 0}, st
        assert not st["transfers"], st["transfers"]
    return "all blocks handed back; 0 stranded"


async def test_kill_9_of_the_receiving_agent_then_restart(tmp_path):
    async with mid_transfer("k1") as (net, e):
        t0 = time.monotonic()
        net.kill9("B")
        with pytest.raises(TransportError):  # B's engine: its agent is gone
            await e.b.wait("k1", timeout=5)
        t_b = time.monotonic() - t0
        net.start("B")  # systemd would restart it
        ev = await e.a.wait("k1", timeout=10)
        t_a = time.monotonic() - t0
        assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.PEER_RESTARTED, ev
        # The engine reconnects to the new agent, registers again, and the retry lands.
        await net.wait_up()
        await e.connect_b()
        await e.start("k1-retry")
        assert isinstance(await e.b.wait("k1-retry", timeout=30), p.KvReceived)
        assert isinstance(await e.a.wait("k1-retry", timeout=10), p.KvSent)
        assert e.landed()
        TABLE.append({"fault": "`kill -9` of B's agent mid-transfer, restarted at once",
                      "a": "`transfer_failed PEER_RESTARTED`", "b": "engine socket closed; reconnects, "
                      "registers again, the retry lands byte-identical",
                      "t": f"A {t_a:.2f} s, B {t_b:.2f} s", "released": await released(net, "A", "B")})


async def test_kill_9_of_the_receiving_agent_for_good(tmp_path):
    async with mid_transfer("k2") as (net, e):
        t0 = time.monotonic()
        net.kill9("B")
        ev = await e.a.wait("k2", timeout=GIVE_UP + 5)
        t_a = time.monotonic() - t0
        assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.PEER_UNREACHABLE, ev
        assert GIVE_UP - 0.5 <= t_a <= GIVE_UP + 2
        TABLE.append({"fault": "`kill -9` of B's agent mid-transfer, not restarted",
                      "a": "`transfer_failed PEER_UNREACHABLE`", "b": "engine socket closed",
                      "t": f"A {t_a:.2f} s (`peer_give_up_s` {GIVE_UP:g})", "released": await released(net, "A")})


async def test_sigstop_longer_than_the_lease_fails_both_sides_and_strands_nothing(tmp_path):
    async with mid_transfer("s1") as (net, e):
        t0 = time.monotonic()
        net.signal("B", signal.SIGSTOP)  # alive but stalled: no FIN, no RST, just silence
        ev = await e.a.wait("s1", timeout=GIVE_UP + 6)
        t_a = time.monotonic() - t0
        assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.PEER_UNREACHABLE, ev
        net.signal("B", signal.SIGCONT)
        t1 = time.monotonic()
        ev = await e.b.wait("s1", timeout=10)  # B learns it on reconnect (A's queued KV_CANCEL)
        t_b = time.monotonic() - t1
        assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.PEER_UNREACHABLE, ev
        await net.wait_up()
        TABLE.append({"fault": f"`SIGSTOP` of B's agent for longer than the lease (resumed after {t_a:.1f} s)",
                      "a": "`transfer_failed PEER_UNREACHABLE`",
                      "b": "`transfer_failed PEER_UNREACHABLE` once it runs again (KV_CANCEL queued by A)",
                      "t": f"A {t_a:.2f} s (`dead_after_s` 1 + `peer_give_up_s` {GIVE_UP:g}); B {t_b:.2f} s "
                           f"after `SIGCONT`", "released": await released(net, "A", "B")})


async def test_sigstop_shorter_than_the_lease_resumes(tmp_path):
    async with mid_transfer("s2") as (net, e):
        net.signal("B", signal.SIGSTOP)
        await asyncio.sleep(1.8)  # past dead_after_s (1 s): A drops the connections
        net.signal("B", signal.SIGCONT)
        assert isinstance(await e.b.wait("s2", timeout=30), p.KvReceived)
        assert isinstance(await e.a.wait("s2", timeout=10), p.KvSent)
        assert e.landed()
        st = await net.status("A")
        assert st["peers"][0]["up"]
        TABLE.append({"fault": "`SIGSTOP` of B's agent for 1.8 s (shorter than the lease)",
                      "a": "`kv_sent`", "b": "`kv_received`, byte-identical", "t": "resumed on reconnect",
                      "released": await released(net, "A", "B")})


@pytest.mark.parametrize("down_s", [1.5, 5.0])
async def test_link_down_then_up(tmp_path, down_s):
    async with mid_transfer("l1") as (net, e):
        t0 = time.monotonic()
        net.sites.link(False)
        if down_s < GIVE_UP:
            await asyncio.sleep(down_s)
            net.sites.link(True)
            assert isinstance(await e.b.wait("l1", timeout=30), p.KvReceived)
            assert isinstance(await e.a.wait("l1", timeout=10), p.KvSent)
            assert e.landed()
            a, b, t = "`kv_sent`", "`kv_received`, byte-identical", "resumed on reconnect"
        else:
            ev_a = await e.a.wait("l1", timeout=GIVE_UP + 6)
            ev_b = await e.b.wait("l1", timeout=GIVE_UP + 6)
            t_end = time.monotonic() - t0
            assert ev_a.code == ev_b.code == ErrorCode.PEER_UNREACHABLE, (ev_a, ev_b)
            await asyncio.sleep(max(0.0, down_s - t_end))
            net.sites.link(True)
            await net.wait_up()
            await e.start("l1-retry")
            assert isinstance(await e.b.wait("l1-retry", timeout=30), p.KvReceived)
            assert e.landed()
            a = b = "`transfer_failed PEER_UNREACHABLE`; a retry after the link is back lands"
            t = f"both {t_end:.2f} s"
        TABLE.append({"fault": f"WAN link down for {down_s:g} s mid-transfer", "a": a, "b": b, "t": t,
                      "released": await released(net, "A", "B")})


def _busiest_bulk_flow(net: NetAgents) -> int:
    """A's local port of the connection to B that has moved the most bytes (a bulk one, mid-chunk)."""
    out = net.run_in("A", ["ss", "-tni", "dst", f"{net.addr('B')}:{PORT}"]).stdout
    flows, port = [], None
    for line in out.splitlines():
        if line.startswith("ESTAB"):
            port = int(line.split()[3].rpartition(":")[2])
        elif port is not None and (m := re.search(r"bytes_acked:(\d+)", line)):
            flows.append((int(m.group(1)), port))
            port = None
    assert flows, out
    return max(flows)[1]


def _blackhole(net: NetAgents, port: int) -> None:
    """Drop every packet of A's flow from ``port``, both ways, saying nothing to either end (a
    middlebox that lost the flow's state, an ECMP path gone): policy routes to a blackhole, A's
    packets by source port, B's by destination port. The other flows go on."""
    for site, match in (("A", "sport"), ("B", "dport")):
        for argv in (["ip", "rule", "add", match, str(port), "table", "100", "prio", "100"],
                     ["ip", "route", "add", "blackhole", "default", "table", "100"]):
            res = net.run_in(site, argv)
            assert res.returncode == 0, (argv, res.stderr)


async def test_one_bulk_flow_blackholed_mid_transfer(tmp_path):
    """One bulk TCP flow loses its path mid-chunk, no FIN or RST, while the control connection and
    the other flow work. Before, the receiver held that chunk's claim for ever (KV_NACK CHUNK_BUSY
    to every resend: gigabytes resent) and the transfer failed TRANSFER_TIMEOUT at its deadline
    (300 s by default). Now the receiver drops a bulk connection that stalls mid-frame for
    `timeouts.dead_after_s` (1 s here), and the sender's kernel ends the flow whose data goes
    unacknowledged that long, at least 3 s (TCP_USER_TIMEOUT): the stream is dialed again, the
    chunk resent."""
    async with mid_transfer("bh1") as (net, e):
        port = _busiest_bulk_flow(net)
        t0 = time.monotonic()
        _blackhole(net, port)
        ev = await e.b.wait("bh1", timeout=30)
        t = time.monotonic() - t0
        assert isinstance(ev, p.KvReceived), ev
        assert isinstance(await e.a.wait("bh1", timeout=10), p.KvSent)
        assert e.landed()
        TABLE.append({"fault": "one bulk TCP flow blackholed mid-transfer (no FIN, no RST; the rest of the link up)",
                      "a": "`kv_sent`", "b": "`kv_received`, byte-identical",
                      "t": f"landed {t:.2f} s after the flow went dark", "released": await released(net, "A", "B")})


async def test_thirty_seconds_of_mixed_traffic_under_faults_loses_nothing(tmp_path):
    """KV transfers, token relay and handoffs run for 30 s while the link flaps and agents stall
    every few seconds (each fault shorter than the lease). Afterwards: every transfer landed
    byte-identical, every token arrived once and in order, every handoff kept the ownership
    invariant, no checksum failure reached an engine, nothing is pinned or stranded."""
    duration = float(os.environ.get("PDD_CHAOS_S", "30"))
    async with NetAgents(rate_bps=1_000_000_000, give_up_s=10.0) as net:
        A = await EngineClient(net.socket("A"), "chaos-a").connect()
        B = await EngineClient(net.socket("B"), "chaos-b").connect()
        R = await EngineClient(net.socket("A"), "chaos-rld").connect()
        M = await EngineClient(net.socket("B"), "chaos-md").connect()
        T = await EngineClient(net.socket("B"), "chaos-tokens").connect()
        size = 16 * MiB
        src, dst = SharedMemory(size), SharedMemory(size)
        src.buf[:] = random.Random(1).randbytes(size)
        ra = await A.register(src, block_bytes=MiB)
        rb = await B.register(dst, block_bytes=MiB)
        mdmem = SharedMemory(4 * MiB)
        rm = await M.register(mdmem, block_bytes=MiB)
        await R.set_load(0.1)
        stop = asyncio.Event()
        counts = {"transfers": 0, "tokens": 0, "handoffs": 0, "faults": 0}

        async def kv_loop():
            i = 0
            while not stop.is_set():
                rid = f"kv{i}"
                i += 1
                dst.buf[:] = bytes(size)
                await B.post_recv(rid, [rb.blocks(0, 16)], from_site="A")
                await A.send_kv(rid, [ra.blocks(0, 16)], to=["B"])
                ev = await B.wait(rid, timeout=60)
                assert isinstance(ev, p.KvReceived), ev
                assert bytes(dst.buf) == bytes(src.buf), f"{rid}: bytes differ"
                assert isinstance(await A.wait(rid, timeout=60), p.KvSent)
                counts["transfers"] += 1

        async def token_loop():
            await T.expect_tokens("stream", "A")  # tokens reach only the engine that takes the request
            k = 0
            while not stop.is_set():
                await A.send_tokens("stream", "B", [k, k + 1, k + 2])
                k += 3
                await asyncio.sleep(0.01)
            got = []
            async with asyncio.timeout(60):
                while len(got) < k:
                    got += (await T.wait_tokens("stream")).tokens
            assert got == list(range(k)), "tokens lost, duplicated or out of order"
            counts["tokens"] = k

        async def handoff_loop():
            j = 0
            while not stop.is_set():
                rid = f"h{j}"
                j += 1
                await M.post_recv(rid, [rm.blocks(0, 1)], from_site="A")
                md = MdSim(M, rid, "A", n_tokens=120, extend_s=0.005)
                await md.start()
                rld = RldSim(R, rid, "B", n_tokens=120, step_s=0.005, hold_at=40)
                tasks = [asyncio.ensure_future(rld.run(60)), asyncio.ensure_future(md.run(60))]
                await asyncio.wait_for(rld.held.wait(), 30)
                await A.send_kv(rid, [ra.blocks(0, 1)], to=["B"])
                rld.release_hold()
                await asyncio.gather(*tasks)
                await M.wait(rid, timeout=60)  # kv_received
                await A.wait(rid, timeout=60)
                check_stream(rid, 120, rld.emitted, md.emitted)
                counts["handoffs"] += 1

        async def faults():
            kinds = ["link", "stop_b", "stop_a", "link_short"]
            n = 0
            while not stop.is_set():
                await asyncio.sleep(2.5)
                if stop.is_set():
                    break
                kind = kinds[n % len(kinds)]
                n += 1
                if kind.startswith("link"):
                    net.sites.link(False)
                    await asyncio.sleep(1.2 if kind == "link" else 0.4)
                    net.sites.link(True)
                else:
                    site = "B" if kind == "stop_b" else "A"
                    net.signal(site, signal.SIGSTOP)
                    await asyncio.sleep(1.3)
                    net.signal(site, signal.SIGCONT)
                counts["faults"] += 1

        async def clock():
            await asyncio.sleep(duration)
            stop.set()

        try:
            await asyncio.gather(kv_loop(), token_loop(), handoff_loop(), faults(), clock())
            await net.wait_up()
            assert counts["faults"] >= duration / 4 and counts["transfers"] >= 3 and counts["handoffs"] >= 3, counts
            for s in "AB":  # no chunk that failed its checksum was ever handed to an engine (bytes compared above)
                st = await net.status(s)
                assert st["stranded_blocks"] == 0 and st["pinned_blocks"] == {"post": 0, "send": 0, "recv": 0}, st
            TABLE.append({"fault": f"{duration:g} s of mixed traffic, a fault every 2.5 s ({counts['faults']}: link "
                                   f"down 1.2 s / 0.4 s, `SIGSTOP` of A or B 1.3 s)",
                          "a": f"{counts['transfers']} transfers, {counts['tokens']} tokens, {counts['handoffs']} "
                               f"handoffs", "b": "all landed byte-identical, tokens once and in order, every "
                                                 "position emitted once", "t": "—",
                          "released": "0 pinned, 0 stranded"})
        finally:
            stop.set()
            for c in (A, B, R, M, T):
                await c.close()
            for mem in (src, dst, mdmem):
                mem.close()
