"""Offers (proto/transfer.md §16): a receive posted first is offered to its sender, whose transfer
then moves without the KV_ACCEPT round trip. Real agents, real sockets and memory; the hostile
and old peers are raw peers written from proto/ (support/raw_peer.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest

from conftest import engine_pair, fill_random, metric, same_bytes, until
from pdd_wire.engine import protocol as p
from pdd_wire.errors import ErrorCode
from pdd_wire.session import receiving
from pdd_wire.transport.tcp import KIND_BULK
from pdd_wire.wire import FrameReader, FrameType, Lane
from pdd_wire.wire import messages as m
from support.agents import relayed_toml, run_agents, two_site_toml
from support.raw_peer import RawPeer, hello

BLOCK = 64 << 10
CHUNK = 128 << 10  # 2 blocks a chunk: a transfer of n blocks has ceil(n / 2) chunks


def _toml(tmp, **kw) -> dict:
    return two_site_toml(tmp, chunk=CHUNK, **kw)


def _chunked(tomls: dict) -> dict:
    """relayed_toml's agents with this module's chunk size."""
    return {k: (v.replace(f"chunk_bytes = {4 << 20}", f"chunk_bytes = {CHUNK}") if k in "AB" else v)
            for k, v in tomls.items()}


def _transfer(tomls: dict, line: str, sites: str = "AB") -> dict:
    return {k: (v.replace("[transfer]\n", f"[transfer]\n{line}\n") if k in sites else v) for k, v in tomls.items()}


async def _engines(engines, tmp, blocks: int = 32):
    return await engine_pair(engines, tmp, blocks * BLOCK, BLOCK)


def offers_at(agent, peer: str = "B/b1") -> dict:
    """The offers ``agent`` holds from ``peer`` (its sending side's table)."""
    return agent.sessions[peer].sender.offers


async def test_a_posted_receive_moves_without_kv_accept_and_lands_byte_identical(tmp_sock_dir, engines):
    async with run_agents(_toml(tmp_sock_dir)) as ag:
        ea, eb, src, dst, ra, rb = await _engines(engines, tmp_sock_dir)
        await eb.post_recv("r1", [rb.blocks(4, 7)], from_site="A")  # 7 blocks: 4 chunks, the last one short
        await until(lambda: "r1" in offers_at(ag["A"]), what="B's KV_OFFER at A")
        sender = ag["A"].sessions["B/b1"].sender
        accepts, on_accept = [], sender.on_accept
        sender.on_accept = lambda tid: (accepts.append(tid), on_accept(tid))
        await ea.send_kv("r1", [ra.blocks(0, 7)], to=["B"])
        got = await eb.wait("r1", timeout=10)
        assert isinstance(got, p.KvReceived) and got.bytes == 7 * BLOCK
        assert isinstance(await ea.wait("r1", timeout=10), p.KvSent)
        assert await same_bytes(dst.buf[4 * BLOCK:11 * BLOCK], src.buf[:7 * BLOCK])
        assert not any(dst.buf[:4 * BLOCK]) and not any(dst.buf[11 * BLOCK:])
        assert metric(ag["A"], "pddwire_kv_offers_total", peer="B/b1", event="taken") == 1
        assert metric(ag["B"], "pddwire_kv_offers_total", peer="A/a1", event="sent") == 1
        assert accepts == []  # it moved on the offer: no KV_ACCEPT came, none was waited for
        assert metric(ag["A"], "pddwire_chunks_total", peer="B/b1", direction="tx") == 4  # KV_DONE acked the last
        assert not offers_at(ag["A"]) and not ag["B"].sessions["A/a1"].receiver.offered


async def test_send_before_post_still_waits_for_its_post(tmp_sock_dir, engines):
    async with run_agents(_toml(tmp_sock_dir)) as ag:
        ea, eb, src, dst, ra, rb = await _engines(engines, tmp_sock_dir)
        await ea.send_kv("late", [ra.blocks(0, 3)], to=["B"], lease_s=10)
        await until(lambda: ag["B"].kv.unposted, what="the KV_BEGIN waiting for its post")
        await eb.post_recv("late", [rb.blocks(0, 3)], from_site="A")
        assert isinstance(await eb.wait("late", timeout=10), p.KvReceived)
        assert await same_bytes(dst.buf[:3 * BLOCK], src.buf[:3 * BLOCK])
        assert metric(ag["A"], "pddwire_kv_offers_total", peer="B/b1", event="taken") == 0
        assert metric(ag["B"], "pddwire_kv_offers_total", peer="A/a1", event="sent") == 0  # nothing left to offer


async def test_a_chunk_that_outruns_its_kv_begin_is_held_until_it_is_handled(tmp_sock_dir, engines):
    """The control connection is slower than a bulk one: B handles the KV_BEGIN 300 ms late, the
    chunks are there first. They are held (nothing written before the match), then land."""
    async with run_agents(_toml(tmp_sock_dir)) as ag:
        ea, eb, src, dst, ra, rb = await _engines(engines, tmp_sock_dir)
        rx = ag["B"].sessions["A/a1"].receiver
        on_begin = rx.on_begin
        held = asyncio.Event()

        def late_begin(tid, begin, conn=None):
            async def later():
                await until(lambda: rx.gate.holding, what="a chunk held for its KV_BEGIN")
                assert not any(dst.buf[:]), "written before its KV_BEGIN was handled"
                held.set()
                on_begin(tid, begin, conn)
            asyncio.get_running_loop().create_task(later())

        rx.on_begin = late_begin
        await eb.post_recv("race", [rb.blocks(0, 8)], from_site="A")
        await until(lambda: "race" in offers_at(ag["A"]), what="the offer at A")
        await ea.send_kv("race", [ra.blocks(0, 8)], to=["B"])
        assert isinstance(await eb.wait("race", timeout=10), p.KvReceived)
        assert held.is_set()
        assert await same_bytes(dst.buf[:8 * BLOCK], src.buf[:8 * BLOCK])
        assert metric(ag["B"], "pddwire_chunks_held_total", peer="A/a1", outcome="held") >= 1
        assert metric(ag["B"], "pddwire_chunks_held_total", peer="A/a1", outcome="expired") == 0
        assert metric(ag["A"], "pddwire_retransmits_total", peer="B/b1", reason="ack_timeout") == 0


async def test_over_a_delayed_link_both_orders_land(tmp_sock_dir, engines):
    async with relayed_toml(tmp_sock_dir) as (relay, tomls):
        relay.set_delay(15)
        async with run_agents(_chunked(tomls)) as ag:
            ea, eb, src, dst, ra, rb = await _engines(engines, tmp_sock_dir)
            await eb.post_recv("first", [rb.blocks(0, 16)], from_site="A")
            await until(lambda: "first" in offers_at(ag["A"]), what="the offer across the delay")
            await ea.send_kv("first", [ra.blocks(0, 16)], to=["B"])
            await ea.send_kv("second", [ra.blocks(16, 16)], to=["B"], lease_s=10)
            await eb.post_recv("second", [rb.blocks(16, 16)], from_site="A")
            for rid in ("first", "second"):
                assert isinstance(await eb.wait(rid, timeout=10), p.KvReceived)
                assert isinstance(await ea.wait(rid, timeout=10), p.KvSent)
            assert await same_bytes(dst.buf, src.buf)
            assert metric(ag["A"], "pddwire_kv_offers_total", peer="B/b1", event="taken") >= 1


async def test_offers_are_withdrawn_when_their_post_goes(tmp_sock_dir, engines):
    tomls = _transfer(_toml(tmp_sock_dir), "unposted_wait_s = 0.3")
    async with run_agents(_chunked(tomls)) as ag:
        ea, eb, src, dst, ra, rb = await _engines(engines, tmp_sock_dir)
        # Aborted: withdrawn; a send that comes after goes the normal way and waits for a post.
        await eb.post_recv("ab", [rb.blocks(0, 2)], from_site="A")
        await until(lambda: "ab" in offers_at(ag["A"]))
        await eb.abort("ab")
        await until(lambda: "ab" not in offers_at(ag["A"]), what="KV_WITHDRAW at A")
        await ea.send_kv("ab", [ra.blocks(0, 2)], to=["B"])
        ev = await ea.wait("ab", timeout=10)
        assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.NOT_POSTED
        # Expired: withdrawn with the post's ttl (its engine told).
        await eb.post_recv("ttl", [rb.blocks(0, 2)], from_site="A", ttl_s=0.2)
        ev = await eb.wait("ttl", timeout=10)
        assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.TRANSFER_TIMEOUT
        await until(lambda: "ttl" not in offers_at(ag["A"]), what="the expired post's offer withdrawn")
        # Sizes that do not fit the offer: the send goes the normal way, refused by name.
        await eb.post_recv("mm", [rb.blocks(0, 2)], from_site="A")
        await until(lambda: "mm" in offers_at(ag["A"]))
        await ea.send_kv("mm", [ra.blocks(0, 3)], to=["B"])
        for e in (ea, eb):
            ev = await e.wait("mm", timeout=10)
            assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.SIZE_MISMATCH, ev
        assert metric(ag["A"], "pddwire_kv_offers_total", peer="B/b1", event="unfit") == 1
        assert not any(dst.buf[:])


async def test_a_withdrawal_racing_the_send_writes_nothing(tmp_sock_dir, engines):
    """The abort's KV_WITHDRAW and the send cross: the offered KV_BEGIN finds no post, waits,
    and is refused; its early chunks are dropped without a byte written."""
    async with relayed_toml(tmp_sock_dir, transfer="unposted_wait_s = 0.3") as (relay, tomls):
        async with run_agents(_chunked(tomls)) as ag:
            ea, eb, src, dst, ra, rb = await _engines(engines, tmp_sock_dir)
            await eb.post_recv("x", [rb.blocks(0, 4)], from_site="A")
            await until(lambda: "x" in offers_at(ag["A"]))
            relay.pause()  # the KV_WITHDRAW and the offered KV_BEGIN cross in the link
            await asyncio.gather(eb.abort("x"), ea.send_kv("x", [ra.blocks(0, 4)], to=["B"]))
            relay.resume()
            ev = await ea.wait("x", timeout=10)
            # Refused unposted, or ended by the abort's REQUEST_ABORT first (abort.v1): either way
            # the sender's engine is told, and B wrote nothing.
            assert isinstance(ev, p.TransferFailed) and ev.code in (ErrorCode.NOT_POSTED,
                                                                    ErrorCode.TRANSFER_CANCELLED), ev
            assert metric(ag["A"], "pddwire_kv_offers_total", peer="B/b1", event="taken") == 1
            assert not any(dst.buf[:])
            assert not eb.take("x", kinds=(p.KvReceived, p.TransferFailed))  # its abort ended it


async def test_offers_survive_a_reconnect_and_an_unconfirmed_transfer_is_announced_again(tmp_sock_dir, engines):
    async with relayed_toml(tmp_sock_dir) as (relay, tomls):
        async with run_agents(_chunked(tomls)) as ag:
            ea, eb, src, dst, ra, rb = await _engines(engines, tmp_sock_dir)
            # An offer standing when the link drops is sent again after the reconnect.
            await eb.post_recv("o1", [rb.blocks(0, 4)], from_site="A")
            await until(lambda: "o1" in offers_at(ag["A"]))
            relay.abort_all()  # A forgets it with the connection; B sends it again on the next one
            await until(lambda: metric(ag["B"], "pddwire_kv_offers_total", peer="A/a1", event="sent") == 2,
                        what="the offer sent again after the reconnect")
            await until(lambda: "o1" in offers_at(ag["A"]))
            await ea.send_kv("o1", [ra.blocks(0, 4)], to=["B"])
            assert isinstance(await eb.wait("o1", timeout=10), p.KvReceived)
            # A transfer that took its offer and whose KV_BEGIN and chunks are lost with the link
            # (nothing came back): ANNOUNCED again, KV_BEGIN sent again on the new connection.
            await eb.post_recv("o2", [rb.blocks(4, 8)], from_site="A")
            await until(lambda: "o2" in offers_at(ag["A"]))
            relay.pause()
            await ea.send_kv("o2", [ra.blocks(4, 8)], to=["B"])
            relay.abort_all()
            relay.resume()
            assert isinstance(await eb.wait("o2", timeout=15), p.KvReceived)
            assert isinstance(await ea.wait("o2", timeout=10), p.KvSent)
            assert await same_bytes(dst.buf[:12 * BLOCK], src.buf[:12 * BLOCK])
            assert metric(ag["A"], "pddwire_kv_offers_total", peer="B/b1", event="taken") == 2


async def test_without_the_capability_nothing_is_offered_and_transfers_go_as_before(tmp_sock_dir, engines):
    """B runs with transfer.offers = false (as an agent before offer.v1 would): it advertises no
    offer.v1, so A offers it nothing and B offers A nothing; both directions work."""
    tomls = _transfer(_toml(tmp_sock_dir), "offers = false", sites="B")
    async with run_agents(_chunked(tomls)) as ag:
        assert "offer.v1" not in ag["A"].sessions["B/b1"].remote_caps
        assert "offer.v1" in ag["B"].sessions["A/a1"].remote_caps
        ea, eb, src, dst, ra, rb = await _engines(engines, tmp_sock_dir)
        await eb.post_recv("b", [rb.blocks(0, 4)], from_site="A")
        await ea.post_recv("a", [ra.blocks(8, 4)], from_site="B")
        await ea.send_kv("b", [ra.blocks(0, 4)], to=["B"])
        await eb.send_kv("a", [rb.blocks(16, 4)], to=["A"])
        assert isinstance(await eb.wait("b", timeout=10), p.KvReceived)
        assert isinstance(await ea.wait("a", timeout=10), p.KvReceived)
        for agent in ag.values():
            assert metric(agent, "pddwire_kv_offers_total", peer=next(iter(agent.sessions)), event="sent") == 0
            assert not next(iter(agent.sessions.values())).sender.offers


@contextlib.asynccontextmanager
async def _agent_b(tmp, extra: str = ""):
    tomls = _transfer(two_site_toml(tmp, plaintext=True, chunk=CHUNK), f"max_transfers = 8\n{extra}")
    async with run_agents(tomls, sites=("B",), wait_up=False) as ag:
        yield ag["B"]


async def test_an_old_peer_is_offered_nothing(tmp_sock_dir, engines):
    async with _agent_b(tmp_sock_dir) as b:
        peer, _ = await hello(b.wan_address[1])  # kv.v1, tokens.v1, abort.v1: no offer.v1
        eb = await engines.connect(tmp_sock_dir / "B.sock", "decode")
        rb = await eb.register(engines.memory(4 * BLOCK), block_bytes=BLOCK)
        await eb.post_recv("old", [rb.blocks(0, 2)], from_site="A")
        peer.send(FrameType.PING, m.Ping(nonce=5, sent_ns=1))
        seen = await peer.until(FrameType.PONG)
        assert FrameType.KV_OFFER not in [f[0] for f in seen if f], seen
        assert metric(b, "pddwire_kv_offers_total", peer="A/a1", event="sent") == 0
        peer.close()


async def test_an_offer_from_a_peer_without_the_capability_is_ignored(tmp_sock_dir, engines):
    """A KV_BEGIN ``offered`` goes only to a peer that advertised offer.v1 (it reads the field):
    a KV_OFFER from one that did not is ignored and counted, and its send goes the normal way."""
    async with _agent_b(tmp_sock_dir) as b:
        peer, _ = await hello(b.wan_address[1])  # no offer.v1
        eb = await engines.connect(tmp_sock_dir / "B.sock", "prefill")
        rb = await eb.register(engines.memory(4 * BLOCK), block_bytes=BLOCK)
        peer.send(FrameType.KV_OFFER, m.KvOffer("unasked", 2 * BLOCK, BLOCK, 60_000))
        assert await peer.pong(5)
        await eb.send_kv("unasked", [rb.blocks(0, 2)], to=["A"])
        seen = await peer.until(FrameType.KV_BEGIN)
        assert seen[-1] is not None and seen[-1][1].offered is False, seen
        assert metric(b, "pddwire_kv_offers_total", peer="A/a1", event="ignored") == 1
        assert metric(b, "pddwire_kv_offers_total", peer="A/a1", event="taken") == 0
        peer.close()


async def test_a_hostile_peers_offers_and_early_chunks_reach_nothing_of_anyone_else(tmp_sock_dir, engines,
                                                                                   monkeypatch):
    monkeypatch.setattr(receiving, "PARK_S", 0.2)
    async with _agent_b(tmp_sock_dir, "unposted_wait_s = 0.3") as b:
        peer, welcome = await hello(b.wan_address[1], capabilities=("kv.v1", "tokens.v1", "offer.v1"))
        bulk = await RawPeer.dial(b.wan_address[1], KIND_BULK)
        bulk.frames = FrameReader(max_body=1 << 16, max_payload=1 << 20)  # it reads B's chunks
        bulk.send(FrameType.BULK_HELLO, m.BulkHello(session=welcome.session, stream=0, site="A", node="a1"))
        assert (await bulk.next())[0] == FrameType.BULK_WELCOME
        keep = asyncio.create_task(peer.keepalive())
        eb = await engines.connect(tmp_sock_dir / "B.sock", "decode")
        mem = engines.memory(16 * BLOCK)
        await fill_random(mem)
        rb = await eb.register(mem, block_bytes=BLOCK)
        try:
            # A flood of offers: B keeps at most transfer.max_transfers of them, the oldest go.
            for i in range(40):
                peer.send(FrameType.KV_OFFER, m.KvOffer(f"junk-{i}", 2 * BLOCK, BLOCK, 60_000))
            # An offer that does not fit B's send: B's transfer goes the normal way.
            peer.send(FrameType.KV_OFFER, m.KvOffer("s-unfit", 3 * BLOCK, BLOCK, 60_000))
            # One that fits: B's transfer moves at once (its chunks come without KV_ACCEPT).
            peer.send(FrameType.KV_OFFER, m.KvOffer("s-fit", 2 * BLOCK, BLOCK, 60_000))
            assert await peer.pong(1)
            sess = b.sessions["A/a1"]
            assert len(sess.sender.offers) == 8
            assert metric(b, "pddwire_kv_offers_total", peer="A/a1", event="dropped") == 34
            await eb.send_kv("s-unfit", [rb.blocks(0, 2)], to=["A"], deadline_s=0.5)
            await eb.send_kv("s-fit", [rb.blocks(2, 2)], to=["A"], deadline_s=0.5)
            begins = {}
            while len(begins) < 2:
                t, body, h = await peer.next()
                if t == FrameType.KV_BEGIN:
                    begins[body.request_id] = body.offered
            assert begins == {"s-unfit": False, "s-fit": True}
            t, _, h = await bulk.next()  # s-fit's chunk, with no KV_ACCEPT sent
            assert t == FrameType.KV_CHUNK
            # Chunks for a transfer it never announces: held briefly, then dropped; nothing written.
            before = bytes(mem.buf)
            await eb.post_recv("p-other", [rb.blocks(8, 2)], from_site="Z")  # posted for another site
            bulk.send(FrameType.KV_CHUNK, b"", lane=Lane.BULK, transfer_id=900, seq=0, payload=[os.urandom(2 * BLOCK)])
            await until(lambda: metric(b, "pddwire_chunks_held_total", peer="A/a1", outcome="expired") == 1)
            # Its KV_BEGIN taking an offer it never got, for a post of another site: refused,
            # its chunk (sent first) dropped; B's memory untouched.
            bulk.send(FrameType.KV_CHUNK, b"", lane=Lane.BULK, transfer_id=901, seq=0, payload=[os.urandom(2 * BLOCK)])
            peer.send(FrameType.KV_BEGIN, m.KvBegin("p-other", 2 * BLOCK, CHUNK, 1, BLOCK, 2, 1000, offered=True),
                      transfer_id=901)
            seen = await peer.until(FrameType.KV_REJECT)
            assert seen[-1][1].code == ErrorCode.NOT_POSTED and seen[-1][1].request_id == "p-other"
            assert bytes(mem.buf) == before
            # The bulk connection still carries what is announced and matched.
            await eb.post_recv("p-ok", [rb.blocks(12, 2)], from_site="A")
            good = os.urandom(2 * BLOCK)
            peer.send(FrameType.KV_BEGIN, m.KvBegin("p-ok", 2 * BLOCK, CHUNK, 1, BLOCK, 2, 5000, offered=True),
                      transfer_id=902)
            bulk.send(FrameType.KV_CHUNK, b"", lane=Lane.BULK, transfer_id=902, seq=0, payload=[good])
            assert isinstance(await eb.wait("p-ok", timeout=10), p.KvReceived)
            assert bytes(mem.buf[12 * BLOCK:14 * BLOCK]) == good
            assert bytes(mem.buf[:12 * BLOCK]) == before[:12 * BLOCK]
        finally:
            keep.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keep
            peer.close()
            bulk.close()


@pytest.mark.parametrize("n_blocks", [1, 5])
async def test_an_offered_transfer_accepted_late_sends_its_chunks_again(tmp_sock_dir, engines, n_blocks):
    """Its offer still stood at A, but its post was gone at B (its region deregistered; the
    withdrawal still under way): the offered KV_BEGIN waits for a post, its early chunks are
    dropped; posted again, B matches it late and says KV_ACCEPT, A sends every chunk again."""
    async with relayed_toml(tmp_sock_dir) as (relay, tomls):
        async with run_agents(_chunked(tomls)) as ag:
            ea, eb, src, dst, ra, rb = await _engines(engines, tmp_sock_dir)
            scratch = await eb.register(engines.memory(8 * BLOCK), block_bytes=BLOCK)
            await eb.post_recv("re", [scratch.blocks(0, n_blocks)], from_site="A")
            await until(lambda: "re" in offers_at(ag["A"]))
            relay.pause()  # the KV_WITHDRAW and the offered KV_BEGIN cross in the link
            await eb.deregister(scratch)  # the post goes with its region
            await ea.send_kv("re", [ra.blocks(0, n_blocks)], to=["B"], lease_s=10)
            relay.resume()
            await until(lambda: ag["B"].kv.unposted, what="the offered KV_BEGIN waiting for a post")
            assert metric(ag["A"], "pddwire_kv_offers_total", peer="B/b1", event="taken") == 1
            await eb.post_recv("re", [rb.blocks(0, n_blocks)], from_site="A")
            assert isinstance(await eb.wait("re", timeout=10), p.KvReceived)
            assert isinstance(await ea.wait("re", timeout=10), p.KvSent)
            assert await same_bytes(dst.buf[:n_blocks * BLOCK], src.buf[:n_blocks * BLOCK])


async def test_an_offer_taken_after_the_prefix_query_ships_only_the_suffix(tmp_sock_dir, engines):
    """With block hashes the sender asks first (PREFIX_QUERY), then announces the suffix taking
    the offer: the offer's sizes are the whole post's, the KV_BEGIN's the suffix's."""
    from pdd_wire.engine.hashes import chain_hashes

    async with run_agents(_toml(tmp_sock_dir)) as ag:
        ea, eb, src, dst, ra, rb = await _engines(engines, tmp_sock_dir)
        hashes = chain_hashes(list(range(8 * 16)), 16, model="offers")
        await eb.kv_stored([rb.blocks(0, 5)], hashes[:5])  # MD's cache holds the first 5 blocks
        await eb.post_recv("sfx", [rb.blocks(16, 8)], from_site="A")
        await until(lambda: "sfx" in offers_at(ag["A"]))
        await ea.send_kv("sfx", [ra.blocks(0, 8)], to=["B"], block_hashes=hashes)
        ev = await eb.wait("sfx", timeout=10)
        assert isinstance(ev, p.KvReceived) and ev.reused_blocks == 5 and ev.bytes == 3 * BLOCK
        assert await same_bytes(dst.buf[21 * BLOCK:24 * BLOCK], src.buf[5 * BLOCK:8 * BLOCK])
        assert metric(ag["A"], "pddwire_kv_offers_total", peer="B/b1", event="taken") == 1


async def test_the_begin_gate_holds_only_what_may_still_be_announced(monkeypatch):
    """The gate alone (any thread asks, the loop answers): a chunk of a transfer whose KV_BEGIN
    was handled is never held; one held is woken once, by its KV_BEGIN or by the bound."""
    monkeypatch.setattr(receiving, "PARK_S", 0.05)
    counts: list[str] = []
    gate = receiving.BeginGate(keep=2, count=counts.append)
    woken: list[int] = []
    assert not gate.hold(1, lambda: woken.append(1))  # not opened: the peer sends nothing early
    gate.open(asyncio.get_running_loop())
    assert gate.hold(1, lambda: woken.append(1)) and gate.holding == 1
    gate.begun(1)
    assert woken == [1] and gate.holding == 0
    assert not gate.hold(1, lambda: woken.append(99))  # its KV_BEGIN was handled: drop it as before
    assert gate.hold(2, lambda: woken.append(2))
    await until(lambda: woken == [1, 2], what="the bound waking a chunk no KV_BEGIN follows")
    assert counts == ["held", "held", "expired"]
    gate.begun(2)
    gate.begun(3)
    gate.begun(4)  # keep = 2: transfer 2 is forgotten again
    assert gate.hold(2, lambda: woken.append(22)) and not gate.hold(4, lambda: None)
    monkeypatch.setattr(receiving, "MAX_PARKED", 2)
    assert gate.hold(5, lambda: woken.append(5)) and not gate.hold(6, lambda: None)  # bounded
    gate.clear()  # the peer restarted: everything held goes on (to be dropped), ids start again
    assert sorted(woken[2:]) == [5, 22] and gate.holding == 0 and gate.hold(4, lambda: None)
