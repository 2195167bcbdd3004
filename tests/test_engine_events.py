"""Engine events delivered per request: order kept, requests isolated, overflow raised, never
dropped silently.

Real in-process agents for sites A and B on loopback; the engines are real clients on their
sockets. Token frames (one ``send_tokens`` is one TOKENS frame, one event at B) make the load.
"""

from __future__ import annotations

import asyncio

import pytest

from pdd_wire import EngineClient
from pdd_wire.engine import protocol as p
from pdd_wire.engine.client import EventOverflow
from support.agents import run_agents, two_site_toml

MiB = 1 << 20


async def _flush(a: EngineClient, b: EngineClient, marker: str) -> None:
    """Every event A's earlier token frames caused at B has arrived (one relay stream, in order)."""
    await a.send_tokens(marker, "B", [0])
    await b.wait_tokens(marker, timeout=10)


async def test_a_requests_events_come_in_order_and_other_requests_do_not_disturb_them(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)):
        a = await engines.connect(tmp_sock_dir / "A.sock", "a")
        b = await engines.connect(tmp_sock_dir / "B.sock", "b")
        ra = await a.register(engines.memory(4 * MiB), block_bytes=MiB)
        rb = await b.register(engines.memory(4 * MiB), block_bytes=MiB)
        await b.post_recv("kv", [rb.blocks(0, 4)], from_site="A")
        for i in range(50):  # interleaved: two token streams, then the KV
            await a.send_tokens("one", "B", [i])
            await a.send_tokens("two", "B", [100 + i, 200 + i])
        await a.send_kv("kv", [ra.blocks(0, 4)], to=["B"])
        ev = await b.wait("kv", timeout=30)
        assert isinstance(ev, p.KvReceived) and ev.bytes == 4 * MiB
        assert isinstance(await a.wait("kv", timeout=30), p.KvSent)
        two = [await b.wait_tokens("two", timeout=10) for _ in range(50)]
        one = [await b.wait_tokens("one", timeout=10) for _ in range(50)]
        assert [e.seq for e in one] == list(range(50)) and [e.tokens for e in one] == [[i] for i in range(50)]
        assert [e.seq for e in two] == list(range(0, 100, 2))
        assert b.take("one", kinds=(p.TokensReceived,)) == [] and b.events() == []


async def test_a_flooded_token_stream_overflows_only_its_own_request(tmp_sock_dir, engines):
    overflowed: list[str | None] = []
    async with run_agents(two_site_toml(tmp_sock_dir)):
        a = await engines.connect(tmp_sock_dir / "A.sock", "a")
        b = EngineClient(str(tmp_sock_dir / "B.sock"), "b", max_request_events=4, on_overflow=overflowed.append)
        engines.clients.append(await b.connect())
        ra = await a.register(engines.memory(2 * MiB), block_bytes=MiB)
        rb = await b.register(engines.memory(2 * MiB), block_bytes=MiB)
        await b.post_recv("flood", [rb.blocks(0, 2)], from_site="A")
        for i in range(7):
            await a.send_tokens("flood", "B", [i])
        await a.send_tokens("calm", "B", [1, 2])
        await a.send_kv("flood", [ra.blocks(0, 2)], to=["B"])
        # The KV outcome has its own mailbox: the token flood cannot push it out.
        assert isinstance(await b.wait("flood", timeout=30), p.KvReceived)
        await _flush(a, b, "marker")
        assert overflowed == ["flood"]
        assert (await b.wait_tokens("calm", timeout=5)).tokens == [1, 2]
        kept = [await b.wait_tokens("flood", timeout=5) for _ in range(4)]
        assert [e.seq for e in kept] == [0, 1, 2, 3]  # what was kept comes first, in order ...
        with pytest.raises(EventOverflow, match="3 events for request 'flood' were lost"):
            await b.wait_tokens("flood", timeout=5)  # ... then the loss, not a timeout
        assert b.forget("flood") == 0
        await a.send_tokens("flood", "B", [9])
        assert (await b.wait_tokens("flood", timeout=5)).seq == 7  # forgotten: delivered again


async def test_an_engine_that_takes_no_events_gets_an_error_not_a_silent_drop(tmp_sock_dir, engines):
    lost = asyncio.get_running_loop().create_future()
    async with run_agents(two_site_toml(tmp_sock_dir)):
        a = await engines.connect(tmp_sock_dir / "A.sock", "a")
        b = EngineClient(str(tmp_sock_dir / "B.sock"), "b", max_events=8,
                         on_overflow=lambda rid: rid is None and not lost.done() and lost.set_result(rid))
        engines.clients.append(await b.connect())
        ra = await a.register(engines.memory(MiB), block_bytes=MiB)
        rb = await b.register(engines.memory(MiB), block_bytes=MiB)
        await b.post_recv("kv", [rb.blocks(0, 1)], from_site="A")
        for i in range(8):  # eight requests' tokens fill the client's events ...
            await a.send_tokens(f"r{i}", "B", [i])
        await a.send_kv("kv", [ra.blocks(0, 1)], to=["B"])  # ... so this KvReceived has no room
        assert isinstance(await a.wait("kv", timeout=30), p.KvSent)
        with pytest.raises(EventOverflow, match="max_events 8"):
            await b.wait("kv", timeout=30)  # raised, where a dropped event would have timed out
        await lost
        assert (await b.wait_tokens("r0", timeout=5)).tokens == [0]  # kept events still come
        with pytest.raises(EventOverflow):
            b.events()


async def test_one_task_taking_every_event_sees_them_in_arrival_order(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)):
        a = await engines.connect(tmp_sock_dir / "A.sock", "a")
        b = await engines.connect(tmp_sock_dir / "B.sock", "b")
        sent = [("p", 0), ("q", 0), ("p", 1), ("r", 0), ("q", 1)]
        for rid, i in sent:
            await a.send_tokens(rid, "B", [i])
        got = [await b.next_event(timeout=10) for _ in sent]
        assert [(e.request_id, e.tokens[0]) for e in got] == sent
        await a.send_tokens("p", "B", [2])
        await a.send_tokens("q", "B", [2])
        # A predicate sees across requests too; what it passes over stays for its own waiter.
        ev = await b.wait_for(lambda e: e.request_id == "q", timeout=10)
        assert ev.seq == 2 and (await b.wait_tokens("p", timeout=10)).seq == 2
