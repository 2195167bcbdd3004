"""KV and token transfers between two real agents over real loopback sockets and real memfd memory."""

import asyncio

import pytest

from conftest import engine_pair, metric, same_bytes, wait_rx_chunks
from pdd_wire.engine import protocol as p
from pdd_wire.errors import EngineRequestError, ErrorCode
from support.agents import relayed_toml, run_agents, two_site_toml

MiB = 1 << 20


async def _pair(engines, tmp, size, block=MiB):
    return await engine_pair(engines, tmp, size, block)


async def test_256MiB_lands_byte_identical_in_posted_blocks(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as ag:
        size = 256 * MiB
        ea, eb, src, dst, ra, rb = await _pair(engines, tmp_sock_dir, size + 8 * MiB)
        # The receiver posts blocks 8..263: the KV lands there and nowhere else.
        await eb.post_recv("r1", [rb.blocks(8, 256)], from_site="A")
        sends = await ea.send_kv("r1", [ra.blocks(0, 256)], to=["B"])
        assert sends == [{"to": "B/b1", "transfer_id": sends[0]["transfer_id"]}]
        got = await eb.wait("r1", timeout=60)
        assert isinstance(got, p.KvReceived) and got.bytes == size and got.peer == "A/a1"
        sent = await ea.wait("r1", timeout=10)
        assert isinstance(sent, p.KvSent) and sent.bytes == size
        assert await same_bytes(dst.buf[8 * MiB:8 * MiB + size], src.buf[:size])
        assert not any(dst.buf[:8 * MiB]) and not any(dst.buf[8 * MiB + size:])
        assert metric(ag["B"], "pddwire_bytes_total", peer="A/a1", lane="bulk", direction="rx") == size
        assert metric(ag["B"], "pddwire_checksum_failures_total", peer="A/a1") == 0


async def test_scattered_blocks_and_several_regions(tmp_sock_dir, engines):
    """Blocks need not be contiguous, and one transfer may span regions of one block size."""
    async with run_agents(two_site_toml(tmp_sock_dir, chunk=256 * 1024)):
        ea, eb, src, dst, ra, rb = await _pair(engines, tmp_sock_dir, 8 * MiB, block=64 * 1024)
        extra = engines.memory(MiB)
        extra.buf[:] = b"\x5a" * MiB
        rx = await ea.register(extra, block_bytes=64 * 1024)
        src_ext = [ra.blocks(3, 5), rx.blocks(0, 2), ra.blocks(100, 1)]
        dst_ext = [rb.blocks(120, 1), rb.blocks(10, 4), rb.blocks(50, 3)]
        await eb.post_recv("s", dst_ext)
        await ea.send_kv("s", src_ext, to=["B"])
        assert isinstance(await eb.wait("s", timeout=30), p.KvReceived)
        B = 64 * 1024
        want = bytes(src.buf[3 * B:8 * B]) + b"\x5a" * 2 * B + bytes(src.buf[100 * B:101 * B])
        got = bytes(dst.buf[120 * B:121 * B]) + bytes(dst.buf[10 * B:14 * B]) + bytes(dst.buf[50 * B:53 * B])
        assert got == want


async def test_token_frame_overtakes_running_bulk_transfer(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as ag:
        size = 256 * MiB
        ea, eb, src, dst, ra, rb = await _pair(engines, tmp_sock_dir, size)
        await eb.post_recv("big", [rb.blocks(0, 256)])
        await ea.send_kv("big", [ra.blocks(0, 256)], to=["B"])
        await wait_rx_chunks(ag["B"], "A/a1", 2)
        await ea.send_tokens("big", "B", [11, 22, 33])
        first = await eb.wait_for(lambda e: e.request_id == "big", timeout=30)
        # Tokens were sent after the KV started and arrive before the KV finishes.
        assert isinstance(first, p.TokensReceived), first
        assert first.tokens == [11, 22, 33] and first.seq == 0
        assert metric(ag["B"], "pddwire_chunks_total", peer="A/a1", direction="rx") < 64
        assert isinstance(await eb.wait("big", timeout=60), p.KvReceived)


async def test_send_naming_a_peer_twice_or_an_unknown_site_is_refused(tmp_sock_dir, engines):
    """One send naming a destination twice is refused; an unknown site names the known ones.
    (Delivery to several destinations: tests/test_dual_path.py.)"""
    async with run_agents(two_site_toml(tmp_sock_dir)):
        ea, eb, src, dst, ra, rb = await _pair(engines, tmp_sock_dir, 4 * MiB)
        with pytest.raises(EngineRequestError) as ei:
            await ea.send_kv("x", [ra.blocks(0, 4)], to=["B", "B/b1"])
        assert ei.value.code == ErrorCode.BAD_REQUEST
        with pytest.raises(EngineRequestError) as ei:
            await ea.send_kv("x", [ra.blocks(0, 4)], to=["C"])
        assert ei.value.code == ErrorCode.UNKNOWN_PEER_SITE and "B/b1" in str(ei.value)


async def test_bad_requests_name_the_problem(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)):
        ea, eb, src, dst, ra, rb = await _pair(engines, tmp_sock_dir, 4 * MiB)
        with pytest.raises(EngineRequestError) as ei:
            await ea.send_kv("x", [(ra.region, 2, 9)], to=["B"])
        assert ei.value.code == ErrorCode.OUT_OF_BOUNDS and "outside region" in str(ei.value)
        with pytest.raises(EngineRequestError) as ei:
            await ea.send_kv("x", [(999, 0, 1)], to=["B"])
        assert ei.value.code == ErrorCode.UNKNOWN_REGION
        # B cannot address A's region ids: regions belong to the engine that registered them.
        with pytest.raises(EngineRequestError):
            await eb.post_recv("x", [(ra.region + 100, 0, 1)])


async def test_size_mismatch_is_refused_and_both_engines_are_told(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)):
        ea, eb, src, dst, ra, rb = await _pair(engines, tmp_sock_dir, 8 * MiB)
        await eb.post_recv("m", [rb.blocks(0, 3)])
        await ea.send_kv("m", [ra.blocks(0, 4)], to=["B"])
        ev = await ea.wait("m", timeout=10)
        assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.SIZE_MISMATCH
        assert "4 blocks" in ev.reason and "3 blocks" in ev.reason
        assert not any(dst.buf[:])


async def test_unposted_kv_waits_then_is_refused(tmp_sock_dir, engines):
    tomls = two_site_toml(tmp_sock_dir)
    tomls = {k: (v.replace("[transfer]\n", "[transfer]\nunposted_wait_s = 0.3\n") if k in "AB" else v)
             for k, v in tomls.items()}
    async with run_agents(tomls):
        ea, eb, src, dst, ra, rb = await _pair(engines, tmp_sock_dir, 4 * MiB)
        # Posted late but within the wait: accepted.
        await ea.send_kv("late", [ra.blocks(0, 4)], to=["B"])
        await asyncio.sleep(0.05)
        await eb.post_recv("late", [rb.blocks(0, 4)])
        assert isinstance(await eb.wait("late", timeout=10), p.KvReceived)
        # Never posted: refused with NOT_POSTED, nothing written.
        dst.buf[:] = b"\0" * dst.size
        await ea.send_kv("never", [ra.blocks(0, 4)], to=["B"])
        ev = await ea.wait("never", timeout=10)
        assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.NOT_POSTED
        assert not any(dst.buf[:])


async def test_from_site_restricts_who_may_fill_a_post(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)):
        ea, eb, src, dst, ra, rb = await _pair(engines, tmp_sock_dir, 4 * MiB)
        await eb.post_recv("q", [rb.blocks(0, 4)], from_site="Z")
        await ea.send_kv("q", [ra.blocks(0, 4)], to=["B"])
        ev = await ea.wait("q", timeout=10)
        assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.NOT_POSTED
        assert not any(dst.buf[:])


async def test_flipped_byte_is_caught_and_the_chunk_sent_again(tmp_sock_dir, engines):
    async with relayed_toml(tmp_sock_dir) as (relay, tomls):
        # A dials B, so A->B is the relay's client-to-server direction. Offset 10 MiB + 12345 of
        # a bulk stream is inside the third chunk's payload (frames are 48 + 4 MiB bytes).
        relay.flip_byte_at(10 * MiB + 12345, direction="c2s", min_conn_bytes=MiB)
        async with run_agents(tomls) as ag:
            ea, eb, src, dst, ra, rb = await _pair(engines, tmp_sock_dir, 64 * MiB)
            await eb.post_recv("f", [rb.blocks(0, 64)])
            await ea.send_kv("f", [ra.blocks(0, 64)], to=["B"])
            assert isinstance(await eb.wait("f", timeout=60), p.KvReceived)
            assert relay.flips_done == 1
            assert await same_bytes(dst.buf, src.buf)
            assert metric(ag["B"], "pddwire_checksum_failures_total", peer="A/a1") == 1
            assert metric(ag["A"], "pddwire_retransmits_total", peer="B/b1", reason="checksum") == 1


async def test_bulk_connection_cut_mid_transfer_completes_resending_only_unacked(tmp_sock_dir, engines):
    async with relayed_toml(tmp_sock_dir, transfer="credit_bytes = 33554432") as (relay, tomls):
        relay.cut_after(40 * MiB, direction="c2s", count=1)
        async with run_agents(tomls) as ag:
            size = 256 * MiB
            ea, eb, src, dst, ra, rb = await _pair(engines, tmp_sock_dir, size)
            await eb.post_recv("c", [rb.blocks(0, 256)])
            await ea.send_kv("c", [ra.blocks(0, 256)], to=["B"])
            assert isinstance(await eb.wait("c", timeout=60), p.KvReceived)
            assert relay.cuts_done == 1
            assert await same_bytes(dst.buf, src.buf)
            resent = metric(ag["A"], "pddwire_retransmits_total", peer="B/b1", reason="connection_lost")
            # Only what was in flight on the cut connection goes again: at most the credit window.
            assert 1 <= resent <= 32 * MiB // (4 * MiB)
            assert metric(ag["B"], "pddwire_bytes_total", peer="A/a1", lane="bulk", direction="rx") == size


async def test_whole_link_drop_resumes_without_resending_verified_chunks(tmp_sock_dir, engines):
    async with relayed_toml(tmp_sock_dir, transfer="credit_bytes = 33554432") as (relay, tomls):
        async with run_agents(tomls) as ag:
            size = 256 * MiB
            ea, eb, src, dst, ra, rb = await _pair(engines, tmp_sock_dir, size)
            await eb.post_recv("d", [rb.blocks(0, 256)])
            await ea.send_kv("d", [ra.blocks(0, 256)], to=["B"])
            await wait_rx_chunks(ag["B"], "A/a1", 16)
            relay.abort_all()  # control and bulk connections all drop at once
            assert isinstance(await eb.wait("d", timeout=60), p.KvReceived)
            assert await same_bytes(dst.buf, src.buf)
            assert metric(ag["A"], "pddwire_reconnects_total", peer="B/b1") >= 1
            # Every chunk was written once: duplicates, if any, went to scratch and were re-acked.
            assert metric(ag["B"], "pddwire_chunks_total", peer="A/a1", direction="rx") == 64
            assert metric(ag["A"], "pddwire_chunks_total", peer="B/b1", direction="tx") == 64
            assert metric(ag["B"], "pddwire_duplicate_chunks_total", peer="A/a1") == 0


async def test_tokens_are_relayed_in_order_exactly_once_across_a_reconnect(tmp_sock_dir, engines):
    async with relayed_toml(tmp_sock_dir) as (relay, tomls):
        async with run_agents(tomls):
            ea = await engines.connect(tmp_sock_dir / "A.sock", "rld")
            eb = await engines.connect(tmp_sock_dir / "B.sock", "md")
            sent = []
            for i in range(50):
                batch = [i * 10 + j for j in range(3)]
                seq = await ea.send_tokens("t", "B", batch)
                assert seq == len(sent)
                sent += batch
                if i == 20:
                    relay.pause()
                if i == 30:
                    relay.abort_all()
                    relay.resume()
            got = []
            async with asyncio.timeout(20):
                while len(got) < len(sent):
                    ev = await eb.wait_tokens("t")
                    assert ev.seq == len(got)
                    got += ev.tokens
            assert got == sent
