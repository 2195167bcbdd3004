"""One engine's requests do not hold the agent's loop: a write of many is answered a slice at a
time (engine_server.SERVE_BUDGET_S), and lists past a request's limits are refused before their
elements are looked at.

A write of many requests (engine_server.SERVE_BUDGET_S):
requests that never wait are answered a loop turn's slice at a time, so every other engine and
every peer get the loop between them. Before, the engine's worker answered all it had queued (up
to 1024 decoded, thousands in one write) as one step of the loop: 14,000 ``status`` requests in
one write held it 170 ms, 300 with 4,096 transfers open 5 s, past a peer's ``dead_after_s``.

A real in-process agent; the engine is a raw socket writing encoded requests (proto/engine.md).
"""

from __future__ import annotations

import asyncio
import collections

from pdd_wire.desk.handoff import MAX_TOKENS_PER_CALL
from pdd_wire.engine import protocol as p
from pdd_wire.engine_server import EngineConn
from pdd_wire.errors import EngineRequestError, ErrorCode
from pdd_wire.session.tokens import MAX_UNACKED_TOKENS
from support.agents import run_agents, two_site_toml

N = 8000


async def test_a_write_of_thousands_of_requests_is_answered_over_many_loop_turns(tmp_sock_dir, monkeypatch):
    loop = asyncio.get_running_loop()
    turn = 0
    running = True

    def tick() -> None:
        nonlocal turn
        turn += 1
        if running:
            loop.call_soon(tick)

    per_turn: collections.Counter[int] = collections.Counter()
    send = EngineConn.send

    def counted(self, msg) -> None:
        if isinstance(msg, p.Ok):
            per_turn[turn] += 1
        send(self, msg)

    monkeypatch.setattr(EngineConn, "send", counted)
    async with run_agents(two_site_toml(tmp_sock_dir), sites=("A",), wait_up=False) as ag:
        reader, writer = await asyncio.open_unix_connection(ag["A"].config.listen.engine_socket)
        data = b"".join(p.encode(p.SetLoad(id=i + 1, load=0.5)) for i in range(N))
        tick()
        try:
            writer.write(data)
            decoder = p.Decoder(to_agent=False)
            replies = []
            async with asyncio.timeout(60):
                while len(replies) < N:
                    replies += [m for m in decoder.feed(await reader.read(1 << 20)) if m.id]
        finally:
            running = False
            writer.close()
        assert [r.id for r in replies] == list(range(1, N + 1))  # every one answered, in order
        assert all(isinstance(r, p.Ok) for r in replies)
        # Before: all but the first read's 32 in one turn (7,968 here).
        assert max(per_turn.values()) < N // 4, sorted(per_turn.values())[-5:]
        assert len(per_turn) > 4


async def test_token_lists_over_the_limits_are_refused_before_each_token_is_looked_at(tmp_sock_dir, engines):
    """A send_tokens of more than the per-request limit is refused at once, LIMIT_EXCEEDED (before,
    after a check of each token on the loop: 0.5 s for 15M); a handoff_tokens of more than
    MAX_TOKENS_PER_CALL (4096) is refused BAD_REQUEST (each token is a step of the state machine:
    65,536 took 130 ms)."""
    async with run_agents(two_site_toml(tmp_sock_dir)) as ag:
        ea = await engines.connect(ag["A"].config.listen.engine_socket, "rld")
        try:
            await ea.send_tokens("r1", "B", [1] * (MAX_UNACKED_TOKENS + 1))
            raise AssertionError("accepted")
        except EngineRequestError as exc:
            assert exc.code == ErrorCode.LIMIT_EXCEEDED and "in one send_tokens" in str(exc), exc
        assert await ea.send_tokens("r1", "B", [1, 2, 3]) == 0  # the request is untouched
        await ea.handoff_rld("h1", "B")
        try:
            await ea.handoff_tokens("h1", [7] * (MAX_TOKENS_PER_CALL + 1))
            raise AssertionError("accepted")
        except EngineRequestError as exc:
            assert exc.code == ErrorCode.BAD_REQUEST and "in one handoff_tokens" in str(exc), exc
        await ea.handoff_tokens("h1", [7, 8])
