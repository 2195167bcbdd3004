"""The agent's handoff desk: drives :mod:`~pdd_wire.desk.handoff_protocol`'s state machines for its engines.

The state machines are sans-IO; this module is their I/O. For each request in a handoff it keeps
one :class:`Entry` (the state machine, the engine that drives it, the peer session it talks
over, a timer) and turns actions into effects, in order:

=====================  ==============================================================
action                 effect
=====================  ==============================================================
``Emit``               ``emit`` event to the engine (consecutive positions coalesced)
``RelayTokens``        TOKENS frames to MD through the session's token relay (``seq`` =
                       position; coalesced)
``Send``               a HANDOFF_* frame on the control connection, lane TOKEN
``Extend``             ``extend`` event (MD)
``StopGenerating``     ``stop_generating`` event (RLD)
``StartGenerating``    ``start_generating`` event
``ModeChosen``         logged and counted (``pddwire_handoff_modes``)
``Done``               ``handoff_done`` event, logged and counted (``pddwire_handoffs``)
=====================  ==============================================================

Inputs come from the engine socket (``handoff_rld``, ``handoff_md``, ``handoff_tokens``,
``handoff_extended``, ``handoff_fail``, ``set_load``, ``abort``, a disconnect), from the peer
session (HANDOFF_* frames, relayed TOKENS, reconnects, a restarted or unreachable peer) and
from the KV transfer into MD (received or failed).

MD's engine may learn of a request after RLD started relaying it, and after its KV arrived: the
desk keeps relayed tokens, messages and the KV outcome of requests with no MD entry yet, bounded
and least recently used first out, and feeds them in when ``handoff_md`` comes. A settled entry
lingers for ``timeouts.peer_give_up_s`` so that a copy of a message lost in a reconnect is still
answered, then it is forgotten (or earlier, oldest first, when ``4 x max_transfers`` are kept).
RLD waits for MD's answer to its commit at most :meth:`HandoffDesk.answer_window_s` after it last
sent it (longer than a live MD may take to release: MD's default deadline, plus
``timeouts.peer_give_up_s``): an MD agent that is up but forgot the request (or never answers)
ends the handoff as an MD lost after the commit. After a peer restart nothing more is sent for
that peer's handoffs: its new incarnation never knew them.
"""

from __future__ import annotations

import array
import asyncio
import collections
from typing import TYPE_CHECKING

import structlog

from .. import policy
from ..config import Config
from ..engine import protocol as p
from ..errors import EngineRequestError, ErrorCode, PddWireError, check_duration
from ..metrics import Metrics
from ..wire import messages as m
from .admission import Gate, check_request_id, check_token_ids
from .handoff_protocol import (
    ABORTED,
    CAPABILITY,
    Done,
    Emit,
    Extend,
    HandoffError,
    HandoffMessage,
    HandoffProtocolError,
    HandoffUsageError,
    MdHandoff,
    ModeChosen,
    RelayTokens,
    RldHandoff,
    RldState,
    Send,
    StartGenerating,
    StopGenerating,
)

if TYPE_CHECKING:
    from ..engine_server import EngineConn
    from ..peers import Peers
    from ..session import PeerSession

log = structlog.get_logger("pdd_wire.handoff")

MAX_EARLY_TOKENS = 1 << 16  # relayed tokens kept for one request that has no MD entry yet
MAX_TOKENS_PER_CALL = 4096  # in one handoff_tokens: each is a step of the state machine (~2 us), on the loop
MAX_EARLY_TOTAL = 1 << 20  # ... and for all of one peer's requests together (its oldest dropped first)
# RLD's COMMIT / ABORT kept for a request with no MD entry yet: one of each per epoch (a copy
# replaces the one kept), at most 4 a request, a reason cut to 128 characters, and 4096 for all of
# one peer's requests (its oldest dropped first). Before: 16 a request of any kind, 16384 requests
# a peer, a 4 KiB reason each: a peer could fill about 1.2 GB.
EARLY_MESSAGES, MAX_EARLY_MESSAGES, EARLY_REASON = 4, 4096, 128


#: The ``Done`` reasons this code gives. Others (a peer's ABORT or RELEASE reason, an engine's
#: own text) reach the engine as they are, but are counted as ``other``: no peer or engine
#: grows a metric's label set.
REASONS = frozenset({
    "one_shot", "catch_up_converged", "catch_up_forced", "md_failed_after_commit", "finished_on_rld",
    "finished", "deadline", "md_failed", "md_released", "rld_failed", "engine_gone", "aborted", "shutting_down",
    "took_over", "protocol_error", "kv_cancelled", "post_expired", "peer_restarted", "peer_unreachable",
})


def reason_label(reason: str) -> str:
    """``reason`` as a metric label: itself if this code gives it, else ``other``."""
    return reason if reason in REASONS else "other"


class Entry:
    __slots__ = ("role", "sm", "engine", "session", "timer", "timer_at", "ready_at", "settled", "linger", "answer",
                 "peer_gone", "log")

    def __init__(self, role: str, sm: RldHandoff | MdHandoff, engine: "EngineConn", session: "PeerSession") -> None:
        self.role = role
        self.sm = sm
        self.engine = engine
        self.session = session
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at: float | None = None
        self.ready_at: float | None = None  # RLD: MD's first progress; MD: the KV arrived
        self.settled = False  # no more own output to emit: lingers, then is forgotten
        self.linger: asyncio.TimerHandle | None = None
        self.answer: asyncio.TimerHandle | None = None  # RLD: its commit's answer is due
        self.peer_gone = False  # the peer restarted: nothing more goes to it for this request
        self.log = log.bind(request_id=sm.request_id, role=role, peer=session.key, epoch=sm.epoch)


class Early:
    """What arrived for a request before its MD entry: relayed tokens and RLD's messages."""

    __slots__ = ("session", "tokens", "messages")

    def __init__(self, session: "PeerSession") -> None:
        self.session = session
        # 4 bytes a token ID (a list took ~46: 1,048,576 IDs a peer were 47 MB, audit)
        self.tokens = array.array("I")
        self.messages: list[HandoffMessage] = []


class HandoffDesk:
    """The handoffs of this agent's engines, by request id; ``peers`` finds the session an
    engine names, ``gate`` refuses new handoffs once the agent stops."""

    def __init__(self, config: Config, metrics: Metrics, peers: "Peers", gate: Gate) -> None:
        self.cfg = config
        self.metrics = metrics
        self.peers = peers
        self.gate = gate
        self.live: dict[str, Entry] = {}
        # Kept per peer (session key -> request id -> Early), each peer within its own bounds:
        # a peer that relays first for a guessable request id cannot crowd out, or stand in
        # for, the peer the MD engine names.
        self.early: dict[str, collections.OrderedDict[str, Early]] = {}
        self._early_total: collections.Counter[str] = collections.Counter()  # tokens kept, per peer
        self._early_msgs: collections.Counter[str] = collections.Counter()  # messages kept, per peer
        # The KV outcome of receives that ended here with no MD entry ("ready" or the reason).
        self.kv_outcome: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.cap = self.cfg.transfer.max_transfers * 4

    # ------------------------------------------------------------------ engine requests
    def start_rld(self, ec: "EngineConn", msg: p.HandoffRld) -> dict:
        session = self._start_checks(ec, msg.request_id, msg.to, msg.epoch)
        if session.relaying_tokens(msg.request_id):
            raise EngineRequestError(f"request {msg.request_id!r} already relayed tokens to {session.key} outside a "
                                     f"handoff; its positions would not match", ErrorCode.DUPLICATE_TRANSFER)
        deadline = self._deadline(msg.deadline_s, self.cfg.timeouts.handoff_s)
        cfg = self.cfg.policy.handoff
        sm = RldHandoff(msg.request_id, msg.epoch, deadline=deadline, policy=cfg,
                        choose_mode=lambda gap: policy.choose_handoff_mode(max(0.0, ec.load), gap, cfg))
        e = self._add(Entry("RLD", sm, ec, session))
        e.log.info("handoff started", deadline_s=round(deadline - self._now(), 3))
        self._timer(e)
        return {"peer": session.key}

    def start_md(self, ec: "EngineConn", msg: p.HandoffMd) -> dict:
        session = self._start_checks(ec, msg.request_id, msg.from_site, msg.epoch)
        to = self.cfg.timeouts
        deadline = self._deadline(msg.deadline_s, to.handoff_s + to.handoff_md_margin_s)
        sm = MdHandoff(msg.request_id, msg.epoch, deadline=deadline)
        e = self._add(Entry("MD", sm, ec, session))
        e.log.info("handoff started", deadline_s=round(deadline - self._now(), 3))
        early = self._drop_early(session.key, msg.request_id)
        if early is not None:
            if early.tokens:
                self._feed(e, lambda: sm.on_tokens(0, early.tokens.tolist()))
            for hm in early.messages:
                self._feed(e, lambda hm=hm: sm.on_message(hm))
        kv = self.kv_outcome.pop(msg.request_id, None)
        if kv == "ready":
            self._feed(e, sm.on_kv_ready)
        elif kv is not None:
            self._feed(e, lambda: sm.on_kv_cancelled(kv))
        self._timer(e)
        return {"peer": session.key}

    def tokens(self, ec: "EngineConn", msg: p.HandoffTokens) -> dict:
        e = self._own_entry(ec, msg.request_id)
        if len(msg.tokens) > MAX_TOKENS_PER_CALL:
            raise EngineRequestError(f"over {MAX_TOKENS_PER_CALL} tokens in one handoff_tokens", ErrorCode.BAD_REQUEST)
        check_token_ids(msg.tokens)
        sm = e.sm
        n = len(msg.tokens)
        acts: list = []  # the whole batch's actions, run once: one emit event, one TOKENS frame
        try:
            for i, tok in enumerate(msg.tokens):
                acts += sm.on_token_generated(tok, last=msg.last and i == n - 1)
        except HandoffUsageError as exc:
            raise EngineRequestError(str(exc), ErrorCode.BAD_REQUEST) from exc
        finally:
            self._run(e, acts)  # what the state machine already did must happen, error or not
        if msg.last and sm.done is not None and sm.done.owner == e.role:
            self._settle(e)
        return {"owner": sm.owner}

    def extended(self, ec: "EngineConn", msg: p.HandoffExtended) -> dict:
        e = self._own_entry(ec, msg.request_id)
        if e.role != "MD":
            raise EngineRequestError("handoff_extended is for the MD engine", ErrorCode.BAD_REQUEST)
        try:
            acts = e.sm.on_md_progress(msg.absorbed)
        except HandoffUsageError as exc:
            raise EngineRequestError(str(exc), ErrorCode.BAD_REQUEST) from exc
        self._run(e, acts)
        return {"owner": e.sm.owner}

    def fail(self, ec: "EngineConn", msg: p.HandoffFail) -> dict:
        e = self._own_entry(ec, msg.request_id)
        if e.role != "MD":
            raise EngineRequestError("handoff_fail is for the MD engine (RLD aborts the request)",
                                     ErrorCode.BAD_REQUEST)
        self._feed(e, lambda: e.sm.on_md_failed(msg.reason or "md_failed"))
        return {"owner": e.sm.owner}

    def abort(self, ec: "EngineConn", request_id: str, reason: str) -> int:
        """The engine aborted the request: RLD keeps nothing to hand over (MD is told), MD
        releases it (RLD keeps it, if RLD is still there). Counts 1 only if it ended something: a
        handoff whose handoff_done was told already is only forgotten."""
        e = self.live.get(request_id)
        if e is None or e.engine is not ec:
            return 0
        ended = e.sm.done is None
        # MD releases with ABORTED whatever the engine's reason: RLD must not take the output back.
        self._engine_failed(e, ABORTED if e.role == "MD" else reason or ABORTED, "rld_failed")
        self._forget(request_id)
        return int(ended)

    def request_aborted(self, session: "PeerSession", request_id: str, reason: str) -> "EngineConn | None":
        """The peer says the request is dead: settle and forget its handoff with that peer."""
        e = self.live.get(request_id)
        self._drop_early(session.key, request_id)
        if e is None or e.session is not session:
            return None
        self.kv_outcome.pop(request_id, None)
        if e.sm.done is None:
            self._engine_failed(e, "aborted", "aborted")
        self._forget(request_id)
        return e.engine

    def engine_gone(self, ec: "EngineConn") -> None:
        for rid, e in list(self.live.items()):
            if e.engine is ec:
                self._engine_failed(e, "engine_gone", "engine_gone")
                self._forget(rid)

    def owns_relay(self, request_id: str) -> bool:
        """The request's TOKENS stream belongs to a handoff (RLD side)."""
        e = self.live.get(request_id)
        return e is not None and e.role == "RLD"

    # ------------------------------------------------------------------ from the sessions
    def on_message(self, session: "PeerSession", msg: HandoffMessage) -> None:
        e = self.live.get(msg.request_id)
        if e is None:
            if isinstance(msg, (m.HandoffCommit, m.HandoffAbort)):  # RLD -> MD ahead of handoff_md
                self._keep_early(session, msg)
            return  # no handoff here: a late copy (the spec says ignore it)
        if e.session is not session:
            session.lines.line(e.log.warning, "handoff message from another peer; ignored",  # once per period
                               detail={"other": session.key, "msg": type(msg).__name__})
            return
        self._feed(e, lambda: e.sm.on_message(msg))

    def on_tokens(self, session: "PeerSession", msg: m.Tokens) -> bool:
        """Relayed tokens (exactly once, in order). True if they were the handoff desk's (taken,
        kept for MD's entry, or dropped and counted); False: plain relay, for the KV desk."""
        e = self.live.get(msg.request_id)
        if e is not None and e.role == "MD" and e.session is session:
            self._feed(e, lambda: e.sm.on_tokens(msg.seq, msg.tokens))
            return True
        if not msg.handoff:
            return False  # plain relay: the KV desk gives it to the request's owner
        # A handoff's relay never becomes a plain ``tokens`` event: kept for MD's entry, or dropped.
        if e is None:
            early = self._early(msg.request_id, session)
            fresh = msg.tokens[len(early.tokens) - msg.seq:]  # a resend may overlap what is kept
            if msg.seq <= len(early.tokens) and len(early.tokens) + len(fresh) <= MAX_EARLY_TOKENS:
                early.tokens.extend(fresh)
                mine = self.early[session.key]
                self._early_total[session.key] += len(fresh)
                while self._early_total[session.key] > MAX_EARLY_TOTAL and mine:
                    self._drop_early(session.key, next(iter(mine)))
                return True
            reason = "over_bounds"
        else:
            reason = "foreign_site"  # the request is in a handoff with another peer (or is RLD here)
        self.metrics.tokens_dropped.labels(peer=session.key, reason=reason).inc(len(msg.tokens))
        return True

    def kv_received(self, request_id: str) -> None:
        e = self.live.get(request_id)
        if e is not None and e.role == "MD":
            self._feed(e, e.sm.on_kv_ready)
        elif e is None:
            self._remember_kv(request_id, "ready")

    def kv_failed(self, request_id: str, reason: str) -> None:
        e = self.live.get(request_id)
        if e is not None and e.role == "MD":
            self._feed(e, lambda: e.sm.on_kv_cancelled(reason))
        elif e is None:
            self._remember_kv(request_id, reason)

    def session_up(self, session: "PeerSession") -> None:
        """The control connection is back: resend each handoff's latest message."""
        for e in list(self.live.values()):
            if e.session is session and not e.peer_gone:
                self._feed(e, e.sm.on_reconnect)

    def peer_lost(self, session: "PeerSession", reason: str) -> None:
        """The peer's agent restarted (its state is gone) or stayed unreachable too long. After a
        restart nothing more is sent for these handoffs (the new incarnation never knew them) and
        the settled ones are dropped; an RLD that keeps the output goes on emitting."""
        restarted = reason == "peer_restarted"
        for rid, e in list(self.live.items()):
            if e.session is not session:
                continue
            e.peer_gone = e.peer_gone or restarted
            if e.sm.done is None:
                self._feed(e, lambda e=e: e.sm.on_md_failed(reason))
            if restarted and e.settled:
                self._forget(rid)
        if restarted:  # what its old incarnation relayed ahead of handoff_md belongs to nothing now
            self.early.pop(session.key, None)
            self._early_total.pop(session.key, None)
            self._early_msgs.pop(session.key, None)

    def shutdown(self) -> None:
        """The agent stops: tell the peers, so that RLD keeps (or MD takes) what it can."""
        for rid, e in list(self.live.items()):
            if e.sm.done is None:
                self._engine_failed(e, "shutting_down", "shutting_down")
            self._forget(rid)
        self.early.clear()
        self.kv_outcome.clear()
        self._early_total.clear()
        self._early_msgs.clear()

    def describe(self, most: int = 100) -> list[dict]:
        """The newest ``most`` handoffs (the count is ``pddwire_handoffs_open``)."""
        return [{"request_id": rid, "role": e.role, "peer": e.session.key, "state": e.sm.state.value,
                 "owner": e.sm.owner, "position": e.sm.position, "done": e.sm.done.reason if e.sm.done else None}
                for rid, e in list(self.live.items())[-most:]]

    # ------------------------------------------------------------------ internals
    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _deadline(self, given: float | None, default: float) -> float:
        return self._now() + check_duration("deadline_s", default if given is None else given)

    def _start_checks(self, ec: "EngineConn", request_id: str, peer: str, epoch: int) -> "PeerSession":
        self.gate.check()
        check_request_id(request_id)
        if not 0 <= epoch < 1 << 63:
            raise EngineRequestError(f"epoch must be 0..2^63-1, got {epoch}", ErrorCode.BAD_REQUEST)
        session = self.peers.session_for(peer)
        if session.remote_caps is not None and CAPABILITY not in session.remote_caps:
            raise EngineRequestError(f"peer {session.key} does not speak {CAPABILITY}", ErrorCode.UNSUPPORTED_BY_PEER)
        old = self.live.get(request_id)
        if old is not None:
            if not old.settled:
                raise EngineRequestError(f"request {request_id!r} is already in a handoff ({old.role})",
                                         ErrorCode.DUPLICATE_TRANSFER)
            self._forget(request_id)  # a new attempt (epoch) replaces a settled one
        if len(self.live) >= self.cap:
            self._evict_settled()
            if len(self.live) >= self.cap:
                raise EngineRequestError(f"{len(self.live)} handoffs open (limit 4 x transfer.max_transfers)",
                                         ErrorCode.LIMIT_EXCEEDED)
        return session

    def _evict_settled(self) -> None:
        for rid in [r for r, e in self.live.items() if e.settled][: max(1, len(self.live) // 8)]:
            self._forget(rid)

    def _add(self, e: Entry) -> Entry:
        self.live[e.sm.request_id] = e
        self.metrics.handoffs_open.labels(role=e.role).inc()
        return e

    def _own_entry(self, ec: "EngineConn", request_id: str) -> Entry:
        e = self.live.get(request_id)
        if e is None:
            raise EngineRequestError(f"no handoff for request {request_id!r} (start it with handoff_rld or "
                                     f"handoff_md)", ErrorCode.UNKNOWN_REQUEST)
        if e.engine is not ec:
            raise EngineRequestError(f"request {request_id!r} is handed off by another engine", ErrorCode.BAD_REQUEST)
        return e

    def _drop_early(self, peer: str, request_id: str) -> Early | None:
        mine = self.early.get(peer)
        early = mine.pop(request_id, None) if mine is not None else None
        if early is not None:
            self._early_total[peer] -= len(early.tokens)
            self._early_msgs[peer] -= len(early.messages)
        return early

    def _keep_early(self, session: "PeerSession", msg: m.HandoffCommit | m.HandoffAbort) -> None:
        """Keep RLD's COMMIT or ABORT for MD's entry to come, within the bounds of EARLY_MESSAGES."""
        if isinstance(msg, m.HandoffAbort) and len(msg.reason) > EARLY_REASON:
            msg = m.HandoffAbort(msg.request_id, msg.epoch, msg.reason[:EARLY_REASON])
        early = self._early(msg.request_id, session)
        kept = [hm for hm in early.messages if not (type(hm) is type(msg) and hm.epoch == msg.epoch)]
        kept = (kept + [msg])[-EARLY_MESSAGES:]
        self._early_msgs[session.key] += len(kept) - len(early.messages)
        early.messages = kept
        mine = self.early[session.key]
        while self._early_msgs[session.key] > MAX_EARLY_MESSAGES and mine:
            self._drop_early(session.key, next(iter(mine)))

    def _remember_kv(self, request_id: str, outcome: str) -> None:
        self.kv_outcome[request_id] = outcome
        self.kv_outcome.move_to_end(request_id)
        while len(self.kv_outcome) > self.cap:
            self.kv_outcome.popitem(last=False)

    def _early(self, request_id: str, session: "PeerSession") -> Early:
        mine = self.early.setdefault(session.key, collections.OrderedDict())
        early = mine.get(request_id)
        if early is None:
            early = mine[request_id] = Early(session)
            while len(mine) > self.cap:
                self._drop_early(session.key, next(iter(mine)))
        else:
            mine.move_to_end(request_id)
        return early

    def _engine_failed(self, e: Entry, reason: str, label: str) -> None:
        """This side gives the request up: ``reason`` for the peer (ABORT, RELEASE), ``label``
        for RLD's ``handoff_done``."""
        if e.role == "RLD":
            self._feed(e, lambda: e.sm.on_rld_failed(reason, done_reason=label))
        else:
            self._feed(e, lambda: e.sm.on_md_failed(reason))

    def _feed(self, e: Entry, event) -> None:
        """Run one event through the state machine; a peer's protocol error is logged and
        counted, and leaves the state as it was (proto/handoff.md §4)."""
        try:
            acts = event()
        except HandoffProtocolError as exc:
            self.metrics.handoff_errors.labels(peer=e.session.key).inc()
            e.session.lines.line(e.log.warning, "handoff protocol error", detail={"error": str(exc)})  # a peer's
            if e.role == "MD" and e.sm.done is None:
                # MD cannot trust its copy of the relay any more: give the request back.
                acts = e.sm.on_md_failed("protocol_error")
            else:
                return
        except HandoffError as exc:
            e.log.error("handoff usage error", error=str(exc))
            return
        self._run(e, acts)

    def _run(self, e: Entry, acts) -> None:
        rid = e.sm.request_id
        ec = e.engine
        # Emit and RelayTokens come in alternation, one pair per token: runs of each are sent as
        # one emit event and one TOKENS frame, flushed before any other action (order kept).
        runs: dict[type, list] = {Emit: [0, []], RelayTokens: [0, []]}

        def flush() -> None:
            (ef, et), (rf, rt) = runs[Emit], runs[RelayTokens]
            if et:
                ec.send(p.Emit(request_id=rid, first=ef, tokens=et))
            if rt:
                try:
                    seq = e.session.send_tokens(rid, rt, handoff=True)
                except PddWireError as exc:  # the relay is full: MD falls behind, RLD still owns
                    e.log.error("cannot relay tokens", error=str(exc))
                else:
                    if seq != rf:
                        e.log.error("relay stream out of step with positions", seq=seq, position=rf)
            runs[Emit], runs[RelayTokens] = [0, []], [0, []]

        for a in acts:
            if isinstance(a, (Emit, RelayTokens)):
                first, toks = (a.position, (a.token,)) if isinstance(a, Emit) else (a.first, a.tokens)
                run = runs[type(a)]
                if run[1] and run[0] + len(run[1]) != first:
                    flush()
                    run = runs[type(a)]
                if not run[1]:
                    run[0] = first
                run[1].extend(toks)
                continue
            flush()
            if isinstance(a, Send):
                if e.peer_gone:
                    continue
                e.session.send_message(a.message)
                if isinstance(a.message, m.HandoffCommit):  # (re)sent: its answer is due within the window
                    if e.answer is not None:
                        e.answer.cancel()
                    e.answer = asyncio.get_running_loop().call_later(self.answer_window_s, self._unanswered, e)
            elif isinstance(a, Extend):
                ec.send(p.Extend(request_id=rid, first=a.first, tokens=list(a.tokens)))
            elif isinstance(a, StopGenerating):
                ec.send(p.StopGenerating(request_id=rid))
            elif isinstance(a, StartGenerating):
                ec.send(p.StartGenerating(request_id=rid, position=a.position))
            elif isinstance(a, ModeChosen):
                e.ready_at = self._now()
                self.metrics.handoff_modes.labels(mode=a.decision.mode, reason=a.decision.reason).inc()
                e.log.info("handoff mode chosen", mode=a.decision.mode, reason=a.decision.reason, gap=a.gap,
                           detail=a.decision.detail, load=ec.load)
            elif isinstance(a, Done):
                self._done(e, a)
        flush()
        if e.role == "MD" and e.ready_at is None and e.sm.kv_ready:
            e.ready_at = self._now()
        self._timer(e)

    def _done(self, e: Entry, d: Done) -> None:
        rid = e.sm.request_id
        e.engine.send(p.HandoffDone(request_id=rid, owner=d.owner, reason=d.reason, mode=d.mode, position=d.position))
        self.metrics.handoffs.labels(role=e.role, mode=d.mode or "none", reason=reason_label(d.reason)).inc()
        if d.owner == "MD" and e.ready_at is not None:
            self.metrics.handoff_seconds.labels(role=e.role, mode=d.mode or "none").observe(self._now() - e.ready_at)
        e.log.info("handoff settled", owner=d.owner, reason=d.reason, mode=d.mode, position=d.position)
        mine = (d.owner == e.role)
        if not mine or e.sm.finished:
            self._settle(e)

    def _settle(self, e: Entry) -> None:
        """Nothing more for this side to emit: keep the entry a while for late copies."""
        if e.settled:
            return
        e.settled = True
        rid = e.sm.request_id
        e.linger = asyncio.get_running_loop().call_later(self.cfg.timeouts.peer_give_up_s, self._expire, rid, e)

    def _expire(self, rid: str, e: Entry) -> None:
        if self.live.get(rid) is e:
            self._forget(rid)

    def _forget(self, rid: str) -> None:
        e = self.live.pop(rid, None)
        if e is None:
            return
        for timer in (e.timer, e.linger, e.answer):
            if timer is not None:
                timer.cancel()
        self.metrics.handoffs_open.labels(role=e.role).dec()

    def _timer(self, e: Entry) -> None:
        at = e.sm.next_deadline()
        if at == e.timer_at:
            return
        if e.timer is not None:
            e.timer.cancel()
            e.timer = None
        e.timer_at = at
        if at is not None:
            e.timer = asyncio.get_running_loop().call_at(at, self._fire, e)

    @property
    def answer_window_s(self) -> float:
        """How long RLD waits for TAKEN or RELEASE after sending a COMMIT. A live MD answers a
        commit at the latest when its own deadline passes, and that deadline (``handoff_s +
        handoff_md_margin_s`` from its ``handoff_md``, which came before the commit) is over by
        then; ``peer_give_up_s`` on top for the answer's way back. Shorter, RLD could take MD as
        lost while MD still waits to release: then nobody would emit the rest."""
        t = self.cfg.timeouts
        return t.handoff_s + t.handoff_md_margin_s + t.peer_give_up_s

    def _unanswered(self, e: Entry) -> None:
        e.answer = None
        if self.live.get(e.sm.request_id) is e and e.sm.state is RldState.COMMITTED:
            e.log.warning("no answer to the commit; MD is taken as lost after the commit",
                          waited_s=self.answer_window_s)
            self._feed(e, lambda: e.sm.on_md_failed("commit_unanswered"))

    def _fire(self, e: Entry) -> None:
        e.timer = None
        e.timer_at = None
        if self.live.get(e.sm.request_id) is e:
            self._feed(e, lambda: e.sm.on_timeout(self._now()))
