"""The engine socket under local abuse: a read deadline for begun messages (and for a connection
that never speaks), and connection slots per uid, against a real EngineServer on a real socket."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct

import pytest

from pdd_wire.engine import protocol as p
from pdd_wire.engine.client import EngineClient
from pdd_wire.engine_server import EngineServer
from pdd_wire.errors import EngineRequestError, ErrorCode
from support.other_uid import NOBODY, run_as


@contextlib.asynccontextmanager
async def server(tmp, *, read_deadline_s: float = 0.3, max_engines: int = 8, max_per_uid: int | None = None):
    async def handler(conn, msg, fd):
        return {"engine": conn.name}

    async def gone(conn):
        pass

    srv = EngineServer(str(tmp / "e.sock"), 0o666, handler=handler, on_gone=gone, max_engines=max_engines,
                       max_message=16 << 20, allowed_uids={os.getuid(), NOBODY}, max_per_uid=max_per_uid,
                       read_deadline_s=read_deadline_s)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.close()


async def until_closed(reader: asyncio.StreamReader) -> list:
    """Every message the server sent before it closed the connection."""
    dec = p.Decoder(to_agent=False)
    out = []
    async with asyncio.timeout(20):
        while data := await reader.read(65536):
            out += dec.feed(data)
    return out


async def ask(reader, writer, i: int) -> p.Msg:
    writer.write(p.encode(p.Status(id=i)))
    dec = p.Decoder(to_agent=False)
    async with asyncio.timeout(10):
        while True:
            got = dec.feed(await reader.read(65536))
            if got:
                return got[0]


async def test_a_length_prefix_then_silence_is_closed_and_others_are_served(tmp_sock_dir):
    async with server(tmp_sock_dir) as srv:
        good_r, good_w = await asyncio.open_unix_connection(str(tmp_sock_dir / "e.sock"))
        assert isinstance(await ask(good_r, good_w, 1), p.Ok)
        bad_r, bad_w = await asyncio.open_unix_connection(str(tmp_sock_dir / "e.sock"))
        bad_w.write(struct.pack(">I", 16 << 20) + b"\x81")  # 16 MiB announced, one byte sent
        msgs = await until_closed(bad_r)
        assert len(msgs) == 1 and isinstance(msgs[0], p.Err) and msgs[0].code == ErrorCode.BAD_REQUEST
        assert "5 bytes of a message" in msgs[0].message
        # The well-behaved engine, idle far longer than the deadline between its requests, stays.
        await asyncio.sleep(3 * srv.read_deadline_s)
        assert isinstance(await ask(good_r, good_w, 2), p.Ok)
        assert len(srv.engines) == 1
        good_w.close()
        bad_w.close()


async def test_a_connection_that_never_speaks_is_closed(tmp_sock_dir):
    async with server(tmp_sock_dir):
        r, w = await asyncio.open_unix_connection(str(tmp_sock_dir / "e.sock"))
        msgs = await until_closed(r)
        assert len(msgs) == 1 and msgs[0].code == ErrorCode.BAD_REQUEST and "no message" in msgs[0].message
        w.close()


async def test_a_stream_of_messages_split_across_reads_is_not_cut(tmp_sock_dir):
    """Many requests in one write, each crossing read boundaries: messages keep completing, so
    the deadline, counted from the last completed message, never fires."""
    async with server(tmp_sock_dir, read_deadline_s=0.5) as srv:
        r, w = await asyncio.open_unix_connection(str(tmp_sock_dir / "e.sock"))
        n = 2000
        w.write(b"".join(p.encode(p.SendTokens(id=i + 1, request_id="r", to="B", tokens=list(range(300))))
                         for i in range(n)))
        dec = p.Decoder(to_agent=False)
        ids: list[int] = []
        async with asyncio.timeout(60):
            while len(ids) < n:
                data = await r.read(1 << 16)
                assert data, "closed"
                ids += [m.id for m in dec.feed(data)]
        assert ids == list(range(1, n + 1)) and len(srv.engines) == 1
        w.close()


def _hello_as(path: str, uid: int) -> bytes:
    """From a child process of ``uid``: connect, say hello, return the reply bytes (b"" if closed)."""

    def hello() -> bytes:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(path)
        s.sendall(p.encode(p.Hello(id=1, engine="other-uid")))
        return s.recv(4096)

    return run_as(uid, hello)


async def test_one_uid_cannot_take_every_engine_slot(tmp_sock_dir):
    os.chmod(tmp_sock_dir, 0o755)
    async with server(tmp_sock_dir, read_deadline_s=60, max_engines=4, max_per_uid=2) as srv:
        path = str(tmp_sock_dir / "e.sock")
        held = []
        for i in range(2):
            r, w = await asyncio.open_unix_connection(path)
            assert isinstance(await ask(r, w, i + 1), p.Ok)
            held.append(w)
        # A third connection of the same uid is refused with a named reason...
        r, w = await asyncio.open_unix_connection(path)
        msgs = await until_closed(r)
        assert len(msgs) == 1 and msgs[0].code == ErrorCode.LIMIT_EXCEEDED and "max_engines_per_uid" in msgs[0].message
        w.close()
        # ...while another uid still gets in.
        got = p.Decoder(to_agent=False).feed(await asyncio.to_thread(_hello_as, path, NOBODY))
        assert len(got) == 1 and isinstance(got[0], p.Ok), got
        assert len(srv.engines) <= 3
        for w in held:
            w.close()


async def test_requests_answered_in_the_read_never_overtake_one_that_waits(tmp_sock_dir):
    """Requests of EngineServer.now_types are answered within the read (at most NOW_PER_READ of
    them), but never ahead of a request of the same engine that is queued or being served: the
    engine sees its requests answered in the order it sent them."""
    from pdd_wire import engine_server

    order: list[str] = []

    async def handler(conn, msg, fd):  # the request that waits (an abort, a deregister)
        order.append(f"wait{msg.id}")
        # Only the abort waits: a status queued behind it is served at once in its turn (41 of
        # them at 0.2 s each took 8.2 s of the 10 s below, which a loaded machine overran).
        if isinstance(msg, p.Abort):
            await asyncio.sleep(0.2)
        return {"n": msg.id}

    def now_handler(conn, msg):
        order.append(f"now{msg.id}")
        return {"n": msg.id}

    async def gone(conn):
        pass

    srv = EngineServer(str(tmp_sock_dir / "e.sock"), 0o600, handler=handler, on_gone=gone, max_engines=2,
                       max_message=1 << 20, allowed_uids={os.getuid()}, now_handler=now_handler,
                       now_types=frozenset({p.Status}))
    await srv.start()
    try:
        r, w = await asyncio.open_unix_connection(str(tmp_sock_dir / "e.sock"))
        n = engine_server.NOW_PER_READ + 8
        w.write(p.encode(p.Status(id=1)) + p.encode(p.Abort(id=2, request_id="r"))
                + b"".join(p.encode(p.Status(id=3 + i)) for i in range(n)))
        dec, got = p.Decoder(to_agent=False), []
        async with asyncio.timeout(10):
            while len(got) < n + 2:
                got += dec.feed(await r.read(65536))
        assert [m.id for m in got] == list(range(1, n + 3))  # answered in the order asked
        assert all(isinstance(m, p.Ok) and m.result == {"n": m.id} for m in got)
        assert order[:2] == ["now1", "wait2"]  # the first in the read; the rest behind the abort
        # A read of many such requests alone: NOW_PER_READ in it, the rest through the queue, in order.
        w.write(b"".join(p.encode(p.Status(id=100 + i)) for i in range(n)))
        got = []
        async with asyncio.timeout(10):
            while len(got) < n:
                got += dec.feed(await r.read(65536))
        assert [m.id for m in got] == [100 + i for i in range(n)]
        w.close()
    finally:
        await srv.close()


async def test_an_engine_sees_its_connection_end_only_once_the_agent_let_go_of_it(tmp_sock_dir):
    """An engine whose connection ends may reuse its blocks at once: the agent closes an engine's
    socket only after ``on_gone`` (its transfers cancelled, its memory released) has run, also
    when the agent is the one that ends the connection (here: a message never finished)."""
    released = asyncio.Event()
    order: list[str] = []

    async def handler(conn, msg, fd):
        return {}

    async def gone(conn):
        await released.wait()  # a transfer still being cancelled: its bulk writes not yet stopped
        order.append("let go")

    srv = EngineServer(str(tmp_sock_dir / "e.sock"), 0o600, handler=handler, on_gone=gone, max_engines=4,
                       max_message=16 << 20, allowed_uids={os.getuid()}, read_deadline_s=0.2)
    await srv.start()
    try:
        r, w = await asyncio.open_unix_connection(str(tmp_sock_dir / "e.sock"))
        assert isinstance(await ask(r, w, 1), p.Ok)
        w.write(struct.pack(">I", 64) + b"\x81")  # begun, never finished: closed after the read deadline
        closed = asyncio.ensure_future(until_closed(r))
        async with asyncio.timeout(10):
            while srv.engines:  # the agent has dropped the engine...
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        assert not closed.done()  # ...but its socket stays open while on_gone runs
        released.set()
        msgs = await closed
        order.append("eof")
        assert order == ["let go", "eof"]
        assert len(msgs) == 1 and msgs[0].code == ErrorCode.BAD_REQUEST and "engine_read_s" in msgs[0].message
        w.close()
    finally:
        released.set()
        await srv.close()


async def test_the_engine_client_takes_its_connection_as_ended_only_at_the_agents_close(tmp_sock_dir):
    """The agent ends a connection with ``err {id 0}`` and closes once it let go of the engine's
    memory: EngineClient fails its calls at the err, but ``wait_closed`` (and its waits) end
    only at that close -- an engine (the vLLM connector) frees its blocks then."""
    released = asyncio.Event()

    async def handler(conn, msg, fd):
        return {}

    async def gone(conn):
        await released.wait()

    srv = EngineServer(str(tmp_sock_dir / "e.sock"), 0o600, handler=handler, on_gone=gone, max_engines=4,
                       max_message=16 << 20, allowed_uids={os.getuid()}, read_deadline_s=0.2)
    await srv.start()
    try:
        eng = await EngineClient(str(tmp_sock_dir / "e.sock"), "e").connect()
        closed = asyncio.ensure_future(eng.wait_closed())
        eng._sock.send(struct.pack(">I", 64) + b"\x81")  # a message begun, never finished (as a broken engine)
        with pytest.raises(EngineRequestError, match="engine_read_s"):  # the err: calls fail at once
            async with asyncio.timeout(10):
                while True:
                    await eng.status()
                    await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert not closed.done()  # the agent still holds the engine's memory: not ended yet
        released.set()
        ended = await asyncio.wait_for(closed, 10)
        assert isinstance(ended, EngineRequestError) and ended.code == ErrorCode.BAD_REQUEST
        await eng.close()
    finally:
        released.set()
        await srv.close()
