"""The UCX local path (pdd_wire.transport.ucx) with real ucxx: two processes where the
transport matters (shared memory and tcp via UCX_TLS), in-process peers for the matching
and cancellation rules."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdd_wire.errors import ErrorCode, TransferError, TransportError
from pdd_wire.memory import SharedMemory
from pdd_wire.transport import ucx

PEER_SCRIPT = Path(__file__).parent / "support" / "ucx_peer.py"
ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def _read(p: subprocess.Popen) -> str:
    while True:
        line = p.stdout.readline()
        assert line, f"peer process exited ({p.wait()}): {p.stderr.read()[-2000:]}"
        if line.startswith("@@"):
            return line[2:].strip()


def spawn_peer(scenario: str, role: str, tls: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(PEER_SCRIPT), scenario, role],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, UCX_TLS=tls), text=True)


def two_processes(scenario: str, tls: str) -> tuple[dict, dict]:
    """Run ``scenario`` between a receiving and a sending process that exchange their
    worker addresses through us (as agents do over their control connection)."""
    procs = {role: spawn_peer(scenario, role, tls) for role in ("recv", "send")}
    try:
        addrs = {role: _read(p) for role, p in procs.items()}
        for role, other in (("recv", "send"), ("send", "recv")):
            procs[role].stdin.write("@@" + addrs[other] + "\n")
            procs[role].stdin.flush()
        results = {role: json.loads(_read(p).split(" ", 1)[1]) for role, p in procs.items()}
        for p in procs.values():
            p.stdin.write("@@BYE\n")
            p.stdin.flush()
        for p in procs.values():
            assert p.wait(60) == 0
        return results["recv"], results["send"]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def ucx_loop():
    loop = ucx.UcxLoop("test-ucx", options={"TLS": "sm,self"}, unclaimed_ttl_s=30)
    loop.start()
    yield loop
    loop.stop()


@pytest.fixture
def pair(ucx_loop):
    a, b = ucx.UcxPeer(ucx_loop, "a"), ucx.UcxPeer(ucx_loop, "b")

    async def connect():
        await a.connect(b.local_address())
        await b.connect(a.local_address())

    ucx_loop.submit(connect()).result(30)
    yield a, b
    a.close()
    b.close()


def on(loop: ucx.UcxLoop, coro, timeout: float = 60):
    return loop.submit(coro).result(timeout)


# --------------------------------------------------------------------------------------
# tags, availability
# --------------------------------------------------------------------------------------
def test_tag_layout_round_trips_and_keeps_directions_apart():
    seen = set()
    for d in (ucx.DIR_DIALER, ucx.DIR_ACCEPTOR):
        for tid in (0, 1, 2, ucx.MAX_TRANSFER_ID):
            for idx in (0, 1, ucx.MAX_INDEX):
                tag = ucx.tag_for(d, tid, idx)
                assert 0 <= tag < 1 << 64
                assert ucx.tag_parts(tag) == (d, tid, idx)
                assert tag >> ucx.INDEX_BITS == ucx.transfer_prefix(d, tid)
                seen.add(tag)
    assert len(seen) == 2 * 4 * 3
    for bad in ((2, 1, 1), (0, ucx.MAX_TRANSFER_ID + 1, 0), (0, 1, ucx.MAX_INDEX + 1), (0, -1, 0)):
        with pytest.raises(ValueError):
            ucx.tag_for(*bad)


def test_importing_pdd_wire_does_not_import_ucxx():
    code = ("import sys, pdd_wire, pdd_wire.transport.ucx, pdd_wire.agent, pdd_wire.session; "
            "print('ucxx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_available_says_why_when_ucxx_cannot_be_imported():
    code = ("import sys; sys.modules['ucxx'] = None\n"
            "from pdd_wire.transport import ucx\n"
            "import json; print(json.dumps(ucx.available()))\n"
            "try:\n    ucx.UcxLoop().start()\nexcept Exception as e:\n"
            "    print(json.dumps([type(e).__name__, str(e)]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    (ok, why), (exc_name, exc_msg) = map(json.loads, out.stdout.strip().splitlines())
    assert ok is False
    assert "ucxx is not importable" in why and "pdd-wire[ucx]" in why, why
    assert exc_name == "TransportError" and "ucxx is not importable" in exc_msg


@pytest.mark.ucx
def test_available_with_ucxx_leaves_the_environment_alone():
    code = ("import os, json; from pdd_wire.transport import ucx\n"
            "ok, why = ucx.available()\n"
            "print(json.dumps([ok, why, sorted(k for k in os.environ if k.startswith('UCX_')),"
            " sorted(ucx.UCXX_IMPORT_ENV)]))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX")}
    env["UCX_TLS"] = "sm,self"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=env, check=True)
    ok, why, ucx_env, undone = json.loads(out.stdout)
    assert ok is True and why.startswith("ucxx ") and "UCX " in why
    assert ucx_env == ["UCX_TLS"]                 # what ucxx's import wrote was taken back out
    assert "UCX_MEMTYPE_CACHE" in undone          # (UCX 1.21 warns about it at every context)


# --------------------------------------------------------------------------------------
# two processes
# --------------------------------------------------------------------------------------
@pytest.mark.ucx
@pytest.mark.parametrize("tls", ["sm,self", "tcp,self"])
def test_64mib_memfd_lands_byte_identical_in_another_process(tls):
    recv, send = two_processes("bulk", tls)
    assert recv["intact"] is True
    assert recv["xxh3"] == send["xxh3"]


@pytest.mark.ucx
def test_many_tagged_messages_out_of_order_match_their_tags_across_processes():
    recv, send = two_processes("ooo", "sm,self")
    assert send["sent"] == recv["received"] == 48
    assert recv["unclaimed_before_post"] == 24    # half of them waited for their receive
    assert recv["wrong"] == []


@pytest.fixture(scope="module")
def tcp_loop():
    loop = ucx.UcxLoop("test-ucx-tcp", options={"TLS": "tcp,self"})
    loop.start()
    yield loop
    loop.stop()


@pytest.mark.ucx
def test_send_to_a_peer_process_that_died_raises_transport_error_naming_the_ucx_error(tcp_loop):
    peer = ucx.UcxPeer(tcp_loop)
    child = spawn_peer("idle", "x", "tcp,self")
    try:
        remote = bytes.fromhex(_read(child).split()[1])
        child.stdin.write(f"@@ADDR {peer.local_address().hex()}\n")
        child.stdin.flush()
        on(tcp_loop, peer.connect(remote))
        assert _read(child).startswith("RESULT")     # it is connected to us
        on(tcp_loop, peer.send(5, b"hello"))         # nobody receives it, but it goes out
        child.kill()
        child.wait()
        with pytest.raises(TransportError) as exc:
            on(tcp_loop, peer.send(5, b"x" * 100_000))
        assert exc.value.code == ErrorCode.PEER_UNREACHABLE
        assert exc.value.ucx_error.startswith("UCXX")
        assert f"UCX send of tag 0x5 failed: {exc.value.ucx_error}" in str(exc.value)
    finally:
        peer.close()
        if child.poll() is None:
            child.kill()
            child.wait()


# --------------------------------------------------------------------------------------
# matching and cancellation (in-process peers on one UcxLoop)
# --------------------------------------------------------------------------------------
@pytest.mark.ucx
@pytest.mark.parametrize("size", [100, 1 << 20])  # eager and rendezvous
def test_cancelled_recv_before_its_data_is_never_written(ucx_loop, pair, size):
    a, b = pair
    tag = ucx.tag_for(0, 5, 0)
    buf = bytearray(b"\xAA" * size)

    async def scenario():
        recv = asyncio.ensure_future(b.recv(tag, buf))
        await asyncio.sleep(0.01)
        assert b.pending()["waiting"] == 1
        recv.cancel()
        with pytest.raises(asyncio.CancelledError):
            await recv
        assert b.pending() == {"waiting": 0, "in_flight": 0, "unclaimed": 0}
        assert await b.cancel_recv(tag) is False   # nothing left waiting; its message gets drained
        await a.send(tag, b"\x55" * size)          # completes: the receiver drained it
        for _ in range(1000):
            if b.stats["drained"]:
                break
            await asyncio.sleep(0.001)
        return b.stats["drained"]

    assert on(ucx_loop, scenario()) == 1
    assert bytes(buf) == b"\xAA" * size


@pytest.mark.ucx
def test_cancel_recv_fails_the_waiting_receive_with_transfer_cancelled(ucx_loop, pair):
    a, b = pair
    tag = ucx.tag_for(1, 9, 3)
    buf = bytearray(64)

    async def scenario():
        recv = asyncio.ensure_future(b.recv(tag, buf))
        await asyncio.sleep(0)
        assert await b.cancel_recv(tag) is True
        with pytest.raises(TransferError) as exc:
            await recv
        await a.send(tag, b"x" * 64)
        return exc.value.code

    assert on(ucx_loop, scenario()) == ErrorCode.TRANSFER_CANCELLED
    assert bytes(buf) == bytes(64)


@pytest.mark.ucx
def test_cancel_after_the_data_started_landing_waits_until_it_has_landed(tcp_loop):
    # over tcp 64 MiB takes many progress rounds, so the cancel meets the receive mid-way
    a, b = ucx.UcxPeer(tcp_loop), ucx.UcxPeer(tcp_loop)
    on(tcp_loop, a.connect(b.local_address()))
    on(tcp_loop, b.connect(a.local_address()))
    size = 64 << 20
    src, dst = SharedMemory(size), SharedMemory(size)
    src.buf[:] = os.urandom(size)
    tag = ucx.tag_for(0, 77, 1)

    async def scenario():
        recv = asyncio.ensure_future(b.recv(tag, dst.buf))
        send = asyncio.ensure_future(a.send(tag, src.buf))
        while b.pending()["in_flight"] == 0:       # matched: UCX is writing into dst now
            await asyncio.sleep(0)
        recv.cancel()                              # (nothing progresses until we yield)
        try:
            await recv
            outcome = "returned"
        except asyncio.CancelledError:
            outcome = "cancelled"
        pending = b.pending()
        await send
        return outcome, pending

    try:
        outcome, pending = on(tcp_loop, scenario())
        assert outcome == "cancelled"
        assert pending["in_flight"] == 0           # UCX had let go when the cancel returned
        assert dst.buf == src.buf                  # all of it landed, nothing comes later
    finally:
        a.close()
        b.close()
        src.close()
        dst.close()


@pytest.mark.ucx
def test_cancel_transfer_drops_its_receives_and_drains_its_messages(ucx_loop, pair):
    a, b = pair
    x, y = 1001, 1002
    bufs = {i: bytearray(b"\xEE" * 50_000) for i in range(7)}
    ybuf = bytearray(50_000)

    async def scenario():
        # x4 and x5 arrive before anyone asks for them; x0..x3 are waiting; y0 too
        early = [asyncio.ensure_future(a.send(ucx.tag_for(0, x, i), b"\x11" * 50_000)) for i in (4, 5)]
        for _ in range(1000):
            if b.pending()["unclaimed"] == 2:
                break
            await asyncio.sleep(0.001)
        recvs = [asyncio.ensure_future(b.recv(ucx.tag_for(0, x, i), bufs[i])) for i in range(4)]
        yrecv = asyncio.ensure_future(b.recv(ucx.tag_for(0, y, 0), ybuf))
        await asyncio.sleep(0)
        n = await b.cancel_transfer(0, x)
        outcomes = await asyncio.gather(*recvs, return_exceptions=True)
        late = [a.send(ucx.tag_for(0, x, i), b"\x22" * 50_000) for i in (0, 1, 2, 3, 6)]
        await asyncio.gather(*early, *late)       # every send of x completes: drained
        await a.send(ucx.tag_for(0, y, 0), b"\x33" * 50_000)
        await yrecv
        return n, outcomes, b.pending(), b.stats["drained"]

    n, outcomes, pending, drained = on(ucx_loop, scenario())
    assert n == 4
    assert all(isinstance(o, TransferError) and o.code == ErrorCode.TRANSFER_CANCELLED for o in outcomes)
    assert drained == 7
    assert pending == {"waiting": 0, "in_flight": 0, "unclaimed": 0}
    assert all(bytes(v) == b"\xEE" * 50_000 for v in bufs.values())
    assert bytes(ybuf) == b"\x33" * 50_000


@pytest.mark.ucx
@pytest.mark.parametrize("sent", [99, 101, 1 << 20])
def test_a_message_of_another_size_is_refused_without_touching_the_buffer(ucx_loop, pair, sent):
    a, b = pair
    tag = ucx.tag_for(0, 3, 3)
    buf = bytearray(b"\x07" * 100)

    async def scenario():
        recv = asyncio.ensure_future(b.recv(tag, buf))
        await a.send(tag, b"\x09" * sent)
        with pytest.raises(TransportError) as exc:
            await recv
        return exc.value.code

    assert on(ucx_loop, scenario()) == ErrorCode.SIZE_MISMATCH
    assert bytes(buf) == b"\x07" * 100


@pytest.mark.ucx
def test_same_tag_twice_matches_in_order(ucx_loop, pair):
    a, b = pair
    tag = ucx.tag_for(0, 4, 0)

    async def scenario():
        first, second = bytearray(10_000), bytearray(10_000)
        await asyncio.gather(a.send(tag, b"1" * 10_000), a.send(tag, b"2" * 10_000),
                             b.recv(tag, first), b.recv(tag, second))
        return bytes(first[:1]), bytes(second[:1])

    assert on(ucx_loop, scenario()) == (b"1", b"2")


@pytest.mark.ucx
def test_close_fails_what_waits_drains_what_came_and_is_idempotent(ucx_loop):
    a, b = ucx.UcxPeer(ucx_loop), ucx.UcxPeer(ucx_loop)
    on(ucx_loop, a.connect(b.local_address()))
    on(ucx_loop, b.connect(a.local_address()))
    fut = ucx_loop.submit(b.recv(1, bytearray(8)))
    send = ucx_loop.submit(a.send(2, b"y" * 100_000))   # a rendezvous nobody takes

    async def unclaimed():
        while b.pending()["unclaimed"] == 0:
            await asyncio.sleep(0.001)

    on(ucx_loop, unclaimed())
    b.close()
    with pytest.raises(TransportError, match="closed"):
        fut.result(10)
    assert send.result(10) is None                      # the closing receiver drained it
    on(ucx_loop, b.wait_closed())
    b.close()
    with pytest.raises(TransportError, match="closed"):
        on(ucx_loop, b.send(1, b"x"))
    a.close()
    a.close()


@pytest.mark.ucx
def test_misuse_is_refused(ucx_loop, pair):
    b = pair[1]
    with pytest.raises(ValueError, match="writable"):
        on(ucx_loop, b.recv(1, b"read-only"))
    # (UCX itself aborts the process on a malformed address: it is checked first)
    fresh = ucx.UcxPeer(ucx_loop)
    try:
        with pytest.raises(TransportError, match="not a UCX worker address"):
            on(ucx_loop, fresh.connect(b"\x07garbage"))
        with pytest.raises(RuntimeError, match="before connect"):
            on(ucx_loop, fresh.send(1, b"x"))
    finally:
        fresh.close()


@pytest.mark.ucx
async def test_peer_coroutines_refuse_to_run_off_the_ucx_loop(pair):
    a = pair[0]
    with pytest.raises(RuntimeError, match="UcxLoop"):
        await a.send(1, b"x")


# --------------------------------------------------------------------------------------
# the shared loop: start, stop, start again in one process
# --------------------------------------------------------------------------------------
async def _ping(a: ucx.UcxPeer, b: ucx.UcxPeer, msg: bytes) -> bytes:
    await a.connect(b.local_address())
    await b.connect(a.local_address())
    got = bytearray(len(msg))
    await asyncio.gather(a.send(9, msg), b.recv(9, got))
    return bytes(got)


@pytest.mark.ucx
def test_shared_loop_restarts_after_the_last_release():
    for round_ in range(3):
        first = ucx.acquire_loop(options={"TLS": "sm,self"})
        second = ucx.acquire_loop()
        assert first is second
        a, b = ucx.UcxPeer(first), ucx.UcxPeer(first)
        assert on(first, _ping(a, b, b"ping" + bytes([round_]))) == b"ping" + bytes([round_])
        a.close()
        ucx.release_loop(second)
        assert first.running                       # one user left
        ucx.release_loop(first)
        assert not first.running
        first.stop()                               # idempotent
        with pytest.raises(TransportError):
            first.submit(asyncio.sleep(0))
