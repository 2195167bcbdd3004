"""Keyed UCX tags (capability ``ucx-keys.v1``): the transfer id bits of every tag are a keyed
permutation of the transfer id, under the key of the agent that receives the chunk, so that
whatever reaches a worker without being its peer cannot pre-seed the tags of transfers to come.

The permutation itself is checked as a pure function; the rest with agents in this process over
UCX (shared memory), with an "attacker" UCX worker of its own that makes an endpoint to the
receiving agent's worker (as in tests/test_ucx_hardening.py)."""

from __future__ import annotations

import asyncio
import random

import pytest

from conftest import fill_random, metric, same_bytes, until, wait_rx_chunks
from pdd_wire.engine import protocol as p
from pdd_wire.session.peer import PeerSession
from pdd_wire.transport import ucx
from pdd_wire.wire.handshake import CAPABILITIES
from support.agents import cluster_toml, run_agents
from test_ucx_hardening import Attacker, Said, bare_pair, wait_ucx

MiB = 1 << 20
NODES = [("A", "a1"), ("A", "a2")]   # a1 dials and sends, a2 receives, over UCX
CAP = "ucx-keys.v1"


# -- the permutation ---------------------------------------------------------------------------
def test_the_permutation_is_a_bijection_that_differs_per_key_and_direction():
    rnd = random.Random(5)
    key = rnd.getrandbits(64) | 1
    k0, k1, other = ucx.TagKey(key, 0), ucx.TagKey(key, 1), ucx.TagKey(key ^ 2, 0)
    ids = list(range(1, 1 << 14)) + [rnd.randrange(1 << 40) for _ in range(2000)] + [0, ucx.MAX_TRANSFER_ID]
    ids = sorted(set(ids))
    images = [k0(t) for t in ids]
    assert len(set(images)) == len(ids)                       # injective on the sample
    assert all(0 <= w <= ucx.MAX_TRANSFER_ID for w in images)  # and stays in 40 bits
    assert [k0.invert(w) for w in images] == ids               # the inverse undoes it
    first = range(1, 1001)                                     # the ids an agent uses first
    assert sum(k0(t) == t for t in first) <= 1                 # not the identity
    assert sum(k0(t) == k1(t) for t in first) <= 1             # the direction matters
    assert sum(k0(t) == other(t) for t in first) <= 1          # so does every key bit
    # consecutive ids do not give consecutive (or nearby) images
    assert sum(abs(k0(t + 1) - k0(t)) < 1 << 30 for t in first) < 20
    assert ucx.TagKey(key, 0)(77) == k0(77)                    # deterministic: both agents agree
    for bad in (0, 1 << 64, -1):
        with pytest.raises(ValueError):
            ucx.TagKey(bad, 0)
    with pytest.raises(ValueError):
        k0(1 << 40)
    assert str(key) not in repr(k0) and hex(key) not in repr(k0)


def test_the_permutation_is_the_one_handshake_md_describes():
    """proto/handshake.md "UCX tag keys", written again from the text, and its example."""
    import hashlib

    def spec(key: int, d: int, tid: int) -> int:
        ks = [hashlib.blake2b(bytes([d, r]), key=key.to_bytes(8, "little"), person=b"pdd-ucx-tags.v1",
                              digest_size=32).digest() for r in range(4)]
        left, right = tid >> 20, tid & 0xFFFFF
        for r in range(4):
            f = int.from_bytes(hashlib.blake2b(right.to_bytes(3, "little"), key=ks[r], digest_size=4).digest(),
                               "little") & 0xFFFFF
            left, right = right, left ^ f
        return left << 20 | right

    assert ucx.TagKey(0x123456789ABCDEF1, 1)(1) == spec(0x123456789ABCDEF1, 1, 1) == 0x128C5C796F
    rnd = random.Random(9)
    for _ in range(200):
        key, d, tid = rnd.getrandbits(64) or 1, rnd.randrange(2), rnd.randrange(1 << 40)
        assert ucx.TagKey(key, d)(tid) == spec(key, d, tid)


def test_the_spec_details_an_independent_implementation_needs():
    """What handshake.md now states exactly: the personalization is the 15 ASCII bytes zero-padded
    to 16; the round-key data is the two bytes d, r; F_r is a BLAKE2b of digest_size 4 (not the
    first 4 bytes of a 64-byte digest), read little-endian, low 20 bits; the inverse runs the
    rounds backwards."""
    import hashlib

    key, d = 0x123456789ABCDEF1, 1
    padded = b"pdd-ucx-tags.v1".ljust(16, b"\0")
    ks = [hashlib.blake2b(bytes([d, r]), key=key.to_bytes(8, "little"), person=padded, digest_size=32).digest()
          for r in range(4)]

    def f(r: int, x: int) -> int:
        h = hashlib.blake2b(x.to_bytes(3, "little"), key=ks[r], digest_size=4).digest()
        return int.from_bytes(h, "little") & 0xFFFFF

    def forward(tid: int) -> int:
        left, right = tid >> 20, tid & 0xFFFFF
        for r in range(4):
            left, right = right, left ^ f(r, right)
        return left << 20 | right

    def inverse(wire: int) -> int:
        left, right = wire >> 20, wire & 0xFFFFF
        for r in (3, 2, 1, 0):
            left, right = right ^ f(r, left), left
        return left << 20 | right

    k = ucx.TagKey(key, d)
    assert forward(1) == k(1) == 0x128C5C796F and inverse(0x128C5C796F) == k.invert(0x128C5C796F) == 1
    x = 0xABCDE   # a truncated 64-byte digest would give another F (BLAKE2b's output depends on its length)
    cut = int.from_bytes(hashlib.blake2b(x.to_bytes(3, "little"), key=ks[0]).digest()[:4], "little") & 0xFFFFF
    assert cut != f(0, x)
    rnd = random.Random(3)
    for tid in [rnd.randrange(1 << 40) for _ in range(100)]:
        assert k.invert(forward(tid)) == inverse(k(tid)) == tid


def test_tags_of_one_transfer_share_their_prefix_and_keep_the_chunk_index():
    k = ucx.TagKey(0x1234_5678_9ABC_DEF1, 1)
    for tid in (1, 2, 999_999, ucx.MAX_TRANSFER_ID):
        tags = [ucx.tag_for(1, k(tid), i) for i in (0, 1, 5, ucx.MAX_INDEX)]
        assert {t >> ucx.INDEX_BITS for t in tags} == {ucx.transfer_prefix(1, k(tid))}
        assert [ucx.tag_parts(t) for t in tags] == [(1, k(tid), i) for i in (0, 1, 5, ucx.MAX_INDEX)]


def test_the_capability_is_advertised():
    assert CAP in CAPABILITIES


# -- helpers for agents over UCX ---------------------------------------------------------------
async def up_over_ucx(ag) -> None:
    await wait_ucx(ag["a1"], "A/a2")
    await wait_ucx(ag["a2"], "A/a1")


def record_tags(path) -> dict[str, list[int]]:
    """Every tag ``path``'s UCX peer sends or posts a receive for, from now on."""
    seen: dict[str, list[int]] = {"send": [], "recv": []}
    peer = path.peer
    send, recv = peer.start_send, peer.start_recv

    def start_send(tag, *a, **kw):
        seen["send"].append(tag)
        return send(tag, *a, **kw)

    def start_recv(tag, *a, **kw):
        seen["recv"].append(tag)
        return recv(tag, *a, **kw)

    peer.start_send, peer.start_recv = start_send, start_recv
    return seen


async def move(engines, tmp_sock_dir, rid: str, size: int, *, mems=None, timeout: float = 30):
    """One transfer a1 -> a2 of ``size`` random bytes (1 MiB blocks); True when it arrived intact."""
    prefill = await engines.connect(tmp_sock_dir / "a1.sock", f"prefill-{rid}")
    decode = await engines.connect(tmp_sock_dir / "a2.sock", f"decode-{rid}")
    src, dst = mems or (engines.memory(size), engines.memory(size))
    await fill_random(src)
    n = size // MiB
    rs, rd = await prefill.register(src, block_bytes=MiB), await decode.register(dst, block_bytes=MiB)
    await decode.post_recv(rid, [rd.blocks(0, n)])
    await prefill.send_kv(rid, [rs.blocks(0, n)], to=["A/a2"])
    got = await decode.wait(rid, timeout=timeout)
    assert isinstance(got, p.KvReceived), got
    assert isinstance(await prefill.wait(rid, timeout=10), p.KvSent)
    return await same_bytes(dst.buf, src.buf)


SMALL_CHUNKS = "[transfer]\nchunk_bytes = 1048576\nucx_chunk_bytes = 1048576\ncredit_bytes = 4194304\n"


# -- with the capability -----------------------------------------------------------------------
@pytest.mark.ucx
async def test_a_message_preseeded_for_the_plain_tag_of_the_next_transfer_does_not_land(tmp_sock_dir, engines):
    """The attack of the plain scheme: messages of the right size, tagged as the next transfer
    ids' chunks would be without keys, sent to the receiver's worker before the transfers. With
    keys they match no receive: the transfers deliver the sender's bytes, the seeded messages
    stay unclaimed (and are drained). Both agents use the same keyed tags, all tags of one
    transfer share their prefix, and none is the plain one."""
    async with run_agents(cluster_toml(tmp_sock_dir, NODES, local_transport="ucx", extra=SMALL_CHUNKS),
                          wait_up=False) as ag:
        await up_over_ucx(ag)
        tx, rx = ag["a1"].sessions["A/a2"].data, ag["a2"].sessions["A/a1"].data
        victim = rx.peer
        first = ag["a1"]._tids + 1
        plain = [ucx.tag_for(rx._dir_in, tid, k) for tid in range(first, first + 3) for k in range(4)]
        att = Attacker(victim.local_address())
        sent_tags, recv_tags = record_tags(tx), record_tags(rx)
        try:
            # keyed, these are tags of no transfer the peer could be sending: drained on arrival, the
            # sends complete at once, and none of them waits (nor takes the unclaimed budget)
            await att.send_all([(tag, b"EVIL" * (MiB // 4)) for tag in plain], timeout=15)
            assert victim.stats["drained_implausible"] == len(plain) and victim.pending()["unclaimed"] == 0
            for i in range(2):
                assert await move(engines, tmp_sock_dir, f"r{i}", 4 * MiB), "the engine got other bytes"
            assert victim.stats["wrong_size"] == 0
        finally:
            att.close()
        assert CAP in ag["a1"].sessions["A/a2"].remote_caps and CAP in ag["a2"].sessions["A/a1"].remote_caps
        assert tx.tag_key() and rx.tag_key() and tx.tag_key() != rx.tag_key()
        tids = (first, first + 1)
        want = [rx.tag_in(tid, k) for tid in tids for k in range(4)]
        assert want == [tx.tag_out(tid, k) for tid in tids for k in range(4)]   # both ends agree
        assert sorted(recv_tags["recv"]) == sorted(want) and sorted(sent_tags["send"]) == sorted(want)
        assert not set(want) & set(plain)
        for tid in tids:
            assert len({rx.tag_in(tid, k) >> ucx.INDEX_BITS for k in range(4)}) == 1
            assert [ucx.tag_parts(rx.tag_in(tid, k))[2] for k in range(4)] == [0, 1, 2, 3]
        # the other direction (a2 -> a1) is keyed under a1's key, not a2's
        assert tx.tag_in(1, 0) == rx.tag_out(1, 0) != rx.tag_in(1, 0)


@pytest.mark.ucx
async def test_a_reconnect_mid_transfer_keeps_the_keys_and_the_transfer_completes(tmp_sock_dir, engines):
    """The keys live as long as the UCX workers: receives posted before a reconnect still match
    the chunks resent after it."""
    async with run_agents(cluster_toml(tmp_sock_dir, NODES, local_transport="ucx", extra=SMALL_CHUNKS),
                          wait_up=False) as ag:
        await up_over_ucx(ag)
        tx, rx = ag["a1"].sessions["A/a2"].data, ag["a2"].sessions["A/a1"].data
        keys = (tx.tag_key(), rx.tag_key())
        tag = rx.tag_in(1, 0)
        size = 64 * MiB
        moving = asyncio.ensure_future(move(engines, tmp_sock_dir, "big", size, timeout=60))
        await wait_rx_chunks(ag["a2"], "A/a1", 4)
        ag["a2"].sessions["A/a1"].control.abort()            # the control connection drops mid-transfer
        assert await moving
        assert metric(ag["a1"], "pddwire_reconnects_total", peer="A/a2") >= 1
        assert (tx.tag_key(), rx.tag_key()) == keys and rx.tag_in(1, 0) == tag == tx.tag_out(1, 0)
        assert tag != ucx.tag_for(rx._dir_in, 1, 0)
        assert ag["a1"].sessions["A/a2"].over_ucx
        assert await move(engines, tmp_sock_dir, "after", 4 * MiB)


# -- interop: one side without the capability --------------------------------------------------
@pytest.mark.ucx
async def test_without_the_capability_on_one_side_tags_stay_plain_and_kv_moves(tmp_sock_dir, engines, monkeypatch):
    mine = PeerSession._capabilities

    def caps(self):
        return [c for c in mine(self) if not (c == CAP and self.cfg.node == "a1")]

    monkeypatch.setattr(PeerSession, "_capabilities", caps)
    async with run_agents(cluster_toml(tmp_sock_dir, NODES, local_transport="ucx", extra=SMALL_CHUNKS),
                          wait_up=False) as ag:
        await up_over_ucx(ag)
        assert CAP not in ag["a2"].sessions["A/a1"].remote_caps and CAP in ag["a1"].sessions["A/a2"].remote_caps
        tx, rx = ag["a1"].sessions["A/a2"].data, ag["a2"].sessions["A/a1"].data
        first = ag["a1"]._tids + 1
        sent_tags, recv_tags = record_tags(tx), record_tags(rx)
        assert await move(engines, tmp_sock_dir, "plain", 4 * MiB)
        want = [ucx.tag_for(rx._dir_in, first, k) for k in range(4)]     # exactly the tags of old agents
        assert sorted(recv_tags["recv"]) == want and sorted(sent_tags["send"]) == want
        assert tx.tag_in(5, 1) == ucx.tag_for(tx._dir_in, 5, 1) and rx.tag_out(5, 1) == ucx.tag_for(rx._dir_out, 5, 1)


@pytest.mark.ucx
async def test_a_renewed_worker_has_a_new_key_that_its_peer_learns_in_the_next_handshake(tmp_sock_dir, engines):
    async with run_agents(cluster_toml(tmp_sock_dir, NODES, local_transport="ucx", extra=SMALL_CHUNKS),
                          wait_up=False) as ag:
        await up_over_ucx(ag)
        tx, rx = ag["a1"].sessions["A/a2"].data, ag["a2"].sessions["A/a1"].data
        old_key, old_address, old_tag = rx.tag_key(), rx.address(), tx.tag_out(1, 0)
        rx._renew()                                           # as when the peer's worker changed
        assert rx.tag_key() != old_key and rx.address() != old_address
        await until(lambda: tx.tag_out(1, 0) == rx.tag_in(1, 0) != old_tag, what="a1 uses a2's new key")
        await up_over_ucx(ag)
        assert await move(engines, tmp_sock_dir, "renewed", 4 * MiB)


@pytest.mark.ucx
async def test_the_endpoint_log_says_how_each_direction_is_tagged():
    """Keyed both ways; then with a peer that sent key 0: the tags sent to it are plain, the
    ones received from it still keyed, and the "UCX endpoint up" line says each."""
    for a_key, b_out in ((None, "keyed (ucx-keys.v1)"), (0, "plain")):
        logs = Said()
        async with bare_pair(keyed=True, a_key_to_b=a_key, log=logs):
            pass
        up = [e for e in logs if e["event"] == "UCX endpoint up"]   # pa's and pb's
        assert len(up) == 2, logs
        assert all(e["tags_in"] == "keyed (ucx-keys.v1)" and "tags" not in e for e in up), up
        assert sorted(e["tags_out"] for e in up) == sorted(["keyed (ucx-keys.v1)", b_out]), up
