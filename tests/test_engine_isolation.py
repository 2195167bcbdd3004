"""Engines on one agent are isolated from each other's requests (issue 11): one engine cannot take
over another live engine's request and its tokens (``expect_tokens``), abort it (``abort``), end
its prefix leases (``prefix_release``), or keep it from posting receives (each engine has its own share of posts).

Real in-process agents for sites A and B on loopback; the engines are real clients on B's socket.
"""

from __future__ import annotations

import pytest

from conftest import fill_random, same_bytes
from pdd_wire.engine import protocol as p
from pdd_wire.errors import EngineRequestError, ErrorCode
from support.agents import run_agents, two_site_toml

MiB = 1 << 20


async def test_another_engine_cannot_take_over_a_live_engines_request_or_its_tokens(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)):
        a = await engines.connect(tmp_sock_dir / "A.sock", "a")
        b = await engines.connect(tmp_sock_dir / "B.sock", "b")
        x = await engines.connect(tmp_sock_dir / "B.sock", "intruder")
        await b.expect_tokens("mine", "A")
        with pytest.raises(EngineRequestError, match="belongs to another engine") as err:
            await x.expect_tokens("mine")
        assert err.value.code == ErrorCode.BAD_REQUEST
        await a.send_tokens("mine", "B", [1, 2, 3])
        tok = await b.wait_tokens("mine", timeout=10)  # still b's: the tokens come to b
        assert tok.tokens == [1, 2, 3]
        assert await b.expect_tokens("mine", "A") == 0  # the owner itself: unchanged
        # Once its engine is gone, the request may be taken by another.
        await b.close()
        await a.send_tokens("mine", "B", [4])
        assert await x.expect_tokens("mine") in (0, 1)
        assert (await x.wait_tokens("mine", timeout=10)).tokens == [4]


async def test_another_engine_cannot_abort_a_live_engines_request(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)):
        a = await engines.connect(tmp_sock_dir / "A.sock", "a")
        b = await engines.connect(tmp_sock_dir / "B.sock", "b")
        x = await engines.connect(tmp_sock_dir / "B.sock", "intruder")
        src, dst = engines.memory(4 * MiB), engines.memory(4 * MiB)
        await fill_random(src)
        ra = await a.register(src, block_bytes=MiB)
        rb = await b.register(dst, block_bytes=MiB)
        await b.post_recv("kv", [rb.blocks(0, 4)], from_site="A")
        with pytest.raises(EngineRequestError, match="belongs to another engine") as err:
            await x.abort("kv", "not yours")
        assert err.value.code == ErrorCode.BAD_REQUEST
        with pytest.raises(EngineRequestError, match="belongs to another engine"):
            await x.prefix_release("kv")  # nor end its prefix leases
        # Nothing was ended: b's post stands and A was sent no REQUEST_ABORT.
        await a.send_kv("kv", [ra.blocks(0, 4)], to=["B"])
        ev = await b.wait("kv", timeout=30)
        assert isinstance(ev, p.KvReceived) and ev.bytes == 4 * MiB, ev
        assert isinstance(await a.wait("kv", timeout=30), p.KvSent)
        assert a.take("kv", kinds=(p.RequestAborted,)) == []
        assert await same_bytes(dst.buf, src.buf)
        # The owner may abort its own request; a request nobody holds may be aborted by anyone.
        await b.post_recv("kv2", [rb.blocks(0, 4)], from_site="A")
        assert await b.abort("kv2", "done") == 1
        assert await x.abort("nobody's", "done") == 0


async def test_each_engine_has_its_own_share_of_posted_receives(tmp_sock_dir, engines):
    tomls = two_site_toml(tmp_sock_dir)
    tomls["B"] = tomls["B"].replace("[transfer]\n", "[transfer]\nmax_transfers = 2\n")
    async with run_agents(tomls):
        b = await engines.connect(tmp_sock_dir / "B.sock", "b")
        x = await engines.connect(tmp_sock_dir / "B.sock", "greedy")
        rb = await b.register(engines.memory(MiB), block_bytes=MiB)
        rx = await x.register(engines.memory(MiB), block_bytes=MiB)
        for i in range(8):  # 4 x transfer.max_transfers: all of x's share
            await x.post_recv(f"x{i}", [rx.blocks(0, 1)])
        with pytest.raises(EngineRequestError, match="too many posted receives") as err:
            await x.post_recv("x8", [rx.blocks(0, 1)])
        assert err.value.code == ErrorCode.LIMIT_EXCEEDED
        for i in range(8):  # b's share is untouched by x's
            await b.post_recv(f"b{i}", [rb.blocks(0, 1)])
        with pytest.raises(EngineRequestError, match="too many posted receives"):
            await b.post_recv("b8", [rb.blocks(0, 1)])
        assert await x.abort("x0", "room") == 1  # a post ended frees its engine's share
        await x.post_recv("x8", [rx.blocks(0, 1)])
