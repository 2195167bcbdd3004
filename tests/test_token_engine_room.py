"""Relayed tokens for an engine that reads its events slowly wait for it (proto/transfer.md §12):
a frame whose engine has a quarter of ``limits.engine_queue_bytes`` unread is neither delivered
nor acknowledged, and once the engine has room the receiver asks for it again. A peer's burst of
tokens so slows that peer, and never cuts the engine off (before, the agent queued every frame as
an event and cut the engine off at ``limits.engine_queue_bytes``, failing everything it had).
"""

from __future__ import annotations

import asyncio
import contextlib

from conftest import metric, until
from pdd_wire.engine.client import EngineClient
from pdd_wire.errors import EngineRequestError, ErrorCode
from pdd_wire.session import tokens as tokens_mod
from pdd_wire.wire import FrameType
from pdd_wire.wire import messages as m
from support.agents import run_agents, two_site_toml
from support.raw_peer import hello

MiB = 1 << 20
QUEUE = 4 * MiB  # limits.engine_queue_bytes here: tokens wait at a quarter of it
LIMITS = f"[limits]\nengine_queue_bytes = {QUEUE}\n"


@contextlib.contextmanager
def not_reading(ec: EngineClient):
    """The engine stops reading its socket (its events pile up in the agent), then reads again."""
    loop = asyncio.get_running_loop()
    loop.remove_reader(ec._sock.fileno())
    try:
        yield
    finally:
        loop.add_reader(ec._sock.fileno(), ec._readable)


async def most_queued(agent, seconds: float) -> int:
    """The most bytes of events any engine of ``agent`` left unread, sampled for ``seconds``."""
    high = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        high = max([high] + [len(c._out) for c in agent.engine_server.engines.values()])
        await asyncio.sleep(0.005)
    return high


def cut_off(agent):
    """A check: has ``agent`` cut off any of the engines connected to it now? (An engine that is
    not reading cannot tell yet.)"""
    conns = list(agent.engine_server.engines.values())
    return lambda: any(c.closed for c in conns)


@contextlib.asynccontextmanager
async def b_and_raw_peer(tmp):
    """Agent B (engine queue QUEUE), a peer written from proto/ alone as A/a1, and B's engine "md"
    owning request "r1" from site A: ``(b, peer, engine)``."""
    async with run_agents(two_site_toml(tmp, plaintext=True, extra=LIMITS), sites=("B",), wait_up=False) as ag:
        b = ag["B"]
        peer, _ = await hello(b.wan_address[1])
        alive = asyncio.create_task(peer.keepalive())
        try:
            async with EngineClient(b.config.listen.engine_socket, "md") as eb:
                await eb.expect_tokens("r1", from_site="A")
                yield b, peer, eb
        finally:
            alive.cancel()


async def flood(peer, frames: int, n: int = 8192) -> None:
    """``frames`` TOKENS frames of ``n`` IDs for "r1" from index 0, written at once."""
    for i in range(frames):
        peer.send(FrameType.TOKENS, m.Tokens("r1", i * n, list(range(i * n, (i + 1) * n)), False))
    await peer.writer.drain()


async def read_tokens(ec: EngineClient, request_id: str, n: int, timeout: float = 60, start: int = 0) -> list[int]:
    """The token IDs of ``request_id`` from index ``start`` up to ``n``, checking that frames come
    in order, once."""
    got: list[int] = []
    async with asyncio.timeout(timeout):
        while start + len(got) < n:
            ev = await ec.wait_tokens(request_id)
            assert ev.seq == start + len(got), f"tokens {ev.seq}.. came after {start + len(got)} (a gap or a repeat)"
            got += ev.tokens
    return got


async def test_a_burst_of_tokens_waits_for_a_slow_engine_and_arrives_once_in_order(tmp_sock_dir):
    """Engine A relays 2M token IDs while engine B reads nothing: B's agent stops taking them at
    a quarter of B's event queue, A's engine is held back by its own agent's limit, and when B
    reads again every token arrives, once, in order; B is never cut off."""
    total, per_call = 1 << 21, 1 << 16
    async with run_agents(two_site_toml(tmp_sock_dir, extra=LIMITS)) as ag:
        a, b = ag["A"], ag["B"]
        async with EngineClient(a.config.listen.engine_socket, "rld") as ea, \
                EngineClient(b.config.listen.engine_socket, "md") as eb:
            await eb.expect_tokens("r1", from_site="A")
            b_cut = cut_off(b)
            sent: list[int] = []
            limited = 0

            async def relay() -> None:
                nonlocal limited
                while len(sent) < total:
                    part = [(len(sent) + i) * 7919 % (1 << 32) for i in range(per_call)]
                    try:
                        await ea.send_tokens("r1", "B", part)
                    except EngineRequestError as exc:  # A's agent holds max_unacked_tokens: wait
                        assert exc.code == ErrorCode.LIMIT_EXCEEDED, exc
                        limited += 1
                        await asyncio.sleep(0.05)
                        continue
                    sent.extend(part)

            with not_reading(eb):
                task = asyncio.create_task(relay())
                # B's agent stops acknowledging, so A's holds its engine back (before: B was cut off).
                await until(lambda: limited > 0 or b_cut(), timeout=30)
                high = await most_queued(b, 1.0)  # more frames come meanwhile, and wait too
                assert not b_cut(), "the engine was cut off"
                assert metric(b, "pddwire_token_frames_waited_total", peer="A/a1") > 0
            got = await read_tokens(eb, "r1", total)
            await task
            assert got == sent
            assert limited > 0  # the sending engine was held back, not the receiving one cut off
            # At most a quarter of the queue and one frame's event (8192 IDs, under 48 KB) past it.
            assert not b_cut() and not eb.closed and high <= QUEUE // 4 + 48 * 1024, high
            assert metric(b, "pddwire_tokens_dropped_total", peer="A/a1", reason="over_bounds") == 0


async def test_a_peer_that_floods_tokens_is_asked_again_and_the_engine_stays(tmp_sock_dir):
    """A peer written from proto/ alone sends frames for a request as fast as it can and never
    resends. Its frames past the engine's room are not acknowledged; the engine stays connected
    and gets an unbroken run from index 0; once it has read, the agent asks the peer for the rest
    (TOKENS_ACK {next_seq: what was delivered, resend: true})."""
    n, frames = 8192, 300  # ~37 KB of event a frame, ~11 MB in all: over the 4 MiB queue
    async with b_and_raw_peer(tmp_sock_dir) as (b, peer, eb):
        b_cut = cut_off(b)
        with not_reading(eb):
            await flood(peer, frames, n)
            await until(lambda: b_cut() or metric(b, "pddwire_token_frames_waited_total", peer="A/a1") > 0)
            high = await most_queued(b, 0.5)
            assert not b_cut(), "the engine was cut off"
            assert high <= QUEUE // 4 + 48 * 1024, high
        acks = []

        async def asked() -> bool:
            while (f := await peer.next()) is not None:
                if f[0] == FrameType.TOKENS_ACK:
                    acks.append(f[1])
                    if f[1].resend:
                        return True
            return False

        # Everything delivered before the wait, in order from 0; then the agent asks for the rest.
        async with asyncio.timeout(20):
            first = await eb.wait_tokens("r1")
            assert first.seq == 0
            assert await asked()
        delivered = acks[-2].next_seq if len(acks) > 1 else 0
        assert acks[-1].next_seq == delivered and 0 < delivered < frames * n
        got = list(first.tokens) + await read_tokens(eb, "r1", delivered, start=len(first.tokens))
        assert got == list(range(delivered))
        assert not b_cut() and not eb.closed
        assert metric(b, "pddwire_tokens_dropped_total", peer="A/a1", reason="over_bounds") == 0


async def test_an_engine_that_stops_reading_is_cut_off_and_frees_its_senders_budget(tmp_sock_dir):
    """An engine that keeps a quarter of its queue unread for timeouts.engine_read_s is cut off,
    as one that filled it was before the wait: its streams' tokens stop holding the sender's
    per-peer budget, and another engine's send_tokens to that peer is taken again."""
    limits = f"[limits]\nengine_queue_bytes = {QUEUE}\nmax_unacked_tokens = 262144\n"
    tomls = two_site_toml(tmp_sock_dir, extra=limits)
    tomls["B"] = tomls["B"].replace("[timeouts]\n", "[timeouts]\nengine_read_s = 1.0\n")
    async with run_agents(tomls) as ag:
        a, b = ag["A"], ag["B"]
        async with EngineClient(a.config.listen.engine_socket, "rld") as ea, \
                EngineClient(b.config.listen.engine_socket, "stuck") as stuck, \
                EngineClient(b.config.listen.engine_socket, "healthy") as healthy:
            await stuck.expect_tokens("s", from_site="A")
            await healthy.expect_tokens("ok", from_site="A")
            b_cut = cut_off(b)
            asyncio.get_running_loop().remove_reader(stuck._sock.fileno())  # never reads again
            with contextlib.suppress(EngineRequestError):
                for _ in range(64):  # until A's budget for B is used up
                    await ea.send_tokens("s", "B", [(1 << 31) + j for j in range(8192)])
            await until(b_cut, timeout=10, what="the stuck engine cut off")
            await until(lambda: a.sessions["B/b1"].tokens.backlog < 262144 // 2, timeout=10, what="A's budget freed")
            assert await ea.send_tokens("ok", "B", list(range(256))) >= 0
            ev = await healthy.wait_tokens("ok", timeout=10)
            assert ev.tokens[:3] == [0, 1, 2]


async def test_a_waiting_stream_is_not_forgotten_for_other_streams(tmp_sock_dir):
    """B keeps 4 x transfer.max_transfers streams of a peer (4 here) and forgets the least recently
    used; a waiting stream is not forgotten: its tokens past what was delivered would be lost (the
    forgotten-stream rule takes a stream from its next frame). A relays a burst for "x", whose
    engine is not reading, then one frame each for six other requests; once the engine reads,
    every token of "x" arrives, in order."""
    total = 40 * 8192
    tomls = two_site_toml(tmp_sock_dir, extra=LIMITS)
    tomls["B"] = tomls["B"].replace("[transfer]\n", "[transfer]\nmax_transfers = 1\n")
    async with run_agents(tomls) as ag:
        a, b = ag["A"], ag["B"]
        async with EngineClient(a.config.listen.engine_socket, "rld") as ea, \
                EngineClient(b.config.listen.engine_socket, "md") as eb:
            await eb.expect_tokens("x", from_site="A")
            sent = [(1 << 31) + i for i in range(total)]
            with not_reading(eb):
                for i in range(0, total, 8192):
                    await ea.send_tokens("x", "B", sent[i:i + 8192])
                await until(lambda: "x" in b.sessions["A/a1"].tokens.waiting, what="x waits")
                for k in range(6):  # other streams from A: each one newer than x's last frame
                    await ea.send_tokens(f"o{k}", "B", [k])
                await until(lambda: all(f"o{k}" in b.sessions["A/a1"].tokens.tok_in or
                                        f"o{k}" in b.sessions["A/a1"].tokens.held for k in range(6)))
                assert "x" in b.sessions["A/a1"].tokens.waiting  # kept apart, not forgotten
            assert await read_tokens(eb, "x", total) == sent


async def test_a_waiting_stream_whose_sender_never_answers_stops_waiting(tmp_sock_dir, monkeypatch):
    """A waiting stream that gets no frame for WAIT_GIVE_UP_S (20 s; 1 s here) after its engine
    had room (its sender restarted, or gave up on this peer) is a stream like any other again: it
    is no longer asked for, and a later frame from where delivery stopped is delivered."""
    monkeypatch.setattr(tokens_mod, "WAIT_GIVE_UP_S", 1.0)
    async with b_and_raw_peer(tmp_sock_dir) as (b, peer, eb):
        relay = b.sessions["A/a1"].tokens
        with not_reading(eb):
            await flood(peer, 300)
            await until(lambda: "r1" in relay.waiting)
        delivered = relay.waiting["r1"].expect
        assert await read_tokens(eb, "r1", delivered) == list(range(delivered))
        await until(lambda: "r1" not in relay.waiting, timeout=10, what="the wait given up")
        assert relay.tok_in["r1"] == delivered
        peer.send(FrameType.TOKENS, m.Tokens("r1", delivered, [7, 8, 9], False))
        ev = await eb.wait_tokens("r1", timeout=10)
        assert (ev.seq, ev.tokens) == (delivered, [7, 8, 9])


async def test_a_stream_waiting_longer_than_the_give_up_is_not_given_up_while_its_engine_is_full(
        tmp_sock_dir, monkeypatch):
    """The give-up clock runs only while the engine has room (and the sender is asked): a finished,
    live sender is silent while the engine stays full (nothing is asked of it), and giving the
    stream up then left its last tokens undelivered and its sender's budget held for good."""
    monkeypatch.setattr(tokens_mod, "WAIT_GIVE_UP_S", 1.0)  # 20 s as shipped
    total = 40 * 8192
    async with run_agents(two_site_toml(tmp_sock_dir, extra=LIMITS)) as ag:
        a, b = ag["A"], ag["B"]
        async with EngineClient(a.config.listen.engine_socket, "rld") as ea, \
                EngineClient(b.config.listen.engine_socket, "md") as eb:
            await eb.expect_tokens("x", from_site="A")
            sent = [(1 << 31) + i for i in range(total)]
            relay = b.sessions["A/a1"].tokens
            with not_reading(eb):  # busy past the give-up, within engine_read_s (5 s): not cut off
                for i in range(0, total, 8192):
                    await ea.send_tokens("x", "B", sent[i:i + 8192])  # the request's last tokens
                await until(lambda: "x" in relay.waiting, what="x waits")
                await asyncio.sleep(2.5)
                assert "x" in relay.waiting
            assert await read_tokens(eb, "x", total, timeout=15) == sent
            await until(lambda: a.sessions["B/b1"].tokens.backlog == 0, what="A's budget freed")
