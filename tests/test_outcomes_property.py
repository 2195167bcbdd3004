"""Every outcome told (proto/transfer.md §15), under random interleavings of peer frames.

One real agent (B) with a real engine client that posts receives and sends KV to site A; site A
is a raw peer written from proto/ (tests/support/raw_peer.py) that sends, in an order hypothesis
chooses, valid and invalid frames: KV_BEGIN (matching a post or not, taking an offer or not),
KV_CHUNK (right, short, corrupt; before or without its KV_BEGIN), KV_ACCEPT / ACK / NACK / DONE /
CANCEL / REJECT / STATUS for B's transfers or made-up ones, KV_OFFER (fitting B's sends or not)
and KV_WITHDRAW, TOKENS, REQUEST_ABORT, unassigned error codes, out-of-range values (which close the
connection: the peer dials again), reconnects and restarts. Deadlines and ttls are short, so
everything ends by itself. At the end every engine request has exactly one final event, the
agent holds nothing (no post, unposted wait or transfer), 0 blocks pinned and 0 stranded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import until
from pdd_wire import EngineClient, SharedMemory
from pdd_wire.engine import protocol as p
from pdd_wire.transport.tcp import KIND_BULK
from pdd_wire.wire import FrameType, Lane, encode_bytes
from pdd_wire.wire import messages as m
from support.agents import run_agents, two_site_toml
from support.raw_peer import RawPeer, hello

BLOCK = 4096
N_REQ = 4  # posts p0.., sends s0..
RIDS = [f"p{i}" for i in range(N_REQ)] + [f"s{i}" for i in range(N_REQ)] + ["zz"]
CODES = [303, 304, 306, 308, 311, 404, 999, 12345, 65535]  # assigned and not

_rid = st.sampled_from(RIDS)
_tid = st.integers(0, 7)  # index into B's transfer ids (when it has some), else a made-up id
_OPS = st.one_of(
    st.tuples(st.just("post"), st.integers(0, N_REQ - 1), st.sampled_from(["A", None])),
    st.tuples(st.just("send"), st.integers(0, N_REQ - 1)),
    st.tuples(st.just("begin"), _rid, st.integers(1, 6), st.booleans(), st.integers(0, 800), st.integers(0, 800),
              st.booleans()),
    st.tuples(st.just("offer"), st.integers(0, N_REQ - 1), st.booleans(), st.integers(1, 800)),
    st.tuples(st.just("withdraw"), st.integers(0, N_REQ - 1)),
    st.tuples(st.just("chunk"), st.integers(1, 6), st.integers(0, 2), st.sampled_from(["ok", "short", "corrupt"])),
    st.tuples(st.just("accept"), _tid),
    st.tuples(st.just("ack"), _tid, st.integers(0, 3), st.integers(1, 3)),
    st.tuples(st.just("nack"), _tid, st.integers(0, 3), st.sampled_from(CODES + [302])),
    st.tuples(st.just("done"), _tid),
    st.tuples(st.just("cancel"), st.one_of(_tid, st.integers(1, 6)), st.sampled_from(CODES), st.booleans()),
    st.tuples(st.just("reject"), _tid, st.sampled_from(CODES)),
    st.tuples(st.just("status"), _tid, st.integers(0, 2)),
    st.tuples(st.just("tokens"), _rid, st.integers(0, 3)),
    st.tuples(st.just("abort"), _rid),
    st.tuples(st.just("bad"), st.sampled_from(["nack-1", "token-1", "chunk0", "huge-seq"])),
    st.tuples(st.just("reconnect"), st.booleans()),  # True: a restart (new incarnation)
)

_BAD = {  # bodies with values out of their range (proto/messages.md): OUT_OF_RANGE, connection closed
    "nack-1": (FrameType.KV_NACK, [-1]),
    "token-1": (FrameType.TOKENS, ["p0", 0, [-1], False]),
    "chunk0": (FrameType.KV_BEGIN, ["p0", 8192, 0, 2, 4096, 2, 100, 0, 0]),
    "huge-seq": (FrameType.TOKENS, ["p0", 1 << 63, [1], False]),
}


class Peer:
    """Site A, raw: a control and a bulk connection to B, readers that note B's KV_BEGINs."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.incarnation = 77
        self.ctl: RawPeer | None = None
        self.bulk: RawPeer | None = None
        self.b_tids: list[tuple[int, str]] = []  # B's transfers to us: (tid, request id)
        self.tasks: list[asyncio.Task] = []

    async def connect(self, restart: bool = False) -> None:
        await self.close()
        if restart:
            self.incarnation += 1
            self.b_tids.clear()
        self.ctl, welcome = await hello(self.port, incarnation=self.incarnation,
                                        capabilities=("kv.v1", "tokens.v1", "abort.v1", "offer.v1"))
        self.bulk = await RawPeer.dial(self.port, KIND_BULK)
        self.bulk.send(FrameType.BULK_HELLO, m.BulkHello(session=welcome.session, stream=0, site="A", node="a1"))
        self.tasks = [asyncio.create_task(self._read(self.ctl)), asyncio.create_task(self._read(self.bulk)),
                      asyncio.create_task(self.ctl.keepalive())]

    async def _read(self, conn: RawPeer) -> None:
        while (f := await conn.next(timeout=3600)) is not None:
            if f[0] == FrameType.KV_BEGIN:
                self.b_tids.append((f[2].transfer_id, f[1].request_id))

    def tid(self, i: int) -> tuple[int, str]:
        return self.b_tids[i % len(self.b_tids)] if self.b_tids else (1000 + i, "zz")

    async def closed_by_agent(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self.tasks[0]

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for c in (self.ctl, self.bulk):
            if c is not None:
                c.close()


def _toml(tmp: Path) -> str:
    t = two_site_toml(tmp, plaintext=True, chunk=64 * 1024)["B"]
    return t.replace("[transfer]\n", "[transfer]\ndefault_deadline_s = 1.0\npost_ttl_s = 1.0\nunposted_wait_s = 0.5\n")


async def _scenario(ops: list) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="pdw-o-"))
    mem = SharedMemory(64 * BLOCK)
    try:
        async with run_agents({"B": _toml(tmp)}, sites=("B",), wait_up=False) as ag:
            b = ag["B"]
            eng = await EngineClient(str(tmp / "B.sock"), "b").connect()
            peer = Peer(b.wan_address[1])
            started: dict[str, str] = {}  # request id -> "post" | "send"
            try:
                region = await eng.register(mem, block_bytes=BLOCK)
                await peer.connect()
                for op in ops:
                    await _apply(op, b, eng, region, peer, started)
                    _indexed(b)
                # Everything ends by itself (deadlines, ttls, leases): the agent empties.
                await until(lambda: _empty(b), timeout=30, what="the agent's tables empty")
                _indexed(b)
                await eng.status()  # every event sent before this reply has arrived
                _check_outcomes(eng, started)
                pinned, stranded = b.audit()
                assert stranded == 0 and not any(pinned.values()), (pinned, stranded)
            finally:
                await peer.close()
                await eng.close()
    finally:
        mem.close()
        shutil.rmtree(tmp, ignore_errors=True)


async def _apply(op, b, eng: EngineClient, region, peer: Peer, started: dict) -> None:
    kind = op[0]
    ctl = peer.ctl
    match op:
        case ("post", i, site):
            if f"p{i}" not in started:
                await eng.post_recv(f"p{i}", [region.blocks(2 * i, 2)], from_site=site, ttl_s=0.6)
                started[f"p{i}"] = "post"
        case ("send", i):
            if f"s{i}" not in started:
                await eng.send_kv(f"s{i}", [region.blocks(16 + 2 * i, 2)], to=["A"], deadline_s=0.6)
                started[f"s{i}"] = "send"
        case ("begin", rid, tid, fits, deadline_ms, wait_ms, offered):
            n = 2 if fits else 3
            ctl.send(FrameType.KV_BEGIN, m.KvBegin(rid, n * BLOCK, BLOCK, n, BLOCK, n, deadline_ms=deadline_ms,
                                                   post_wait_ms=wait_ms, offered=offered), transfer_id=tid)
        case ("offer", i, fits, ttl_ms):  # B's send s{i} (2 blocks) may move at once if it fits
            ctl.send(FrameType.KV_OFFER, m.KvOffer(f"s{i}", (2 if fits else 3) * BLOCK, BLOCK, ttl_ms))
        case ("withdraw", i):
            ctl.send(FrameType.KV_WITHDRAW, m.KvWithdraw(f"s{i}"))
        case ("chunk", tid, k, how):
            data = os.urandom(BLOCK if how != "short" else 100)
            peer.bulk.send(FrameType.KV_CHUNK, b"", lane=Lane.BULK, transfer_id=tid, seq=k, payload=[data],
                           **({"xxh3": 12345} if how == "corrupt" else {}))
        case ("accept", i):
            tid, rid = peer.tid(i)
            ctl.send(FrameType.KV_ACCEPT, m.KvAccept(rid), transfer_id=tid)
        case ("ack", i, first, count):
            tid, _ = peer.tid(i)
            ctl.send(FrameType.KV_ACK, m.KvAck(first, count), transfer_id=tid)
        case ("nack", i, chunk, code):
            tid, _ = peer.tid(i)
            ctl.send(FrameType.KV_NACK, [chunk, code], transfer_id=tid)
        case ("done", i):
            tid, rid = peer.tid(i)
            ctl.send(FrameType.KV_DONE, m.KvDone(rid, 2 * BLOCK), transfer_id=tid)
        case ("cancel", i, code, by_receiver):
            tid, rid = peer.tid(i) if by_receiver else (i, "p0")
            ctl.send(FrameType.KV_CANCEL, [rid, code, "hypothesis", by_receiver], transfer_id=tid)
        case ("reject", i, code):
            tid, rid = peer.tid(i)
            ctl.send(FrameType.KV_REJECT, [rid, code, "hypothesis"], transfer_id=tid)
        case ("status", i, state):
            tid, rid = peer.tid(i)
            ctl.send(FrameType.KV_STATUS, m.KvStatus(rid, state, b"\x01" if state == 1 else b""), transfer_id=tid)
        case ("tokens", rid, seq):
            ctl.send(FrameType.TOKENS, m.Tokens(rid, seq, [1, 2, 3]))
        case ("abort", rid):
            ctl.send(FrameType.REQUEST_ABORT, m.RequestAbort(rid, "hypothesis"))
        case ("bad", which):
            ftype, body = _BAD[which]
            ctl.writer.write(encode_bytes(ftype, msgspec.msgpack.encode(body), lane=_lane(ftype)))
            await peer.closed_by_agent()
            await peer.connect()
        case ("reconnect", restart):
            await peer.connect(restart=restart)
    if kind not in ("post", "send", "bad", "reconnect"):
        await asyncio.sleep(0)  # let B read now and then, as a real peer's frames would come


def _lane(ftype: int) -> int:
    from pdd_wire.wire.frame import LANE_OF

    return LANE_OF[int(ftype)]


def _indexed(b) -> None:
    """Each session's request index (what REQUEST_ABORT reads instead of a scan) is its transfers."""
    for sess in b.peers:
        for side, table in ((sess.sender.by_request, sess.out), (sess.receiver.by_request, sess.inn)):
            scan: dict[str, set[int]] = {}
            for tid, t in table.items():
                scan.setdefault(t.request_id, set()).add(tid)
            assert side == scan, (side, scan)


def _empty(b) -> bool:
    return (not b.posts and not b.kv.unposted and not b.handoffs.live
            and all(not s.out and not s.inn for s in b.peers))


def _check_outcomes(eng: EngineClient, started: dict) -> None:
    for rid, kind in started.items():
        finals = eng.take(rid, kinds=(p.KvReceived, p.KvSent, p.TransferFailed))
        aborted = eng.take(rid, kinds=(p.RequestAborted,))
        if kind == "send":
            assert len(finals) == 1 and isinstance(finals[0], (p.KvSent, p.TransferFailed)), (rid, finals)
            assert getattr(finals[0], "direction", "out") == "out"
        else:
            # A post ends with its transfer's outcome, its ttl, or (dropped unclaimed) `aborted`.
            assert len(finals) == 1 or (not finals and aborted), (rid, finals, aborted)
            assert all(getattr(f, "direction", "in") == "in" for f in finals), finals
            assert not isinstance(finals[0] if finals else None, p.KvSent)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(_OPS, min_size=4, max_size=30))
def test_every_engine_request_gets_exactly_one_final_event(ops):
    from pdd_wire.session import receiving

    park, receiving.PARK_S = receiving.PARK_S, 0.2  # a chunk no KV_BEGIN follows waits less
    try:
        asyncio.run(_scenario(ops))
    finally:
        receiving.PARK_S = park
