"""How a connection's frames meet the event loop: at most FRAMES_PER_TURN of one control
connection a loop turn, however many reads libuv makes in one wake-up; every frame the peer sent
before it closed handled, in order, under TLS too; nothing of a handshake's first read after its
first frame; and a bulk connection's stall judged only after the loop has read its sockets.

Real sockets, uvloop as the agent runs it (each test runs its own loop), writers in processes of
their own where the kernel's buffering matters.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest
import uvloop

from pdd_wire.transport.tcp import (
    FRAMES_PER_TURN,
    KIND_CONTROL,
    TURN_BUDGET_S,
    FrameProtocol,
    adopt,
    control_protocol,
    dial,
    read_preamble,
)
from pdd_wire.transport.tls import client_tls_context, server_tls_context
from pdd_wire.wire import FrameType, encode, encode_body, encode_bytes
from pdd_wire.wire import messages as m
from support.agents import run_agents, two_site_toml
from support.certs import make_pki
from support.raw_peer import RawPeer

WRITER = r"""
import socket, sys
from pdd_wire.wire import FrameType, encode_bytes
port, body, n = map(int, sys.argv[1:4])
frame = encode_bytes(FrameType.PING, b"\x00" * body)
s = socket.create_connection(("127.0.0.1", port))
s.sendall(frame * n)
s.shutdown(socket.SHUT_WR)
s.recv(1)
"""


def frames_per_turn(body: int, n: int, cost_s: float = 0.0) -> list[int]:
    """A writer process sends ``n`` PINGs of ``body`` bytes at once to a control connection whose
    handler takes ``cost_s`` a frame: how many frames each loop turn handled (uvloop, as the agent)."""
    async def main() -> list[int]:
        got = [0]

        def handle(conn, f) -> None:
            if cost_s:
                time.sleep(cost_s)
            got[0] += 1

        def factory():
            c = control_protocol(max_body=1 << 20, max_unsent=1 << 20)
            c.on_frame = handle
            return c

        loop = asyncio.get_running_loop()
        srv = await loop.create_server(factory, "127.0.0.1", 0)
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(srv.sockets[0].getsockname()[1]), str(body),
                                   str(n)])
        per_turn: list[int] = []
        prev = 0
        try:
            async with asyncio.timeout(60):
                while prev < n:
                    await asyncio.sleep(0)  # one loop turn
                    per_turn.append(got[0] - prev)
                    prev = got[0]
        finally:
            writer.kill()
            writer.wait()
            srv.close()
        return per_turn

    return uvloop.run(main())


@pytest.mark.parametrize("body", [3, 2100])  # a PING; frames of about 2 KiB (30 in a 64 KiB read)
def test_one_connection_gets_at_most_a_slice_of_frames_per_loop_turn(body):
    """libuv reads a readable socket up to 32 times per wake-up: with frames of 2 KiB or more each
    read held under FRAMES_PER_TURN of them, and a per-read bound let 90-980 through in one turn."""
    most = max(frames_per_turn(body, max(5000, (8 << 20) // (body + 48))))
    assert 0 < most <= FRAMES_PER_TURN, most


def test_frames_that_each_cost_more_than_the_budget_go_one_a_turn():
    """The slice counted frames, not work: a peer whose frames each cost much (a TOKENS of
    200,000 IDs, a PREFIX_QUERY of 65,536 hashes) held the loop for 32 of them. Past
    TURN_BUDGET_S of handling the turn ends, whatever the count."""
    handled = [k for k in frames_per_turn(3, 200, cost_s=2 * TURN_BUDGET_S) if k]  # each costs twice the budget
    assert sum(handled) == 200 and max(handled) == 1, handled  # (the turns that handled any: 200 at most)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_every_frame_sent_before_a_tls_close_is_handled(tmp_path, loop):
    """An agent that stops writes a KV_CANCEL per open transfer, then GOODBYE, then closes. Under
    TLS the close arrives with the last frames, and the transport was closing before the frames
    past the first slice were handled: they were dropped (32 KV_CANCELs of 40 and no GOODBYE)."""
    pki = make_pki(tmp_path, ["srv", "cli"])
    sctx = server_tls_context(str(pki["srv"][0]), str(pki["srv"][1]), str(pki["ca"]))
    cctx = client_tls_context(str(pki["cli"][0]), str(pki["cli"][1]), str(pki["ca"]))

    async def main() -> list[str]:
        got: list[str] = []
        lost = asyncio.get_running_loop().create_future()
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)

        async def serve():
            sock, _ = await asyncio.get_running_loop().sock_accept(listener)
            await read_preamble(sock, 5)
            c = control_protocol(max_body=1 << 20, max_unsent=1 << 20)
            c.on_frame = lambda conn, f: got.append(FrameType(f.header.type).name)
            c.on_lost = lambda conn, e: lost.done() or lost.set_result(e)
            await adopt(sock, c, ssl_ctx=sctx, timeout=5)

        server = asyncio.create_task(serve())
        c = control_protocol(max_body=1 << 20, max_unsent=1 << 20)
        await dial("127.0.0.1", listener.getsockname()[1], KIND_CONTROL, c, ssl_ctx=cctx, server_name="srv",
                   timeout=5)
        await server
        await asyncio.sleep(0.1)
        for tid in range(1, 41):
            c.send(encode(FrameType.KV_CANCEL, encode_body(m.KvCancel("r", 500, "agent shutting down")),
                          transfer_id=tid))
        c.send(encode(FrameType.GOODBYE, encode_body(m.Goodbye("shutdown"))), now=True)
        while c.unsent:
            await asyncio.sleep(0.01)
        c.close()
        await asyncio.wait_for(lost, 5)
        listener.close()
        return got

    got = (uvloop.run if loop == "uvloop" else asyncio.run)(main())
    assert got == ["KV_CANCEL"] * 40 + ["GOODBYE"], got


async def test_frames_that_follow_hello_in_its_read_are_dropped(tmp_sock_dir):
    """proto/handshake.md §2: the listener reads HELLO alone; frames a dialer pipelines behind it
    in the same read are dropped. With the per-turn slice, the session that took the connection
    over handled those past the first slice (69 of 100 PINGs answered)."""
    async with run_agents(two_site_toml(tmp_sock_dir, plaintext=True), sites=("B",), wait_up=False) as ag:
        peer = await RawPeer.dial(ag["B"].wan_address[1], KIND_CONTROL)
        data = encode_bytes(FrameType.HELLO, encode_body(m.Hello(versions=[1], site="A", node="a1", incarnation=77,
                                                                 capabilities=["kv.v1", "tokens.v1"])))
        data += b"".join(encode_bytes(FrameType.PING, encode_body(m.Ping(nonce=1000 + i, sent_ns=1)))
                         for i in range(100))
        peer.writer.write(data)
        assert (await peer.next())[0] == FrameType.WELCOME
        alive = asyncio.create_task(peer.keepalive())  # (nonce 0)
        answered = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):  # every PING behind HELLO had its turn by then
                while (f := await peer.next()) is not None:
                    if f[0] == FrameType.PONG and f[1].nonce >= 1000:
                        answered.append(f[1].nonce)
        assert answered == [], answered
        assert await peer.pong(7)  # the session itself is up: a PING sent after WELCOME is answered
        alive.cancel()
        peer.close()


STOPPER = r"""
import os, signal, socket, sys, time
from pdd_wire.wire import FrameType, Lane
from pdd_wire.wire.frame import Header, encode_header
port, pid = int(sys.argv[1]), int(sys.argv[2])
payload = bytes(1 << 20)
s = socket.create_connection(("127.0.0.1", port))
s.sendall(encode_header(Header(type=FrameType.KV_CHUNK, flags=0, lane=Lane.BULK, payload_len=len(payload)), b"")
          + payload[:1000])
time.sleep(0.3)
os.kill(pid, signal.SIGSTOP)  # the agent's process does not run ...
s.sendall(payload[1000:])  # ... while the rest of the frame arrives
time.sleep(1.6)
os.kill(pid, signal.SIGCONT)
s.recv(1)
"""


def test_a_bulk_stall_is_judged_after_the_loop_has_read_its_sockets():
    """A bulk connection in the middle of a frame, whose last bytes arrive while its own process
    is stopped longer than the stall bound: on resuming, libuv ran the due timer before it polled
    the socket (its poll was interrupted), and a single check aborted the connection ("no byte
    for 1.9 s") though the bytes were waiting. The frame completes now."""
    async def main() -> str:
        loop = asyncio.get_running_loop()
        res = loop.create_future()

        def factory():
            c = FrameProtocol(max_body=1 << 16, max_payload=1 << 20, sink=lambda h, b: None, bulk=True, stall_s=1.0)
            c.on_frame = lambda conn, f: res.done() or res.set_result("complete")
            c.on_lost = lambda conn, e: res.done() or res.set_result(f"aborted: {e}")
            return c

        srv = await loop.create_server(factory, "127.0.0.1", 0)
        peer = subprocess.Popen([sys.executable, "-c", STOPPER, str(srv.sockets[0].getsockname()[1]),
                                 str(os.getpid())])
        try:
            return await asyncio.wait_for(res, 20)
        finally:
            peer.kill()
            peer.wait()
            srv.close()

    assert uvloop.run(main()) == "complete"
