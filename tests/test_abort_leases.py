"""Aborts that reach both sites, leases that hand memory back, and who may use the engine socket.

Real in-process agents for sites A and B on loopback, real engines on their sockets.
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from conftest import metric, until
from pdd_tools.sim import MdSim, RldSim
from pdd_wire.engine import protocol as p
from pdd_wire.errors import EngineRequestError, ErrorCode
from support.agents import run_agents, two_site_toml

MiB = 1 << 20


async def pair_engines(engines, tmp, size=16 * MiB):
    a = await engines.connect(tmp / "A.sock", "a")
    b = await engines.connect(tmp / "B.sock", "b")
    ma, mb = engines.memory(size), engines.memory(size)
    ra = await a.register(ma, block_bytes=MiB)
    rb = await b.register(mb, block_bytes=MiB)
    return a, b, ra, rb


async def moving(engines, tmp, agents, rid: str):
    """Engines a and b, with 256 MiB of ``rid`` moving from A into b's posted blocks (two chunks in)."""
    a, b, ra, rb = await pair_engines(engines, tmp, size=256 * MiB)
    await b.post_recv(rid, [rb.blocks(0, 256)])
    await a.send_kv(rid, [ra.blocks(0, 256)], to=["B"])
    await until(lambda: metric(agents["B"], "pddwire_chunks_total", peer="A/a1", direction="rx") >= 2)
    return a, b


def hold_quiesce(receiver) -> tuple[asyncio.Event, asyncio.Event]:
    """Make ``receiver``'s cancels wait at a gate before the real quiesce, as if a bulk thread were
    mid-chunk: (the gate to open, set once a cancel waits there)."""
    gate, held = asyncio.Event(), asyncio.Event()
    quiesce = receiver._quiesce

    async def slow_quiesce(route):
        held.set()
        await gate.wait()
        await quiesce(route)

    receiver._quiesce = slow_quiesce
    return gate, held


async def test_abort_on_one_site_drops_the_other_sites_post_and_tells_its_engine(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        a, b, ra, rb = await pair_engines(engines, tmp_sock_dir)
        await b.post_recv("x1", [rb.blocks(0, 4)], from_site="A")  # nothing sent yet
        await a.send_tokens("x1", "B", [1, 2, 3])
        await b.wait_tokens("x1", timeout=5)
        await a.abort("x1", "client disconnected")
        ev = await b.wait("x1", kinds=(p.RequestAborted,), timeout=5)
        assert ev.reason == "client disconnected" and ev.origin == "A/a1"
        assert "x1" not in agents["B"].posts
        assert metric(agents["A"], "pddwire_request_aborts_total", direction="tx") == 1
        assert metric(agents["B"], "pddwire_request_aborts_total", direction="rx") == 1
        # The blocks are free again: the same request id may be posted anew.
        await b.post_recv("x1", [rb.blocks(0, 4)], from_site="A")


async def test_abort_mid_transfer_ends_it_on_both_sites(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        a, b = await moving(engines, tmp_sock_dir, agents, "x2")
        await b.abort("x2", "request cancelled")  # the *receiver's* engine aborts
        ev = await a.wait("x2", timeout=10)
        assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.TRANSFER_CANCELLED
        ab = await a.wait("x2", kinds=(p.RequestAborted,), timeout=5)
        assert ab.origin == "B/b1"
        await until(lambda: not agents["A"].sessions["B/b1"].out and not agents["B"].sessions["A/a1"].inn)
        assert agents["A"].audit() == ({"post": 0, "send": 0, "recv": 0}, 0)
        assert agents["B"].audit() == ({"post": 0, "send": 0, "recv": 0}, 0)


async def test_a_peers_abort_reaches_a_receiving_engine_after_its_transfer_stopped_writing(tmp_sock_dir, engines):
    """The sender's engine aborts while KV lands in the receiver's blocks: the receiving engine
    hears ``transfer_failed`` and only then ``aborted`` -- by which time no bulk thread writes
    into its blocks, so an engine that frees them on ``aborted`` (the vLLM connector) is safe."""
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        a, b = await moving(engines, tmp_sock_dir, agents, "x3")
        await a.abort("x3", "client gone")  # the *sender's* engine aborts
        ab = await b.wait("x3", kinds=(p.RequestAborted,), timeout=10)
        assert ab.origin == "A/a1"
        assert not agents["B"].sessions["A/a1"].inn  # its receive ended (route quiesced) before
        (tf,) = b.take("x3", kinds=(p.TransferFailed,))  # and the engine was told so first
        assert tf.code == ErrorCode.TRANSFER_CANCELLED


async def test_an_abort_while_a_receive_quiesces_leaves_the_request_id_free_to_post_again(tmp_sock_dir, engines):
    """B's engine aborts r while a receive of it from A is moving and a second KV_BEGIN of it (another
    engine at A) waits unposted at B. A answers the REQUEST_ABORT with a KV_CANCEL for that second
    transfer; it must find the wait gone (rejected at the abort, before B waits for its receive to
    quiesce), not record r as given up by A: B's engine may post r again at once."""
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        a, b = await moving(engines, tmp_sock_dir, agents, "r5")
        a2 = await engines.connect(tmp_sock_dir / "A.sock", "a2")
        ra2 = await a2.register(engines.memory(16 * MiB), block_bytes=MiB)
        await a2.send_kv("r5", [ra2.blocks(0, 4)], to=["B"])
        await until(lambda: "r5" in agents["B"].kv.unposted)
        await b.abort("r5", "client gone")
        rb = await b.register(engines.memory(16 * MiB), block_bytes=MiB)
        await b.post_recv("r5", [rb.blocks(0, 4)], from_site="A")  # the same id, reused: accepted


async def test_a_second_cancel_of_a_receive_returns_only_once_its_blocks_are_let_go(tmp_sock_dir, engines):
    """Two cancels of one receive (the peer's abort, then the engine's own): the second one's
    answer -- after which the engine may reuse its blocks -- comes only once the first one has
    stopped the data path (held here while a bulk thread would still be mid-chunk)."""
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        a, b = await moving(engines, tmp_sock_dir, agents, "x4")
        gate, held = hold_quiesce(agents["B"].sessions["A/a1"].receiver)
        await a.abort("x4", "client gone")  # B's first cancel starts, and waits at the gate
        await asyncio.wait_for(held.wait(), 10)
        second = asyncio.ensure_future(b.abort("x4", "engine gives up"))
        await asyncio.sleep(0.3)
        assert not second.done()  # the blocks are still the agent's
        gate.set()
        await asyncio.wait_for(second, 10)
        assert not agents["B"].sessions["A/a1"].inn
        (tf,) = b.take("x4", kinds=(p.TransferFailed,))
        assert tf.code == ErrorCode.TRANSFER_CANCELLED


async def test_a_receiver_stopping_during_a_peers_abort_tells_its_engine_only_once_the_blocks_are_free(
        tmp_sock_dir, engines):
    """A peer's abort is cancelling a receive (its data path not yet let go) when the receiving
    agent stops: the cancel is cut short, and the stop's own cancel takes the transfer over. The
    engine hears nothing before the blocks are free, then one outcome (transfer_failed)."""
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        a, b = await moving(engines, tmp_sock_dir, agents, "x5")
        gate, held = hold_quiesce(agents["B"].sessions["A/a1"].receiver)
        await a.abort("x5", "client gone")
        await asyncio.wait_for(held.wait(), 10)
        stopping = asyncio.ensure_future(agents["B"].shutdown(0))
        await asyncio.sleep(0.3)
        assert b.take("x5", kinds=(p.RequestAborted, p.TransferFailed)) == []  # the blocks are not free yet
        gate.set()
        await asyncio.wait_for(stopping, 20)
        ev = await b.wait("x5", kinds=(p.TransferFailed, p.RequestAborted), timeout=10)
        assert isinstance(ev, p.TransferFailed), ev


async def test_abort_reaches_a_handoff_on_the_other_site(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        R = await engines.connect(tmp_sock_dir / "A.sock", "rld")
        M = await engines.connect(tmp_sock_dir / "B.sock", "md")
        mem = engines.memory(4 * MiB)
        reg = await M.register(mem, block_bytes=MiB)
        await M.post_recv("x3", [reg.blocks(0, 4)], from_site="A")
        md = MdSim(M, "x3", "A", n_tokens=200)
        await md.start()
        rld = RldSim(R, "x3", "B", n_tokens=200, step_s=0.005)
        rt = asyncio.create_task(rld.run(30))
        await until(lambda: rld.generated >= 20)
        await M.abort("x3", "client disconnected")  # the user went away: at MD's site
        ev = await R.wait("x3", kinds=(p.RequestAborted,), timeout=5)
        assert ev.origin == "B/b1"
        rt.cancel()
        await asyncio.gather(rt, return_exceptions=True)
        assert "x3" not in agents["A"].handoffs.live and "x3" not in agents["B"].handoffs.live


async def test_abort_storm_does_not_stall_token_relay(tmp_sock_dir, engines):
    n = 3000
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        a, b, ra, rb = await pair_engines(engines, tmp_sock_dir)
        b2 = await engines.connect(tmp_sock_dir / "B.sock", "b2")
        for i in range(n):
            await b.post_recv(f"s{i}", [rb.blocks(i % 16, 1)], from_site="A")

        issued = 0

        async def storm():
            nonlocal issued
            for i in range(n):
                await a.abort(f"s{i}", "storm")
                issued += 1

        async def tokens():
            got = []
            for i in range(50):
                await a.send_tokens("live", "B", [i])
                got += (await b2.wait_tokens("live", timeout=10)).tokens
            return got, issued

        _, (got, issued_at_last_token) = await asyncio.gather(storm(), tokens())
        assert got == list(range(50))  # in order, exactly once
        assert issued_at_last_token < n, "the tokens only got through once the storm was over"
        await until(lambda: not agents["B"].posts, timeout=30)
        assert metric(agents["B"], "pddwire_request_aborts_total", direction="rx") == n
        told = [e for e in b.events() if isinstance(e, p.RequestAborted)]
        assert len(told) == n and {e.request_id for e in told} == {f"s{i}" for i in range(n)}


async def test_post_that_no_transfer_claims_is_handed_back_at_its_ttl(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        a, b, ra, rb = await pair_engines(engines, tmp_sock_dir)
        await b.post_recv("t1", [rb.blocks(0, 2)], ttl_s=0.3)
        await b.post_recv("t2", [rb.blocks(2, 2)])  # the default ttl: stays
        assert agents["B"].audit()[0]["post"] == 4
        ev = await b.wait("t1", timeout=5)
        assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.TRANSFER_TIMEOUT and "ttl_s" in ev.reason
        assert "t1" not in agents["B"].posts and "t2" in agents["B"].posts
        assert metric(agents["B"], "pddwire_leases_expired_total", kind="post") == 1
        with pytest.raises(EngineRequestError) as ei:
            await b.post_recv("t3", [rb.blocks(4, 1)], ttl_s=-1)
        assert "ttl_s" in str(ei.value)


async def test_memory_pinned_for_a_dead_peer_is_handed_back_and_nothing_is_stranded(tmp_sock_dir, engines):
    tomls = two_site_toml(tmp_sock_dir)  # with a short lease (peer_give_up_s), so the test is quick
    tomls = {k: (v.replace("shutdown_grace_s = 2", "shutdown_grace_s = 2\npeer_give_up_s = 1.0") if k in "AB" else v)
             for k, v in tomls.items()}
    async with run_agents(tomls) as agents:
        a, b, ra, rb = await pair_engines(engines, tmp_sock_dir, size=256 * MiB)
        await b.post_recv("d1", [rb.blocks(0, 256)])
        await a.send_kv("d1", [ra.blocks(0, 256)], to=["B"])
        await until(lambda: metric(agents["B"], "pddwire_chunks_total", peer="A/a1", direction="rx") >= 1)
        await agents["B"].shutdown(0)  # B goes away mid-transfer: A's blocks were pinned for it
        ev = await a.wait("d1", timeout=10)
        assert isinstance(ev, p.TransferFailed)
        assert agents["A"].audit() == ({"post": 0, "send": 0, "recv": 0}, 0)
        await asyncio.sleep(0.5)  # one audit tick
        assert metric(agents["A"], "pddwire_stranded_blocks") == 0


async def test_a_receiver_that_stops_refuses_the_kv_waiting_for_its_post_at_once(tmp_sock_dir, engines):
    """A KV_BEGIN waiting for a post on an agent that begins to stop can get no post any more (its
    engines are told to stop; post_recv is refused): its sender hears SHUTTING_DOWN at once, not
    after peer_give_up_s (30 s) as PEER_UNREACHABLE."""
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        a, b, ra, rb = await pair_engines(engines, tmp_sock_dir)
        await a.send_kv("w1", [ra.blocks(0, 4)], to=["B"], deadline_s=60)
        await until(lambda: agents["B"].kv.unposted_count() == 1, what="the KV_BEGIN waiting on B")
        t0 = asyncio.get_running_loop().time()
        stopping = asyncio.create_task(agents["B"].shutdown())
        ev = await a.wait("w1", timeout=10)
        assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.SHUTTING_DOWN, ev
        assert asyncio.get_running_loop().time() - t0 < 5
        await stopping
        assert agents["A"].audit() == ({"post": 0, "send": 0, "recv": 0}, 0)


def _connect_as(path: str, uid: int, gid: int) -> bool:
    """Connect to the engine socket from a child process with other credentials; True if the
    agent kept the connection (it answers a hello), False if it closed it."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(path)
            s.sendall(p.encode(p.Hello(id=1, engine="probe")))
            data = s.recv(4096)
            os.write(w, b"1" if data and len(data) > 4 else b"0")
            code = 0
        except OSError:
            os.write(w, b"0")
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    return got == b"1"


async def test_engine_socket_admits_the_configured_group_only(tmp_sock_dir, engines):
    os.chmod(tmp_sock_dir, 0o755)
    tomls = two_site_toml(tmp_sock_dir)
    tomls["A"] = tomls["A"].replace('engine_socket = ',
                                    'engine_socket_mode = 0o666\nengine_gid = 4242\nengine_socket = ')
    async with run_agents(tomls, sites=("A",), wait_up=False) as agents:
        path = str(tmp_sock_dir / "A.sock")
        assert await asyncio.to_thread(_connect_as, path, 65534, 4242)
        assert not await asyncio.to_thread(_connect_as, path, 65534, 65534)
        assert metric(agents["A"], "pddwire_errors_total", code="BAD_REQUEST") >= 1


async def test_a_pipelining_engine_is_read_no_faster_than_it_is_served(tmp_sock_dir):
    """An engine that writes 4096 requests without waiting, to a server whose handler takes a
    millisecond: the server stops reading once MAX_QUEUED requests wait (the rest stays in the
    socket) and still answers every one, in order."""
    from pdd_wire.engine_server import MAX_QUEUED, EngineServer

    async def slow(conn, msg, fd):
        await asyncio.sleep(0.0002)
        return {}

    async def gone(conn):
        pass

    server = EngineServer(str(tmp_sock_dir / "e.sock"), 0o600, handler=slow, on_gone=gone, max_engines=4,
                          max_message=1 << 20, allowed_uids={os.getuid()})
    await server.start()
    try:
        reader, writer = await asyncio.open_unix_connection(str(tmp_sock_dir / "e.sock"))
        async with asyncio.timeout(5):
            while not server.engines:
                await asyncio.sleep(0.001)
        conn = next(iter(server.engines.values()))
        most = 0
        put = conn._queue.put_nowait

        def counting_put(item):
            nonlocal most
            put(item)
            most = max(most, conn._queue.qsize())

        conn._queue.put_nowait = counting_put
        n = 4 * MAX_QUEUED

        def req(i: int) -> bytes:  # ~1 KiB each, so that one 256 KiB read holds few of them
            return p.encode(p.SendTokens(id=i, request_id="r", to="B", tokens=list(range(200))))

        one = len(req(n))
        writer.write(b"".join(req(i + 1) for i in range(n)))
        dec = p.Decoder(to_agent=False)
        ids: list[int] = []
        async with asyncio.timeout(60):
            while len(ids) < n:
                ids += [m.id for m in dec.feed(await reader.read(1 << 16))]
        writer.close()
        assert ids == list(range(1, n + 1))
        # One read (256 KiB) may overshoot the mark; unbounded, the queue would hold nearly all n.
        assert MAX_QUEUED <= most <= MAX_QUEUED + (256 << 10) // one, most
    finally:
        await server.close()
