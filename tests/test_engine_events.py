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
        for i in range(8):
            await b.expect_tokens(f"r{i}", "A")  # tokens reach only an engine that takes the request
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
        for rid in "pqr":
            await b.expect_tokens(rid)
        for rid, i in sent:
            await a.send_tokens(rid, "B", [i])
        got = [await b.next_event(timeout=10) for _ in sent]
        assert [(e.request_id, e.tokens[0]) for e in got] == sent
        await a.send_tokens("p", "B", [2])
        await a.send_tokens("q", "B", [2])
        # A predicate sees across requests too; what it passes over stays for its own waiter.
        ev = await b.wait_for(lambda e: e.request_id == "q", timeout=10)
        assert ev.seq == 2 and (await b.wait_tokens("p", timeout=10)).seq == 2


# -- the mailboxes alone, under any interleaving -------------------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pdd_wire.engine.events import EventBox  # noqa: E402

_OPS = st.lists(st.tuples(st.sampled_from(["put-tok", "put-kv", "take-tok", "take-kv", "take-all", "forget"]),
                          st.sampled_from(["a", "b", "c"])), max_size=80)


def _event(rid: str, fam: str, n: int) -> p.Msg:
    if fam == "tok":
        return p.TokensReceived(request_id=rid, peer="A/a1", seq=n, tokens=[])
    return p.KvSent(request_id=rid, transfer_id=n, peer="A/a1", bytes=0, seconds=0.0)


def _key(ev: p.Msg) -> tuple[str, str, int]:
    if isinstance(ev, p.TokensReceived):
        return (ev.request_id, "tok", ev.seq)
    return (ev.request_id, "kv", ev.transfer_id)


@settings(max_examples=300, deadline=None)
@given(ops=_OPS, per_request=st.integers(1, 6), total=st.integers(1, 20))
def test_mailboxes_against_a_model_order_isolation_and_every_loss_raised(ops, per_request, total):
    """A model of the rules: each (request, mailbox) keeps arrival order and at most
    ``per_request`` events; the client at most ``total`` (an overflowed mailbox counts one);
    a take that finds nothing raises exactly when events it could have had were lost."""
    box = EventBox(max_events=total, max_request_events=per_request)
    kept: list[tuple[str, str, int]] = []  # the model: every kept event, in arrival order
    lost: set[tuple[str, str]] = set()  # mailboxes that lost events (until forget)
    client_lost = False
    for n, (op, rid) in enumerate(ops, 1):
        if op.startswith("put"):
            fam = op[4:]
            box.put(_event(rid, fam, n))
            if client_lost or len(kept) + len(lost) >= total:
                client_lost = True
            elif sum(1 for k in kept if k[:2] == (rid, fam)) >= per_request:
                lost.add((rid, fam))
            else:
                kept.append((rid, fam, n))
        elif op == "take-all":
            if client_lost:
                with pytest.raises(EventOverflow):
                    box.take_all()
            else:
                assert [_key(e) for e in box.take_all()] == kept
                kept = []
        elif op == "forget":
            box.forget(rid)
            kept = [k for k in kept if k[0] != rid]
            lost = {k for k in lost if k[0] != rid}
        else:
            fam = op[5:]
            mine = [k for k in kept if k[:2] == (rid, fam)]
            if not mine and ((rid, fam) in lost or client_lost):
                with pytest.raises(EventOverflow):
                    box.take(rid, (p.TokensReceived,) if fam == "tok" else (p.KvSent,))
            else:
                assert [_key(e) for e in box.take(rid, (p.TokensReceived,) if fam == "tok" else (p.KvSent,))] == mine
                kept = [k for k in kept if k[:2] != (rid, fam)]
        assert len(box) == len(kept)
