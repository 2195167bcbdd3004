"""What a peer holding valid credentials costs the agent when it declares what it never sends, or
repeats frames whose text it varies: bounded (proto/frames.md §3, docs/operator.md "Logs").

A real agent B; the peer is written from proto/ alone (support.raw_peer).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tracemalloc

import xxhash

from conftest import metric, until
from pdd_wire import compress as cz
from pdd_wire.engine import protocol as p
from pdd_wire.errors import ErrorCode
from pdd_wire.probe import PROBE_PREFIX
from pdd_wire.transport.tcp import FRAMES_PER_TURN, KIND_BULK, KIND_CONTROL
from pdd_wire.wire import FrameReader, FrameType, Lane, encode_body, encode_bytes
from pdd_wire.wire import messages as m
from pdd_wire.wire.frame import F_CHECKSUM, F_LZ4, SCRATCH_BYTES, Header, encode_header
from support.agents import run_agents, two_site_toml
from support.raw_peer import RawPeer, hello

MiB = 1 << 20


@contextlib.asynccontextmanager
async def agent_b(tmp):
    async with run_agents(two_site_toml(tmp, plaintext=True), sites=("B",), wait_up=False) as ag:
        yield ag["B"]


def chunk_header(tid: int, payload_len: int, xxh3: int) -> bytes:
    return encode_header(Header(type=FrameType.KV_CHUNK, flags=F_CHECKSUM, lane=Lane.BULK, transfer_id=tid, seq=0,
                                payload_len=payload_len, payload_xxh3=xxh3), b"")


def test_a_declined_payload_is_read_through_a_bounded_scratch_and_still_checked():
    """A payload no sink takes is read and dropped through at most SCRATCH_BYTES, hashed as it
    arrives: its checksum verdict is the same as if it had been kept whole."""
    payload = os.urandom(3 * MiB + 12345)
    for xxh3, ok in ((xxhash.xxh3_64_intdigest(payload), True), (1, False)):
        reader = FrameReader(max_body=1 << 16, max_payload=64 * MiB, sink=lambda h, body: None)
        data = chunk_header(5, len(payload), xxh3) + payload
        frames = []
        for i in range(0, len(data), 100_000):
            frames += reader.feed(data[i:i + 100_000])
            assert reader._scratch is None or len(reader._scratch) <= SCRATCH_BYTES
        (f,) = frames
        assert f.header.payload_len == len(payload) and f.payload_ok is ok
        reader.release()
        assert reader._scratch is None


async def test_chunks_declared_and_never_sent_cost_the_agent_scratch_not_their_size(tmp_sock_dir):
    """Each bulk connection gets one KV_CHUNK header declaring 64 MiB (for a transfer never
    announced) and a few bytes, then silence; streams replaced eight times. Before, each such
    header made the reader allocate the whole declared payload (64 MiB each, 512 MiB here), and a
    peer replacing its streams grew the agent without bound."""
    async with agent_b(tmp_sock_dir) as b:
        peer, welcome = await hello(b.wan_address[1])
        alive = asyncio.create_task(peer.keepalive())
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            conns = []
            for i in range(8):  # each BULK_HELLO for a stream replaces the stream's connection
                bulk = await RawPeer.dial(b.wan_address[1], KIND_BULK)
                bulk.send(FrameType.BULK_HELLO, m.BulkHello(session=welcome.session, stream=i % 4, site="A",
                                                            node="a1"))
                t, _, _ = await bulk.next()
                assert t == FrameType.BULK_WELCOME
                bulk.writer.write(chunk_header(777, 64 * MiB, 1) + bytes(1000))
                conns.append(bulk)
            # A chunk of no transfer waits up to 2 s for its KV_BEGIN, then is read into scratch.
            await asyncio.sleep(3)
            grew = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        assert grew < 16 * MiB, f"{grew / MiB:.0f} MiB"
        assert await peer.pong(5)  # the session is untouched
        alive.cancel()
        for c in conns:
            c.close()
        peer.close()


def lines(logs, event: str) -> list[str]:
    return [ln for ln in logs.getvalue().splitlines() if f'"event": "{event}"' in ln]


async def test_frames_a_peer_repeats_with_varying_text_are_logged_once_per_period(tmp_sock_dir, info_logs):
    """ERROR with a new message and code each time, GOODBYE with a new reason, a token gap for a new
    request: each was a log line per frame (a peer could fill the disk at MB/s). One line per
    period per peer now, the text of the first one with it; the counters have every one. (An
    ERROR is the last frame the agent reads from a connection: one per connection.)"""
    async with agent_b(tmp_sock_dir) as b:
        peer, _ = await hello(b.wan_address[1])
        info_logs.seek(0)
        info_logs.truncate()
        for i in range(300):
            peer.send(FrameType.GOODBYE, m.Goodbye(f"going away, take {i}"))
            peer.send(FrameType.TOKENS, m.Tokens(f"gap-{i}", 0, [1]))
            peer.send(FrameType.TOKENS, m.Tokens(f"gap-{i}", 5, [2]))  # 1..4 never sent: a gap
        assert await peer.pong(7)
        codes = [int(c) for c in ErrorCode if c != ErrorCode.OK]  # every code: a line per code was a line per frame
        for i in range(20):
            peer.send(FrameType.ERROR, m.Error(codes[i % len(codes)], f"error number {i}"))
            await peer.until_closed()  # (else its 10 s timeout raises)
            peer, _ = await hello(b.wan_address[1], incarnation=77)  # the session resumes
        assert await peer.pong(8)
        errors = lines(info_logs, "peer reported an error")
        assert len(errors) == 1 and "error number 0" in errors[0], errors
        byes = lines(info_logs, "peer said goodbye")
        assert len(byes) == 1 and "going away, take 0" in byes[0], byes
        assert len(lines(info_logs, "token gap; asking for a resend")) == 1
        assert metric(b, "pddwire_token_gaps_total", peer="A/a1") == 300
        peer.close()


async def test_an_error_frame_is_the_last_frame_read_from_its_connection(tmp_sock_dir):
    """ERROR is the sender's last word on a connection (proto/frames.md §4): the agent reads
    nothing after it and closes the connection, control or bulk. Before, a peer could keep a
    connection open and send ERRORs at will (each one logged, counted and matched)."""
    async with agent_b(tmp_sock_dir) as b:
        peer, welcome = await hello(b.wan_address[1])
        bulk = await RawPeer.dial(b.wan_address[1], KIND_BULK)
        bulk.send(FrameType.BULK_HELLO, m.BulkHello(session=welcome.session, stream=0, site="A", node="a1"))
        assert (await bulk.next())[0] == FrameType.BULK_WELCOME
        bulk.send(FrameType.ERROR, m.Error(int(ErrorCode.INTERNAL), "bulk side gives up"))
        bulk.send(FrameType.ERROR, m.Error(int(ErrorCode.INTERNAL), "and again"))
        assert await bulk.until_closed() == []  # closed, no ERROR back: the peer ended it
        assert await peer.pong(3)  # the session is untouched by a bulk connection's end
        peer.send(FrameType.ERROR, m.Error(int(ErrorCode.INTERNAL), "control side gives up"))
        peer.send(FrameType.PING, m.Ping(nonce=4, sent_ns=1))  # after the ERROR: never read
        after = [t for t, _ in await peer.until_closed()]
        assert FrameType.PONG not in after and FrameType.ERROR not in after, after  # (the agent's PINGs may come)
        assert metric(b, "pddwire_errors_total", code="INTERNAL") == 2
        peer, _ = await hello(b.wan_address[1])  # it resumes as after any lost connection
        assert await peer.pong(5)
        peer.close()


async def test_a_burst_of_small_frames_from_one_peer_is_handled_a_slice_per_loop_turn(tmp_sock_dir):
    """One peer writes 20000 PINGs at once (about 1 MB). The agent handles at most
    FRAMES_PER_TURN of one connection's frames per loop turn, so other connections, timers and
    engines get the loop in between. Before, it handled a whole 64 KiB read (~1,300 PINGs) in one
    go, and libuv reads a readable socket up to 32 times per wake-up: a peer in another process
    flooding one agent held a second peer's PING 30-39 ms at p99, 1.6-1.7 ms with the bound
    (docs/benchmarks.md, "A peer's burst of small frames"). Counted, not timed: the frames handled
    between two turns of a task that yields every turn."""
    async with agent_b(tmp_sock_dir) as b:
        flooder, _ = await hello(b.wan_address[1])
        handled = b.metrics.child(b.metrics.frames, "A/a1", "control", "rx")
        burst = 20000
        start = handled._value.get()
        flooder.writer.write(encode_bytes(FrameType.PING, encode_body(m.Ping(nonce=1, sent_ns=1))) * burst)
        most, prev = 0, start
        async with asyncio.timeout(30):
            while prev < start + burst:
                await asyncio.sleep(0)  # one loop turn
                now = handled._value.get()
                most, prev = max(most, now - prev), now
        assert 0 < most <= FRAMES_PER_TURN, most
        assert await flooder.pong(2)  # every PING answered, in order, the connection whole
        flooder.close()


async def test_a_probe_transfer_takes_no_lz4_chunks(tmp_sock_dir):
    """A probe's sender never compresses (it measures the raw link), so an LZ4 chunk for one is a
    broken or hostile peer: 16 KiB of lz4 that decodes to 4 MiB of zeros in the agent's own probe
    region (a 255x amplification any peer could trigger, no engine's post needed). It fails the
    probe MALFORMED_BODY, undecoded; the same probe sent plain lands (proto/transfer.md §7)."""
    zeros = bytes(4 * MiB)
    async with agent_b(tmp_sock_dir) as b:
        peer, welcome = await hello(b.wan_address[1], capabilities=("kv.v1", "tokens.v1", "abort.v1", "lz4.v1"))
        alive = asyncio.create_task(peer.keepalive())
        bulk = await RawPeer.dial(b.wan_address[1], KIND_BULK)
        bulk.send(FrameType.BULK_HELLO, m.BulkHello(session=welcome.session, stream=0, site="A", node="a1"))
        assert (await bulk.next())[0] == FrameType.BULK_WELCOME
        packed = bytes(cz.encode_chunk(zeros, shuffle=False))
        assert len(packed) < 32 << 10
        for tid, flags, payload in ((1, F_CHECKSUM | F_LZ4, packed), (2, F_CHECKSUM, zeros)):
            peer.send(FrameType.KV_BEGIN, m.KvBegin(f"{PROBE_PREFIX}t{tid}", total_bytes=4 * MiB, chunk_bytes=4 * MiB,
                                                    n_chunks=1, block_bytes=MiB, n_blocks=4), transfer_id=tid)
            seen = await peer.until(FrameType.KV_ACCEPT)
            assert seen[-1] is not None and seen[-1][2].transfer_id == tid, seen
            bulk.writer.write(encode_header(Header(type=FrameType.KV_CHUNK, flags=flags, lane=Lane.BULK,
                                                   transfer_id=tid, seq=0, payload_len=len(payload),
                                                   payload_xxh3=xxhash.xxh3_64_intdigest(zeros)), b"") + payload)
            ends = [f for f in await peer.until_any((FrameType.KV_CANCEL, FrameType.KV_DONE)) if f is not None]
            t, body, header = ends[-1]
            assert header.transfer_id == tid
            if tid == 1:
                assert t == FrameType.KV_CANCEL and body.code == ErrorCode.MALFORMED_BODY and body.by_receiver, body
                assert "LZ4" in body.message, body.message
            else:
                assert t == FrameType.KV_DONE, (t, body)
        assert await peer.pong(9)  # the session is untouched
        alive.cancel()
        bulk.close()
        peer.close()


async def test_a_bulk_connection_stalled_mid_chunk_is_dropped_and_the_chunk_lands_from_another(tmp_sock_dir, engines):
    """A bulk connection that stops in the middle of a chunk (its flow blackholed on the path)
    held the chunk's claim for ever: every copy sent on another connection met CHUNK_BUSY and the
    transfer failed at its deadline. Its reader now drops it after `timeouts.dead_after_s` (1.5 s
    here) without a byte, and the next copy lands (proto/handshake.md §7, transfer.md §7)."""
    payload = os.urandom(4 * MiB)
    async with agent_b(tmp_sock_dir) as b:
        eng = await engines.connect(tmp_sock_dir / "B.sock", "decode")
        dst = engines.memory(4 * MiB)
        region = await eng.register(dst, block_bytes=MiB)
        await eng.post_recv("r1", [region.blocks(0, 4)], from_site="A")
        peer, welcome = await hello(b.wan_address[1])
        alive = asyncio.create_task(peer.keepalive())
        streams = []
        for i in range(2):
            bulk = await RawPeer.dial(b.wan_address[1], KIND_BULK)
            bulk.send(FrameType.BULK_HELLO, m.BulkHello(session=welcome.session, stream=i, site="A", node="a1"))
            assert (await bulk.next())[0] == FrameType.BULK_WELCOME
            streams.append(bulk)
        peer.send(FrameType.KV_BEGIN, m.KvBegin("r1", total_bytes=4 * MiB, chunk_bytes=4 * MiB, n_chunks=1,
                                                block_bytes=MiB, n_blocks=4), transfer_id=1)
        assert (await peer.until(FrameType.KV_ACCEPT))[-1] is not None
        chunk = chunk_header(1, len(payload), xxhash.xxh3_64_intdigest(payload))
        streams[0].writer.write(chunk + payload[:MiB])  # then nothing more: stalled mid-chunk
        await asyncio.sleep(0.3)
        streams[1].writer.write(chunk + payload)  # the copy meets the claim the stalled one holds
        nack = (await peer.until(FrameType.KV_NACK))[-1]
        assert nack is not None and nack[1].code == ErrorCode.CHUNK_BUSY, nack
        t0 = asyncio.get_running_loop().time()
        await streams[0].until_closed()  # dropped by the agent (else next()'s 10 s timeout raises)
        assert asyncio.get_running_loop().time() - t0 < 5
        streams[1].writer.write(chunk + payload)
        done = (await peer.until(FrameType.KV_DONE))[-1]
        assert done is not None and done[2].transfer_id == 1, done
        ev = await eng.wait("r1", timeout=5)
        assert type(ev).__name__ == "KvReceived", ev
        assert bytes(dst.buf) == payload
        alive.cancel()
        for s in streams:
            s.close()
        peer.close()


async def test_handoff_messages_for_requests_nobody_knows_are_kept_within_a_bound(tmp_sock_dir):
    """HANDOFF_ABORT ahead of `handoff_md` is kept for MD's entry to come. A peer sending ABORTs
    with 4 KiB reasons for request ids nobody knows grew the agent about a byte per byte sent (16
    a request, 16384 requests a peer: 1.2 GB). Now one of each kind per epoch a request, reasons
    cut to 128 characters, 4096 messages a peer (proto/handoff.md §9)."""
    caps = ("kv.v1", "tokens.v1", "abort.v1", "handoff.v1")
    async with agent_b(tmp_sock_dir) as b:
        peer, _ = await hello(b.wan_address[1], capabilities=caps)
        for i in range(6000):
            peer.send(FrameType.HANDOFF_ABORT, m.HandoffAbort(f"r{i}", 0, "x" * 4096))
        for _ in range(20):  # copies of one request's ABORT (a resend after each reconnect)
            peer.send(FrameType.HANDOFF_ABORT, m.HandoffAbort("again", 0, "copy"))
        peer.send(FrameType.HANDOFF_COMMIT, m.HandoffCommit("again", 0, 5))
        assert await peer.pong(3)
        early = b.handoffs.early["A/a1"]
        kept = [hm for e in early.values() for hm in e.messages]
        assert len(kept) <= 4096, len(kept)
        assert max(len(getattr(hm, "reason", "")) for hm in kept) <= 128
        assert [type(hm).__name__ for hm in early["again"].messages] == ["HandoffAbort", "HandoffCommit"]
        peer.close()


async def test_a_hello_nested_thousands_deep_is_refused_and_its_place_given_back(tmp_sock_dir):
    """A HELLO of about 2 KB whose unknown key holds a value nested 2000 deep raised
    RecursionError in the decoder: the handshake task died, the connection stayed open and its
    place (limits.max_peer_connections) was never given back; 64 such HELLOs locked every peer
    out until a restart. It is MALFORMED_BODY now (proto/messages.md), and the place comes back."""
    import msgspec

    async with run_agents(two_site_toml(tmp_sock_dir, plaintext=True, extra="[limits]\nmax_peer_connections = 4\n"),
                          sites=("B",), wait_up=False) as ag:
        port = ag["B"].wan_address[1]
        body = msgspec.msgpack.encode({"versions": [1], "site": "A", "node": "a1", "incarnation": 5, "zz": None})
        deep = body[:-1] + b"\x91" * 2000 + b"\xc0"
        for _ in range(8):  # twice the places there are
            bad = await RawPeer.dial(port, KIND_CONTROL)
            bad.send(FrameType.HELLO, deep)
            seen = await bad.until_closed()
            assert seen and seen[0][0] == FrameType.ERROR and seen[0][1].code == ErrorCode.MALFORMED_BODY, seen
        peer, _ = await hello(port)  # a real peer still gets in
        assert await peer.pong(1)
        peer.close()


async def test_transfers_a_peer_opens_and_cancels_at_will_are_not_a_log_line_each(tmp_sock_dir, info_logs):
    """Probe transfers need no engine's post: a peer sending KV_BEGIN and KV_CANCEL pairs for
    them made a WARNING "transfer failed" line per transfer (310 bytes of log per 155 sent). One
    line a second per peer, direction and code now, the first one's ids with it; the counters
    and the engines' events have every one."""
    async with agent_b(tmp_sock_dir) as b:
        peer, _ = await hello(b.wan_address[1])
        info_logs.seek(0)
        info_logs.truncate()
        t0 = asyncio.get_running_loop().time()
        for tid in range(1, 501):
            peer.send(FrameType.KV_BEGIN, m.KvBegin(f"{PROBE_PREFIX}c{tid}", total_bytes=MiB, chunk_bytes=MiB,
                                                    n_chunks=1, block_bytes=MiB, n_blocks=1), transfer_id=tid)
            peer.send(FrameType.KV_CANCEL, m.KvCancel(f"{PROBE_PREFIX}c{tid}", int(ErrorCode.TRANSFER_CANCELLED),
                                                      "gone"), transfer_id=tid)
            if tid % 10 == 0:  # at most 16 probe transfers of a peer open at once
                await until(lambda n=tid: metric(b, "pddwire_transfers_total", peer="A/a1", direction="in",
                                                 outcome="transfer_cancelled") == n, timeout=10, what="ended")
        assert await peer.pong(4)
        await until(lambda: metric(b, "pddwire_transfers_total", peer="A/a1", direction="in",
                                   outcome="transfer_cancelled") == 500, timeout=10, what="every transfer ended")
        took = asyncio.get_running_loop().time() - t0
        failed = lines(info_logs, "transfer failed")
        assert 1 <= len(failed) <= took + 2, (len(failed), took)  # one a second (and the first)
        peer.close()


async def test_a_peer_cannot_set_the_rtt_it_is_routed_by(tmp_sock_dir):
    """The RTT of a link (routing reads it) was taken from the ``sent_ns`` a PONG echoes, and any
    PONG counted: a peer answering with its own numbers, or sending PONGs at will, set it. Now a
    round trip is timed by the agent's own clock from the PING it answers, once."""
    async with agent_b(tmp_sock_dir) as b:
        peer, _ = await hello(b.wan_address[1])
        count = "pddwire_control_rtt_seconds_count"
        answered = 0
        async with asyncio.timeout(20):
            while answered < 3:  # the agent's PINGs (one at the start, then heartbeats)
                t, body, _ = await peer.next()
                if t != FrameType.PING:
                    continue
                for sent_ns in (1, body.sent_ns + 10**15):  # an RTT of the agent's uptime; one of -11 days
                    peer.send(FrameType.PONG, m.Pong(body.nonce, sent_ns))  # the second is a copy
                for bogus in range(10**6, 10**6 + 50):  # never sent by the agent
                    peer.send(FrameType.PONG, m.Pong(bogus, 1))
                answered += 1
                await until(lambda n=answered: metric(b, count, peer="A/a1") >= n, timeout=5, what="the round trip")
        assert await peer.pong(1)
        assert metric(b, count, peer="A/a1") == answered  # one sample a PING, none for the copies
        assert 0 <= metric(b, "pddwire_control_rtt_seconds_sum", peer="A/a1") < answered * 0.5
        session = b.sessions["A/a1"]
        assert 0 <= session.link.rtt_s < 0.5 and 0 <= session.est.rtt_s < 0.5
        peer.close()


async def test_resend_requests_for_a_stream_never_taken_back_off(tmp_sock_dir, engines):
    """A peer repeating TOKENS_ACK {resend} for a relayed stream it never acknowledges had its
    whole backlog sent once per round trip (941 MB in 5 s in an audit). While the last resend
    is not acknowledged whole, each waits twice as long as the one before (up to 2 s); an ack of
    everything ends the backoff. Only lower bounds on the gaps are asserted: a slow machine
    makes them longer, never shorter."""
    from pdd_wire.session.tokens import RESEND_MIN_INTERVAL_S

    async with agent_b(tmp_sock_dir) as b:
        eb = await engines.connect(tmp_sock_dir / "B.sock", "rld")
        peer, _ = await hello(b.wan_address[1])
        assert await eb.send_tokens("r", "A", [1, 2, 3]) == 0
        seen = await peer.until(FrameType.TOKENS)
        assert seen[-1] is not None and seen[-1][1] == m.Tokens("r", 0, [1, 2, 3]), seen

        async def resent() -> float:
            """Ask every 10 ms until the stream comes again; when it came."""
            async def ask() -> None:
                while True:
                    peer.send(FrameType.TOKENS_ACK, m.TokensAck("r", 0, True))
                    await asyncio.sleep(0.01)
            asker = asyncio.create_task(ask())
            try:
                got = await peer.until(FrameType.TOKENS)
                assert got[-1] is not None and got[-1][1] == m.Tokens("r", 0, [1, 2, 3]), got
                return asyncio.get_running_loop().time()
            finally:
                asker.cancel()

        times = [await resent() for _ in range(6)]
        gaps = [later - earlier for earlier, later in zip(times, times[1:])]
        for i, gap in enumerate(gaps):  # 0.1, 0.2, 0.4, 0.8, 1.6 s at the least
            assert gap >= 0.9 * RESEND_MIN_INTERVAL_S * 2 ** (i + 1), gaps
        stream = b.sessions["A/a1"].tokens.tok_out["r"]
        peer.send(FrameType.TOKENS_ACK, m.TokensAck("r", 3))  # everything taken: the backoff ends
        assert await peer.pong(1)
        assert stream.resend_gap == 0.0 and not stream.unacked
        peer.close()


async def test_a_kv_resume_is_answered_once_a_connection(tmp_sock_dir):
    """A sender asks KV_RESUME once per transfer after a reconnect; each copy was answered with
    the transfer's whole bitmap (O(verified chunks) a 20-byte frame). A copy on the same control
    connection is ignored; the next connection asks again and is answered."""
    async with agent_b(tmp_sock_dir) as b:
        peer, _ = await hello(b.wan_address[1], incarnation=90)
        rid = f"{PROBE_PREFIX}resume"
        peer.send(FrameType.KV_BEGIN, m.KvBegin(rid, total_bytes=MiB, chunk_bytes=64 << 10, n_chunks=16,
                                                block_bytes=MiB, n_blocks=1), transfer_id=7)
        for _ in range(200):
            peer.send(FrameType.KV_RESUME, m.KvResume(rid), transfer_id=7)
        peer.send(FrameType.KV_RESUME, m.KvResume("x"), transfer_id=8)  # unknown: answered state 0
        peer.send(FrameType.PING, m.Ping(nonce=1, sent_ns=1))
        seen = await peer.until(FrameType.PONG)  # every frame before it handled
        statuses = [(f[2].transfer_id, f[1].state) for f in seen if f[0] == FrameType.KV_STATUS]
        assert statuses == [(7, 1), (8, 0)], statuses
        peer.close()
        await until(lambda: not b.sessions["A/a1"].is_up, what="the first connection gone")
        again, welcome = await hello(b.wan_address[1], incarnation=90)
        assert welcome.resumed
        again.send(FrameType.KV_RESUME, m.KvResume(rid), transfer_id=7)
        got = await again.until(FrameType.KV_STATUS)
        assert got[-1] is not None and got[-1][2].transfer_id == 7 and got[-1][1].state == 1, got
        again.close()


@contextlib.asynccontextmanager
async def inline_sender(tmp, engines, rid: str):
    """Agent B, whose engine sends ``rid`` (4 chunks of 64 KiB, inline) to a raw peer A that
    accepted it: yields (peer, transfer id, B's engine)."""
    async with agent_b(tmp) as b:
        eb = await engines.connect(tmp / "B.sock", "prefill")
        mem = engines.memory(4 << 16)
        region = await eb.register(mem, block_bytes=1 << 16)
        peer = await RawPeer.dial(b.wan_address[1], KIND_CONTROL)
        peer.frames = FrameReader(max_body=1 << 20, max_payload=1 << 16)  # inline chunks come on it
        peer.send(FrameType.HELLO, m.Hello(versions=[1], site="A", node="a1", incarnation=5, max_chunk=1 << 16,
                                           capabilities=["kv.v1", "tokens.v1", "abort.v1", "inline.v1"]))
        assert (await peer.next())[0] == FrameType.WELCOME
        await eb.send_kv(rid, [region.blocks(0, 4)], to=["A"])
        begin = (await peer.until(FrameType.KV_BEGIN))[-1]
        assert begin is not None and begin[1].n_chunks == 4, begin
        tid = begin[2].transfer_id
        peer.send(FrameType.KV_ACCEPT, m.KvAccept(rid), transfer_id=tid)
        try:
            yield peer, tid, eb
        finally:
            peer.close()


async def test_a_receiver_that_refuses_every_copy_ends_the_transfer(tmp_sock_dir, engines):
    """Each KV_NACK CHUNK_CHECKSUM of a chunk in flight had the sender send the whole chunk again
    at once (4 MiB for 53 bytes, without end until the deadline). Past refusals_allowed(n_chunks)
    the sender gives the transfer up: KV_CANCEL CHUNK_CHECKSUM to the peer, transfer_failed to
    its engine."""
    from pdd_wire.session.sending import refusals_allowed

    async with inline_sender(tmp_sock_dir, engines, "refused") as (peer, tid, eb):
        nacks = 0
        while (f := await peer.next()) is not None and f[0] != FrameType.KV_CANCEL:
            if f[0] == FrameType.KV_CHUNK and f[2].transfer_id == tid:
                peer.send(FrameType.KV_NACK, m.KvNack(f[2].seq, int(ErrorCode.CHUNK_CHECKSUM)), transfer_id=tid)
                nacks += 1
        assert f is not None and f[2].transfer_id == tid and f[1].code == ErrorCode.CHUNK_CHECKSUM, f
        assert nacks == refusals_allowed(4) + 1
        failed = await eb.wait("refused", timeout=10)
        assert failed.code == ErrorCode.CHUNK_CHECKSUM and "refused" in failed.reason, failed


async def test_chunk_busy_answers_back_off_until_an_ack(tmp_sock_dir, engines):
    """KV_NACK CHUNK_BUSY had the chunk sent again every 50 ms for as long as the receiver said
    it (a claim lasts until the receiver finds its connection stalled, 5 s: 100 copies). Each
    such NACK of the transfer since its last ack doubles the wait, up to 400 ms. Lower bounds
    only: a slow machine makes the gaps longer, never shorter."""
    from pdd_wire.session.sending import BUSY_RETRY_MAX_S, BUSY_RETRY_S

    async with inline_sender(tmp_sock_dir, engines, "busy") as (peer, tid, eb):
        copies: list[float] = []
        loop = asyncio.get_running_loop()
        while len(copies) < 7:
            f = await peer.next()
            assert f is not None
            if f[0] == FrameType.KV_CHUNK and f[2].transfer_id == tid:
                if f[2].seq != 0:  # chunks 1..3 would be taken, chunk 0 is always busy
                    peer.send(FrameType.KV_ACK, m.KvAck(f[2].seq, 1), transfer_id=tid)
                    continue
                copies.append(loop.time())
                peer.send(FrameType.KV_NACK, m.KvNack(0, int(ErrorCode.CHUNK_BUSY)), transfer_id=tid)
        gaps = [later - earlier for earlier, later in zip(copies, copies[1:])]
        # (chunk 0 heads the queue of the one inline lane: chunks 1..3 wait behind it, no ack comes between)
        for i, gap in enumerate(gaps):
            assert gap >= 0.9 * min(BUSY_RETRY_S * 2 ** i, BUSY_RETRY_MAX_S), gaps
        assert sum(gaps) >= 0.9 * (0.05 + 0.1 + 0.2 + 0.4 * 3), gaps
        peer.send(FrameType.KV_DONE, m.KvDone("busy", 4 << 16), transfer_id=tid)  # taken at last
        done = await eb.wait("busy", timeout=10)
        assert isinstance(done, p.KvSent), done


async def test_a_peer_has_at_most_16_probe_transfers_open(tmp_sock_dir):
    """A probe transfer needs no engine's post: a peer could open `transfer.max_transfers`
    (4096) of them, each a 64 MiB transfer of 4 KiB chunks (30-50 us and 3 KB of state each).
    A prober keeps 3 in flight; past 16 open, a probe's KV_BEGIN is refused TOO_MANY_TRANSFERS."""
    from pdd_wire.desk.probes import MAX_PROBES_IN

    async with agent_b(tmp_sock_dir) as b:
        peer, _ = await hello(b.wan_address[1])

        def begin(tid: int) -> None:
            peer.send(FrameType.KV_BEGIN, m.KvBegin(f"{PROBE_PREFIX}p{tid}", total_bytes=64 * MiB, chunk_bytes=4096,
                                                    n_chunks=16384, block_bytes=MiB, n_blocks=64), transfer_id=tid)

        async def answers() -> list:
            peer.send(FrameType.PING, m.Ping(nonce=9, sent_ns=1))
            seen = await peer.until(FrameType.PONG)
            return [(f[0], f[2].transfer_id, getattr(f[1], "code", None))
                    for f in seen if f and f[0] in (FrameType.KV_ACCEPT, FrameType.KV_REJECT)]

        for tid in range(1, 21):
            begin(tid)
        got = await answers()
        assert [a for a in got if a[0] == FrameType.KV_REJECT] == [
            (FrameType.KV_REJECT, tid, ErrorCode.TOO_MANY_TRANSFERS) for tid in range(MAX_PROBES_IN + 1, 21)], got
        assert len(b.sessions["A/a1"].inn) == MAX_PROBES_IN
        peer.send(FrameType.KV_CANCEL, m.KvCancel(f"{PROBE_PREFIX}p1", int(ErrorCode.TRANSFER_CANCELLED), "done"),
                  transfer_id=1)
        await until(lambda: 1 not in b.sessions["A/a1"].inn, what="probe 1 ended")
        begin(21)  # a place is free again
        assert all(a[0] != FrameType.KV_REJECT for a in await answers())
        assert 21 in b.sessions["A/a1"].inn
        peer.close()
