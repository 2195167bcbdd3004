"""Cancels and aborts written while the link is silent reach the peer after the session resumes.

A silent link is found dead only after ``timeouts.dead_after_s``; a KV_CANCEL, REQUEST_ABORT or
handoff ABORT/RELEASE written meanwhile is lost with the connection. The outbox keeps each one
until a PONG confirms it and sends it again first on the resumed session (proto/transfer.md §10
and §11, proto/handoff.md §8). Real agents A and B; A reaches B through a relay that goes silent
(paused: nothing forwarded, nothing reset) and is then reset, as a WAN outage would.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from conftest import engine_pair, until
from pdd_wire.engine import protocol as p
from pdd_wire.errors import ErrorCode
from pdd_wire.session.outbox import Outbox
from pdd_wire.wire import FrameType, Lane
from pdd_wire.wire import messages as m
from support.agents import relayed_toml, run_agents

MiB = 1 << 20
SLOW = 4 * MiB  # B/s through the relay: a 64 MiB transfer is still moving when the link goes silent


async def engines_on(engines, tmp, size=64 * MiB):
    a, b, _, _, ra, rb = await engine_pair(engines, tmp, size, MiB)
    return a, b, ra, rb


async def outage(agents, relay, during) -> float:
    """The link goes silent, ``during()`` runs on it, the agents find it dead (dead_after_s), it
    comes back and the session resumes. Returns the time it was back (time.monotonic)."""
    relay.pause()
    await asyncio.sleep(0.1)
    await during()
    session = agents["A"].sessions["B/b1"]
    await until(lambda: not session.is_up, timeout=10, what="A finds the silent link dead")
    relay.abort_all()
    relay.resume()
    await until(lambda: session.is_up and agents["B"].sessions["A/a1"].is_up, timeout=10, what="the session resumed")
    return time.monotonic()


async def relaying(engines, tmp, rid: str):
    """RLD on A relaying ``rid`` to MD on B (both with deadlines far off): (rld, md) engines."""
    r = await engines.connect(tmp / "A.sock", "rld")
    md = await engines.connect(tmp / "B.sock", "md")
    await md.handoff_md(rid, "A", deadline_s=120)
    await r.handoff_rld(rid, "B", deadline_s=120)
    await r.handoff_tokens(rid, [1, 2, 3])
    return r, md


async def test_one_engines_aborts_of_unknown_ids_on_a_silent_link_leave_anothers_cancel(tmp_sock_dir, engines):
    """While the link is silent, engine Y aborts its moving transfer (a KV_CANCEL and a
    REQUEST_ABORT kept for the resume) and engine X aborts 300 request ids nothing here knows of,
    more than the outbox keeps (4 x transfer.max_transfers = 256 here). X's aborts are spare and
    give way: once the session resumes, B's engine is told at once (before: Y's frames were the
    oldest and were dropped, and B's engine waited for the transfer's deadline). Y's reason
    reaches B cut to 256 characters."""
    async with relayed_toml(tmp_sock_dir, transfer="max_transfers = 64") as (relay, tomls):
        async with run_agents(tomls) as agents:
            y, b, ra, rb = await engines_on(engines, tmp_sock_dir)
            x = await engines.connect(tmp_sock_dir / "A.sock", "x")
            relay.set_rate(SLOW)
            await b.post_recv("r1", [rb.blocks(0, 64)], from_site="A")
            await y.send_kv("r1", [ra.blocks(0, 64)], to=["B"], deadline_s=120)
            await asyncio.sleep(0.5)

            async def aborts() -> None:
                await y.abort("r1", "client went away " + "." * 1000)
                for k in range(300):
                    await x.abort(f"junk-{k}", "x")

            back = await outage(agents, relay, aborts)
            relay.set_rate(None)
            assert agents["A"].sessions["B/b1"].outbox.dropped >= 300 - 256
            ev = await b.wait("r1", timeout=10)
            assert isinstance(ev, p.TransferFailed) and ev.code == ErrorCode.TRANSFER_CANCELLED, ev
            assert time.monotonic() - back < 5
            ab = await b.wait("r1", kinds=(p.RequestAborted,), timeout=5)
            assert ab.reason == ("client went away " + "." * 1000)[:256]


@pytest.mark.parametrize("ends", ["abort", "disconnect"])
async def test_a_sender_ending_a_transfer_on_a_silent_link_ends_the_receive_once_the_session_resumes(
        tmp_sock_dir, engines, ends):
    async with relayed_toml(tmp_sock_dir) as (relay, tomls):
        async with run_agents(tomls) as agents:
            a, b, ra, rb = await engines_on(engines, tmp_sock_dir)
            relay.set_rate(SLOW)
            await b.post_recv("r1", [rb.blocks(0, 64)], from_site="A")
            await a.send_kv("r1", [ra.blocks(0, 64)], to=["B"], deadline_s=120)
            await asyncio.sleep(0.5)
            back = await outage(agents, relay, (lambda: a.abort("r1", "client went away")) if ends == "abort"
                                else a.close)
            relay.set_rate(None)
            # Told now, with the cancel's code: not at the deadline (120 s) as TRANSFER_TIMEOUT.
            ev = await b.wait("r1", timeout=10)
            code = ErrorCode.TRANSFER_CANCELLED if ends == "abort" else ErrorCode.ENGINE_GONE
            assert isinstance(ev, p.TransferFailed) and ev.code == code, ev
            assert time.monotonic() - back < 5
            if ends == "abort":
                ab = await b.wait("r1", kinds=(p.RequestAborted,), timeout=5)
                assert ab.origin == "A/a1" and ab.reason == "client went away"
            await until(lambda: not agents["B"].sessions["A/a1"].inn)
            # Confirmed by a PONG on the new connection: nothing kept.
            await until(lambda: not len(agents["A"].sessions["B/b1"].outbox), what="the outbox confirmed")


async def test_a_retry_after_an_abort_on_a_silent_link_is_not_refused_as_a_duplicate(tmp_sock_dir, engines):
    """The aborted KV_BEGIN was waiting at B for its post: its KV_CANCEL goes first on the resumed
    session, so the same request sent again waits in its place and lands once B posts."""
    async with relayed_toml(tmp_sock_dir) as (relay, tomls):
        async with run_agents(tomls) as agents:
            a, b, ra, rb = await engines_on(engines, tmp_sock_dir, size=8 * MiB)
            await a.send_kv("r3", [ra.blocks(0, 8)], to=["B"], lease_s=30)
            await until(lambda: "r3" in agents["B"].kv.unposted)
            await outage(agents, relay, lambda: a.abort("r3"))
            first = await a.wait("r3", timeout=5)  # the aborted one's outcome, told at the abort
            assert isinstance(first, p.TransferFailed) and first.code == ErrorCode.TRANSFER_CANCELLED
            await a.send_kv("r3", [ra.blocks(0, 8)], to=["B"], lease_s=30)
            await until(lambda: "r3" in agents["B"].kv.unposted)
            await b.post_recv("r3", [rb.blocks(0, 8)], from_site="A")
            assert isinstance(await b.wait("r3", timeout=10), p.KvReceived)
            assert isinstance(await a.wait("r3", timeout=10), p.KvSent)


async def test_tokens_of_a_request_aborted_on_a_silent_link_and_sent_again_are_delivered(tmp_sock_dir, engines):
    """The request's token stream restarts at 0 after the abort: B, which missed the abort, would
    take them for copies of what it delivered. The REQUEST_ABORT goes first on the resumed
    session, so B starts the stream afresh."""
    async with relayed_toml(tmp_sock_dir) as (relay, tomls):
        async with run_agents(tomls) as agents:
            a, b, ra, rb = await engines_on(engines, tmp_sock_dir, size=4 * MiB)
            await b.expect_tokens("t1", from_site="A")
            assert await a.send_tokens("t1", "B", list(range(10))) == 0
            got = []
            while len(got) < 10:
                got += (await b.wait_tokens("t1", timeout=5)).tokens
            await outage(agents, relay, lambda: a.abort("t1"))
            await b.wait("t1", kinds=(p.RequestAborted,), timeout=10)
            await b.expect_tokens("t1", from_site="A")
            assert await a.send_tokens("t1", "B", list(range(100, 110))) == 0
            again = []
            while len(again) < 10:
                ev = await b.wait_tokens("t1", timeout=10)
                again += ev.tokens
            assert again == list(range(100, 110))


@pytest.mark.parametrize("aborts", ["RLD", "MD"])
async def test_a_handoff_aborted_on_a_silent_link_settles_the_other_side_once_the_session_resumes(
        tmp_sock_dir, engines, aborts):
    """RLD's engine aborts: MD hears the ABORT (owner RLD, its reason). MD's engine aborts: RLD is
    told its handoff ended ``aborted`` (owner RLD, nothing to go on with: the REQUEST_ABORT
    follows). Either now, once the session resumes, not at the other side's deadline (120 s)."""
    async with relayed_toml(tmp_sock_dir) as (relay, tomls):
        async with run_agents(tomls) as agents:
            r, md = await relaying(engines, tmp_sock_dir, "h1")
            ender, other = (r, md) if aborts == "RLD" else (md, r)
            back = await outage(agents, relay, lambda: ender.abort("h1", "client gone"))
            done = await other.wait("h1", kinds=(p.HandoffDone,), timeout=10)
            assert done.owner == "RLD" and done.reason == ("client gone" if aborts == "RLD" else "aborted"), done
            assert time.monotonic() - back < 5
            ab = await other.wait("h1", kinds=(p.RequestAborted,), timeout=5)
            assert ab.origin == ("A/a1" if aborts == "RLD" else "B/b1")
            assert "h1" not in agents["A" if aborts == "RLD" else "B"].handoffs.live


class _Session:
    """What the outbox uses of a session: frames it writes (while ``up``), and its PINGs."""

    def __init__(self) -> None:
        self.up = True
        self.closing = False
        self.sent: list[tuple[int, object, int, int]] = []
        self.pings = self
        self.nonce = 0
        self.outbox: Outbox | None = None

    @property
    def control(self):  # its connection, for a spare frame's room (paced_room below)
        return self if self.up else None

    closed = False
    room = 1 << 20

    def paced_room(self) -> int:
        return self.room

    def send_frame(self, ftype, body, *, tid=0, lane=Lane.CONTROL) -> bool:
        if self.up:
            self.sent.append((ftype, body, tid, lane))
        return self.up

    def send(self) -> int:  # Pings.send
        self.nonce += 1
        if self.up:
            assert self.outbox is not None
            self.outbox.ping_written(self.nonce)
        return self.nonce

    class log:  # noqa: N801 (structlog's shape)
        warnings: list = []

        @classmethod
        def warning(cls, event, **kw) -> None:
            cls.warnings.append(event)


def cancel(tid: int) -> m.KvCancel:
    return m.KvCancel(f"r{tid}", int(ErrorCode.TRANSFER_CANCELLED), "aborted", False)


ABORT = m.RequestAbort("r", "client gone")


async def test_the_outbox_keeps_a_frame_until_a_later_ping_is_answered_and_resends_in_order() -> None:
    s = _Session()
    box = s.outbox = Outbox(s, cap=3, cap_bytes=1 << 20)
    s.send()  # PING 1, before anything
    box.send(("cancel", 7), cancel(7), tid=7)
    box.pong(1)  # answers a PING written before the frame: confirms nothing
    assert len(box) == 1
    await asyncio.sleep(0)  # the PING the frame asked for (2) is written at the end of the turn
    assert s.nonce == 2
    s.up = False
    box.send(("abort", "r"), ABORT)  # not written: waits
    box.pong(2)
    assert len(box) == 1  # the cancel is confirmed; the unwritten abort is not
    s.up = True
    s.sent.clear()
    box.send(("cancel", 8), cancel(8), tid=8)
    box.resend()  # the session resumed: the abort, then the cancel, in the order first sent
    assert [b for _, b, _, _ in s.sent] == [cancel(8), ABORT, cancel(8)]
    # Each frame's type and lane follow from its body: the abort rides the token lane.
    assert [(t, lane) for t, _, _, lane in s.sent[:2]] == [(FrameType.KV_CANCEL, Lane.CONTROL),
                                                        (FrameType.REQUEST_ABORT, Lane.TOKEN)]
    box.forget(("abort", "r"))
    assert len(box) == 1
    for tid in (9, 10, 11):  # over the cap: the oldest goes (its peer ends it on its own clock)
        box.send(("cancel", tid), cancel(tid), tid=tid)
    assert len(box) == 3 and box.dropped == 1
    box.clear()
    assert not len(box) and box.bytes == 0
    # Bounded in bytes too: what is kept can always be sent again at once.
    box = s.outbox = Outbox(s, cap=100, cap_bytes=3000)
    for i in range(4):
        box.send(("abort", f"r{i}"), m.RequestAbort(f"r{i}", "x" * 900))
    assert len(box) == 3 and box.bytes <= 3000 and box.dropped == 1


async def test_a_pong_costs_what_it_confirms() -> None:
    """PONGs are the peer's to send at will: one answering a PING already confirmed, or one this
    side never wrote, confirms nothing (it scanned every kept frame: 2-3.6 ms a PONG with 16384
    kept, 140-250x a PING's cost per byte), and a real one confirms exactly the frames written
    before its PING."""
    s = _Session()
    box = s.outbox = Outbox(s, cap=100_000, cap_bytes=1 << 30)
    for tid in range(1, 1001):
        box.send(("cancel", tid, False), cancel(tid), tid=tid)
    await asyncio.sleep(0)  # PING 1 follows them
    for tid in range(1001, 1501):
        box.send(("cancel", tid, False), cancel(tid), tid=tid)
    for bogus in (0, 0, 7, 10**9):
        box.pong(bogus)  # never written (the peer's own numbers)
        assert len(box) == 1500
    box.pong(1)
    assert len(box) == 500  # the 1000 written before PING 1
    box.pong(1)  # a copy: nothing more
    assert len(box) == 500



async def test_spare_aborts_give_way_to_cancels_and_wait_for_room() -> None:
    """A REQUEST_ABORT of a request no engine held here is *spare*: when the outbox is full the
    oldest spare frame goes first, so one engine aborting unknown ids never pushes out another's
    KV_CANCEL (before: oldest first, whatever it was); and a spare frame is dropped, not written,
    while the control connection has half its buffer unsent."""
    s = _Session()
    box = s.outbox = Outbox(s, cap=4, cap_bytes=1 << 20)
    s.up = False  # the link is down: everything waits for the resume
    box.send(("cancel", 7, False), cancel(7), tid=7)
    box.send(("abort", "mine"), m.RequestAbort("mine", "client went away"))
    for i in range(10):
        box.send(("abort", f"junk{i}"), m.RequestAbort(f"junk{i}", "x"), spare=True)
    assert len(box) == 4 and box.dropped == 8
    s.up = True
    s.sent.clear()
    box.resend()
    assert [b for _, b, _, _ in s.sent] == [cancel(7), m.RequestAbort("mine", "client went away"),
                                            m.RequestAbort("junk8", "x"), m.RequestAbort("junk9", "x")]
    s.sent.clear()
    s.room = 0  # half of the control buffer unsent
    assert not box.send(("abort", "junk10"), m.RequestAbort("junk10", "x"), spare=True)
    assert not s.sent and ("abort", "junk10") not in box._kept and box.dropped == 9
    assert box.send(("cancel", 8, False), cancel(8), tid=8)  # what ends known state still goes
    # A spare copy of a frame kept as not spare (an engine aborting the same id twice: by the
    # second time it holds nothing) stays not spare: it does not give way to another's junk.
    s.room = 1 << 20
    box.send(("abort", "real"), m.RequestAbort("real", "first"))
    box.send(("abort", "real"), m.RequestAbort("real", "again"), spare=True)
    for i in range(20, 30):
        box.send(("abort", f"junk{i}"), m.RequestAbort(f"junk{i}", "x"), spare=True)
    assert ("abort", "real") in box._kept and ("abort", "real") not in box._spare
    box.clear()
    assert not box._spare
