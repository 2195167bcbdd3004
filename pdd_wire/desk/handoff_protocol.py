"""Extend-Decode handoff: output ownership passes from relay decode (RLD) to main decode (MD).

Sans-IO, like h11/h2: :class:`RldHandoff` (site A) and :class:`MdHandoff` (site B) are per-request
state machines. The caller feeds them *events* (a token generated, a message received, the KV is
ready, a timer fired, the peer failed) and performs the *actions* they return, in order (emit a
token to the user, send a message, start or stop the engine, extend the KV). Nothing here does
I/O, reads a clock or keeps a reference to anything outside the object. The protocol is specified
in ``proto/handoff.md``; the one-shot / catch-up choice is ``pdd_wire.policy.choose_handoff_mode``.

The invariant (checked by ``tests/test_handoff.py`` under reordering, duplicates, reconnects,
failures and timeouts): output positions 0, 1, 2, ... of a request are each emitted by exactly
one of RLD and MD, each side in order; RLD emits ``[0, p)`` and MD ``[p, ...)`` for one agreed
``p``, or RLD emits everything.

How (details in the spec):

* RLD emits every token as it generates it and relays its id to MD (:class:`RelayTokens`, TOKENS
  frames whose ``seq`` is the position). MD extends every relayed token it has as soon as it holds
  the KV, one :class:`Extend` at a time, and reports :class:`HandoffProgress` ("I hold the KV and
  absorbed every token < n") after each.
* RLD **commits** at ``p`` = the tokens it generated so far: it stops emitting and sends
  :class:`HandoffCommit` -- at MD's first progress report (one-shot), or once MD is at most
  ``catchup_gap_tokens`` behind (catch-up). Ownership passes when RLD sends the commit.
* MD emits from ``p`` once it has absorbed every token < ``p`` (the extend that absorbs token
  ``p-1`` yields token ``p``) and answers :class:`HandoffTaken`. The user-visible stall is one
  one-way trip plus the last small extend.
* Ownership comes back only through :class:`HandoffRelease`, which MD sends only while it has not
  emitted (then never will): on a failure it sees (engine, KV cancelled) or at its deadline.
  RLD resumes from ``p`` with the tokens it generated meanwhile.
* Before committing, RLD keeps ownership on its deadline, on MD's failure and on MD's release,
  and tells MD with :class:`HandoffAbort`. After committing, a failure RLD is told about (MD's
  agent lost, without a release) ends the handoff with ``Done(owner="MD",
  reason="md_failed_after_commit")``: RLD cannot know whether MD emitted, so it never resumes.
  RLD giving the request up itself after committing ends it with ``Done(owner="MD", reason)``.

Every message names the request and its handoff ``epoch`` (messages of another epoch are ignored)
and is idempotent, so the control lane may deliver a message again after a reconnect, in any
order with TOKENS frames; after a reconnect, call ``on_reconnect()`` on each live handoff and
send what it returns (the latest state message, in case the first copy was lost).
"""

from __future__ import annotations

import array
import enum
from collections.abc import Callable, Sequence
from typing import Literal

import msgspec

from ..policy import DEFAULT_POLICY, HandoffMode, HandoffPolicy, ModeDecision

Owner = Literal["RLD", "MD"]
#: Relayed positions MD takes for one handoff (transfer.md §12's limit); past it MD gives it back ...
MAX_RELAYED_TOKENS = 1 << 20
#: ... and the positions one Extend carries: a longer backlog goes as several, in turn.
MAX_EXTEND_TOKENS = 1 << 16


class HandoffError(Exception):
    """Base of the errors below."""


class HandoffProtocolError(HandoffError):
    """A message of this request's epoch contradicts the protocol (a bug on the peer, or two
    requests sharing an id and epoch). The handoff state is unchanged; log it and count it."""


class HandoffUsageError(HandoffError):
    """The caller fed an event the state machine cannot have asked for (a local bug)."""


# ----------------------------------------------------------------------------- wire messages
# Control lane, lane 1 (TOKEN class), transfer_id 0, one frame type each; see proto/handoff.md.
# Fields are only ever appended, with defaults. ``reason`` and ``mode`` strings are informational.


from ..wire.messages import HandoffAbort, HandoffCommit, HandoffProgress, HandoffRelease, HandoffTaken  # noqa: E402

HandoffMessage = HandoffProgress | HandoffCommit | HandoffTaken | HandoffRelease | HandoffAbort

#: The messages, in the order proposed for frame type numbers (the codec assigns them), with the
#: proposed frame names: HANDOFF_PROGRESS, HANDOFF_COMMIT, HANDOFF_TAKEN, HANDOFF_RELEASE,
#: HANDOFF_ABORT.
HANDOFF_MESSAGES: tuple[type, ...] = (HandoffProgress, HandoffCommit, HandoffTaken, HandoffRelease, HandoffAbort)
#: Capability an agent advertises (HELLO/WELCOME) before the peer may send it these frame types.
CAPABILITY = "handoff.v1"
#: The RELEASE reason of an MD whose engine aborted the request: RLD settles and does not go on
#: (``Done(RLD, "aborted")``, as for the REQUEST_ABORT that follows).
ABORTED = "aborted"


# ----------------------------------------------------------------------------- actions
class Emit(msgspec.Struct, frozen=True):
    """Send output position ``position`` (token ``token``) to the user."""

    position: int
    token: int


class RelayTokens(msgspec.Struct, frozen=True):
    """RLD: relay token ids to MD (TOKENS frames; ``first`` is the TOKENS ``seq``)."""

    first: int
    tokens: tuple[int, ...]


class Send(msgspec.Struct, frozen=True):
    """Send ``message`` to the peer on the control lane."""

    message: HandoffMessage


class StopGenerating(msgspec.Struct, frozen=True):
    """RLD: stop decoding this request (a step already running may still deliver tokens: feed
    them, they are held). Keep its KV until :class:`Done`."""


class StartGenerating(msgspec.Struct, frozen=True):
    """Start (MD: take over) or resume (RLD) decoding; the next token generated is ``position``.
    MD: the token ``position`` comes out of the extend that absorbed token ``position - 1``."""

    position: int


class Extend(msgspec.Struct, frozen=True):
    """MD: compute the KV of relayed tokens ``[first, first + len(tokens))`` in one extend step;
    call ``on_md_progress(first + len(tokens))`` when it is done. One at a time."""

    first: int
    tokens: tuple[int, ...]


class ModeChosen(msgspec.Struct, frozen=True):
    """RLD: the handoff mode was decided (log it, count ``decision.reason``)."""

    decision: ModeDecision
    gap: int


class Done(msgspec.Struct, frozen=True):
    """Ownership is settled; the handoff needs nothing more. The object keeps turning the owner's
    tokens into :class:`Emit`; everything else it ignores.

    ``owner``: who emits from here on (``"MD"`` from ``position``). ``reason`` is a stable label:

    * RLD side: ``one_shot``, ``catch_up_converged``, ``catch_up_forced`` (MD took over);
      ``md_failed_after_commit`` (owner MD, but RLD was told MD failed after it committed: whether
      MD emits the rest is unknown here; RLD never resumes); ``finished_on_rld``, ``deadline``,
      ``md_failed``, ``md_released`` (owner RLD); RLD gave the request up (its engine's abort
      ``rld_failed``, its disconnect ``engine_gone``, a REQUEST_ABORT ``aborted``, the agent
      stopping ``shutting_down``): owner RLD before the commit, MD after it (with ``p``), and
      nobody here emits the rest.
    * MD side: ``took_over``; or owner RLD with RLD's abort reason or MD's own release reason.
    """

    owner: Owner
    reason: str
    mode: HandoffMode | None = None
    position: int | None = None


Action = Emit | RelayTokens | Send | StopGenerating | StartGenerating | Extend | ModeChosen | Done


# ----------------------------------------------------------------------------- RLD
class RldState(enum.Enum):
    RELAYING = "relaying"  # RLD owns and emits; relays tokens; waits for MD to catch up
    COMMITTED = "committed"  # commit sent: RLD emits nothing; waits for Taken or Release
    RLD_OWNS = "rld_owns"  # settled: RLD keeps the output (aborted, or MD released)
    MD_OWNS = "md_owns"  # settled: MD took over (or failed after the commit)


class RldHandoff:
    """RLD's half of one request's handoff (site A).

    ``deadline``: an absolute time on the caller's clock; if RLD has not committed by then it
    keeps the output. ``choose_mode(gap)`` is called once, when MD's first progress report
    arrives, with the number of tokens MD is behind; typically
    ``lambda gap: policy.choose_handoff_mode(rld_load_now(), gap, cfg)``.

    Feed it: every token RLD's engine generates for the request (:meth:`on_token_generated`,
    including those after :class:`StopGenerating`), MD's messages (:meth:`on_message`), a failure
    of MD that the agent learns of (:meth:`on_md_failed`), timer expiry (:meth:`on_timeout` at
    :meth:`next_deadline`) and reconnects (:meth:`on_reconnect`).
    """

    def __init__(self, request_id: str, epoch: int, *, deadline: float,
                 choose_mode: Callable[[int], ModeDecision], policy: HandoffPolicy = DEFAULT_POLICY) -> None:
        self.request_id = request_id
        self.epoch = epoch
        self.deadline = deadline
        self.policy = policy
        self._choose_mode = choose_mode
        self.state = RldState.RELAYING
        self.generated = 0  # tokens RLD's engine produced (positions 0 .. generated-1)
        self.emitted = 0  # positions RLD emitted: [0, emitted)
        self.finished = False  # the request's last token was generated here
        self.absorbed = -1  # highest MD progress seen; -1: MD not ready yet
        self.rounds = 0  # progress reports that advanced, after the mode was chosen
        self.decision: ModeDecision | None = None
        self.position: int | None = None  # the commit position p
        self.commit_reason: str | None = None
        self.done: Done | None = None
        self.lost = False  # told MD failed after the commit: MD's fate unknown here
        self.gave_up = False  # RLD gave the request up: after the commit, or on RELEASE 'aborted'
        self._held: list[int] = []  # generated after the commit: positions p, p+1, ...
        self._last_sent: HandoffCommit | HandoffAbort | None = None

    # -- queries
    @property
    def owner(self) -> Owner:
        """Who owns the output now (``"MD"`` from the moment RLD sent its commit)."""
        return "RLD" if self.state in (RldState.RELAYING, RldState.RLD_OWNS) else "MD"

    def next_deadline(self) -> float | None:
        """When :meth:`on_timeout` must be called next; ``None``: no timer needed."""
        return self.deadline if self.state is RldState.RELAYING else None

    # -- events
    def on_token_generated(self, token: int, *, last: bool = False) -> list[Action]:
        """RLD's engine produced the request's next token (position = tokens produced before it).
        ``last``: it ends the request (EOS or length limit)."""
        if self.finished:
            raise HandoffUsageError(f"{self.request_id}: token after the request's last one")
        pos = self.generated
        self.generated += 1
        self.finished = last
        st = self.state
        if st is RldState.RELAYING:
            self.emitted += 1
            out: list[Action] = [Emit(pos, token)]
            if last:
                return out + self._abort("finished", done_reason="finished_on_rld")
            out.append(RelayTokens(pos, (token,)))
            return out + self._maybe_commit()
        if st is RldState.COMMITTED:
            self._held.append(token)  # generated past p: never emitted unless MD releases
            return []
        if st is RldState.RLD_OWNS and not self.gave_up:
            self.emitted += 1
            return [Emit(pos, token)]
        return []  # MD_OWNS, or given up: a step that was already running when RLD stopped

    def on_message(self, msg: HandoffMessage) -> list[Action]:
        """A handoff message from MD. Messages of another epoch are ignored."""
        self._check_request(msg)
        if msg.epoch != self.epoch:
            return []
        if isinstance(msg, HandoffProgress):
            return self._on_progress(msg.absorbed)
        if isinstance(msg, HandoffTaken):
            return self._on_taken(msg.position)
        if isinstance(msg, HandoffRelease):
            return self._on_release(msg.reason)
        raise HandoffProtocolError(f"{self.request_id}: {type(msg).__name__} is not sent by MD")

    def on_md_failed(self, reason: str = "md_failed") -> list[Action]:
        """The agent learned that MD cannot take over: its agent restarted or stayed unreachable,
        the KV transfer to it failed, ... (MD's own view of such failures comes as a release)."""
        if self.state is RldState.RELAYING:
            return self._abort(reason, done_reason="md_failed")
        if self.state is RldState.COMMITTED:
            # MD may already be emitting: resuming could emit a position twice. MD's release
            # (if MD is alive and did not start) is the only way back.
            self.state = RldState.MD_OWNS
            self.lost = True
            return [self._settle("MD", "md_failed_after_commit")]
        return []

    def on_rld_failed(self, reason: str = "rld_failed", *, done_reason: str = "rld_failed") -> list[Action]:
        """RLD itself gives the request up (its engine aborted it or disconnected, MD's site
        aborted it, the agent stops). Before the commit MD is told to drop it (ABORT ``reason``)
        and nobody emits any more: ``Done(RLD, done_reason)``. After the commit MD owns the
        output and nothing needs saying, but RLD's engine still learns that the handoff is over:
        ``Done(MD, done_reason, p)``; nothing held is emitted and RLD never resumes (a late
        RELEASE finds nobody to resume)."""
        if self.state is RldState.RELAYING:
            return self._abort(reason, done_reason=done_reason)
        if self.state is RldState.COMMITTED:
            self.state = RldState.MD_OWNS
            self.gave_up = True
            self._held.clear()
            return [self._settle("MD", done_reason)]
        return []

    def on_timeout(self, now: float) -> list[Action]:
        """A timer fired (any time is fine: it does nothing before :meth:`next_deadline`)."""
        if self.state is RldState.RELAYING and now >= self.deadline:
            return self._abort("deadline", done_reason="deadline")
        return []

    def on_reconnect(self) -> list[Action]:
        """The control connection to MD's agent was re-established: resend the latest message
        (idempotent) in case the first copy was lost. TOKENS are resent by the session."""
        if isinstance(self._last_sent, HandoffAbort):
            return [Send(self._last_sent)]
        if isinstance(self._last_sent, HandoffCommit) and (self.state is RldState.COMMITTED or self.lost):
            return [Send(self._last_sent)]  # (after md_failed_after_commit: MD may be alive after all)
        return []

    # -- internals
    def _check_request(self, msg: object) -> None:
        if getattr(msg, "request_id", None) != self.request_id:
            raise HandoffUsageError(f"message for {getattr(msg, 'request_id', None)!r} fed to {self.request_id!r}")

    def _on_progress(self, absorbed: int) -> list[Action]:
        if self.state is not RldState.RELAYING:
            return []  # stale: the handoff moved on
        if absorbed > self.generated:
            raise HandoffProtocolError(f"{self.request_id}: MD absorbed {absorbed} tokens, only "
                                       f"{self.generated} were generated")
        out: list[Action] = []
        if self.decision is None:
            gap = self.generated - absorbed
            self.decision = self._choose_mode(gap)
            out.append(ModeChosen(self.decision, gap))
        elif absorbed > self.absorbed:
            self.rounds += 1
        self.absorbed = max(self.absorbed, absorbed)
        return out + self._maybe_commit()

    def _maybe_commit(self) -> list[Action]:
        if self.decision is None or self.generated < 1:
            return []  # MD not ready; or MD could not produce position 0 (it is prefill's token)
        if self.decision.mode == "one-shot":
            reason = "one_shot"
        elif self.generated - self.absorbed <= self.policy.catchup_gap_tokens:
            reason = "catch_up_converged"
        elif self.rounds >= self.policy.max_catchup_rounds:
            reason = "catch_up_forced"
        else:
            return []
        # Every generated token was emitted and relayed: p = generated.
        self.state = RldState.COMMITTED
        self.position = self.generated
        self.commit_reason = reason
        msg = HandoffCommit(self.request_id, self.epoch, self.position, self.decision.mode)
        self._last_sent = msg
        return [Send(msg), StopGenerating()]

    def _on_taken(self, position: int) -> list[Action]:
        if self.state is RldState.COMMITTED or self.state is RldState.MD_OWNS:
            if position != self.position:
                raise HandoffProtocolError(f"{self.request_id}: MD took over at {position}, commit was "
                                           f"{self.position}")
            if self.state is RldState.COMMITTED:
                self.state = RldState.MD_OWNS
                return [self._settle("MD", self.commit_reason or "")]
            return []  # a copy; or MD was alive after all (after md_failed_after_commit)
        raise HandoffProtocolError(f"{self.request_id}: MD took over in state {self.state.value} "
                                   f"(no commit outstanding)")

    def _on_release(self, reason: str) -> list[Action]:
        if reason == ABORTED and self.state in (RldState.RELAYING, RldState.COMMITTED):
            # MD's engine aborted the request (its REQUEST_ABORT follows): nobody goes on.
            self.state = RldState.RLD_OWNS
            self.gave_up = True
            self._held.clear()
            return [self._settle("RLD", ABORTED)]
        if self.state is RldState.RELAYING:
            self.state = RldState.RLD_OWNS
            return [self._settle("RLD", "md_released")]
        if self.state is RldState.COMMITTED:
            # MD promises it never emitted and never will: take the output back at p.
            self.state = RldState.RLD_OWNS
            out: list[Action] = [self._settle("RLD", "md_released")]
            for tok in self._held:
                out.append(Emit(self.emitted, tok))
                self.emitted += 1
            self._held.clear()
            if not self.finished:
                out.append(StartGenerating(self.generated))
            return out
        if self.state is RldState.MD_OWNS and not (self.lost or self.gave_up):
            raise HandoffProtocolError(f"{self.request_id}: MD released after it took over")
        return []  # a copy; or too late (RLD already settled: md_failed_after_commit, or it gave up)

    def _abort(self, reason: str, *, done_reason: str) -> list[Action]:
        self.state = RldState.RLD_OWNS
        msg = HandoffAbort(self.request_id, self.epoch, reason)
        self._last_sent = msg
        return [Send(msg), self._settle("RLD", done_reason)]

    def _settle(self, owner: Owner, reason: str) -> Done:
        self.done = Done(owner, reason, self.decision.mode if self.decision else None,
                         self.position if owner == "MD" else None)
        return self.done


# ----------------------------------------------------------------------------- MD
class MdState(enum.Enum):
    WAITING = "waiting"  # no commit yet: buffering tokens, extending once the KV is here
    COMMITTED = "committed"  # commit received: extending up to p
    STARTED = "started"  # MD emits from p (settled: MD owns)
    RELEASED = "released"  # settled: MD never emits (it said so)
    ABORTED = "aborted"  # settled: RLD kept the output


class MdHandoff:
    """MD's half of one request's handoff (site B).

    ``deadline``: an absolute time on the caller's clock; if MD has not started emitting by
    then, it releases the request to RLD (always safe; it bounds how long MD holds the KV when
    RLD or the link is gone). Choose it later than RLD's deadline plus the time to absorb a
    commit (e.g. RLD's deadline + a few RTTs + one extend), so that it rarely races a commit.

    Feed it: relayed tokens (:meth:`on_tokens`, from TOKENS events, in any order with the
    messages), the KV transfer's outcome (:meth:`on_kv_ready`, :meth:`on_kv_cancelled`), extend
    completion (:meth:`on_md_progress`), RLD's messages (:meth:`on_message`), MD's own tokens once
    it started (:meth:`on_token_generated`), engine failure (:meth:`on_md_failed`), timers and
    reconnects.
    """

    def __init__(self, request_id: str, epoch: int, *, deadline: float) -> None:
        self.request_id = request_id
        self.epoch = epoch
        self.deadline = deadline
        self.state = MdState.WAITING
        self.kv_ready = False
        self.tokens = array.array("I")  # relayed tokens, positions 0 .. len-1 (4 bytes each)
        self.absorbed = 0  # tokens whose KV the engine computed: [0, absorbed)
        self.extending: int | None = None  # end of the Extend in flight
        self.position: int | None = None  # the commit position p
        self.mode: HandoffMode | None = None
        self.emitted = 0  # positions MD emitted: [p, p + emitted)
        self.finished = False
        self.done: Done | None = None
        self.release_reason = ""

    # -- queries
    @property
    def owner(self) -> Owner:
        return "MD" if self.state is MdState.STARTED else "RLD"

    def next_deadline(self) -> float | None:
        return self.deadline if self.state in (MdState.WAITING, MdState.COMMITTED) else None

    # -- events
    def on_tokens(self, first: int, tokens: Sequence[int]) -> list[Action]:
        """Relayed token ids for positions ``[first, first + len(tokens))``. Copies of positions
        already held are checked and dropped; a gap is an error (TOKENS never skip)."""
        if self.state not in (MdState.WAITING, MdState.COMMITTED):
            return []  # settled: MD needs no more relayed tokens
        if first < 0:
            raise HandoffProtocolError(f"{self.request_id}: relayed tokens at position {first}")
        have = len(self.tokens)
        if first > have:
            raise HandoffProtocolError(f"{self.request_id}: relayed tokens from {first}, expected {have}")
        overlap = min(have - first, len(tokens))
        if array.array("I", tokens[:overlap]) != self.tokens[first:first + overlap]:
            raise HandoffProtocolError(f"{self.request_id}: a relayed position changed token")
        fresh = list(tokens[overlap:])
        if not fresh:
            return []
        if self.position is not None and have + len(fresh) > self.position:
            raise HandoffProtocolError(f"{self.request_id}: relayed tokens past the commit position {self.position}")
        if have + len(fresh) > MAX_RELAYED_TOKENS:
            raise HandoffProtocolError(f"{self.request_id}: over {MAX_RELAYED_TOKENS} relayed tokens")
        self.tokens.extend(fresh)
        return self._pump()

    def on_kv_ready(self) -> list[Action]:
        """The request's prompt KV is in MD's memory (``kv_received``)."""
        if self.kv_ready or self.state not in (MdState.WAITING, MdState.COMMITTED):
            return []
        self.kv_ready = True
        out: list[Action] = []
        if self.state is MdState.WAITING:
            out.append(self._progress())
        return out + self._pump()

    def on_kv_cancelled(self, reason: str = "kv_cancelled") -> list[Action]:
        """The KV transfer failed or the KV was dropped: MD cannot take over."""
        return self._fail(reason)

    def on_md_failed(self, reason: str = "md_failed") -> list[Action]:
        """MD's engine cannot continue the request. Before MD started: released to RLD, which
        finishes it. After: the request fails on MD like any decode failure (returns nothing)."""
        return self._fail(reason)

    def on_md_progress(self, absorbed: int) -> list[Action]:
        """The engine finished the :class:`Extend` in flight: every token < ``absorbed`` is in
        MD's KV."""
        if self.extending is None or absorbed != self.extending:
            raise HandoffUsageError(f"{self.request_id}: progress {absorbed}, extend in flight ends at "
                                    f"{self.extending}")
        self.extending = None
        self.absorbed = absorbed
        if self.state is MdState.WAITING:
            return [self._progress()] + self._pump()
        if self.state is MdState.COMMITTED:
            return self._pump()
        return []  # released or aborted meanwhile

    def on_message(self, msg: HandoffMessage) -> list[Action]:
        """A handoff message from RLD. Messages of another epoch are ignored."""
        if getattr(msg, "request_id", None) != self.request_id:
            raise HandoffUsageError(f"message for {getattr(msg, 'request_id', None)!r} fed to {self.request_id!r}")
        if msg.epoch != self.epoch:
            return []
        if isinstance(msg, HandoffCommit):
            return self._on_commit(msg)
        if isinstance(msg, HandoffAbort):
            return self._on_abort(msg.reason)
        raise HandoffProtocolError(f"{self.request_id}: {type(msg).__name__} is not sent by RLD")

    def on_token_generated(self, token: int, *, last: bool = False) -> list[Action]:
        """MD's engine produced its next token (the first is position p, out of the last extend)."""
        if self.state is not MdState.STARTED:
            raise HandoffUsageError(f"{self.request_id}: MD generated a token in state {self.state.value}")
        if self.finished:
            raise HandoffUsageError(f"{self.request_id}: token after the request's last one")
        assert self.position is not None
        self.finished = last
        pos = self.position + self.emitted
        self.emitted += 1
        return [Emit(pos, token)]

    def on_timeout(self, now: float) -> list[Action]:
        """A timer fired: past the deadline without having started, release."""
        if self.state in (MdState.WAITING, MdState.COMMITTED) and now >= self.deadline:
            return self._release("deadline")
        return []

    def on_reconnect(self) -> list[Action]:
        """The control connection to RLD's agent was re-established: resend the latest state."""
        if self.state is MdState.WAITING and self.kv_ready:
            return [self._progress()]
        if self.state is MdState.STARTED:
            assert self.position is not None  # STARTED comes after the commit at a position
            return [Send(HandoffTaken(self.request_id, self.epoch, self.position))]
        if self.state is MdState.RELEASED:
            return [Send(HandoffRelease(self.request_id, self.epoch, self.release_reason))]
        return []

    # -- internals
    def _progress(self) -> Send:
        return Send(HandoffProgress(self.request_id, self.epoch, self.absorbed))

    def _pump(self) -> list[Action]:
        """Extend what can be extended; take over when every token < p is absorbed."""
        if not self.kv_ready or self.extending is not None:
            return []
        limit = len(self.tokens) if self.position is None else min(len(self.tokens), self.position)
        limit = min(limit, self.absorbed + MAX_EXTEND_TOKENS)
        if self.absorbed < limit:
            self.extending = limit
            return [Extend(self.absorbed, tuple(self.tokens[self.absorbed:limit]))]
        if self.state is MdState.COMMITTED and self.absorbed == self.position:
            self.state = MdState.STARTED
            self.done = Done("MD", "took_over", self.mode, self.position)
            return [StartGenerating(self.position),
                    Send(HandoffTaken(self.request_id, self.epoch, self.position)), self.done]
        return []

    def _on_commit(self, msg: HandoffCommit) -> list[Action]:
        p = msg.position
        if self.position is not None:  # a copy, or answered already
            if p != self.position:
                raise HandoffProtocolError(f"{self.request_id}: commit at {p}, earlier commit at {self.position}")
            if self.state is MdState.STARTED:
                return [Send(HandoffTaken(self.request_id, self.epoch, p))]
            if self.state is MdState.RELEASED:
                return [Send(HandoffRelease(self.request_id, self.epoch, self.release_reason))]
            return []
        if self.state is MdState.ABORTED:
            raise HandoffProtocolError(f"{self.request_id}: commit after abort")
        if p < 1 or p < len(self.tokens) or p < self.absorbed:
            raise HandoffProtocolError(f"{self.request_id}: commit at {p}, but {len(self.tokens)} tokens were "
                                       f"relayed and {self.absorbed} absorbed")
        self.position = p
        self.mode = msg.mode if msg.mode in ("one-shot", "catch-up") else None  # type: ignore[assignment]
        if self.state is MdState.RELEASED:
            # Released before the commit arrived (the two crossed): say it again for this commit.
            return [Send(HandoffRelease(self.request_id, self.epoch, self.release_reason))]
        self.state = MdState.COMMITTED
        return self._pump()

    def _on_abort(self, reason: str) -> list[Action]:
        if self.state is MdState.STARTED:
            raise HandoffProtocolError(f"{self.request_id}: abort after MD took over")
        if self.state in (MdState.RELEASED, MdState.ABORTED):
            return []
        if self.state is MdState.COMMITTED:
            raise HandoffProtocolError(f"{self.request_id}: abort after commit")
        self.state = MdState.ABORTED
        self.done = Done("RLD", reason or "aborted", self.mode, None)
        return [self.done]

    def _fail(self, reason: str) -> list[Action]:
        if self.state in (MdState.WAITING, MdState.COMMITTED):
            return self._release(reason)
        return []

    def _release(self, reason: str) -> list[Action]:
        self.state = MdState.RELEASED
        self.release_reason = reason
        self.done = Done("RLD", reason, self.mode, None)
        return [Send(HandoffRelease(self.request_id, self.epoch, reason)), self.done]
