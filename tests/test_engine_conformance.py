"""The engine socket as proto/engine.md describes it, checked the way an engine written from the
spec alone sees it: raw bytes on the socket, fds as SCM_RIGHTS, and the replies, events and end
of connection that come back.

Found by an independent client: a malformed message must not take the requests read before it
with it (§2: every request gets exactly one reply, in order), request ids are 1..2^64-1, extents
and request ids are checked as the tables say, and an fd the agent cannot map read-write is the
engine's fault (BAD_REQUEST), not the agent's (INTERNAL).

Real in-process agents for sites A and B on loopback, or a real EngineServer with a handler
that waits where the order of a slow request and a protocol error is the point.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import os
import socket
import struct

import msgspec
import pytest

from conftest import until
from pdd_wire.engine import protocol as p
from pdd_wire.engine.client import EngineClient
from pdd_wire.engine_server import EngineServer
from pdd_wire.errors import EngineRequestError, ErrorCode, ProtocolError, TransportError
from pdd_wire.memory import BlockMap, Extent, Region, SharedMemory
from support.agents import run_agents, two_site_toml
from support.raw_engine import RawEngine

MiB = 1 << 20
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1+


def raw(obj: dict) -> bytes:
    """One engine message from a plain map, as an engine written from the spec would build it."""
    body = msgspec.msgpack.encode(obj)
    return struct.pack(">I", len(body)) + body


BOGUS = raw({"op": "bogus", "id": 2})


def replies(msgs: list[p.Msg]) -> list[tuple[str, int]]:
    return [(type(m).__name__, m.id) for m in msgs if isinstance(m, (p.Ok, p.Err))]


# ------------------------------------------------------------------ a protocol error ends the connection in order
async def test_a_request_before_a_malformed_one_in_the_same_write_is_answered_first(tmp_sock_dir):
    """status + a bogus op + status, in one write: the first is answered, then err {id 0}, then the
    end; the request after the offending bytes is never read."""
    async with run_agents(two_site_toml(tmp_sock_dir)):
        eng = await RawEngine(tmp_sock_dir / "A.sock").connect()
        try:
            await eng.send(raw({"op": "status", "id": 1}) + BOGUS + raw({"op": "status", "id": 3}))
            msgs = await eng.until_closed()
        finally:
            eng.close()
    assert replies(msgs) == [("Ok", 1), ("Err", 0)], msgs
    assert msgs[0].result["site"] == "A" and msgs[-1].code == ErrorCode.MALFORMED_BODY


@pytest.mark.parametrize("bad", [BOGUS, raw({"op": "status"}), raw({"op": "status", "id": -2}),
                                 struct.pack(">I", p.MAX_MESSAGE + 1)],
                         ids=["unknown_op", "id_0", "negative_id", "too_large"])
async def test_requests_before_a_malformed_message_are_carried_out(bad, tmp_sock_dir, engines):
    """An abort and a send_tokens sent in the same write as a malformed message are carried out
    (the peer's engine sees the abort and the tokens) and answered, before the err."""
    async with run_agents(two_site_toml(tmp_sock_dir)):
        b = await engines.connect(tmp_sock_dir / "B.sock", "b")
        await b.expect_tokens("ab", "A")  # b owns both requests, tied to A: it is told of each
        await b.expect_tokens("tk", "A")
        eng = await RawEngine(tmp_sock_dir / "A.sock").connect()
        try:
            await eng.send(raw({"op": "abort", "request_id": "ab", "id": 7})
                           + raw({"op": "send_tokens", "request_id": "tk", "to": "B", "tokens": [5, 6], "id": 8})
                           + bad)
            msgs = await eng.until_closed()
        finally:
            eng.close()
        assert replies(msgs) == [("Ok", 7), ("Ok", 8), ("Err", 0)], msgs
        assert msgs[-1].code in (ErrorCode.MALFORMED_BODY, ErrorCode.FRAME_TOO_LARGE)
        ev = await b.wait("ab", kinds=(p.RequestAborted,), timeout=10)
        assert ev.origin == "A/a1"
        assert (await b.wait_tokens("tk", timeout=10)).tokens == [5, 6]


async def test_a_register_paging_in_and_a_request_behind_it_are_answered_before_the_err(tmp_sock_dir):
    """A 256 MiB register is paging in, a set_load waits behind it, then a malformed message comes:
    both are answered, in order, then the err; the region is released once the connection ends."""
    async with run_agents(two_site_toml(tmp_sock_dir)) as ag:
        a = ag["A"]
        eng = await RawEngine(tmp_sock_dir / "A.sock").connect()
        try:
            with SharedMemory(256 * MiB) as mem:
                await eng.send(raw({"op": "register", "size": mem.size, "block_bytes": 2 * MiB, "id": 1}), fd=mem.fd)
                await eng.send(raw({"op": "set_load", "load": 0.5, "id": 2}))
                assert eng.nothing_yet(), "the register was answered before the malformed message was sent"
                await eng.send(raw({"op": "bogus", "id": 3}))
                msgs = await eng.until_closed(timeout=60)
                assert replies(msgs) == [("Ok", 1), ("Ok", 2), ("Err", 0)], msgs
                assert msgs[0].result["blocks"] == 128 and msgs[-1].code == ErrorCode.MALFORMED_BODY
                # The socket ends only once the agent let go of the memory (proto/engine.md §6).
                assert not a.regions and not a.engine_server.engines
        finally:
            eng.close()


@contextlib.asynccontextmanager
async def slow_server(tmp, *, read_deadline_s: float = 5.0, wait_s: float = 0.5):
    """An EngineServer whose aborts take ``wait_s`` (a request that waits its turn on the worker),
    and that answers status at once; ``served`` lists the requests handled, in order."""
    served: list[int] = []
    gone = asyncio.Event()

    async def handler(conn, msg, fd):
        served.append(msg.id)
        if isinstance(msg, p.Abort):
            await asyncio.sleep(wait_s)
        return {"n": msg.id}

    def now_handler(conn, msg):
        served.append(msg.id)
        return {"n": msg.id}

    async def on_gone(conn):
        gone.set()

    srv = EngineServer(str(tmp / "e.sock"), 0o600, handler=handler, on_gone=on_gone, max_engines=4,
                       max_message=1 << 20, allowed_uids={os.getuid()}, read_deadline_s=read_deadline_s,
                       now_handler=now_handler, now_types=frozenset({p.Status}))
    await srv.start()
    try:
        yield srv, served
    finally:
        await srv.close()


async def test_the_read_deadline_ends_the_connection_after_the_requests_read_before_it(tmp_sock_dir):
    """A request is being served when a begun message misses the read deadline: the request is
    answered, then comes the err {id 0, BAD_REQUEST}."""
    async with slow_server(tmp_sock_dir, read_deadline_s=0.2, wait_s=0.6) as (srv, served):
        eng = await RawEngine(tmp_sock_dir / "e.sock").connect()
        try:
            await eng.send(raw({"op": "abort", "request_id": "r", "id": 1}) + raw({"op": "status", "id": 2})
                           + struct.pack(">I", 100) + b"\x81")  # a message begun, never finished
            msgs = await eng.until_closed()
        finally:
            eng.close()
    assert replies(msgs) == [("Ok", 1), ("Ok", 2), ("Err", 0)], msgs
    assert msgs[-1].code == ErrorCode.BAD_REQUEST and "engine_read_s" in msgs[-1].message
    assert served == [1, 2]


async def test_a_read_that_breaks_the_fd_rules_is_not_carried_out_but_earlier_requests_are(tmp_sock_dir):
    """Five fds on one write (more than one recvmsg takes): none of that read's requests is served
    (which one the fds came with cannot be told), and no fd stays open in the agent; the request
    read before it is still answered before the err."""
    async with slow_server(tmp_sock_dir) as (srv, served):
        eng = await RawEngine(tmp_sock_dir / "e.sock").connect()
        with SharedMemory(64 << 10) as mem:
            mine = [os.dup(mem.fd) for _ in range(5)]
            try:
                await eng.send(raw({"op": "abort", "request_id": "r", "id": 1}))
                await until(lambda: served == [1])  # read, and being served
                fds = len(os.listdir("/proc/self/fd"))  # the agent's end of the socket among them
                eng.sock.sendmsg([raw({"op": "status", "id": 2}) + raw({"op": "abort", "request_id": "q", "id": 3})],
                                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", mine))])
                msgs = await eng.until_closed()
                await until(lambda: len(os.listdir("/proc/self/fd")) == fds - 1,
                            what="the agent closed every fd it received, and its end of the socket")
            finally:
                eng.close()
                for fd in mine:
                    os.close(fd)
    assert replies(msgs) == [("Ok", 1), ("Err", 0)], msgs
    assert msgs[-1].code == ErrorCode.BAD_REQUEST and "file descriptors" in msgs[-1].message
    assert served == [1]


def test_an_engine_message_nested_too_deep_is_malformed():
    """An unknown key whose value is nested 2,000 deep (about 2 KB) raised RecursionError out of
    the decoder, into the engine connection's read callback; it is MALFORMED_BODY now."""
    body = msgspec.msgpack.encode({"op": "status", "id": 1, "x": None})[:-1] + b"\x91" * 2000 + b"\xc0"
    with pytest.raises(p.BadMessage) as err:
        p.Decoder(to_agent=True).feed(struct.pack(">I", len(body)) + body)
    assert err.value.code == ErrorCode.MALFORMED_BODY


def test_the_decoder_hands_back_what_it_decoded_before_the_offending_bytes():
    dec = p.Decoder(to_agent=True)
    with pytest.raises(p.BadMessage) as err:
        dec.feed(raw({"op": "status", "id": 1}) + raw({"op": "set_load", "load": 1.0, "id": 2}) + BOGUS)
    assert isinstance(err.value, ProtocolError) and err.value.code == ErrorCode.MALFORMED_BODY
    assert [(type(m), m.id) for m in err.value.decoded] == [(p.Status, 1), (p.SetLoad, 2)]
    with pytest.raises(p.BadMessage) as err:
        p.Decoder(to_agent=True).feed(raw({"op": "status", "id": 1}) + struct.pack(">I", p.MAX_MESSAGE + 1))
    assert err.value.code == ErrorCode.FRAME_TOO_LARGE and [m.id for m in err.value.decoded] == [1]


# ------------------------------------------------------------------ request ids
@pytest.mark.parametrize("rid", [-1, -(1 << 63)])
def test_a_negative_request_id_is_malformed(rid):
    with pytest.raises(ProtocolError) as err:
        p.Decoder(to_agent=True).feed(raw({"op": "status", "id": rid}))
    assert err.value.code == ErrorCode.MALFORMED_BODY


@pytest.mark.parametrize("op,field", [("hello", "engine"), ("register", "name")])
def test_an_engine_or_region_name_over_256_characters_is_malformed(op, field):
    """Both names are in every log line about them: bounded (proto/engine.md §3)."""
    base = {"op": op, "id": 1, **({"size": 1, "block_bytes": 1} if op == "register" else {"engine": "e"})}
    (msg,) = p.Decoder(to_agent=True).feed(raw({**base, field: "é" * 256}))
    assert getattr(msg, field) == "é" * 256
    with pytest.raises(ProtocolError) as err:
        p.Decoder(to_agent=True).feed(raw({**base, field: "n" * 257}))
    assert err.value.code == ErrorCode.MALFORMED_BODY and field in str(err.value)


def test_the_largest_request_id_is_accepted_and_echoed():
    (msg,) = p.Decoder(to_agent=True).feed(raw({"op": "status", "id": (1 << 64) - 1}))
    assert msg.id == (1 << 64) - 1
    (ok,) = p.Decoder(to_agent=False).feed(p.encode(p.Ok(id=msg.id)))
    assert ok.id == (1 << 64) - 1


# ------------------------------------------------------------------ request_id, extents, unmappable fds
async def test_choose_pipeline_and_prefix_release_check_the_request_id(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)):
        a = await engines.connect(tmp_sock_dir / "A.sock", "a")
        for rid in ("", "r" * 257):
            with pytest.raises(EngineRequestError, match="request_id must be 1..256 bytes") as err:
                await a.choose_pipeline(rid, to="B", input_tokens=100, expected_output_tokens=10,
                                        kv_bytes_per_token=1000)
            assert err.value.code == ErrorCode.BAD_REQUEST
            with pytest.raises(EngineRequestError, match="request_id must be 1..256 bytes") as err:
                await a.prefix_release(rid)
            assert err.value.code == ErrorCode.BAD_REQUEST
        assert (await a.choose_pipeline("r" * 256, to="B", input_tokens=100, expected_output_tokens=10,
                                        kv_bytes_per_token=1000))["pipeline"]
        assert await a.prefix_release("r" * 256) is False


async def test_a_from_site_that_is_no_site_name_is_refused(tmp_sock_dir, engines):
    """``post_recv`` and ``expect_tokens`` tie a request to a site: "A/a1" (a node) or "" could
    never fill it -- the KV would be refused NOT_POSTED and the tokens dropped -- so they are
    BAD_REQUEST, naming the field; a site name no peer has (yet) is accepted."""
    async with run_agents(two_site_toml(tmp_sock_dir)):
        b = await engines.connect(tmp_sock_dir / "B.sock", "b")
        r = (await b.register(engines.memory(4 * MiB), block_bytes=MiB)).region
        for site in ("A/a1", "", "-A", "a" * 64, "A\n"):
            with pytest.raises(EngineRequestError, match="from_site .* is not a site name") as err:
                await b.post_recv("x", [(r, 0, 1)], from_site=site)
            assert err.value.code == ErrorCode.BAD_REQUEST
            with pytest.raises(EngineRequestError, match="from_site .* is not a site name") as err:
                await b.expect_tokens("x", site)
            assert err.value.code == ErrorCode.BAD_REQUEST
        await b.post_recv("x", [(r, 0, 1)], from_site="Z")  # no such peer yet: accepted
        assert await b.expect_tokens("y", "a" * 63) == 0


async def test_extents_are_checked_with_the_codes_the_spec_gives(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)):
        b = await engines.connect(tmp_sock_dir / "B.sock", "b")
        r = (await b.register(engines.memory(16 * MiB), block_bytes=MiB)).region
        cases = [([r, 0, 0], ErrorCode.BAD_REQUEST, rf"extent \[{r}, 0, 0\]: count must be >= 1"),
                 ([r, 3, -2], ErrorCode.BAD_REQUEST, "count must be >= 1"),
                 ([r, -1, 1], ErrorCode.OUT_OF_BOUNDS, "outside region"),
                 ([r, 15, 2], ErrorCode.OUT_OF_BOUNDS, "outside region"),
                 ([-1, 0, 1], ErrorCode.UNKNOWN_REGION, "not registered"),
                 ([r + 100, 0, 0], ErrorCode.UNKNOWN_REGION, "not registered")]
        for i, (extent, code, what) in enumerate(cases):
            with pytest.raises(EngineRequestError, match=what) as err:
                await b.post_recv(f"x{i}", [(r, 0, 1), tuple(extent)])  # the first extent is fine
            assert err.value.code == code, (extent, err.value)
            with pytest.raises(EngineRequestError, match=what) as err:
                await b.kv_stored([tuple(extent)], [1])
            assert err.value.code == code, (extent, err.value)
        await b.post_recv("fine", [(r, 15, 1)])


def test_a_blockmap_refuses_an_empty_extent_as_a_bad_request():
    regions = {1: Region(1, "host-fd", 4 * MiB, MiB, owner=None)}
    with pytest.raises(EngineRequestError, match=r"extent \[1, 2, 0\]") as err:
        BlockMap(regions, [Extent(1, 2, 0)])
    assert err.value.code == ErrorCode.BAD_REQUEST
    assert BlockMap(regions, [Extent(1, 3, 1)]).n_blocks == 1


def _sealed(size: int, seals: int) -> int:
    fd = os.memfd_create("kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | seals)
    return fd


async def test_an_fd_that_cannot_be_mapped_read_write_is_a_bad_request(tmp_sock_dir, engines):
    """A read-only fd of a sealed memfd, or a memfd sealed against writes, fails the agent's
    mapping with EACCES / EPERM: the engine's fault (BAD_REQUEST), and the connection stays."""
    async with run_agents(two_site_toml(tmp_sock_dir)) as ag:
        a = await engines.connect(tmp_sock_dir / "A.sock", "a")
        good = _sealed(MiB, 0)
        fds = [os.open(f"/proc/self/fd/{good}", os.O_RDONLY), _sealed(MiB, fcntl.F_SEAL_WRITE),
               _sealed(MiB, F_SEAL_FUTURE_WRITE)]
        try:
            for fd in fds:
                with pytest.raises(EngineRequestError, match="cannot be mapped for reading and writing") as err:
                    await a.register(fd, size=MiB, block_bytes=64 << 10)
                assert err.value.code == ErrorCode.BAD_REQUEST
            assert (await a.register(good, size=MiB, block_bytes=64 << 10)).n_blocks == 16
            assert len(ag["A"].regions) == 1
        finally:
            for fd in [good, *fds]:
                os.close(fd)


# ------------------------------------------------------------------ the end of a connection, as EngineClient sees it
async def test_engine_client_takes_a_reset_as_the_end_of_the_connection(tmp_sock_dir):
    """An agent that closes with the engine's requests unread resets the engine's socket (Linux);
    EngineClient takes that, like end-of-file, as the end: ``closed``, ``wait_closed()``, and its
    pending request fails (proto/engine.md §6)."""
    path = str(tmp_sock_dir / "reset.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    listener.setblocking(False)
    loop = asyncio.get_running_loop()

    async def agent() -> None:
        conn, _ = await loop.sock_accept(listener)
        dec = p.Decoder(to_agent=True)
        (hello,) = dec.feed(await loop.sock_recv(conn, 1 << 16))
        await loop.sock_sendall(conn, p.encode(p.Ok(id=hello.id, result={"site": "A"})))
        await until(lambda: bool(select_readable(conn)))  # the engine's status sits unread
        conn.close()

    task = asyncio.create_task(agent())
    try:
        eng = await EngineClient(path, "e").connect()
        status = asyncio.create_task(eng.status())
        await task
        with pytest.raises(TransportError):
            await status
        end = await asyncio.wait_for(eng.wait_closed(), 10)
        assert eng.closed and isinstance(end, TransportError) and "reset" in str(end).lower(), end
        await eng.close()
    finally:
        listener.close()


def select_readable(conn: socket.socket) -> bytes:
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return b""
