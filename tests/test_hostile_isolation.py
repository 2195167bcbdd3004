"""One peer against another: a raw peer (site A, written from proto/, tests/support/raw_peer.py)
attacks agent B while a real agent C sends B its KV and tokens. Each attack checks that B stays
up, C's transfer beside it arrives byte-identical, B's tables stay within their bounds, and C's
session is never dropped (only the attacker's connection may be closed).

The attack classes of issue 11 covered here: a token flood to requests nobody posted, token
injection into another peer's request, out-of-vocabulary token ids, unposted-table exhaustion by
one peer, guessable request-id squatting, REQUEST_ABORT from another site, and a connection
flood while a legitimate peer restarts (idle, slow, bulk preambles, bulk preambles with a forged
BULK_HELLO), a peer that asks for token resends over and over while it reads nothing, and one
that lets unposted sends expire to push another site's given-up requests out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import msgspec
import pytest

from conftest import fill_random, metric, same_bytes, until
from pdd_wire.engine import protocol as p
from pdd_wire.errors import EngineRequestError, ErrorCode
from pdd_wire.inbound import UNVERIFIED
from pdd_wire.session.tokens import MAX_HELD_REQUESTS, MAX_HELD_TOKENS
from pdd_wire.transport.tcp import KIND_BULK, KIND_CONTROL, preamble
from pdd_wire.wire import FrameType, encode_bytes
from pdd_wire.wire import messages as m
from pdd_wire.wire.frame import LANE_OF
from support.agents import cluster_toml, run_agents, two_site_toml
from support.raw_peer import hello

MiB = 1 << 20
MAX_TRANSFERS = 16  # B's transfer.max_transfers: small, so a table is quick to fill


def rss() -> int:
    """This process's resident bytes (the agents run in it)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.asynccontextmanager
async def attacked(tmp, engines, extra: str = ""):
    """Agents B and C (plaintext, so the raw peer A can speak at all), engines on both with
    registered memory, and the attacker's authenticated control connection to B."""
    tomls = cluster_toml(tmp, [("A", "a1"), ("B", "b1"), ("C", "c1")],
                         extra=f"[tls]\nallow_plaintext = true\n[transfer]\nmax_transfers = {MAX_TRANSFERS}\n"
                               "unposted_wait_s = 2.0\n" + extra)
    async with run_agents({"B": tomls["b1"], "C": tomls["c1"]}, wait_up=False) as ag:
        b, c = ag["B"], ag["C"]
        await until(lambda: b.sessions["C/c1"].is_up and c.sessions["B/b1"].is_up, what="B and C up")
        eb = await engines.connect(tmp / "b1.sock", "b")
        ec = await engines.connect(tmp / "c1.sock", "c")
        mb, mc = engines.memory(8 * MiB), engines.memory(8 * MiB)
        await fill_random(mc)
        rb = await eb.register(mb, block_bytes=MiB)
        rc = await ec.register(mc, block_bytes=MiB)
        attacker, _ = await hello(b.wan_address[1])
        alive = asyncio.create_task(attacker.keepalive())
        try:
            yield b, c, eb, ec, rb, rc, mb, mc, attacker
        finally:
            alive.cancel()
            attacker.close()


async def legit_transfer(b, eb, ec, rb, rc, mb, mc, rid: str = "legit") -> None:
    """C sends B 8 MiB for ``rid`` (posted from site C) and tokens after it: both arrive intact."""
    await eb.post_recv(rid, [rb.blocks(0, 8)], from_site="C")
    await ec.send_kv(rid, [rc.blocks(0, 8)], to=["B"])
    ev = await eb.wait(rid, timeout=30)
    assert isinstance(ev, p.KvReceived) and ev.peer == "C/c1", ev
    assert isinstance(await ec.wait(rid, timeout=30), p.KvSent)
    assert await same_bytes(mb.buf, mc.buf)
    await ec.send_tokens(rid, "B", [11, 12, 13])
    tok = await eb.wait_tokens(rid, timeout=10)
    assert (tok.peer, tok.tokens) == ("C/c1", [11, 12, 13])


def c_never_dropped(b, c) -> None:
    assert b.sessions["C/c1"].is_up and c.sessions["B/b1"].is_up
    assert metric(b, "pddwire_reconnects_total", peer="C/c1") == 0
    assert metric(c, "pddwire_reconnects_total", peer="B/b1") == 0


async def test_a_token_flood_to_requests_nobody_posted_reaches_no_engine(tmp_sock_dir, engines):
    async with attacked(tmp_sock_dir, engines) as (b, c, eb, ec, rb, rc, mb, mc, attacker):
        before = rss()
        # 3000 frames of 256-character request ids (the decode-time limit), 1000 tokens each: once
        # 830 MB of agent and every engine's event queue.
        for i in range(3000):
            attacker.send(FrameType.TOKENS, m.Tokens(f"{i:08d}" + "x" * 248, 0, list(range(1000))))
            if i % 200 == 0:
                await attacker.writer.drain()
        assert await attacker.pong(1)
        relay = b.sessions["A/a1"].tokens
        assert len(relay.held) <= MAX_HELD_REQUESTS and relay.held_tokens <= MAX_HELD_TOKENS
        dropped = sum(metric(b, "pddwire_tokens_dropped_total", peer="A/a1", reason=r)
                      for r in ("unowned", "over_bounds"))
        assert dropped >= 3000 * 1000 - MAX_HELD_TOKENS
        await legit_transfer(b, eb, ec, rb, rc, mb, mc)
        assert [e for e in eb.events() if isinstance(e, p.TokensReceived)] == []  # none of A's
        assert rss() - before < 256 * MiB
        c_never_dropped(b, c)
        assert b.sessions["A/a1"].is_up  # tokens are not a protocol error: A stays connected


async def test_tokens_injected_into_another_peers_request_are_dropped(tmp_sock_dir, engines):
    async with attacked(tmp_sock_dir, engines) as (b, c, eb, ec, rb, rc, mb, mc, attacker):
        await eb.post_recv("victim", [rb.blocks(0, 8)], from_site="C")  # B's engine owns it, tied to C
        attacker.send(FrameType.TOKENS, m.Tokens("victim", 0, [666, 667]))
        # ... also into a request B's engine sends tokens for (tied to C), and one it only expects from C
        await eb.send_tokens("chat", "C", [1])
        await eb.expect_tokens("quiet", "C")
        attacker.send(FrameType.TOKENS, m.Tokens("chat", 0, [666]))
        attacker.send(FrameType.TOKENS, m.Tokens("quiet", 0, [666]))
        assert await attacker.pong(2)
        assert metric(b, "pddwire_tokens_dropped_total", peer="A/a1", reason="foreign_site") == 4
        await ec.send_kv("victim", [rc.blocks(0, 8)], to=["B"])
        assert isinstance(await eb.wait("victim", timeout=30), p.KvReceived)
        assert await same_bytes(mb.buf, mc.buf)
        await ec.send_tokens("victim", "B", [5])
        await ec.send_tokens("quiet", "B", [6])
        assert (await eb.wait_tokens("victim", timeout=10)).tokens == [5]  # seq 0 from C, not A's
        assert (await eb.wait_tokens("quiet", timeout=10)).tokens == [6]
        assert [e for e in eb.events() if isinstance(e, p.TokensReceived)] == []
        c_never_dropped(b, c)


async def test_out_of_vocabulary_token_ids_close_the_attackers_connection_only(tmp_sock_dir, engines):
    async with attacked(tmp_sock_dir, engines) as (b, c, eb, ec, rb, rc, mb, mc, attacker):
        await eb.expect_tokens("oov")
        for bad in (-1, (1 << 64) - 1, 1 << 32):
            # msgpack by hand: [request_id, seq, [token], handoff]
            attacker.writer.write(encode_bytes(FrameType.TOKENS, _tokens_body("oov", bad), lane=1))
            got = await attacker.until_closed()
            assert [(t, x.code) for t, x in got if t == FrameType.ERROR] == [(FrameType.ERROR, ErrorCode.OUT_OF_RANGE)]
            attacker.close()
            attacker, _ = await hello(b.wan_address[1])
        attacker.close()
        await legit_transfer(b, eb, ec, rb, rc, mb, mc)
        assert eb.take("oov", kinds=(p.TokensReceived,)) == []
        c_never_dropped(b, c)


def _tokens_body(rid: str, token: int) -> bytes:
    return msgspec.msgpack.encode([rid, 0, [token], False])


async def test_one_peer_filling_the_unposted_table_leaves_the_others_share(tmp_sock_dir, engines):
    async with attacked(tmp_sock_dir, engines) as (b, c, eb, ec, rb, rc, mb, mc, attacker):
        begin = dict(total_bytes=MiB, chunk_bytes=MiB, n_chunks=1, block_bytes=MiB, n_blocks=1, post_wait_ms=60_000)
        for i in range(MAX_TRANSFERS + 4):
            attacker.send(FrameType.KV_BEGIN, m.KvBegin(f"junk{i}", **begin), transfer_id=i + 1)
        attacker.send(FrameType.PING, m.Ping(nonce=3, sent_ns=1))
        seen = await attacker.until(FrameType.PONG)
        rejects = [f[1].code for f in seen if f is not None and f[0] == FrameType.KV_REJECT]
        assert rejects == [ErrorCode.TOO_MANY_TRANSFERS] * 4
        assert b.kv.unposted_per_peer["A/a1"] == MAX_TRANSFERS
        # C's KV, sent before B's engine posts, still waits for its post and lands.
        await ec.send_kv("early", [rc.blocks(0, 8)], to=["B"], lease_s=30)
        await until(lambda: "C/c1" in b.kv.unposted.get("early", {}), what="C's KV_BEGIN waiting")
        await eb.post_recv("early", [rb.blocks(0, 8)], from_site="C")
        assert isinstance(await eb.wait("early", timeout=30), p.KvReceived)
        assert await same_bytes(mb.buf, mc.buf)
        assert b.kv.unposted_per_peer["A/a1"] == MAX_TRANSFERS  # A's own waits are A's business
        c_never_dropped(b, c)


async def test_a_squatted_request_id_does_not_refuse_the_real_senders_kv(tmp_sock_dir, engines):
    async with attacked(tmp_sock_dir, engines) as (b, c, eb, ec, rb, rc, mb, mc, attacker):
        # A guesses the id and announces it first, with the same sizes.
        attacker.send(FrameType.KV_BEGIN, m.KvBegin("turn-42", total_bytes=8 * MiB, chunk_bytes=4 * MiB, n_chunks=2,
                                                    block_bytes=MiB, n_blocks=8, post_wait_ms=2000), transfer_id=1)
        assert await attacker.pong(4)
        await ec.send_kv("turn-42", [rc.blocks(0, 8)], to=["B"], lease_s=30)
        await until(lambda: len(b.kv.unposted.get("turn-42", {})) == 2, what="both KV_BEGINs waiting")
        await eb.post_recv("turn-42", [rb.blocks(0, 8)], from_site="C")  # the post says whose KV it takes
        ev = await eb.wait("turn-42", timeout=30)
        assert isinstance(ev, p.KvReceived) and ev.peer == "C/c1"
        assert await same_bytes(mb.buf, mc.buf)
        assert isinstance(await ec.wait("turn-42", timeout=30), p.KvSent)
        # A's announcement ends at its own lease, refused NOT_POSTED, on A's connection.
        got = await attacker.until(FrameType.KV_REJECT)
        assert got[-1] is not None and got[-1][1].code == ErrorCode.NOT_POSTED
        assert not b.kv.unposted
        c_never_dropped(b, c)


async def test_request_abort_from_a_site_not_tied_to_the_request_reaches_no_engine(tmp_sock_dir, engines):
    async with attacked(tmp_sock_dir, engines) as (b, c, eb, ec, rb, rc, mb, mc, attacker):
        await eb.post_recv("keep", [rb.blocks(0, 8)], from_site="C")
        await eb.send_tokens("talk", "C", [1])  # owned by B's engine, tied to C
        for rid in ("keep", "talk"):
            attacker.send(FrameType.REQUEST_ABORT, m.RequestAbort(rid, "not yours"))
        assert await attacker.pong(5)
        assert metric(b, "pddwire_request_aborts_total", direction="rx") == 2
        assert "keep" in b.posts
        assert [e for e in eb.events() if isinstance(e, p.RequestAborted)] == []
        await ec.send_kv("keep", [rc.blocks(0, 8)], to=["B"])
        assert isinstance(await eb.wait("keep", timeout=30), p.KvReceived)
        assert await same_bytes(mb.buf, mc.buf)
        # The site tied to it still can.
        await ec.abort("talk", "done")
        ev = await eb.wait("talk", kinds=(p.RequestAborted,), timeout=10)
        assert ev.origin == "C/c1"
        c_never_dropped(b, c)


# What one flood connection sends before it waits to be closed. With the default TLS (mode auto)
# bulk connections are plaintext: a bulk preamble is accepted at once, a BULK_HELLO is read, and
# only its session token (forged here) could prove anything.
FORGED_BULK_HELLO = encode_bytes(FrameType.BULK_HELLO, m.encode_body(
    m.BulkHello(session=0x1234_5678_9ABC, stream=0, site="A", node="a1")), lane=LANE_OF[FrameType.BULK_HELLO])
FLOODS = {
    "idle and slow": lambda i: b"" if i % 2 == 0 else preamble(KIND_CONTROL)[:3],
    "bulk preambles": lambda i: preamble(KIND_BULK),
    "bulk preambles, forged BULK_HELLO": lambda i: preamble(KIND_BULK) + (FORGED_BULK_HELLO if i % 2 else b""),
}


@pytest.mark.parametrize("flood_kind", list(FLOODS))
async def test_a_connection_flood_does_not_keep_a_restarting_peer_out(tmp_sock_dir, engines, flood_kind):
    """Unauthenticated connections flood B's listener (with the default TLS) while A restarts:
    A's new incarnation gets in, within the flood, and moves KV byte-identical."""
    tomls = two_site_toml(tmp_sock_dir)
    async with run_agents(tomls) as ag:
        b = ag["B"]
        port = b.wan_address[1]
        stop = asyncio.Event()
        opened = 0

        async def flood(i: int) -> None:
            """One connection after another, each held until the agent closes it."""
            nonlocal opened
            first = FLOODS[flood_kind](i)
            while not stop.is_set():
                try:
                    r, w = await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    await asyncio.sleep(0.01)
                    continue
                opened += 1
                try:
                    w.write(first)  # and nothing more
                    while not stop.is_set() and await r.read(4096):
                        pass
                except OSError:
                    pass
                finally:
                    w.close()

        floods = [asyncio.create_task(flood(i)) for i in range(150)]
        try:
            await until(lambda: opened > 100, what="the flood under way")
            await ag["A"].shutdown(0)
            # A's freed slots go to the flood before A comes back.
            await until(lambda: not b.sessions["A/a1"].is_up, what="B sees A gone")
            mark = opened
            await until(lambda: opened > mark + 300, what="the flood refills B's slots")
            from pdd_wire import config as cfgmod
            from pdd_wire.agent import Agent

            a2 = Agent(cfgmod.loads(tomls["A"]))
            await a2.start()
            try:
                await until(lambda: a2.sessions["B/b1"].is_up and b.sessions["A/a1"].is_up, timeout=60,
                            what="A back in while the flood goes on")
                assert not stop.is_set() and opened > 100
                assert b.inbound.handshaking <= b.config.limits.max_handshakes
                ea = await engines.connect(tmp_sock_dir / "A.sock", "a")
                eb = await engines.connect(tmp_sock_dir / "B.sock", "b")
                ma, mb = engines.memory(4 * MiB), engines.memory(4 * MiB)
                await fill_random(ma)
                ra = await ea.register(ma, block_bytes=MiB)
                rb = await eb.register(mb, block_bytes=MiB)
                await eb.post_recv("after", [rb.blocks(0, 4)], from_site="A")
                await ea.send_kv("after", [ra.blocks(0, 4)], to=["B"])
                assert isinstance(await eb.wait("after", timeout=60), p.KvReceived)
                assert await same_bytes(ma.buf, mb.buf)
                assert b.inbound.cut > 0  # the flood's connections were cut for newcomers
            finally:
                await a2.shutdown(0)
        finally:
            stop.set()
            for t in floods:
                t.cancel()
            await asyncio.gather(*floods, return_exceptions=True)


async def test_bulk_preambles_do_not_outrank_a_control_connection_in_its_handshake(tmp_sock_dir, engines):
    """A plaintext bulk preamble (TLS mode auto) proves nothing: a pool full of them ranks with a
    control connection still in TLS, and the next one cuts the oldest of the flood, not it."""
    async with run_agents(two_site_toml(tmp_sock_dir), sites=("B",), wait_up=False) as ag:
        b = ag["B"]
        port, cap = b.wan_address[1], b.config.limits.max_handshakes
        held = []
        try:
            for _ in range(cap):
                held.append(await asyncio.open_connection("127.0.0.1", port))
                held[-1][1].write(preamble(KIND_BULK))
            await until(lambda: b.inbound.handshaking == cap
                        and {h.stage for h in b.inbound._handshaking} == {UNVERIFIED}, what="the pool full")
            r, w = await asyncio.open_connection("127.0.0.1", port)  # a control connection: TLS under way
            held.append((r, w))
            w.write(preamble(KIND_CONTROL))
            mine = w.get_extra_info("sockname")[1]
            await until(lambda: any(h.addr[1] == mine and h.stage == UNVERIFIED for h in b.inbound._handshaking),
                        what="the control connection in its handshake")
            cut = b.inbound.cut
            held.append(await asyncio.open_connection("127.0.0.1", port))
            held[-1][1].write(preamble(KIND_BULK))
            await until(lambda: b.inbound.cut > cut, what="a connection cut for the newcomer")
            assert any(h.addr[1] == mine for h in b.inbound._handshaking)  # the control one was not it
        finally:
            for _, w in held:
                w.close()


# B's engine relays tokens to A (the attacker), which never acknowledges them: 16 frames of
# 8192 five-byte token IDs, about 650 KiB that B keeps for resend.
UNACKED_FRAMES, PER_FRAME = 16, 8192


async def _unacked_tokens_to_attacker(b, eb, rid: str) -> None:
    for i in range(UNACKED_FRAMES):
        await eb.send_tokens(rid, "A", [1_000_000 + i] * PER_FRAME)
    assert sum(len(part) for _, part, _ in b.sessions["A/a1"].tokens.tok_out[rid].unacked) == UNACKED_FRAMES * PER_FRAME


def _resend_request(rid: str) -> bytes:
    """TOKENS_ACK {next_seq 0, resend}: 'send me everything of ``rid`` again'."""
    body = m.encode_body(m.TokensAck(rid, 0, True))
    return encode_bytes(FrameType.TOKENS_ACK, body, lane=LANE_OF[FrameType.TOKENS_ACK])


def _token_frames_to_attacker(b) -> float:
    return metric(b, "pddwire_frames_total", peer="A/a1", lane="token", direction="tx")


async def test_a_burst_of_resend_requests_sends_a_stream_again_once(tmp_sock_dir, engines):
    """TOKENS_ACK {resend} is honoured once per round trip per request: a hundred of them in
    one burst make B send the stream's unacknowledged frames again once, not a hundred times."""
    async with attacked(tmp_sock_dir, engines) as (b, c, eb, ec, rb, rc, mb, mc, attacker):
        await _unacked_tokens_to_attacker(b, eb, "resend-me")
        before = _token_frames_to_attacker(b)
        attacker.writer.write(_resend_request("resend-me") * 100)
        assert await attacker.pong(5)  # every request handled
        again = _token_frames_to_attacker(b) - before
        assert UNACKED_FRAMES <= again < 10 * UNACKED_FRAMES  # once (a stall past 50 ms may allow a second)
        assert b.sessions["A/a1"].is_up
        await legit_transfer(b, eb, ec, rb, rc, mb, mc)
        c_never_dropped(b, c)


async def test_a_peer_that_asks_for_resends_and_never_reads_is_cut_alone(tmp_sock_dir, engines):
    """The attacker repeats TOKENS_ACK {resend} for 8 streams and reads nothing: what B queues
    for it is bounded by limits.control_buffer_bytes, then that control connection alone is
    failed (PEER_NOT_READING); B's memory stays bounded and C's transfer beside it is
    byte-identical. (Each stream's resends back off while unacknowledged, so it takes several
    streams' backlogs to fill the socket buffers and the 4 MiB quickly.)"""
    async with attacked(tmp_sock_dir, engines, "[limits]\ncontrol_buffer_bytes = 4194304\n") as (
            b, c, eb, ec, rb, rc, mb, mc, attacker):
        for i in range(8):
            await _unacked_tokens_to_attacker(b, eb, f"never-read-{i}")
        before = rss()
        ask = b"".join(_resend_request(f"never-read-{i}") for i in range(8))
        attacker.reader._transport.pause_reading()  # reads nothing from here on
        legit = asyncio.create_task(legit_transfer(b, eb, ec, rb, rc, mb, mc))
        try:
            # Unbounded, 2000 requests would queue 2000 x 5.2 MB at B.
            for _ in range(1000):
                if attacker.writer.is_closing() or metric(b, "pddwire_errors_total", code="PEER_NOT_READING"):
                    break
                attacker.writer.write(ask * 10)
                await asyncio.sleep(0.01)
            await until(lambda: metric(b, "pddwire_errors_total", code="PEER_NOT_READING") >= 1,
                        what="B fails the connection that does not read")
            assert rss() - before < 256 * MiB
            await legit
        finally:
            legit.cancel()
        await until(lambda: not b.sessions["A/a1"].is_up, what="the attacker's session down")
        assert metric(b, "pddwire_errors_total", code="PEER_NOT_READING") == 1
        c_never_dropped(b, c)


async def test_tokens_that_come_before_their_owner_are_held_for_it_then_dropped(tmp_sock_dir, engines):
    """The legitimate side of holding: C's tokens may outrun B's post; they wait (per peer, for
    transfer.unposted_wait_s) and come with the post. Those nobody takes are dropped, counted."""
    async with attacked(tmp_sock_dir, engines) as (b, c, eb, ec, rb, rc, mb, mc, attacker):
        await ec.send_tokens("early", "B", [1, 2])
        await ec.send_tokens("early", "B", [3])
        await ec.send_tokens("nobody", "B", [9])
        attacker.send(FrameType.TOKENS, m.Tokens("early", 0, [666]))  # A's copy: A is not tied to the post
        assert await attacker.pong(6)
        await until(lambda: "early" in b.sessions["C/c1"].tokens.held, what="C's tokens held at B")
        await eb.post_recv("early", [rb.blocks(0, 8)], from_site="C")
        got = [await eb.wait_tokens("early", timeout=10) for _ in range(2)]
        assert [(e.peer, e.seq, e.tokens) for e in got] == [("C/c1", 0, [1, 2]), ("C/c1", 2, [3])]
        # Nobody takes the others: after unposted_wait_s (2 s here) they are dropped, and counted.
        await until(lambda: metric(b, "pddwire_tokens_dropped_total", peer="C/c1", reason="unowned") == 1
                    and metric(b, "pddwire_tokens_dropped_total", peer="A/a1", reason="unowned") == 1,
                    timeout=30, what="held tokens dropped once nobody took them")
        assert eb.take("early", kinds=(p.TokensReceived,)) == []
        c_never_dropped(b, c)


async def test_a_handoff_relay_squatted_first_by_another_peer_does_not_stand_in(tmp_sock_dir, engines):
    """A relays handoff tokens for a guessable request id before C's relay decoder does; B's main
    decoder names C, gets C's relay (the model's tokens, checked by MdSim) and takes over."""
    from pdd_tools.sim import MdSim, RldSim, check_stream

    async with attacked(tmp_sock_dir, engines) as (b, c, eb, ec, rb, rc, mb, mc, attacker):
        attacker.send(FrameType.TOKENS, m.Tokens("h1", 0, [7] * 100, True))
        assert await attacker.pong(7)
        R = await engines.connect(tmp_sock_dir / "c1.sock", "rld")
        await R.set_load(0.95)
        rld = RldSim(R, "h1", "B", n_tokens=200, step_s=0.002, hold_at=80)
        rt = asyncio.create_task(rld.run(30))
        await asyncio.wait_for(rld.held.wait(), 10)  # C relayed 80 tokens before MD registers
        await eb.post_recv("h1", [rb.blocks(0, 8)], from_site="C")
        md = MdSim(eb, "h1", "C", n_tokens=200)
        await md.start()
        mt = asyncio.create_task(md.run(30))
        await ec.send_kv("h1", [rc.blocks(0, 8)], to=["B"])
        rld.release_hold()
        await asyncio.gather(rt, mt)
        check_stream("h1", 200, rld.emitted, md.emitted)
        assert md.done.owner == "MD" and await same_bytes(mb.buf, mc.buf)
        c_never_dropped(b, c)


async def test_one_peers_expired_sends_do_not_push_out_anothers_given_up_request(tmp_sock_dir, engines):
    """C's KV for "g" waited unposted past its lease: B remembers that site C gave "g" up, so a
    receive B's engine posts for it later fails at once instead of holding its blocks for its
    ttl. The attacker then lets more unposted sends expire than B remembers in all
    (4 x max_transfers): each site has its own share, so C's "g" is still remembered."""
    async with attacked(tmp_sock_dir, engines) as (b, c, eb, ec, rb, rc, mb, mc, attacker):
        await ec.send_kv("g", [rc.blocks(0, 1)], to=["B"], lease_s=0.2)
        ev = await ec.wait("g", timeout=30)
        assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.NOT_POSTED, ev
        begin = dict(total_bytes=MiB, chunk_bytes=MiB, n_chunks=1, block_bytes=MiB, n_blocks=1, post_wait_ms=1)
        tid, batch = 1, MAX_TRANSFERS - 2
        for _ in range(-(-(4 * MAX_TRANSFERS + 1) // batch)):
            for _i in range(batch):
                attacker.send(FrameType.KV_BEGIN, m.KvBegin(f"x{tid}", **begin), transfer_id=tid)
                tid += 1
            got = 0
            async with asyncio.timeout(30):
                while got < batch:
                    attacker.send(FrameType.PING, m.Ping(nonce=tid, sent_ns=1))
                    seen = await attacker.until(FrameType.PONG)
                    got += sum(1 for f in seen if f is not None and f[0] == FrameType.KV_REJECT
                               and f[1].code == ErrorCode.NOT_POSTED)
                    await asyncio.sleep(0.01)
        with pytest.raises(EngineRequestError) as exc:
            await eb.post_recv("g", [rb.blocks(0, 1)], from_site="C")
        assert exc.value.code == ErrorCode.NOT_POSTED, exc.value
        c_never_dropped(b, c)
