"""Abuse of the agent's two doors, the WAN port and the engine socket, and engines that die
mid-transfer: the offender gets an ERROR / err (or just the close), loses its connection and
its resources, and everything else carries on. The A<->B session (A dials B) stays up on the
same connections throughout and keeps moving KV and tokens, before and after each abuse.

Real agents on the test's loop, real sockets, real memfd memory, a real engine process for
the deaths; no mocks.
"""

from __future__ import annotations

import array
import asyncio
import math
import os
import random
import socket
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from conftest import fill_random, metric, same_bytes, until
from pdd_tools.shaper import Shaper
from pdd_wire.engine import protocol as p
from pdd_wire.errors import EngineRequestError, ErrorCode
from pdd_wire.memory import SharedMemory
from pdd_wire.transport.tcp import KIND_BULK, KIND_CONTROL, preamble
from pdd_wire.wire import FrameReader, decode_body, encode_body, encode_bytes
from pdd_wire.wire import messages as m
from pdd_wire.wire.frame import HEADER, MAGIC, FrameType, Header, Lane, encode_header
from support.agents import free_port, run_agents, two_site_toml
from support.raw_engine import RawEngine

MiB = 1 << 20
KiB = 1 << 10
MAX_BODY = 64 * KiB  # limits.max_body of both agents here
HANDSHAKE_S = 0.5
ENGINE_PROC = Path(__file__).parent / "support" / "engine_proc.py"
CTRL = preamble(KIND_CONTROL)
BULK = preamble(KIND_BULK)


def _tomls(tmp, **kw) -> dict:
    """Both sites, with a short handshake timeout and a 64 KiB control body limit; plaintext
    (tls.allow_plaintext), so the frames below reach the frame decoder as a peer's would (with
    TLS, the default, they never get past the TLS handshake: tests/test_auth_default.py)."""
    kw.setdefault("plaintext", True)
    t = two_site_toml(tmp, extra=f"[limits]\nmax_body = {MAX_BODY}\n", **kw)
    for s in "AB":
        t[s] = t[s].replace("[timeouts]\n", f"[timeouts]\nhandshake_s = {HANDSHAKE_S}\n")
    return t


def healthy(ag) -> bool:
    return all(s.is_up and len(s.links) == s.streams for a in ag.values() for s in a.sessions.values())


# ------------------------------------------------------------------------------ the served pair
class Served:
    """An engine on each site, moving a request's KV A->B and tokens both ways, on demand."""

    SIZE = 8 * MiB
    BLOCK = 512 * KiB

    def __init__(self, engines, tmp, ag) -> None:
        self.engines, self.tmp, self.ag = engines, tmp, ag
        self.rounds = 0

    async def start(self) -> "Served":
        self.ea = await self.engines.connect(self.tmp / "A.sock", "prefill")
        self.eb = await self.engines.connect(self.tmp / "B.sock", "decode")
        self.src, self.dst = self.engines.memory(self.SIZE), self.engines.memory(self.SIZE)
        self.ra = await self.ea.register(self.src, block_bytes=self.BLOCK)
        self.rb = await self.eb.register(self.dst, block_bytes=self.BLOCK)
        self.a_sess = self.ag["A"].sessions["B/b1"]
        self.b_sess = self.ag["B"].sessions["A/a1"]
        self.controls = (self.a_sess.control, self.b_sess.control)
        self.reconnects = self._reconnects()
        return self

    def _reconnects(self):
        return (metric(self.ag["A"], "pddwire_reconnects_total", peer="B/b1"),
                metric(self.ag["B"], "pddwire_reconnects_total", peer="A/a1"))

    async def round(self) -> None:
        """One request's KV, byte-identical, and tokens in both directions."""
        self.rounds += 1
        rid = f"served-{self.rounds}"
        n = self.SIZE // self.BLOCK
        await fill_random(self.src)
        self.dst.buf[:] = bytes(self.SIZE)
        await self.eb.post_recv(rid, [self.rb.blocks(0, n)], from_site="A")
        await self.ea.send_kv(rid, [self.ra.blocks(0, n)], to=["B"])
        got = await self.eb.wait(rid, timeout=30)
        assert isinstance(got, p.KvReceived) and got.bytes == self.SIZE, got
        sent = await self.ea.wait(rid, timeout=30)
        assert isinstance(sent, p.KvSent), sent
        assert await same_bytes(self.dst.buf, self.src.buf)
        await self.ea.send_tokens(rid, "B", [self.rounds, 2, 3])
        assert (await self.eb.wait_tokens(rid, timeout=10)).tokens == [self.rounds, 2, 3]
        await self.eb.send_tokens(rid, "A", [7, self.rounds])
        assert (await self.ea.wait_tokens(rid, timeout=10)).tokens == [7, self.rounds]

    async def barrier(self) -> None:
        """Tokens A->B on the control connection, behind whatever was sent before them: back
        when they are delivered, or as soon as a reconnect is counted (the session broke)."""
        self.rounds += 1
        rid = f"barrier-{self.rounds}"
        before = self._reconnects()
        await self.ea.send_tokens(rid, "B", [self.rounds])
        got = asyncio.ensure_future(self.eb.wait_tokens(rid))
        try:
            await until(lambda: got.done() or self._reconnects() != before, 10, "tokens relayed")
        finally:
            if not got.done():
                got.cancel()
            await asyncio.gather(got, return_exceptions=True)

    def assert_session_untouched(self) -> None:
        """Up the whole time: the very same control connections, no reconnect counted."""
        assert self._reconnects() == self.reconnects, "the session was re-established (reconnects counted)"
        assert self.a_sess.is_up and self.b_sess.is_up, "the session is down"
        assert (self.a_sess.control, self.b_sess.control) == self.controls, "the control connections changed"
        assert metric(self.ag["A"], "pddwire_peer_up", peer="B/b1") == 1
        assert metric(self.ag["B"], "pddwire_peer_up", peer="A/a1") == 1


# ------------------------------------------------------------------------------ WAN abuse
def frame_header(*, version=1, type=FrameType.HELLO, flags=0, lane=0, body_len=0, payload_len=0,
                 check=0, reserved=0) -> bytes:
    return HEADER.pack(MAGIC, version, type, flags, lane, 0, 0, body_len, payload_len, 0, check, reserved)


def hello(site="A", node="a1", versions=(1,)) -> bytes:
    return encode_bytes(FrameType.HELLO, encode_body(m.Hello(versions=list(versions), site=site, node=node,
                                                             incarnation=4242)))


def bulk_hello(token: int, *, site="A", node="a1", stream=0) -> bytes:
    return encode_bytes(FrameType.BULK_HELLO, encode_body(m.BulkHello(session=token, stream=stream, site=site,
                                                                      node=node)))


def _garbage(n: int, seed: int) -> bytes:
    g = random.Random(seed).randbytes(n)
    return b"X" + g[1:]  # never starts like "PDDW"


def _bad_check(frame: bytes) -> bytes:
    raw = bytearray(frame)
    raw[40] ^= 0x01
    return bytes(raw)


def _token(ag) -> int:
    return ag["B"].sessions["A/a1"].token


@dataclass
class Case:
    """What to send (given the agents), whether to half-close after it, and what must come back:
    an ERROR frame with ``code``, or nothing at all (``code`` None). ``timeout``: the agent
    waits ``handshake_s`` for more, then closes (an ERROR HANDSHAKE_TIMEOUT may precede the close)."""

    data: Callable[[dict], bytes]
    code: ErrorCode | None
    half_close: bool = False
    timeout: bool = False


WAN_CASES = {
    "garbage_instead_of_preamble": Case(lambda ag: _garbage(300, 1), None),
    "preamble_of_another_version": Case(lambda ag: b"PDDWC\x02\x00\x00" + hello(), None),
    "preamble_of_unknown_kind": Case(lambda ag: b"PDDWZ\x01\x00\x00" + hello(), None),
    "control_preamble_then_garbage": Case(lambda ag: CTRL + _garbage(300, 2), ErrorCode.BAD_MAGIC),
    "bulk_preamble_then_garbage": Case(lambda ag: BULK + _garbage(48, 3), ErrorCode.BAD_MAGIC),
    "control_preamble_truncated_header_then_close": Case(lambda ag: CTRL + hello()[:20], None, half_close=True),
    "control_preamble_truncated_body_then_close": Case(lambda ag: CTRL + hello()[:60], None, half_close=True),
    "body_larger_than_max_body": Case(lambda ag: CTRL + frame_header(body_len=MAX_BODY + 1), ErrorCode.FRAME_TOO_LARGE),
    "huge_body_len": Case(lambda ag: CTRL + frame_header(body_len=2**32 - 1), ErrorCode.FRAME_TOO_LARGE),
    "payload_on_control_connection": Case(lambda ag: CTRL + frame_header(payload_len=1), ErrorCode.FRAME_TOO_LARGE),
    "bulk_payload_over_64MiB": Case(lambda ag: BULK + frame_header(type=FrameType.KV_CHUNK, lane=Lane.BULK,
                                                                   payload_len=64 * MiB + 1),
                                    ErrorCode.FRAME_TOO_LARGE),
    "frame_version_2": Case(lambda ag: CTRL + frame_header(version=2, body_len=10),
                            ErrorCode.UNSUPPORTED_FRAME_VERSION),
    "bad_header_checksum": Case(lambda ag: CTRL + _bad_check(hello()), ErrorCode.HEADER_CHECKSUM),
    "reserved_header_bytes_set": Case(lambda ag: CTRL + frame_header(reserved=1), ErrorCode.MALFORMED_BODY),
    "hello_with_malformed_body": Case(lambda ag: CTRL + encode_bytes(FrameType.HELLO, b"\xc1\xc1"),
                                      ErrorCode.MALFORMED_BODY),
    "ping_instead_of_hello": Case(lambda ag: CTRL + encode_bytes(FrameType.PING, encode_body(m.Ping(1, 2))),
                                  ErrorCode.UNEXPECTED_FRAME),
    "hello_offering_only_version_99": Case(lambda ag: CTRL + hello(versions=(99,)),
                                           ErrorCode.UNSUPPORTED_PROTOCOL_VERSION),
    "hello_from_unknown_site": Case(lambda ag: CTRL + hello(site="Z", node="z1"), ErrorCode.UNKNOWN_PEER),
    "hello_from_unknown_node_of_a_known_site": Case(lambda ag: CTRL + hello(node="a9"), ErrorCode.UNKNOWN_PEER),
    "bulk_hello_with_wrong_session_token": Case(lambda ag: BULK + bulk_hello(_token(ag) ^ 0x5A5A),
                                                ErrorCode.UNKNOWN_SESSION),
    "bulk_hello_with_the_token_but_another_node": Case(lambda ag: BULK + bulk_hello(_token(ag), node="a9"),
                                                       ErrorCode.UNKNOWN_SESSION),
    "bulk_hello_with_stream_out_of_range": Case(lambda ag: BULK + bulk_hello(_token(ag), stream=99),
                                                ErrorCode.OUT_OF_RANGE),
    "bulk_hello_with_stream_beyond_the_configured": Case(lambda ag: BULK + bulk_hello(_token(ag), stream=10),
                                                         ErrorCode.UNEXPECTED_FRAME),
    "kv_chunk_before_bulk_hello": Case(lambda ag: BULK + encode_bytes(FrameType.KV_CHUNK, lane=Lane.BULK,
                                                                      transfer_id=1, payload=[b"k" * 1000]),
                                       ErrorCode.UNEXPECTED_FRAME),
    "silent_connection": Case(lambda ag: b"", None, timeout=True),
    "silent_control_connection": Case(lambda ag: CTRL, None, timeout=True),
    "silent_bulk_connection": Case(lambda ag: BULK, None, timeout=True),
    # A payload before BULK_HELLO is refused from its header: no scratch is spent on it.
    "bulk_payload_before_hello_stalled": Case(
        lambda ag: BULK + encode_header(Header(type=FrameType.KV_CHUNK, lane=Lane.BULK, payload_len=8 * MiB), b"")
        + b"\0" * 1000, ErrorCode.UNEXPECTED_FRAME),
}


async def poke(port: int, data: bytes, *, half_close: bool, timeout: float = 10) -> tuple[bytes, str]:
    """Connect to the WAN port, send ``data``, read until the agent ends the connection.
    Returns what came back and how it ended ("eof" or "reset")."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got, how = b"", "eof"
    try:
        try:
            if data:
                writer.write(data)
                await writer.drain()
            if half_close:
                writer.write_eof()
        except ConnectionError:
            how = "reset"
        async with asyncio.timeout(timeout):
            while True:
                try:
                    chunk = await reader.read(65536)
                except ConnectionResetError:
                    how = "reset"
                    break
                if not chunk:
                    break
                got += chunk
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
    return got, how


def check_answer(case: Case, got: bytes) -> None:
    r = FrameReader(max_body=1 << 20)
    frames = r.feed(got)
    assert r.idle, f"a partial frame came back: {got!r}"
    answers = [decode_body(f.header.type, f.body) for f in frames]
    if case.code is not None:
        assert len(answers) == 1 and isinstance(answers[0], m.Error), answers
        assert answers[0].code == case.code, (ErrorCode(answers[0].code).name, answers[0].message)
        assert answers[0].message and len(answers[0].message) <= 512
    elif case.timeout:
        # proto/handshake.md says a timed-out handshake is closed without an ERROR; the code
        # sends ERROR HANDSHAKE_TIMEOUT first. Either way nothing else may come back.
        assert answers == [] or (len(answers) == 1 and isinstance(answers[0], m.Error)
                                 and answers[0].code == ErrorCode.HANDSHAKE_TIMEOUT), answers
    else:
        assert got == b"", answers


def inbound(agent) -> int:
    """WAN connections the agent holds open (the count limits.max_peer_connections caps)."""
    return agent.inbound.open_connections


@pytest.mark.parametrize("name", list(WAN_CASES))
async def test_wan_abuse_is_refused_and_the_session_keeps_serving(name, tmp_sock_dir, engines):
    case = WAN_CASES[name]
    async with run_agents(_tomls(tmp_sock_dir)) as ag:
        served = await Served(engines, tmp_sock_dir, ag).start()
        await served.round()
        held = inbound(ag["B"])
        got, _how = await poke(ag["B"].wan_address[1], case.data(ag), half_close=case.half_close)
        check_answer(case, got)
        # The offender's connection slot is given back, nothing else was touched.
        await until(lambda: inbound(ag["B"]) == held)
        served.assert_session_untouched()
        await served.round()
        served.assert_session_untouched()
        assert len(ag["B"].sessions["A/a1"].links) == ag["B"].sessions["A/a1"].streams


async def test_every_wan_abuse_at_once_during_a_transfer(tmp_sock_dir, engines):
    """All of the above, concurrently, while a 64 MiB transfer and token traffic are running."""
    async with run_agents(_tomls(tmp_sock_dir, chunk=MiB)) as ag:
        served = await Served(engines, tmp_sock_dir, ag).start()
        ea, eb = served.ea, served.eb
        size = 64 * MiB
        src, dst = engines.memory(size), engines.memory(size)
        await fill_random(src)
        ra = await ea.register(src, block_bytes=MiB)
        rb = await eb.register(dst, block_bytes=MiB)
        held = inbound(ag["B"])
        await eb.post_recv("big", [rb.blocks(0, 64)])
        await ea.send_kv("big", [ra.blocks(0, 64)], to=["B"])
        await ea.send_tokens("big", "B", [1, 2, 3])
        port = ag["B"].wan_address[1]
        names = list(WAN_CASES)  # with the session's own, well below limits.max_peer_connections
        results = await asyncio.gather(*(poke(port, WAN_CASES[n].data(ag), half_close=WAN_CASES[n].half_close)
                                         for n in names))
        for n, (got, _) in zip(names, results):
            check_answer(WAN_CASES[n], got)
        assert (await eb.wait_tokens("big", timeout=10)).tokens == [1, 2, 3]
        assert isinstance(await eb.wait("big", timeout=60), p.KvReceived)
        assert isinstance(await ea.wait("big", timeout=10), p.KvSent)
        assert await same_bytes(dst.buf, src.buf)
        await until(lambda: inbound(ag["B"]) == held)
        served.assert_session_untouched()
        await served.round()
        served.assert_session_untouched()
        # Refusals are counted by code.
        assert metric(ag["B"], "pddwire_errors_total", code="UNKNOWN_PEER") == 2
        assert metric(ag["B"], "pddwire_errors_total", code="UNSUPPORTED_PROTOCOL_VERSION") == 1


# ------------------------------------------------------------------------------ engine socket abuse
def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _garbage_body(eng: RawEngine, ag) -> None:
    await eng.send(struct.pack(">I", 32) + b"\xc1" * 32)
    msgs = await eng.until_closed()
    assert len(msgs) == 1 and isinstance(msgs[0], p.Err), msgs
    assert msgs[0].id == 0 and msgs[0].code == ErrorCode.MALFORMED_BODY


async def _random_garbage(eng: RawEngine, ag) -> None:
    await eng.send(b"\x7f" + random.Random(5).randbytes(4095))
    msgs = await eng.until_closed()
    assert len(msgs) == 1 and isinstance(msgs[0], p.Err) and msgs[0].id == 0, msgs
    assert msgs[0].code == ErrorCode.FRAME_TOO_LARGE


async def _oversized_length(eng: RawEngine, ag) -> None:
    await eng.send(p.encode(p.Status(id=1)))
    assert isinstance(await eng.reply(), p.Ok)
    await eng.send(struct.pack(">I", p.MAX_MESSAGE + 1))  # the prefix alone: no body follows
    msgs = await eng.until_closed()
    assert len(msgs) == 1 and isinstance(msgs[0], p.Err), msgs
    assert msgs[0].id == 0 and msgs[0].code == ErrorCode.FRAME_TOO_LARGE


async def _register_without_fd(eng: RawEngine, ag) -> None:
    await eng.send(p.encode(p.Register(id=5, size=MiB, block_bytes=64 * KiB)))
    r = await eng.reply()
    assert isinstance(r, p.Err) and r.id == 5 and r.code == ErrorCode.BAD_REQUEST, r
    # Still usable: a status request is answered, and a proper register works.
    await eng.send(p.encode(p.Status(id=6)))
    r = await eng.reply()
    assert isinstance(r, p.Ok) and r.id == 6 and r.result["site"] == "A", r
    with SharedMemory(MiB) as mem:
        fds = _open_fds()
        # Refused registers close the fd the agent received (no leak in the agent process).
        await eng.send(p.encode(p.Register(id=7, size=4 * MiB, block_bytes=64 * KiB)), fd=mem.fd)
        r = await eng.reply()
        assert isinstance(r, p.Err) and r.id == 7 and r.code == ErrorCode.OUT_OF_BOUNDS, r
        await eng.send(p.encode(p.Register(id=8, size=MiB, block_bytes=64 * KiB, kind="cuda-ipc")), fd=mem.fd)
        r = await eng.reply()
        assert isinstance(r, p.Err) and r.id == 8 and r.code == ErrorCode.BAD_REQUEST, r
        await eng.send(p.encode(p.Register(id=9, size=MiB, block_bytes=0)), fd=mem.fd)
        r = await eng.reply()
        assert isinstance(r, p.Err) and r.id == 9 and r.code == ErrorCode.BAD_REQUEST, r
        assert _open_fds() == fds
        before = len(ag["A"].regions)
        await eng.send(p.encode(p.Register(id=10, size=MiB, block_bytes=64 * KiB)), fd=mem.fd)
        r = await eng.reply()
        assert isinstance(r, p.Ok) and r.id == 10 and r.result["blocks"] == 16, r
        assert len(ag["A"].regions) == before + 1
        await eng.send(p.encode(p.PostRecv(id=11, request_id="raw-post", blocks=[(r.result["region"], 0, 4)])))
        assert isinstance(await eng.reply(), p.Ok)
        assert "raw-post" in ag["A"].posts
    # Going away releases what it held.
    eng.close()
    await until(lambda: len(ag["A"].regions) == before and "raw-post" not in ag["A"].posts)


async def _unknown_op(eng: RawEngine, ag) -> None:
    await eng.send(p.encode(p.Status(id=1)))
    assert isinstance(await eng.reply(), p.Ok)
    body = encode_body({"op": "frobnicate", "id": 7, "x": 1})
    await eng.send(struct.pack(">I", len(body)) + body)
    msgs = await eng.until_closed()
    assert len(msgs) == 1 and isinstance(msgs[0], p.Err), msgs
    assert msgs[0].id == 0 and msgs[0].code == ErrorCode.MALFORMED_BODY


async def _holder_then_garbage(eng: RawEngine, ag) -> None:
    """An engine holding memory and a posted receive breaks the protocol: all of it is released."""
    before = len(ag["A"].regions)
    with SharedMemory(MiB) as mem:
        await eng.send(p.encode(p.Register(id=1, size=MiB, block_bytes=64 * KiB)), fd=mem.fd)
        r = await eng.reply()
        assert isinstance(r, p.Ok), r
        await eng.send(p.encode(p.PostRecv(id=2, request_id="held", blocks=[(r.result["region"], 0, 16)])))
        assert isinstance(await eng.reply(), p.Ok)
        assert len(ag["A"].regions) == before + 1 and "held" in ag["A"].posts
        await eng.send(b"\xff\xff\xff\xff")
        msgs = await eng.until_closed()
        assert [type(x) for x in msgs] == [p.Err] and msgs[0].code == ErrorCode.FRAME_TOO_LARGE
        await until(lambda: len(ag["A"].regions) == before and "held" not in ag["A"].posts)
    assert metric(ag["A"], "pddwire_regions_registered") == before


def _refused_for_fds(msgs: list, what: str) -> None:
    """The agent's answer to a broken fd rule: one err {id 0, BAD_REQUEST} naming it, then the close."""
    assert len(msgs) == 1 and isinstance(msgs[0], p.Err), msgs
    assert msgs[0].id == 0 and msgs[0].code == ErrorCode.BAD_REQUEST and what in msgs[0].message, msgs


async def _too_many_fds(eng: RawEngine, ag) -> None:
    """More fds than one recvmsg takes: the connection is closed, and no fd stays behind."""
    with SharedMemory(64 * KiB) as mem:
        mine = [os.dup(mem.fd) for _ in range(6)]
        fds = _open_fds()
        try:
            eng.sock.sendmsg([p.encode(p.Status(id=1))],
                             [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", mine))])
            _refused_for_fds(await eng.until_closed(), "more than 4 file descriptors in one message")
            # Every fd that arrived is closed, and so is the agent's end of this connection.
            await until(lambda: _open_fds() == fds - 1, what="the agent closed every fd it received")
        finally:
            for fd in mine:
                os.close(fd)


async def _unclaimed_fds(eng: RawEngine, ag) -> None:
    """fds on messages that are not registers: up to 4 are held for later registers; past that the
    engine is told and closed, and every fd it sent is closed."""
    with SharedMemory(64 * KiB) as mem:
        mine = [os.dup(mem.fd) for _ in range(6)]
        fds = _open_fds()
        try:
            for i, group in enumerate((mine[:3], mine[3:])):
                eng.sock.sendmsg([p.encode(p.Status(id=i + 1))],
                                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", group))])
                if i == 0:  # 3 unclaimed: within the limit, served
                    assert isinstance(await eng.reply(), p.Ok)
            _refused_for_fds(await eng.until_closed(), "6 file descriptors sent without register requests")
            await until(lambda: _open_fds() == fds - 1, what="the agent closed every fd it received")
        finally:
            for fd in mine:
                os.close(fd)


async def _pipelined_registers(eng: RawEngine, ag) -> None:
    """Registers sent one after another without waiting, each with its fd on its first byte (as
    proto/engine.md §4 allows): every one is served, in order, with its own memory, far more than
    4 in flight; the agent reads only about 16 of them ahead (the rest wait in the socket)."""
    from pdd_wire.engine_server import MAX_PENDING_REGISTERS

    n = 40
    before = len(ag["A"].regions)
    mems = [SharedMemory(64 * KiB) for _ in range(n)]
    try:
        for i, mem in enumerate(mems):
            mem.buf[:8] = i.to_bytes(8, "little")  # which pool a region maps, to check it got its own fd
            await eng.send(p.encode(p.Register(id=i + 1, size=64 * KiB, block_bytes=64 * KiB)), fd=mem.fd)
        conn = max(ag["A"].engine_server.engines.values(), key=lambda c: c.number)  # this one: the newest
        most = 0
        replies = []
        while len(replies) < n:
            most = max(most, conn.pending_registers)
            replies.append(await eng.reply())
        assert [type(r) for r in replies] == [p.Ok] * n, replies
        assert [r.id for r in replies] == list(range(1, n + 1))
        assert most <= MAX_PENDING_REGISTERS + 4, most  # checked after each read (of at most 4 fds)
        regions = [ag["A"].regions[r.result["region"]] for r in replies]
        assert [int.from_bytes(reg.view()[:8], "little") for reg in regions] == list(range(n))
    finally:
        eng.close()
        for mem in mems:
            mem.close()
    await until(lambda: len(ag["A"].regions) == before)


async def _request_without_id(eng: RawEngine, ag) -> None:
    """id 0 belongs to events and connection errors: a request carrying it is refused as malformed."""
    await eng.send(p.encode(p.Status(id=1)))
    assert isinstance(await eng.reply(), p.Ok)
    body = encode_body({"op": "status"})
    await eng.send(struct.pack(">I", len(body)) + body)
    msgs = await eng.until_closed()
    assert len(msgs) == 1 and isinstance(msgs[0], p.Err), msgs
    assert msgs[0].id == 0 and msgs[0].code == ErrorCode.MALFORMED_BODY and "without an id" in msgs[0].message


ENGINE_CASES = {
    "fds_no_register_claims": _unclaimed_fds,
    "registers_pipelined": _pipelined_registers,
    "request_without_id": _request_without_id,
    "too_many_fds_in_one_message": _too_many_fds,
    "garbage_body": _garbage_body,
    "random_garbage": _random_garbage,
    "oversized_length_prefix": _oversized_length,
    "register_without_fd_and_bad_registers": _register_without_fd,
    "unknown_op": _unknown_op,
    "engine_holding_memory_sends_garbage": _holder_then_garbage,
}


@pytest.mark.parametrize("name", list(ENGINE_CASES))
async def test_engine_socket_abuse_hits_only_the_offender(name, tmp_sock_dir, engines):
    async with run_agents(_tomls(tmp_sock_dir)) as ag:
        served = await Served(engines, tmp_sock_dir, ag).start()  # its engines stay connected
        await served.round()
        n_engines = len(ag["A"].engine_server.engines)
        eng = await RawEngine(tmp_sock_dir / "A.sock").connect()
        try:
            await until(lambda: len(ag["A"].engine_server.engines) == n_engines + 1)
            await ENGINE_CASES[name](eng, ag)
        finally:
            eng.close()
        await until(lambda: len(ag["A"].engine_server.engines) == n_engines)
        # The other engines, connected all along, are still served, on the same session.
        assert (await served.ea.status())["site"] == "A"
        await served.round()
        served.assert_session_untouched()
        await until(lambda: metric(ag["A"], "pddwire_engines_connected") == n_engines)


# ------------------------------------------------------------------------------ requests the wire cannot carry
@pytest.mark.parametrize("deadline", [math.inf, math.nan, 1e300, 2e16], ids=["inf", "nan", "1e300", "2e16"])
async def test_send_kv_with_a_deadline_the_wire_cannot_carry(deadline, tmp_sock_dir, engines):
    """``deadline_s`` is a float from the engine; KV_BEGIN carries the remaining budget as a u64
    of milliseconds. The agent must refuse it (or carry it), and either way leave nothing
    behind that breaks the session later.

    BUG: announcing the transfer raises (OverflowError / ValueError) after it was registered in
    the session: the engine gets err INTERNAL, the transfer stays open, and every later
    reconnect re-announces it inside the WELCOME handler, which raises again: the session
    never comes back up (it reconnects about 20 times a second, forever)."""
    ports = {"A": free_port(), "B": free_port()}
    async with Shaper(target=("127.0.0.1", ports["B"])) as relay:
        async with run_agents(_tomls(tmp_sock_dir, ports=ports, wan_override={"B": f"127.0.0.1:{relay.port}"})) as ag:
            served = await Served(engines, tmp_sock_dir, ag).start()
            await served.round()
            xa, xb = engines.memory(MiB), engines.memory(MiB)
            ra = await served.ea.register(xa, block_bytes=MiB)
            rb = await served.eb.register(xb, block_bytes=MiB)
            await served.eb.post_recv("odd", [rb.blocks(0, 1)])
            try:
                await served.ea.send_kv("odd", [ra.blocks(0, 1)], to=["B"], deadline_s=deadline)
                refused = None
            except EngineRequestError as exc:
                refused = exc
            if refused is None:  # carried: it must then complete like any other
                assert isinstance(await served.eb.wait("odd", timeout=30), p.KvReceived)
            # A link drop: the session must come back, once.
            before = metric(ag["A"], "pddwire_reconnects_total", peer="B/b1")
            relay.abort_all()
            await until(lambda: (healthy(ag) and metric(ag["A"], "pddwire_reconnects_total", peer="B/b1") > before)
                        or metric(ag["A"], "pddwire_reconnects_total", peer="B/b1") >= before + 3, 10,
                        "the session back up after a link drop")
            assert metric(ag["A"], "pddwire_reconnects_total", peer="B/b1") == before + 1, \
                "the session keeps failing right after each reconnect"
            await served.round()
            if refused is not None:
                assert refused.code == ErrorCode.BAD_REQUEST, refused
                assert ag["A"].describe()["transfers"] == [], "a refused send_kv left a transfer open"


SMALL_BODY = 4096  # the smallest limits.max_body allowed


async def _kv_long_request_id(served, region) -> None:
    await served.ea.send_kv("k" * (SMALL_BODY + 100), [region.blocks(0, 1)], to=["B"])


async def _tokens_long_request_id(served, region) -> None:
    await served.ea.send_tokens("t" * (SMALL_BODY + 100), "B", [1, 2, 3])


async def _many_tokens(served, region) -> None:
    # 1000 ordinary token ids (5 msgpack bytes each): well under limits.max_tokens_per_frame
    # (8192), yet a 5 KB body, over the peer's max_body; both are valid settings.
    await served.ea.send_tokens("many", "B", [100_000 + i for i in range(1000)])


TOO_BIG = {
    "send_kv_request_id_over_max_body": _kv_long_request_id,
    "send_tokens_request_id_over_max_body": _tokens_long_request_id,
    "send_tokens_frame_over_max_body": _many_tokens,
}


@pytest.mark.parametrize("name", list(TOO_BIG))
async def test_engine_request_too_big_for_the_peers_max_body_does_not_break_the_session(name, tmp_sock_dir,
                                                                                        engines):
    """proto/frames.md: a sender MUST NOT send a body larger than the peer's advertised max_body.
    An engine request that would need one must be refused (or split), not put on the wire.

    BUG: the agent sends it; the peer answers FRAME_TOO_LARGE and closes the control connection;
    on reconnect the frame is sent again (the transfer is re-announced, unacknowledged tokens are
    resent), so the session for every engine flaps for the transfer's whole deadline (tokens:
    for ever)."""
    tomls = two_site_toml(tmp_sock_dir, extra=f"[limits]\nmax_body = {SMALL_BODY}\n")
    async with run_agents(tomls) as ag:
        served = await Served(engines, tmp_sock_dir, ag).start()
        await served.round()
        extra = engines.memory(MiB)
        region = await served.ea.register(extra, block_bytes=MiB)
        try:
            await TOO_BIG[name](served, region)
        except EngineRequestError as exc:
            assert exc.code in (ErrorCode.BAD_REQUEST, ErrorCode.LIMIT_EXCEEDED), exc
        await served.barrier()
        served.assert_session_untouched()
        await served.round()
        served.assert_session_untouched()


# ------------------------------------------------------------------------------ engines that die
CHUNK = 64 * KiB
DOOMED = 64 * MiB
AFTER = 4 * MiB // CHUNK  # blocks of the transfer that follows a death
QUEUE = 256 * KiB  # the relay reads no more while this much waits out its delay: a slow link


def _slow_tomls(tmp, ports, relay) -> dict:
    """One bulk stream (so stream order is a barrier), 256 KiB chunks, a 1 MiB credit window,
    and a long dead_after_s so a paused relay does not drop the session."""
    t = two_site_toml(tmp, ports=ports, streams=1, chunk=CHUNK, wan_override={"B": f"127.0.0.1:{relay.port}"})
    for s in "AB":
        t[s] = t[s].replace("[transfer]\n", f"[transfer]\ncredit_bytes = {MiB}\n").replace(
            "dead_after_s = 1.5", "dead_after_s = 30")
    return t


async def _spawn(*args: str, pass_fds=()) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(sys.executable, str(ENGINE_PROC), *args,
                                                stdout=asyncio.subprocess.PIPE, pass_fds=pass_fds)
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    assert line == b"started\n", line
    return proc


async def _status(agent) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://{agent.admin.address}/v1/status") as resp:
            assert resp.status == 200
            return await resp.json()


def _only_prefixes_of(got: bytes, want: bytes, chunk: int) -> int:
    """Each chunk of ``got`` is untouched (zero), fully ``want``'s, or a prefix of ``want``'s
    followed by zeros (a chunk cut short): never anything else. Returns the full chunks."""
    full = 0
    for off in range(0, len(want), chunk):
        g, w = got[off:off + chunk], want[off:off + chunk]
        if g == w:
            full += 1
            continue
        lo, hi = 0, len(g)  # longest prefix of g equal to w's
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if g[:mid] == w[:mid]:
                lo = mid
            else:
                hi = mid - 1
        assert not any(g[lo:]), f"chunk at {off}: foreign bytes after {lo} good ones"
    return full


async def test_sending_engine_killed_mid_transfer(tmp_sock_dir, engines):
    ports = {"A": free_port(), "B": free_port()}
    async with Shaper(target=("127.0.0.1", ports["B"]), queue_limit=QUEUE) as relay:
        async with run_agents(_slow_tomls(tmp_sock_dir, ports, relay)) as ag:
            A, B = ag["A"], ag["B"]
            survivor = await engines.connect(tmp_sock_dir / "A.sock", "survivor")
            eb = await engines.connect(tmp_sock_dir / "B.sock", "decode")
            dst = engines.memory(DOOMED)
            rb = await eb.register(dst, block_bytes=CHUNK)
            await eb.post_recv("doomed", [rb.blocks(0, rb.n_blocks)], from_site="A")
            regions0 = len(A.regions)
            relay.set_delay(20)  # slow enough that the transfer is caught in the middle
            proc = await _spawn("--socket", str(tmp_sock_dir / "A.sock"), "--role", "send", "--request", "doomed",
                                "--spare", "spare", "--size", str(DOOMED), "--block", str(CHUNK), "--to", "B",
                                "--seed", "11")
            try:
                assert len(A.regions) == regions0 + 1 and "spare" in A.posts
                await until(lambda: metric(B, "pddwire_chunks_total", peer="A/a1", direction="rx") >= 2, 30)
                relay.pause()
                proc.kill()
                await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            # The agent dropped the dead engine's memory, posts and transfer.
            await until(lambda: len(A.regions) == regions0)
            assert regions0 == 0 and metric(A, "pddwire_regions_registered") == 0
            st = await _status(A)
            assert st["regions"] == 0 and st["posted_receives"] == 0 and st["transfers"] == []
            assert [e["name"].split("#")[0] for e in st["engines"]] == ["survivor"]
            assert "spare" not in A.posts
            assert metric(A, "pddwire_transfers_total", peer="B/b1", direction="out", outcome="engine_gone") == 1
            # The receiver hears of it once the link moves again.
            relay.set_delay(0)
            relay.resume()
            ev = await eb.wait("doomed", timeout=30)
            assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.ENGINE_GONE, ev
            assert ev.direction == "in" and ev.peer == "A/a1"
            snapshot = bytes(dst.buf)
            want = random.Random(11).randbytes(DOOMED)
            full = _only_prefixes_of(snapshot, want, CHUNK)
            assert 1 <= full < DOOMED // CHUNK
            assert (await _status(B))["transfers"] == []
            # Others are served: a new transfer from the surviving engine, behind whatever was
            # still on the (single) bulk stream; the dead transfer's late chunks went nowhere.
            src2, dst2 = engines.memory(4 * MiB), engines.memory(4 * MiB)
            await fill_random(src2)
            rs = await survivor.register(src2, block_bytes=CHUNK)
            rd = await eb.register(dst2, block_bytes=CHUNK)
            await eb.post_recv("after", [rd.blocks(0, AFTER)])
            await survivor.send_kv("after", [rs.blocks(0, AFTER)], to=["B"])
            assert isinstance(await eb.wait("after", timeout=30), p.KvReceived)
            assert isinstance(await survivor.wait("after", timeout=30), p.KvSent)
            assert await same_bytes(dst2.buf, src2.buf)
            await survivor.send_tokens("after", "B", [5, 6])
            assert (await eb.wait_tokens("after", timeout=10)).tokens == [5, 6]
            assert bytes(dst.buf) == snapshot
            assert metric(A, "pddwire_reconnects_total", peer="B/b1") == 0


async def test_receiving_engine_killed_mid_transfer(tmp_sock_dir, engines):
    ports = {"A": free_port(), "B": free_port()}
    async with Shaper(target=("127.0.0.1", ports["B"]), queue_limit=QUEUE) as relay:
        async with run_agents(_slow_tomls(tmp_sock_dir, ports, relay)) as ag:
            A, B = ag["A"], ag["B"]
            ea = await engines.connect(tmp_sock_dir / "A.sock", "prefill")
            survivor = await engines.connect(tmp_sock_dir / "B.sock", "survivor")
            src = engines.memory(DOOMED)
            await fill_random(src)
            ra = await ea.register(src, block_bytes=CHUNK)
            # The dying engine's memory is a memfd the test maps too, to watch what lands in it.
            dst = engines.memory(DOOMED)
            regions0 = len(B.regions)
            proc = await _spawn("--socket", str(tmp_sock_dir / "B.sock"), "--role", "recv", "--request", "doomed",
                                "--spare", "spare", "--size", str(DOOMED), "--block", str(CHUNK),
                                "--fd", str(dst.fd), pass_fds=(dst.fd,))
            try:
                assert len(B.regions) == regions0 + 1 and {"doomed", "spare"} <= set(B.posts)
                relay.set_delay(20)
                await ea.send_kv("doomed", [ra.blocks(0, ra.n_blocks)], to=["B"])
                await until(lambda: metric(B, "pddwire_chunks_total", peer="A/a1", direction="rx") >= 2, 30)
                relay.pause()
                proc.kill()
                await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            # The agent stopped writing, then unmapped: regions, posts and the transfer are gone.
            await until(lambda: len(B.regions) == regions0)
            assert regions0 == 0 and metric(B, "pddwire_regions_registered") == 0
            st = await _status(B)
            assert st["regions"] == 0 and st["posted_receives"] == 0 and st["transfers"] == []
            assert [e["name"].split("#")[0] for e in st["engines"]] == ["survivor"]
            assert metric(B, "pddwire_transfers_total", peer="A/a1", direction="in", outcome="engine_gone") == 1
            snapshot = bytes(dst.buf)
            full = _only_prefixes_of(snapshot, bytes(src.buf), CHUNK)
            assert 1 <= full < DOOMED // CHUNK
            relay.set_delay(0)
            relay.resume()
            ev = await ea.wait("doomed", timeout=30)
            assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.ENGINE_GONE, ev
            assert ev.direction == "out" and ev.peer == "B/b1"
            await until(lambda: A.describe()["transfers"] == [])
            # Others are served: the surviving engine on B receives a new transfer, which comes
            # behind anything of the dead one still on the wire; none of it reached the dead
            # engine's pages.
            dst2 = engines.memory(4 * MiB)
            rd = await survivor.register(dst2, block_bytes=CHUNK)
            await survivor.post_recv("after", [rd.blocks(0, AFTER)])
            await ea.send_kv("after", [ra.blocks(0, AFTER)], to=["B"])
            assert isinstance(await survivor.wait("after", timeout=30), p.KvReceived)
            assert isinstance(await ea.wait("after", timeout=30), p.KvSent)
            assert await same_bytes(dst2.buf, src.buf[:4 * MiB])
            await ea.send_tokens("after", "B", [8, 9])
            assert (await survivor.wait_tokens("after", timeout=10)).tokens == [8, 9]
            assert bytes(dst.buf) == snapshot


async def test_engine_that_stops_reading_is_cut_off(tmp_sock_dir):
    """Replies and events for an engine that never reads pile up only to limits.engine_queue_bytes;
    then the agent drops that engine (and what it holds), not its own memory bound."""
    import socket as _socket

    from pdd_wire.engine import protocol as ep
    from support.agents import run_agents as _run
    from support.agents import two_site_toml as _toml

    tomls = _toml(tmp_sock_dir, extra="[limits]\nengine_queue_bytes = 65536\n")
    async with _run(tomls) as ag:
        a = ag["A"]
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        sock.connect(str(tmp_sock_dir / "A.sock"))
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_RCVBUF, 4096)
        try:
            async with asyncio.timeout(20):
                while not a.engine_server.engines:
                    await asyncio.sleep(0.01)
                # status replies are large; never read any of them
                req = b"".join(ep.encode(ep.Status(id=i + 1)) for i in range(400))
                await asyncio.to_thread(sock.sendall, req)
                while a.engine_server.engines:
                    await asyncio.sleep(0.01)
            assert not a.engine_server.engines
        finally:
            sock.close()
