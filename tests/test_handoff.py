"""The Extend-Decode handoff (pdd_wire/desk/handoff_protocol.py, proto/handoff.md).

Two parts:

* exact action sequences of the happy paths, the failure paths and a set of nasty interleavings
  (kept as regression tests);
* a hypothesis state machine that drives an RLD and an MD through a simulated control lane
  (ordered per direction; TOKENS and handoff messages interleave arbitrarily, a superset of what
  one TCP connection can do; a reconnect resends unacknowledged TOKENS and either loses or
  re-delivers handoff messages, then both sides resend their latest state), with MD crashes,
  engine failures, KV cancellations, false failure alarms, timers, RLD tokens generated after it
  was told to stop, and extends completing at arbitrary points. After every step and after
  draining: each output position was emitted at most once, in order, without a gap; at the end
  every position was emitted exactly once unless MD failed after owning the output; an MD
  failure before the hand-over leaves RLD owning and finishing the request.
"""

from __future__ import annotations

from collections import deque

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdd_wire.desk.handoff_protocol import (
    CAPABILITY,
    HANDOFF_MESSAGES,
    Done,
    Emit,
    Extend,
    HandoffAbort,
    HandoffCommit,
    HandoffProgress,
    HandoffProtocolError,
    HandoffRelease,
    HandoffTaken,
    HandoffUsageError,
    MdHandoff,
    MdState,
    ModeChosen,
    RelayTokens,
    RldHandoff,
    RldState,
    Send,
    StartGenerating,
    StopGenerating,
)
from pdd_wire.policy import HandoffPolicy, ModeDecision, choose_handoff_mode

RID = "req-1"
EP = 7
ONE_SHOT = ModeDecision("one-shot", "rld_busy")
CATCH_UP = ModeDecision("catch-up", "rld_headroom")


def T(pos: int) -> int:
    """The request's token at ``pos`` (RLD and MD run the same model: same tokens)."""
    return 1000 + pos


def rld_(mode=ONE_SHOT, deadline=10.0, **policy) -> RldHandoff:
    return RldHandoff(RID, EP, deadline=deadline, choose_mode=lambda gap: mode, policy=HandoffPolicy(**policy))


def md_(deadline=20.0) -> MdHandoff:
    return MdHandoff(RID, EP, deadline=deadline)


def gen(rld: RldHandoff, n: int) -> list:
    out = []
    for _ in range(n):
        out += rld.on_token_generated(T(rld.generated))
    return out


def relayed(actions) -> list:
    return [a for a in actions if isinstance(a, RelayTokens)]


def feed(md: MdHandoff, relays) -> list:
    out = []
    for r in relays:
        out += md.on_tokens(r.first, r.tokens)
    return out


def Progress(n: int) -> HandoffProgress:  # named like the message it builds
    return HandoffProgress(RID, EP, n)


def Commit(p: int, mode: str = "one-shot") -> HandoffCommit:
    return HandoffCommit(RID, EP, p, mode)


def Taken(p: int) -> HandoffTaken:
    return HandoffTaken(RID, EP, p)


# ============================================================================ happy paths
def test_one_shot_exact_actions():
    rld, md = rld_(ONE_SHOT), md_()
    assert rld.on_token_generated(T(0)) == [Emit(0, T(0)), RelayTokens(0, (T(0),))]
    rel = relayed(gen(rld, 2))
    assert rel == [RelayTokens(1, (T(1),)), RelayTokens(2, (T(2),))]
    assert md.on_tokens(0, [T(0)]) == []  # no KV yet: buffered
    assert md.on_tokens(1, [T(1)]) == []
    # The KV arrives: "ready" (absorbed 0) and one extend of everything relayed so far.
    assert md.on_kv_ready() == [Send(Progress(0)), Extend(0, (T(0), T(1)))]
    # RLD (busy): one-shot, commit at once at p = 3 (every token it generated and emitted).
    assert rld.on_message(Progress(0)) == [ModeChosen(ONE_SHOT, 3), Send(Commit(3)), StopGenerating()]
    assert rld.owner == "MD" and rld.position == 3 and rld.emitted == 3
    assert rld.on_token_generated(T(3)) == []  # the step that was already running: held, not emitted
    assert md.on_tokens(2, [T(2)]) == []  # an extend is in flight
    assert md.on_message(Commit(3)) == []
    assert md.on_md_progress(2) == [Extend(2, (T(2),))]  # committed: no more progress reports
    assert md.on_md_progress(3) == [StartGenerating(3), Send(Taken(3)), Done("MD", "took_over", "one-shot", 3)]
    assert md.on_token_generated(T(3)) == [Emit(3, T(3))]
    assert md.on_token_generated(T(4), last=True) == [Emit(4, T(4))]
    assert rld.on_message(Taken(3)) == [Done("MD", "one_shot", "one-shot", 3)]
    assert rld.state is RldState.MD_OWNS and md.state is MdState.STARTED
    assert rld.next_deadline() is None and md.next_deadline() is None


def test_catch_up_exact_actions():
    rld, md = rld_(CATCH_UP, catchup_gap_tokens=2), md_()
    feed(md, relayed(gen(rld, 10)))
    assert md.on_kv_ready() == [Send(Progress(0)), Extend(0, tuple(T(i) for i in range(10)))]
    # Ten tokens behind: catch-up; RLD keeps generating, emitting and relaying.
    assert rld.on_message(Progress(0)) == [ModeChosen(CATCH_UP, 10)]
    more = gen(rld, 4)
    assert [a for a in more if isinstance(a, Emit)] == [Emit(i, T(i)) for i in range(10, 14)]
    assert feed(md, relayed(more)) == []  # an extend is in flight
    assert md.on_md_progress(10) == [Send(Progress(10)), Extend(10, tuple(T(i) for i in range(10, 14)))]
    assert rld.on_message(Progress(10)) == []  # 14 - 10 = 4 > 2: not yet
    last = gen(rld, 1)
    assert md.on_md_progress(14) == [Send(Progress(14))]
    # 15 - 14 = 1 <= 2: commit at 15.
    assert rld.on_message(Progress(14)) == [Send(Commit(15, "catch-up")), StopGenerating()]
    assert feed(md, relayed(last)) == [Extend(14, (T(14),))]
    assert md.on_message(Commit(15, "catch-up")) == []
    assert md.on_md_progress(15) == [StartGenerating(15), Send(Taken(15)), Done("MD", "took_over", "catch-up", 15)]
    assert rld.on_message(Taken(15)) == [Done("MD", "catch_up_converged", "catch-up", 15)]
    assert rld.rounds == 2


def test_catch_up_that_does_not_converge_is_forced():
    rld = rld_(CATCH_UP, catchup_gap_tokens=1, max_catchup_rounds=2)
    gen(rld, 5)
    assert rld.on_message(Progress(0)) == [ModeChosen(CATCH_UP, 5)]
    gen(rld, 5)
    assert rld.on_message(Progress(4)) == []  # round 1, gap 6
    gen(rld, 5)
    assert rld.on_message(Progress(9)) == [Send(Commit(15, "catch-up")), StopGenerating()]  # round 2
    assert rld.commit_reason == "catch_up_forced"


def test_finished_on_rld_before_md_is_ready():
    rld, md = rld_(ONE_SHOT), md_()
    gen(rld, 2)
    assert rld.on_token_generated(T(2), last=True) == [
        Emit(2, T(2)), Send(HandoffAbort(RID, EP, "finished")), Done("RLD", "finished_on_rld")]
    with pytest.raises(HandoffUsageError):
        rld.on_token_generated(T(3))
    assert rld.on_message(Progress(0)) == []
    assert md.on_message(HandoffAbort(RID, EP, "finished")) == [Done("RLD", "finished")]
    assert md.on_kv_ready() == [] and md.on_reconnect() == [] and md.next_deadline() is None


def test_deadline_before_commit_keeps_rld():
    rld, md = rld_(ONE_SHOT, deadline=10.0), md_()
    gen(rld, 3)
    assert rld.next_deadline() == 10.0
    assert rld.on_timeout(9.99) == []
    assert rld.on_timeout(10.0) == [Send(HandoffAbort(RID, EP, "deadline")), Done("RLD", "deadline")]
    assert rld.on_token_generated(T(3)) == [Emit(3, T(3))]  # emits on, relays nothing
    assert rld.on_message(Progress(0)) == []  # MD got ready too late
    assert rld.on_reconnect() == [Send(HandoffAbort(RID, EP, "deadline"))]
    assert md.on_kv_ready() == [Send(Progress(0))]
    assert md.on_message(HandoffAbort(RID, EP, "deadline")) == [Done("RLD", "deadline")]


def test_md_failure_before_commit_keeps_rld():
    rld = rld_(ONE_SHOT)
    gen(rld, 3)
    assert rld.on_md_failed("peer_restarted") == [Send(HandoffAbort(RID, EP, "peer_restarted")),
                                                 Done("RLD", "md_failed")]
    assert rld.on_message(Progress(0)) == [] and rld.on_md_failed() == []
    assert rld.on_token_generated(T(3)) == [Emit(3, T(3))]


def test_rld_giving_up_tells_md_before_the_commit_and_only_its_engine_after():
    rld, md = rld_(ONE_SHOT), md_()
    feed(md, relayed(gen(rld, 3)))
    assert rld.on_rld_failed("engine_gone") == [Send(HandoffAbort(RID, EP, "engine_gone")), Done("RLD", "rld_failed")]
    assert rld.on_rld_failed("again") == [] and rld.on_message(Progress(0)) == []
    assert md.on_message(HandoffAbort(RID, EP, "engine_gone")) == [Done("RLD", "engine_gone")]
    committed = rld_(ONE_SHOT)
    gen(committed, 2)
    assert [type(a) for a in committed.on_message(Progress(0))] == [ModeChosen, Send, StopGenerating]
    assert committed.on_token_generated(T(2)) == []  # held
    # MD owns the output: nothing to say to it, but RLD's engine hears that the handoff is over
    # (it keeps the KV until handoff_done), and nothing held is emitted.
    assert committed.on_rld_failed("x", done_reason="aborted") == [Done("MD", "aborted", "one-shot", 2)]
    assert committed.owner == "MD" and committed.on_rld_failed("again") == []
    assert committed.on_message(HandoffRelease(RID, EP, "deadline")) == []  # too late: nobody resumes
    assert committed.on_message(HandoffTaken(RID, EP, 2)) == []
    assert committed.on_reconnect() == [] and committed.on_token_generated(T(3)) == []


def test_md_release_before_commit_keeps_rld():
    rld, md = rld_(CATCH_UP), md_()
    feed(md, relayed(gen(rld, 3)))
    md.on_kv_ready()
    assert md.on_kv_cancelled() == [Send(HandoffRelease(RID, EP, "kv_cancelled")), Done("RLD", "kv_cancelled")]
    assert md.on_md_progress(3) == []  # the extend that was running: ignored
    assert rld.on_message(HandoffRelease(RID, EP, "kv_cancelled")) == [Done("RLD", "md_released")]
    assert rld.on_message(Progress(0)) == []


def test_release_after_commit_resumes_rld_with_held_tokens():
    rld, md = rld_(ONE_SHOT), md_()
    feed(md, relayed(gen(rld, 3)))
    md.on_kv_ready()
    rld.on_message(Progress(0))  # commit at 3
    assert rld.on_token_generated(T(3)) == [] and rld.on_token_generated(T(4)) == []  # held
    assert md.on_message(Commit(3)) == []  # extend in flight
    assert md.on_md_failed("engine") == [Send(HandoffRelease(RID, EP, "engine")), Done("RLD", "engine", "one-shot")]
    with pytest.raises(HandoffUsageError):
        md.on_token_generated(T(3))
    assert rld.on_message(HandoffRelease(RID, EP, "engine")) == [
        Done("RLD", "md_released", "one-shot"), Emit(3, T(3)), Emit(4, T(4)), StartGenerating(5)]
    assert rld.on_token_generated(T(5)) == [Emit(5, T(5))]
    assert rld.on_reconnect() == []


def test_a_release_because_mds_engine_aborted_ends_rld_without_resuming():
    """MD's engine aborted the request (RELEASE "aborted"): RLD settles ``aborted``, before or
    after the commit, and neither emits what it held nor starts generating again."""
    rld = rld_(CATCH_UP)
    gen(rld, 3)
    assert rld.on_message(HandoffRelease(RID, EP, "aborted")) == [Done("RLD", "aborted")]
    rld, md = rld_(ONE_SHOT), md_()
    feed(md, relayed(gen(rld, 3)))
    md.on_kv_ready()
    rld.on_message(Progress(0))  # commit at 3
    assert rld.on_token_generated(T(3)) == []  # held
    assert rld.on_message(HandoffRelease(RID, EP, "aborted")) == [Done("RLD", "aborted", "one-shot")]
    assert rld.on_token_generated(T(4)) == []  # a step already running: nothing is emitted
    assert rld.on_reconnect() == []

def test_md_lost_after_commit_rld_never_resumes():
    rld = rld_(ONE_SHOT)
    gen(rld, 3)
    rld.on_message(Progress(3))
    assert rld.on_md_failed("peer_restarted") == [Done("MD", "md_failed_after_commit", "one-shot", 3)]
    assert rld.on_token_generated(T(3)) == []
    assert rld.on_message(HandoffRelease(RID, EP, "deadline")) == []  # too late: RLD gave it up
    assert rld.on_reconnect() == [Send(Commit(3))]  # MD may be alive after all: it can still take over


def test_md_deadline_releases_only_before_it_started():
    md = md_(deadline=5.0)
    md.on_tokens(0, [T(0)])
    md.on_kv_ready()
    assert md.on_timeout(4.0) == []
    assert md.on_timeout(5.0) == [Send(HandoffRelease(RID, EP, "deadline")), Done("RLD", "deadline")]
    assert md.on_reconnect() == [Send(HandoffRelease(RID, EP, "deadline"))]
    md2 = md_(deadline=5.0)
    md2.on_tokens(0, [T(0)])
    md2.on_kv_ready()
    md2.on_md_progress(1)
    md2.on_message(Commit(1))
    assert md2.state is MdState.STARTED
    assert md2.on_timeout(99.0) == [] and md2.on_md_failed() == [] and md2.on_kv_cancelled() == []


def test_other_epochs_are_ignored_and_misrouted_messages_refused():
    rld, md = rld_(ONE_SHOT), md_()
    gen(rld, 2)
    assert rld.on_message(HandoffProgress(RID, EP + 1, 0)) == []
    assert md.on_message(HandoffCommit(RID, EP + 1, 2)) == []
    with pytest.raises(HandoffUsageError):
        rld.on_message(HandoffProgress("other", EP, 0))
    with pytest.raises(HandoffProtocolError):
        rld.on_message(Commit(2))  # RLD never receives a commit
    with pytest.raises(HandoffProtocolError):
        md.on_message(Progress(0))


def test_contradictions_are_protocol_errors():
    rld, md = rld_(ONE_SHOT), md_()
    gen(rld, 2)
    with pytest.raises(HandoffProtocolError):
        rld.on_message(Progress(3))  # MD absorbed more than was generated
    with pytest.raises(HandoffProtocolError):
        rld.on_message(Taken(2))  # nothing was committed
    rld.on_message(Progress(0))
    with pytest.raises(HandoffProtocolError):
        rld.on_message(Taken(1))  # not the commit position
    md.on_tokens(0, [T(0), T(1)])
    with pytest.raises(HandoffProtocolError):
        md.on_tokens(1, [T(1) + 1])  # a relayed position changed
    with pytest.raises(HandoffProtocolError):
        md.on_tokens(5, [T(5)])  # a gap
    with pytest.raises(HandoffProtocolError):
        md.on_message(Commit(1))  # tokens past the commit position were relayed
    with pytest.raises(HandoffProtocolError):
        md.on_message(Commit(0))
    md.on_message(Commit(2))
    with pytest.raises(HandoffProtocolError):
        md.on_message(Commit(3))
    with pytest.raises(HandoffProtocolError):
        md.on_message(HandoffAbort(RID, EP, "x"))


def test_messages_round_trip_as_msgpack_arrays():
    msgs = [Progress(5), Commit(9, "catch-up"), Taken(9), HandoffRelease(RID, EP, "deadline"),
            HandoffAbort(RID, EP, "finished")]
    assert [type(m) for m in msgs] == list(HANDOFF_MESSAGES) and CAPABILITY == "handoff.v1"
    for msg in msgs:
        wire = msgspec.msgpack.encode(msg)
        assert isinstance(msgspec.msgpack.decode(wire), list)
        assert msgspec.msgpack.decode(wire, type=type(msg)) == msg
    # Optional trailing fields may be omitted, and unknown trailing ones are ignored.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode([RID, EP, 4]), type=HandoffCommit) == Commit(4, "")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode([RID, EP, 4, "one-shot", 99]), type=HandoffCommit) == Commit(4)
    assert len(msgspec.msgpack.encode(Commit(100))) < 32


# ============================================================================ regressions
def test_commit_arrives_before_the_relayed_tokens():
    """TOKENS and handoff messages are separate kinds: a commit may overtake the tokens < p
    (e.g. after a reconnect resends both). The state machine's shortest counterexample against a
    variant that started MD on the commit without waiting for the extend."""
    rld, md = rld_(ONE_SHOT), md_()
    rel = relayed(gen(rld, 3))
    feed(md, rel[:1])
    md.on_kv_ready()  # Progress(0), Extend(0, [t0])
    rld.on_message(Progress(0))
    assert md.on_message(Commit(3)) == []
    assert md.on_md_progress(1) == []  # tokens 1, 2 not here yet: wait
    assert feed(md, rel[1:]) == [Extend(1, (T(1),))]  # the first arrival starts an extend ...
    assert md.on_md_progress(3 - 1) == [Extend(2, (T(2),))]  # ... the next one the following
    assert md.on_md_progress(3)[0] == StartGenerating(3)


def test_commit_crosses_md_release():
    """MD releases (KV cancelled) while RLD's commit is in flight: RLD resumes exactly once."""
    rld, md = rld_(ONE_SHOT), md_()
    feed(md, relayed(gen(rld, 2)))
    md.on_kv_ready()
    assert rld.on_message(Progress(0))[-1] == StopGenerating()
    rel = md.on_kv_cancelled()[0].message
    assert md.on_message(Commit(2)) == [Send(rel)]  # released: say it again for this commit
    first = rld.on_message(rel)
    assert first == [Done("RLD", "md_released", "one-shot"), StartGenerating(2)]
    assert rld.on_message(rel) == []  # the second copy does nothing
    assert rld.on_token_generated(T(2)) == [Emit(2, T(2))]


def test_stale_copies_after_a_reconnect():
    """A reconnect re-delivers old messages after newer ones; all are idempotent."""
    rld, md = rld_(ONE_SHOT), md_()
    rel = relayed(gen(rld, 2))
    feed(md, rel)
    md.on_kv_ready()
    rld.on_message(Progress(0))
    md.on_md_progress(2)
    assert md.on_message(Commit(2))[0] == StartGenerating(2)
    assert feed(md, rel) == []  # TOKENS resent: dropped
    assert md.on_message(Commit(2)) == [Send(Taken(2))]  # commit resent: Taken again
    assert rld.on_message(Progress(2)) == []  # a late progress after the commit
    assert rld.on_message(Taken(2))[0].owner == "MD"
    assert rld.on_message(Taken(2)) == [] and rld.on_message(Progress(0)) == []
    assert md.on_reconnect() == [Send(Taken(2))] and rld.on_reconnect() == []


def test_reconnect_loses_progress_both_sides_resend():
    """A drop loses MD's progress reports in flight; TOKENS are resent from the last ack."""
    rld, md = rld_(ONE_SHOT), md_()
    rel = relayed(gen(rld, 2))
    feed(md, rel[:1])
    assert md.on_kv_ready() == [Send(Progress(0)), Extend(0, (T(0),))]  # this Progress is lost
    assert md.on_md_progress(1) == [Send(Progress(1))]  # and this one
    assert rld.on_reconnect() == []  # RLD sent no handoff message yet
    assert md.on_reconnect() == [Send(Progress(1))]  # MD's latest state
    assert feed(md, rel) == [Extend(1, (T(1),))]  # frame 0 again (dropped), then frame 1
    assert rld.on_message(Progress(1)) == [ModeChosen(ONE_SHOT, 1), Send(Commit(2)), StopGenerating()]


def test_overlapping_token_frames():
    md = md_()
    md.on_kv_ready()
    assert md.on_tokens(0, [T(0), T(1)]) == [Extend(0, (T(0), T(1)))]
    assert md.on_tokens(1, [T(1), T(2)]) == []  # position 1 known, 2 fresh (extend in flight)
    assert md.on_md_progress(2) == [Send(Progress(2)), Extend(2, (T(2),))]


def test_md_ready_before_rld_generated_anything():
    """MD cannot produce position 0 (prefill's token): RLD commits at 1 at the earliest."""
    rld = rld_(ONE_SHOT)
    assert rld.on_message(Progress(0)) == [ModeChosen(ONE_SHOT, 0)]
    assert rld.on_token_generated(T(0)) == [Emit(0, T(0)), RelayTokens(0, (T(0),)), Send(Commit(1)),
                                            StopGenerating()]


def test_false_alarm_after_commit_md_still_takes_over():
    """RLD is told MD failed while its commit is in flight, but MD was alive: MD emits, RLD never
    does. (The state machine's shortest counterexample against a variant that resumed here.)"""
    rld, md = rld_(ONE_SHOT), md_()
    feed(md, relayed(gen(rld, 2)))
    md.on_kv_ready()
    rld.on_message(Progress(0))
    assert rld.on_md_failed()[0].reason == "md_failed_after_commit"
    md.on_md_progress(2)
    assert md.on_message(Commit(2))[0] == StartGenerating(2)
    assert rld.on_message(Taken(2)) == []
    assert rld.on_token_generated(T(2)) == []


def test_abort_crosses_md_progress():
    rld, md = rld_(ONE_SHOT, deadline=1.0), md_()
    feed(md, relayed(gen(rld, 2)))
    abort = rld.on_timeout(1.0)[0].message
    md.on_kv_ready()  # Progress crosses the abort
    assert rld.on_message(Progress(0)) == []
    assert md.on_message(abort) == [Done("RLD", "deadline")]
    assert md.on_md_progress(2) == [] and md.on_tokens(2, [T(2)]) == []


def test_release_twice_then_commit_copy():
    """MD's deadline and engine failure both fire before the commit arrives; then copies."""
    rld, md = rld_(ONE_SHOT), md_(deadline=1.0)
    feed(md, relayed(gen(rld, 1)))
    md.on_kv_ready()
    rld.on_message(Progress(0))
    rel = md.on_timeout(1.0)[0]
    assert md.on_md_failed() == [] and md.on_kv_cancelled() == []
    assert md.on_message(Commit(1)) == [rel] and md.on_message(Commit(1)) == [rel]
    assert rld.on_message(rel.message)[-1] == StartGenerating(1)


# ============================================================================ the cost
def test_stall_is_one_one_way_trip_through_the_wire_codec():
    """A 100-token one-shot handoff, every message through msgpack: after RLD's last emission,
    the only thing on the user's critical path is the commit's one-way trip (plus MD's last
    extend). Its time is a benchmark figure (``pdd-tools bench --only handoff``), not asserted."""
    enc, dec = msgspec.msgpack.Encoder(), {t: msgspec.msgpack.Decoder(t) for t in HANDOFF_MESSAGES}

    def wire(msg):
        return dec[type(msg)].decode(enc.encode(msg))

    def once() -> None:
        rld, md = rld_(ONE_SHOT), md_()
        for i in range(100):
            for a in rld.on_token_generated(T(i)):
                if isinstance(a, RelayTokens):
                    md.on_tokens(a.first, a.tokens)
        ext = md.on_kv_ready()
        md.on_md_progress(ext[-1].first + len(ext[-1].tokens))
        commit = next(a for a in rld.on_message(wire(Progress(100))) if isinstance(a, Send)).message
        after_commit = md.on_message(wire(commit))  # one one-way trip
        assert after_commit[0] == StartGenerating(100)
        taken = after_commit[1].message
        assert rld.on_message(wire(taken))[0].owner == "MD"

    once()


# ============================================================================ state machine
class Lane:
    """One direction of the control lane, for handoff messages: FIFO while connected."""

    def __init__(self) -> None:
        self.q: deque = deque()
        self.delivered: list = []


class HandoffMachine(RuleBasedStateMachine):
    """RLD and MD, a simulated control lane, engines, clocks and faults. Subclasses choose which
    faults may happen (all of them at once would crowd out the interleavings that matter)."""

    FAULTS = st.just("none")

    @initialize(n=st.integers(1, 60),
                mode=st.sampled_from(["one-shot", "catch-up", "policy"]),
                gap=st.integers(0, 6), rounds=st.integers(1, 4), load=st.sampled_from([0.1, 0.9]),
                rld_deadline=st.integers(1, 200), md_deadline=st.integers(1, 250),
                slack=st.integers(0, 2), kv_arrives=st.booleans(),
                data=st.data())
    def setup(self, n, mode, gap, rounds, load, rld_deadline, md_deadline, slack, kv_arrives, data):
        self.n = n
        pol = HandoffPolicy(catchup_gap_tokens=gap, max_catchup_rounds=rounds, busy_load=0.5)
        fixed = {"one-shot": ONE_SHOT, "catch-up": CATCH_UP}.get(mode)
        choose = (lambda g: fixed) if fixed else (lambda g: choose_handoff_mode(load, g, pol))
        self.now = 0
        self.rld = RldHandoff(RID, EP, deadline=rld_deadline, choose_mode=choose, policy=pol)
        self.md = MdHandoff(RID, EP, deadline=md_deadline)
        self.a2b, self.b2a = Lane(), Lane()
        self.tok_frames: list = []  # TOKENS A->B: resent from `tok_acked` after a reconnect
        self.tok_next = self.tok_acked = 0
        self.emitted: list[tuple[str, int]] = []  # (side, position), in the order they happened
        self.rld_running, self.slack_cfg, self.slack = True, slack, 0
        self.md_alive = True  # False: MD's agent and engine are gone (crash)
        self.md_engine_ok = True
        self.md_extend: int | None = None  # end of the Extend MD's engine is running
        self.md_absorbed = 0  # end of the last Extend MD's engine finished
        self.md_next: int | None = None  # MD's next position to generate, once started
        self.kv_arrives, self.kv_given = kv_arrives, False
        faults = data.draw(self.FAULTS, label="faults")
        # One kind of fault per example (or all of them): otherwise faults crowd out the handoffs.
        self.faults = {faults} if faults != "all" else {"crash", "engine", "kv_cancel", "false_alarm"}
        self.rld_told = False
        self.md_failed_after_start = False
        self.md_failed_before_start = False  # a failure MD itself saw before it started
        self.rld_told_before_commit = False
        self.rld_dones: list[Done] = []
        self.md_dones: list[Done] = []

    # ---------------------------------------------------------------- applying actions
    def _emit(self, side: str, a: Emit) -> None:
        assert a.position == len(self.emitted), (side, a, self.emitted)  # no gap, no duplicate
        assert a.token == T(a.position)
        assert a.position < self.n
        self.emitted.append((side, a.position))

    def apply_rld(self, actions) -> None:
        for a in actions:
            if isinstance(a, Emit):
                self._emit("RLD", a)
            elif isinstance(a, RelayTokens):
                assert a.first == sum(len(f[1]) for f in self.tok_frames)  # the stream has no gap
                assert a.tokens == tuple(T(a.first + i) for i in range(len(a.tokens)))
                self.tok_frames.append((a.first, a.tokens))
            elif isinstance(a, Send):
                self.a2b.q.append(a.message)
            elif isinstance(a, StopGenerating):
                self.rld_running, self.slack = False, self.slack_cfg
            elif isinstance(a, StartGenerating):
                assert a.position == self.rld.generated
                self.rld_running = True
            elif isinstance(a, Done):
                self.rld_dones.append(a)
                assert len(self.rld_dones) == 1, self.rld_dones
            else:
                assert isinstance(a, ModeChosen), a

    def apply_md(self, actions) -> None:
        for a in actions:
            if isinstance(a, Emit):
                self._emit("MD", a)
            elif isinstance(a, Extend):
                assert self.md_extend is None and a.first == self.md_absorbed
                assert a.tokens == tuple(T(a.first + i) for i in range(len(a.tokens)))
                self.md_extend = a.first + len(a.tokens)
            elif isinstance(a, Send):
                self.b2a.q.append(a.message)
            elif isinstance(a, StartGenerating):
                # MD's engine absorbed exactly the tokens before p (its last extend yields token p).
                assert self.md_extend is None and self.md_absorbed == a.position
                self.md_next = a.position
            elif isinstance(a, Done):
                self.md_dones.append(a)
                assert len(self.md_dones) == 1, self.md_dones
            else:
                raise AssertionError(a)

    # ---------------------------------------------------------------- engines
    @precondition(lambda s: s.rld.generated < s.n and (s.rld_running or s.slack > 0))
    @rule(k=st.integers(1, 4))
    def rld_generates(self, k=1):
        for _ in range(k):
            if self.rld.generated >= self.n or not (self.rld_running or self.slack > 0):
                return
            if not self.rld_running:
                self.slack -= 1  # a step that was already running when RLD was told to stop
            pos = self.rld.generated
            self.apply_rld(self.rld.on_token_generated(T(pos), last=pos == self.n - 1))

    @precondition(lambda s: s.md_alive and not s.kv_given)
    @rule()
    def md_kv_ready(self):
        self.kv_given = True
        self.apply_md(self.md.on_kv_ready())

    @precondition(lambda s: s.md_alive and s.md_engine_ok and s.md_extend is not None)
    @rule()
    def md_extend_done(self):
        end, self.md_extend = self.md_extend, None
        self.md_absorbed = end
        self.apply_md(self.md.on_md_progress(end))

    @precondition(lambda s: s.md_alive and s.md_engine_ok and s.md_next is not None and s.md_next < s.n)
    @rule()
    def md_generates(self):
        pos = self.md_next
        self.md_next += 1
        self.apply_md(self.md.on_token_generated(T(pos), last=pos == self.n - 1))

    # ---------------------------------------------------------------- the network
    @precondition(lambda s: s.a2b.q)
    @rule()
    def deliver_to_md(self):
        msg = self.a2b.q.popleft()
        self.a2b.delivered.append(msg)
        if self.md_alive:
            self.apply_md(self.md.on_message(msg))

    @precondition(lambda s: s.b2a.q)
    @rule()
    def deliver_to_rld(self):
        msg = self.b2a.q.popleft()
        self.b2a.delivered.append(msg)
        self.apply_rld(self.rld.on_message(msg))

    @precondition(lambda s: s.tok_next < len(s.tok_frames))
    @rule(ack=st.booleans())
    def deliver_tokens(self, ack=True):
        first, toks = self.tok_frames[self.tok_next]
        self.tok_next += 1
        if ack:  # TOKENS_ACK (it may lag: then a reconnect resends the frame)
            self.tok_acked = self.tok_next
        if self.md_alive:
            self.apply_md(self.md.on_tokens(first, toks))

    @rule(resend=st.booleans(), dup_a=st.integers(0, 3), dup_b=st.integers(0, 3))
    def reconnect(self, resend, dup_a, dup_b):
        """The control connection drops and comes back (same incarnations)."""
        self.tok_next = self.tok_acked  # unacknowledged TOKENS are resent; MD drops what it has
        for lane, dup in ((self.a2b, dup_a), (self.b2a, dup_b)):
            if resend:  # the integrator resends unacknowledged messages: copies of delivered ones
                old = lane.delivered[len(lane.delivered) - min(dup, len(lane.delivered)):]
                lane.q = deque(old + list(lane.q))
            else:  # in flight and lost
                lane.q = deque()
        self.apply_rld(self.rld.on_reconnect())
        if self.md_alive:
            self.apply_md(self.md.on_reconnect())

    # ---------------------------------------------------------------- failures and time
    def _md_failure_seen(self) -> None:
        if self.md.state is MdState.STARTED:
            self.md_failed_after_start = True
        elif self.md.state in (MdState.WAITING, MdState.COMMITTED):
            self.md_failed_before_start = True

    @precondition(lambda s: s.md_alive and "crash" in s.faults)
    @rule()
    def md_crashes(self):
        """MD's agent and engine die: no release is sent; RLD hears of it later."""
        if self.md.state is MdState.STARTED:
            self.md_failed_after_start = True
        self.md_alive = False

    @precondition(lambda s: not s.md_alive and not s.rld_told)
    @rule()
    def rld_told_md_failed(self):
        self.rld_told = True
        self.rld_told_before_commit = self.rld.state is RldState.RELAYING
        self.apply_rld(self.rld.on_md_failed("peer_restarted"))

    @precondition(lambda s: s.md_alive and "false_alarm" in s.faults and not s.rld_told)
    @rule()
    def rld_false_alarm(self):
        """RLD's agent gives MD up (unreachable too long) although MD is alive."""
        self.rld_told = True
        self.apply_rld(self.rld.on_md_failed("peer_unreachable"))

    @precondition(lambda s: s.md_alive and s.md_engine_ok and "engine" in s.faults)
    @rule()
    def md_engine_fails(self):
        self._md_failure_seen()
        self.md_engine_ok = False
        self.apply_md(self.md.on_md_failed("engine"))

    @precondition(lambda s: s.md_alive and "kv_cancel" in s.faults)
    @rule()
    def md_kv_cancelled(self):
        if self.md.state is not MdState.STARTED:
            self._md_failure_seen()
            self.apply_md(self.md.on_kv_cancelled())

    @rule(dt=st.integers(1, 10))
    def tick(self, dt):
        self.now += dt
        self.apply_rld(self.rld.on_timeout(self.now))
        if self.md_alive:
            self.apply_md(self.md.on_timeout(self.now))

    # ---------------------------------------------------------------- invariants
    @invariant()
    def ownership_is_consistent(self):
        rld, md = self.rld, self.md
        by_rld = [p for side, p in self.emitted if side == "RLD"]
        by_md = [p for side, p in self.emitted if side == "MD"]
        assert by_rld == list(range(len(by_rld)))
        if by_md:
            assert md.position == rld.position == by_md[0] and by_md == list(range(by_md[0], by_md[0] + len(by_md)))
            assert set(by_rld) == set(range(rld.position))  # RLD stopped exactly at p, and for good
        if rld.state is RldState.COMMITTED:
            assert rld.emitted == rld.position
        if rld.state is RldState.RELAYING:
            assert rld.emitted == rld.generated and not by_md
        if md.state is MdState.STARTED:
            assert rld.state is not RldState.RELAYING and not (rld.state is RldState.RLD_OWNS and rld.position)

    def teardown(self):
        if not hasattr(self, "rld"):
            return
        self.drain()
        rld, md = self.rld, self.md
        assert sorted(p for _, p in self.emitted) == list(range(len(self.emitted)))
        assert rld.done is not None, rld.state  # RLD's handoff always settles
        if self.md_alive:
            assert md.done is not None, md.state  # so does MD's, while it lives
        by_md = [p for side, p in self.emitted if side == "MD"]
        if not (rld.lost or self.md_failed_after_start):
            assert len(self.emitted) == self.n, (rld.done, md.done, self.emitted)
        if rld.done.owner == "RLD":
            assert not by_md and len(self.emitted) == self.n
        elif not rld.lost:
            assert md.done == Done("MD", "took_over", rld.done.mode, rld.position)
        if (self.md_failed_before_start or self.rld_told_before_commit) and not rld.lost:
            assert rld.done.owner == "RLD" and not by_md and len(self.emitted) == self.n

    @rule()
    def everything_runs_once(self):
        """A round of normal operation (so that handoffs, not just faults, fill the examples)."""
        self._round(drain=False)

    def _round(self, drain=True):
        while self.a2b.q or self.b2a.q or self.tok_next < len(self.tok_frames):
            if self.tok_next < len(self.tok_frames):
                self.deliver_tokens()
            if self.a2b.q:
                self.deliver_to_md()
            if self.b2a.q:
                self.deliver_to_rld()
            if not drain:
                break
        if self.md_alive and self.kv_arrives and not self.kv_given:
            self.md_kv_ready()
        if self.md_alive and self.md_engine_ok and self.md_extend is not None:
            self.md_extend_done()
        if self.rld.generated < self.n and self.rld_running:
            self.rld_generates()
        if self.md_alive and self.md_engine_ok and self.md_next is not None and self.md_next < self.n:
            self.md_generates()
        if not self.md_alive and not self.rld_told:
            self.rld_told_md_failed()

    def drain(self):
        """Let everything run: deliver all, finish extends and generation, then fire the timers."""
        for _ in range(100_000):
            before = (len(self.emitted), self.rld.generated, self.md_next, self.md_extend, self.tok_next,
                      len(self.a2b.delivered), len(self.b2a.delivered), self.rld.state, self.md.state, self.now)
            self._round()
            after = (len(self.emitted), self.rld.generated, self.md_next, self.md_extend, self.tok_next,
                     len(self.a2b.delivered), len(self.b2a.delivered), self.rld.state, self.md.state, self.now)
            if after == before:
                timers = [t for t in (self.rld.next_deadline(), self.md.next_deadline() if self.md_alive else None)
                          if t is not None]
                if not timers:
                    return
                self.tick(max(0, min(timers) - self.now))
        raise AssertionError("drain did not settle")


MACHINE = settings(max_examples=300, stateful_step_count=60, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow])


class NetworkOnly(HandoffMachine):
    """Reordering, copies, reconnects and timers; MD does not fail."""


class MdFailures(HandoffMachine):
    """Plus MD crashes (RLD hears of them later), engine failures and KV cancellations."""

    FAULTS = st.sampled_from(["crash", "engine", "kv_cancel", "all"])


class FalseAlarms(HandoffMachine):
    """Plus RLD's agent giving MD up while MD is alive (and everything else)."""

    FAULTS = st.sampled_from(["false_alarm", "all"])


TestMachineNetworkOnly = NetworkOnly.TestCase
TestMachineMdFailures = MdFailures.TestCase
TestMachineFalseAlarms = FalseAlarms.TestCase
TestMachineNetworkOnly.settings = TestMachineMdFailures.settings = TestMachineFalseAlarms.settings = MACHINE
