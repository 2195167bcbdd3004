"""Lazy peering: sessions with fleet members open on first need and close when idle, and a
member that leaves (its lease expired) is unreachable at once.

* **First need** (:meth:`FleetPeering.discover`, called by :meth:`pdd_wire.peers.Peers.session_for`
  for a name without a session): the member's record becomes a :class:`~pdd_wire.config.Peer`
  (its registered certificate fingerprint pinned; its certificate must name its node, whatever
  the record says) and a session. The agent that sorts lower dials as always
  (proto/handshake.md §1); the other *knocks* (§8): a HELLO the peer answers with ``DIAL_BACK``
  and a dial. Meanwhile the need waits as it would for a peer that is reconnecting: its transfer
  or tokens queue in the session, for at most ``fleet.dial_wait_s``, after which they fail
  ``PEER_UNREACHABLE`` and the session is dropped (the next need starts afresh). A need that
  finds a listener's session down knocks again.
* **Inbound** (:meth:`FleetPeering.admit`): a HELLO from a member without a session gets one only
  once its connection proved the identity etcd lists: a certificate naming the node (checked
  before etcd is asked) and exactly the fingerprint it registered. Nothing is opened, and no
  dial starts, for anyone else.
* **Idle close**: the dialing side closes a session with nothing open for ``fleet.idle_close_s``
  (GOODBYE "idle", to a peer that advertised ``fleet.v1``); its peer drops its side on that
  GOODBYE at once, so both start afresh at the next need (anything the peer queued in that one
  round trip fails ``PEER_UNREACHABLE``, naming the idle close).
* **Leave**: the member's record is gone (lease expired: ``kill -9``, a dead node; or it left).
  A session that is down gives up at once (transfers fail ``PEER_UNREACHABLE`` instead of after
  ``timeouts.peer_give_up_s``); one still up (the member lost etcd, not its life: heartbeats
  answer) goes on, and gives up the moment its connection drops.
* **Restart**: a record with a new incarnation ends the session with the old process (its work
  fails ``PEER_RESTARTED``) unless the session already reached the new one.
* A member that moved (new address or transport) loses its session; a new certificate (same
  address) only changes the fingerprint pinned for the next handshake.
* A listener's session that is down and idle for ``fleet.dial_wait_s`` is dropped (its dialer
  has gone: a next need knocks afresh); one with work queued knocks, for at most
  ``timeouts.peer_give_up_s`` (the longer of the two), then is dropped and the work fails.
* Work that cannot go on when a session is dropped is told to its engine: transfers fail, and
  relayed token IDs not yet acknowledged are reported (``on_retire``).
* A dropped side is never resumed: the listener that dropped its side answers the dialer's next
  HELLO with a new session (WELCOME ``resumed`` false); the dialer then drops what it kept of the
  session as for a peer restart (transfers fail ``PEER_RESTARTED``, token streams start again)
  and its engines of unacknowledged token IDs are told, as here (proto/handshake.md §6, §8).
* The reverse: a dialer that dropped its side (``left``, ``moved``) while the listener kept its
  own is answered WELCOME ``resumed`` true by that listener, from the dialer's new session: the
  dialer declines it (GOODBYE "idle": the listener drops its side as above, telling its engines)
  and dials again, so both start afresh (:meth:`~pdd_wire.session.dialer.Dialer.welcomed`).
* A housekeeping tick late by over ``max(timeouts.heartbeat_s, 1 s)`` (this process did not run)
  drops nothing: the peers' frames of that time may wait unread (a dialer's HELLO, a WELCOME), so
  its sessions are judged at the next tick, which is never held (:class:`~pdd_wire.loopwatch.LateTicks`).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from ..config import Config, Peer
from ..errors import ConfigError, ErrorCode, FatalHandshakeError
from ..log import limited
from ..loopwatch import LateTicks
from ..wire.handshake import FLEET_CAPABILITY  # GOODBYE "idle"'s meaning (proto/handshake.md §8)
from .membership import Membership
from .metrics import FleetMetrics
from .record import MemberRecord

if TYPE_CHECKING:
    from ..peers import Peers
    from ..session import PeerSession


@dataclass(eq=False)
class Lazy:
    """What the fleet keeps about one of its sessions."""

    session: "PeerSession"
    created: float
    incarnation: int  # the member's, as its record said when the session opened
    ever_up: bool = False
    unlisted: bool = False  # its record left etcd while the session was up
    knocking: asyncio.Task | None = None
    busy_at: float = field(default_factory=time.monotonic)
    admitted: bool = False  # opened for a HELLO whose certificate was this member's (proven)


def peer_of(record: MemberRecord, my_site: str) -> Peer:
    """The session settings for a member: its registered address, certificate and transport
    (UCX only within a site). Its certificate must name its node (no other name is taken)."""
    return Peer(site=record.site, node=record.node, address=record.wan,
                transport="ucx" if record.transport == "ucx" and record.site == my_site else "tcp",
                fingerprint=record.fingerprint)


class FleetPeering:
    """``new_session(peer, index)`` makes, adds and starts a session (the agent's);
    ``busy()`` names the peers with anything open (transfers, token streams, handoffs);
    ``forget(key)`` drops a closed session's per-peer metric series (their labels would grow
    with every member ever met); ``on_retire(session, why, code)`` tells the engines whose relayed
    tokens to a dropped session were not acknowledged. ``tls``: this agent authenticates its
    peers (set at start): a member must then have registered a certificate."""

    def __init__(self, config: Config, peers: "Peers", membership: Membership, metrics: FleetMetrics, *,
                 new_session: Callable[[Peer, int], "PeerSession"], busy: Callable[[], set[str]],
                 log, forget: Callable[[str], None] = lambda key: None,
                 on_retire: Callable[["PeerSession", str, int], None] = lambda s, why, code: None) -> None:
        self.config = config
        self.fleet = config.fleet
        self.peers = peers
        self.membership = membership
        self.metrics = metrics
        self.new_session = new_session
        self.busy = busy
        self.forget = forget
        self.on_retire = on_retire
        self.log = log
        self.tls = True
        self.lazy: dict[str, Lazy] = {}
        # Sessions' indices (they spread sessions over the bulk threads, modulo): only ever counts
        # up, one per session opened, and an int does not overflow.
        self._index = itertools.count(len(config.peers))
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
        self._late = LateTicks(config.timeouts.heartbeat_s)  # ticks come every heartbeat (the agent's audit)
        self._ticked = time.monotonic()  # (a first tick late by a slow start is held once: harmless)

    # ------------------------------------------------------------------ membership changes
    def on_event(self, kind: str, record: MemberRecord, old: MemberRecord | None) -> None:
        entry = self.lazy.get(record.key)
        if entry is None:
            return
        s = entry.session
        if kind == "leave":
            if s.is_up:
                entry.unlisted = True
                self.log.info("member left etcd while its session is up: keeping it until it drops", peer=s.key)
            else:
                self._retire(entry, "left", f"peer {s.key} left the fleet (its lease expired)")
            return
        # join (back after a leave: re-registered) or update
        entry.unlisted = False
        want = peer_of(record, self.config.site)
        restarted = record.incarnation != entry.incarnation and record.incarnation != s.remote_incarnation
        if (want.address, want.transport) != (s.peer.address, s.peer.transport):
            self._retire(entry, "moved", f"peer {s.key} moved to {record.wan}",
                         ErrorCode.PEER_RESTARTED if restarted else ErrorCode.PEER_UNREACHABLE)
        elif restarted:
            self._retire(entry, "restarted", f"peer {s.key} restarted (a new incarnation registered)",
                         ErrorCode.PEER_RESTARTED)
        elif want.fingerprint != s.peer.fingerprint:
            s.peer = msgspec.structs.replace(s.peer, fingerprint=want.fingerprint)
            self.log.info("member registered a new certificate", peer=s.key, fingerprint=want.fingerprint)
        entry.incarnation = record.incarnation

    # ------------------------------------------------------------------ first need, inbound
    def _usable(self, record: MemberRecord) -> bool:
        if self.tls and not record.fingerprint:
            self.metrics.ignored.labels(reason="no_certificate").inc()
            limited(self, self.log.warning, "fleet member registered no certificate: not used (this agent "
                    "authenticates its peers)", peer=record.key)
            return False
        return True

    def discover(self, dest: str) -> "PeerSession | None":
        """A session for ``dest`` ("site/node", or "site": its least loaded member)."""
        if self._closing:
            return None
        members = self.membership.members
        if "/" in dest:
            record = members.get(dest)
        else:
            site = [r for r in members.values() if r.site == dest and (not self.tls or r.fingerprint)]
            load = self.membership.live  # watched by routers; an agent spreads its picks at random
            record = min(site, key=lambda r: (load[r.key].transfers if r.key in load else 0, random.random())) \
                if site else None
        if record is None or not self._usable(record):
            return None
        if (other := self._holder(record)) is not None:
            self.metrics.ignored.labels(reason="certificate_in_use").inc()
            limited(self, self.log.warning, "fleet member's certificate backs another session: not used",
                    peer=record.key, detail={"session": other})
            return None
        s = self._open(record)
        if s is None:
            return None
        if not s.dialer:
            self._knock(self.lazy[s.key])
        self.metrics.dials.labels(how="dial" if s.dialer else "knock").inc()
        return s

    def need(self, s: "PeerSession") -> None:
        """A need found ``s``: a listener's session that is down knocks (its dialer may have
        restarted, or dropped it)."""
        entry = self.lazy.get(s.key)
        if entry is not None and entry.session is s and not s.dialer and not s.is_up and not self._closing:
            self._knock(entry)

    async def admit(self, site: str, node: str, names: frozenset[str] | None, fingerprint: str) -> bool:
        """A HELLO from ``site/node``, which has no session, on a connection whose certificate
        names ``names`` and has ``fingerprint`` (``names`` None: plaintext, nothing proven).
        Opens a session once the certificate is the one etcd lists for that member; False: etcd
        does not list it; FatalHandshakeError IDENTITY_MISMATCH: it is not that member."""
        if self._closing:
            return False
        if names is not None and node not in names:  # before etcd is asked: a stranger costs no read
            self.metrics.admissions.labels(outcome="identity_mismatch").inc()
            raise FatalHandshakeError(f"certificate names {sorted(names)} do not include {node!r}",
                                      ErrorCode.IDENTITY_MISMATCH)
        record = await self.membership.lookup(site, node)
        if record is None:
            outcome = "unknown" if self.membership.up else "refused_etcd_away"
            self.metrics.admissions.labels(outcome=outcome).inc()
            limited(self, self.log.info, "HELLO from a member etcd does not list", peer=f"{site}/{node}",
                    outcome=outcome)
            return False
        if names is not None and (not record.fingerprint or fingerprint != record.fingerprint):
            self.metrics.admissions.labels(outcome="identity_mismatch").inc()
            raise FatalHandshakeError(f"{record.key}'s certificate {fingerprint or '(none)'} is not the one it "
                                      f"registered ({record.fingerprint or 'none'})", ErrorCode.IDENTITY_MISMATCH)
        if self.peers.get(record.key) is None:  # another connection may have opened it meanwhile
            if names is not None and (other := self._holder(record)) is not None:
                self.metrics.admissions.labels(outcome="certificate_in_use").inc()
                raise FatalHandshakeError(f"{record.key}'s certificate is already {other}'s (a session is open under "
                                          "that name): one certificate, one member", ErrorCode.IDENTITY_MISMATCH)
            if (s := self._open(record)) is None:
                return False
            self.lazy[s.key].admitted = names is not None
        self.metrics.admissions.labels(outcome="admitted").inc()
        return True

    def _holder(self, record: MemberRecord) -> str | None:
        """The member of another fleet session proven to hold ``record``'s certificate (up, or
        admitted for a HELLO that showed it and not up yet): one node's key registered under many
        names (the certificate binds the node, not the site) must not take a session, and its
        connections (limits.max_peer_connections), under each. Unproven sessions do not count: a
        record anyone can put in etcd naming a member's (public) fingerprint keeps nobody out."""
        fp = record.fingerprint
        return next((k for k, e in self.lazy.items() if fp and k != record.key and e.session.peer.fingerprint == fp
                     and (e.session.is_up or (e.admitted and not e.ever_up))), None)

    def _open(self, record: MemberRecord) -> "PeerSession | None":
        try:
            s = self.new_session(peer_of(record, self.config.site), next(self._index))
        except ConfigError as exc:  # decode checked the record; this is the last guard
            self.metrics.ignored.labels(reason="invalid").inc()
            self.log.warning("fleet member's record cannot make a session", peer=record.key, error=str(exc))
            return None
        self.lazy[s.key] = Lazy(s, created=time.monotonic(), incarnation=record.incarnation)
        s.dialer_loop.on_session_lost = lambda why: self._state_lost(s, why)
        s.dialer_loop.on_declined = lambda: self._declined(s)
        self.metrics.sessions.set(len(self.lazy))
        # (per member once per 30 s: a member that churns sessions, GOODBYE idle in a loop, is counted in full)
        limited(self, self.log.info, "fleet session opened", peer=s.key, address=record.wan,
                role="dialer" if s.dialer else "listener")
        return s

    def _knock(self, entry: Lazy) -> None:
        if entry.knocking is not None and not entry.knocking.done():
            return
        entry.knocking = self._spawn(self._knock_until_up(entry), f"{entry.session.key}:knock")

    async def _knock_until_up(self, entry: Lazy) -> None:
        s = entry.session
        backoff = 0.05
        deadline = time.monotonic() + self.fleet.dial_wait_s
        while not s.is_up and time.monotonic() < deadline and self.lazy.get(s.key) is entry:
            if await s.dialer_loop.knock():
                try:  # it dials now: give that a handshake's time before knocking again
                    async with asyncio.timeout(self.config.timeouts.connect_s + self.config.timeouts.handshake_s):
                        await s.up.wait()
                except TimeoutError:
                    pass
                continue
            await asyncio.sleep(backoff * (0.5 + random.random() / 2))  # a retry backoff, not a readiness wait
            backoff = min(backoff * 2, self.config.timeouts.reconnect_max_backoff_s)

    async def wait_up(self, dest: str, timeout: float) -> None:
        """Until the session for ``dest`` is up (opened now if needed), at most ``timeout`` s:
        what a probe needs before it can measure."""
        s = self.peers.session_for(dest)
        if s.is_up or s.key not in self.lazy:
            return
        try:
            async with asyncio.timeout(timeout):
                await s.up.wait()
        except TimeoutError:
            pass

    # ------------------------------------------------------------------ the session's reports
    def session_up(self, s: "PeerSession") -> None:
        entry = self.lazy.get(s.key)
        if entry is not None and entry.session is s:
            entry.ever_up = True

    def goodbye(self, s: "PeerSession", reason: str) -> None:
        """GOODBYE "idle" from a peer that advertised fleet.v1: its side is closed, so is ours,
        now (a need from here on opens a new session instead of queueing into this one)."""
        entry = self.lazy.get(s.key)
        if reason == "idle" and entry is not None and entry.session is s and FLEET_CAPABILITY in (s.remote_caps or ()):
            self._retire(entry, "idle", f"peer {s.key} closed the session as idle")

    def _state_lost(self, s: "PeerSession", why: str) -> None:
        """Dialer side: the listener kept nothing of session ``s`` (it dropped its side, idle, down
        or unreachable, and its WELCOME says ``resumed`` false). Counted and logged; the session
        goes on with a fresh state (it drops the old one next, telling the engines of token IDs
        relayed to it and not acknowledged, as a restart does)."""
        self.metrics.closed.labels(reason="dropped_by_peer").inc()
        limited(self, self.log.warning, "fleet member kept nothing of the session: nothing resumed", peer=s.key)

    def _declined(self, s: "PeerSession") -> None:
        """Dialer side: the listener resumed session ``s``, which is new here (this agent dropped
        its side of the one before, ``left`` or ``moved``, while the listener kept its own): it is
        asked to drop its side (GOODBYE "idle") and dialed again; nothing of that one is taken."""
        self.metrics.closed.labels(reason="resume_declined").inc()
        limited(self, self.log.warning, "fleet member resumed a session this agent had dropped: asked it to drop "
                "its side too, dialing afresh", peer=s.key)

    # ------------------------------------------------------------------ housekeeping (every heartbeat)
    def tick(self) -> None:
        now = time.monotonic()
        # A tick this late means this process did not run: what the peers sent meanwhile is unread
        # (a HELLO that would bring a session back), so nothing is dropped for time that passed.
        stalled = self._late.hold(self._ticked + self.config.timeouts.heartbeat_s, now)
        self._ticked = now
        busy_keys = self.busy() if self.lazy else set()
        for entry in list(self.lazy.values()):
            s = entry.session
            if s.is_up:
                entry.ever_up = True
            busy = s.key in busy_keys
            used = max(entry.busy_at, self.peers.used_at.get(s.key, 0.0))
            if busy:
                entry.busy_at = used = now
            down_for = now - s.down_since if s.down_since is not None and not s.is_up else 0.0
            if stalled:
                continue  # judged at the next tick, once what arrived meanwhile was read
            if not entry.ever_up and now - entry.created > self.fleet.dial_wait_s:
                self._retire(entry, "dial_timeout", f"no session with {s.key} within fleet.dial_wait_s "
                                                    f"({self.fleet.dial_wait_s:g} s)")
            elif entry.unlisted and not s.is_up:
                self._retire(entry, "left", f"peer {s.key} left the fleet and its connection dropped")
            elif s.is_up and s.dialer and not busy and now - used >= self.fleet.idle_close_s:
                self._retire(entry, "idle", None)
            elif not s.is_up and s.peer_goodbye == "idle" and FLEET_CAPABILITY in (s.remote_caps or ()):
                self._retire(entry, "idle", f"peer {s.key} closed the session as idle")
            elif not s.dialer and not s.is_up and entry.ever_up:
                # Work waiting on it (a link drop) gets as long as a static peer's, then fails; idle,
                # it is forgotten after dial_wait_s (a need knocks afresh).
                give_up = max(self.fleet.dial_wait_s, self.config.timeouts.peer_give_up_s)
                if busy and down_for > give_up:
                    self._retire(entry, "unreachable", f"the session with {s.key} dropped and its dialer did not "
                                                       f"come back within timeouts.peer_give_up_s ({give_up:g} s)")
                elif busy:
                    self._knock(entry)  # work waits for it: ask the dialer to come back
                elif down_for > self.fleet.dial_wait_s:
                    self._retire(entry, "down", None)

    def _retire(self, entry: Lazy, reason: str, why: str | None, code: int = ErrorCode.PEER_UNREACHABLE) -> None:
        """Drop a fleet session: no need finds it from now on; its transfers (if any) fail with
        ``code`` and ``why``, and the engines of its unacknowledged tokens are told; it closes
        (GOODBYE "idle" for an idle close, to a peer that understands it)."""
        s = entry.session
        if self.lazy.get(s.key) is not entry:
            return
        del self.lazy[s.key]
        self.peers.remove(s)
        if entry.knocking is not None:
            entry.knocking.cancel()
        self.metrics.closed.labels(reason=reason).inc()
        self.metrics.sessions.set(len(self.lazy))
        limited(self, self.log.info, "fleet session closed", peer=s.key, reason=reason)
        why = why or f"the session with {s.key} was closed ({reason})"
        self.on_retire(s, why, code)
        goodbye = "idle" if reason == "idle" and FLEET_CAPABILITY in (s.remote_caps or ()) else "shutdown"

        async def end() -> None:
            s.closing = True  # nothing opens while its transfers are ended (a KV_BEGIN now is refused)
            await s.give_up(why, code)
            await s.close(goodbye)
            if s.key not in self.lazy:  # not opened again meanwhile
                self.forget(s.key)

        self._spawn(end(), f"{s.key}:retire")

    def _spawn(self, coro, name: str) -> asyncio.Task:
        t = asyncio.create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def describe(self) -> dict:
        now = time.monotonic()
        return {"sessions": [{"peer": k, "up": e.session.is_up, "role": "dialer" if e.session.dialer else "listener",
                              "idle_s": round(now - max(e.busy_at, self.peers.used_at.get(k, 0.0)), 3),
                              "unlisted": e.unlisted} for k, e in self.lazy.items()]}

    async def close(self) -> None:
        """The agent stops: no more fleet sessions; the retirements under way finish."""
        self._closing = True
        for entry in self.lazy.values():
            if entry.knocking is not None:
                entry.knocking.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
