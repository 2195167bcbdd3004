"""The dialing side of a session's control connection: connect, HELLO, wait for WELCOME, hold
the connection until it is lost, dial again with backoff (the longest one after a refusal
that a retry cannot fix). The handshake in progress is one explicit :class:`Handshake`.

With a pinned ``fingerprint`` (a fleet member's registered certificate, ``peers[].fingerprint``)
the listener's certificate must be exactly that one, or the connection is refused as
IDENTITY_MISMATCH before HELLO. :meth:`Dialer.knock` is the fleet's way for the agent that
does *not* dial (it sorts higher) to ask the one that does: proto/handshake.md §8.

:meth:`Dialer.session_lost` reads WELCOME ``resumed``: a listener that kept nothing of this
session (a fleet member drops its side when idle, down or unreachable) resumes nothing, so
neither may the dialer, even though the listener's incarnation did not change (§6). The reverse,
:meth:`Dialer.welcomed`: a listener that resumes a session this dialer remembers nothing of (a
fleet member dropped its side, ``left`` or ``moved``, while the listener kept its own) is asked to
drop its side too (GOODBYE "idle"), and dialed again: nothing of that session is taken."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import Timeouts
from ..errors import ErrorCode, FatalHandshakeError, HandshakeError, ProtocolError, TransportError
from ..log import limited
from ..pki import peer_fingerprint
from ..transport.base import Connector
from ..transport.tcp import FrameProtocol
from ..wire import FrameType, decode_body, encode, encode_body
from ..wire import messages as m
from ..wire.handshake import FLEET_CAPABILITY, refusal

FIRST_BACKOFF_S = 0.05
#: Knocks cut a backoff short, but start at most one attempt per this long: a member's record
#: names the address dialed, and knocks must not make this agent dial it as fast as they come.
KNOCK_SPACING_S = 0.25
#: A session declines a listener's resume (see :meth:`Dialer.welcomed`) at most this many times: a
#: GOODBYE "idle" lost with its connection gets another try, a listener that resumes after every
#: one is taken as it is.
MAX_DECLINES = 3


@dataclass
class Handshake:
    """The dialer's handshake in progress: resolved by WELCOME, failed by ERROR or a loss."""

    conn: FrameProtocol
    done: asyncio.Future
    refusal_counted: bool = False  # the peer's ERROR frame was counted in the metrics already
    declined: bool = False  # its WELCOME resumed a session this dialer does not have (see welcomed)
    answered: bool = False  # declined: the listener answered the PING behind the GOODBYE (it got both)

    def fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)


class Dialer:
    def __init__(self, connector: Connector, timeouts: Timeouts, *, new_conn: Callable[[], FrameProtocol],
                 hello: Callable[[], m.Hello], count_error: Callable[[Any], None], log: Any,
                 fingerprint: Callable[[], str] = lambda: "",
                 on_session_lost: Callable[[str], None] = lambda why: None) -> None:
        self.connector = connector
        #: Told (with the reason) before the session's state is dropped (the session tells the
        #: engines itself): a fleet counts and logs it (set by :mod:`pdd_wire.fleet.peering`).
        self.on_session_lost = on_session_lost
        #: Told when a WELCOME that resumed a session this dialer does not have is declined (the
        #: fleet counts it); ``declines``: how often (at most MAX_DECLINES).
        self.on_declined: Callable[[], None] = lambda: None
        self.declines = 0
        self.fingerprint = fingerprint
        self.timeouts = timeouts
        self.new_conn = new_conn
        self.hello = hello
        self.count_error = count_error
        self.log = log
        self.pending: Handshake | None = None
        self.lost = asyncio.Event()  # set when the established connection went
        self.closing = False
        self._wake = asyncio.Event()  # cuts a backoff short (the peer knocked: it needs us now)

    async def run(self) -> None:
        backoff = FIRST_BACKOFF_S
        to = self.timeouts
        while not self.closing:
            self.lost.clear()
            self._wake.clear()  # here, not before the backoff: a wake during this attempt cuts the next wait
            started = asyncio.get_running_loop().time()
            hs: Handshake | None = None
            try:
                conn = self.new_conn()
                await self.connector.connect(conn, timeout=to.connect_s)
                self.check_identity(conn)
                hs = self.pending = Handshake(conn, asyncio.get_running_loop().create_future())
                conn.send(encode(FrameType.HELLO, encode_body(self.hello())))
                try:
                    async with asyncio.timeout(to.handshake_s):
                        await hs.done
                except BaseException:
                    conn.abort()
                    raise
                finally:
                    self.pending = None
                backoff = FIRST_BACKOFF_S
                if hs.declined:
                    await self._until_closed(hs)  # the listener drops its side, then closes: dial again
                    continue
                await self.lost.wait()
            except FatalHandshakeError as exc:
                if exc.code == ErrorCode.TOO_MANY_CONNECTIONS:  # the peer's own limit, not a refusal of us
                    limited(self, self.log.warning, "peer at its connection limit (limits.max_peer_connections "
                            "on the peer): dialing again", error=str(exc), code=exc.code.name)
                else:
                    limited(self, self.log.error, "handshake refused", error=str(exc), code=exc.code.name)
                if hs is None or not hs.refusal_counted:
                    self.count_error(exc.code)
                backoff = to.reconnect_max_backoff_s
            except (TransportError, HandshakeError, TimeoutError, OSError) as exc:
                limited(self, self.log.info, "peer not reachable", error=str(exc) or type(exc).__name__)
            if self.closing:
                return
            try:
                async with asyncio.timeout(backoff * (0.5 + random.random() / 2)):
                    await self._wake.wait()
                await asyncio.sleep(started + KNOCK_SPACING_S - asyncio.get_running_loop().time())
            except TimeoutError:
                pass
            backoff = min(backoff * 2, to.reconnect_max_backoff_s)

    def wake(self) -> None:
        """Dial now if waiting out a backoff."""
        self._wake.set()

    def check_identity(self, conn: FrameProtocol) -> None:
        """The certificate the listener presented is the pinned one (when one is pinned)."""
        want = self.fingerprint()
        if not want or conn.transport is None:
            return
        got = peer_fingerprint(conn.transport)
        if got != want:
            conn.abort()
            raise FatalHandshakeError(f"certificate {got or '(none)'} is not the pinned {want} "
                                      "(peers[].fingerprint, or the fleet member's registered one)",
                                      ErrorCode.IDENTITY_MISMATCH)

    async def knock(self) -> bool:
        """Ask the peer to dial this agent: a control connection with HELLO, which a fleet peer
        that sorts lower answers with ERROR DIAL_BACK (and dials). True when it did; False when
        it refused, did not answer within ``timeouts.handshake_s`` or could not be reached."""
        to = self.timeouts
        conn = self.new_conn()
        answer: asyncio.Future = asyncio.get_running_loop().create_future()

        def settle(frame) -> None:
            if not answer.done():
                answer.set_result(frame)

        conn.on_frame = lambda c, f: settle(f)
        conn.on_lost = lambda c, e: settle(None)
        try:
            await self.connector.connect(conn, timeout=to.connect_s)
            self.check_identity(conn)
            conn.send(encode(FrameType.HELLO, encode_body(self.hello())))
            async with asyncio.timeout(to.handshake_s):
                frame = await answer
        except (TransportError, HandshakeError, TimeoutError, OSError) as exc:
            if isinstance(exc, FatalHandshakeError):  # the peer's certificate is not the registered one
                self.count_error(exc.code)
            limited(self, self.log.info, "knock unanswered", error=str(exc) or type(exc).__name__)
            return False
        finally:
            conn.abort()
        if frame is None or frame.header.type != FrameType.ERROR:
            return False
        try:
            err = decode_body(FrameType.ERROR, frame.body)
        except ProtocolError:
            return False
        if err.code != ErrorCode.DIAL_BACK:
            limited(self, self.log.info, "knock refused", code=err.code, message=err.message)
        return err.code == ErrorCode.DIAL_BACK

    def session_lost(self, msg: m.Hello | m.Welcome, key: str) -> str:
        """Called for a listener met before whose incarnation did not change: its WELCOME ``msg``
        says ``resumed`` false, so it keeps no state of this session (it dropped its side: a
        fleet's idle, down or unreachable session) and nothing of it can be resumed
        (proto/handshake.md §6). Returns why (the reason engines are told), or "" (resumed; or a
        HELLO: the listener's own side). The caller drops the session's state as for a restart."""
        if not isinstance(msg, m.Welcome) or msg.resumed:
            return ""
        why = f"peer {key} kept no state of its session with this agent (WELCOME resumed false): nothing to resume"
        self.on_session_lost(why)
        return why

    def welcomed(self, conn: FrameProtocol, msg: m.Welcome, *, first: bool) -> bool:
        """WELCOME ``msg`` on ``conn`` ends the handshake. False: it is declined, the session must
        not be established on it. It is when the listener resumed (``resumed``) a session this
        dialer remembers nothing of (``first``): a new dialer process has a new incarnation, which
        no listener resumes, so this dialer dropped its side of a session the listener kept (a
        fleet's ``left``, ``moved``, ...), and the listener's state (its token streams' positions,
        its resends, its transfers) would meet none here (proto/handshake.md §6). It is asked to
        drop its side (GOODBYE "idle", which a listener with ``fleet.v1`` acts on at once), nothing
        more is read from ``conn`` (what the listener resends right behind WELCOME is neither
        taken nor acknowledged), and :meth:`run` dials again once the listener closed ``conn``:
        a new session. At most :data:`MAX_DECLINES` times a session, and no more once a listener
        that got that GOODBYE (it answered the PING sent right behind it) kept ``conn`` open
        (:meth:`_until_closed`): such a listener keeps its side (it lists this agent among its
        ``[[peers]]``) and is taken as it is."""
        resumed_unknown = first and msg.resumed and FLEET_CAPABILITY in msg.capabilities
        hs = self.pending
        answering = hs is not None and not hs.done.done() and hs.conn is conn  # (a WELCOME out of turn: no)
        decline = resumed_unknown and answering and self.declines < MAX_DECLINES
        if decline:
            self.declines += 1

            def after_goodbye(c, frame) -> None:  # nothing is taken; a PONG says the GOODBYE arrived
                if frame.header.type == FrameType.PONG and hs is not None:
                    try:
                        hs.answered = hs.answered or decode_body(FrameType.PONG, frame.body).nonce == 1
                    except ProtocolError:
                        pass

            conn.on_frame = after_goodbye
            try:
                conn.send(encode(FrameType.GOODBYE, encode_body(m.Goodbye("idle"))), now=True)
                conn.send(encode(FrameType.PING, encode_body(m.Ping(nonce=1, sent_ns=time.monotonic_ns()))), now=True)
            except TransportError:
                pass  # closed meanwhile: the listener keeps its side, and this agent dials again
            self.on_declined()
        elif resumed_unknown and answering:
            limited(self, self.log.warning, "peer resumed a session this agent had dropped, again after GOODBYE "
                    "idle: taken as it is (does it list this agent among its [[peers]]? list each other alike)")
        if self.pending is not None and not self.pending.done.done():
            self.pending.declined = decline
            self.pending.done.set_result(msg)
        return not decline

    async def _until_closed(self, hs: Handshake) -> None:
        """After a declined WELCOME: wait for the listener to close the connection (it dropped
        its side of the session then), at most ``timeouts.handshake_s``, so that the next HELLO
        finds it gone. A listener that answered the PING behind the GOODBYE (so it got the
        GOODBYE: frames arrive in order) and keeps the connection open that long kept its side
        through it: it is not declined again. Silence proves nothing (the link may have dropped
        the GOODBYE): that decline is one of MAX_DECLINES."""
        closed = asyncio.Event()
        hs.conn.add_close_callback(closed.set)
        try:
            async with asyncio.timeout(self.timeouts.handshake_s):
                await closed.wait()
        except TimeoutError:
            if hs.answered:
                self.declines = MAX_DECLINES
        finally:
            hs.conn.abort()

    def failed(self, exc: BaseException) -> None:
        if self.pending is not None:
            self.pending.fail(exc)

    def refused(self, code: int, message: str) -> None:
        """The peer sent ERROR during the handshake (already counted in the metrics)."""
        if self.pending is not None and not self.pending.done.done():
            self.pending.refusal_counted = True
            self.pending.fail(refusal(code, message))

    def conn_lost(self, conn: FrameProtocol, exc: BaseException | None) -> None:
        if self.pending is not None and conn is self.pending.conn:
            why = str(exc) if exc is not None and str(exc) else "closed by the peer"
            self.pending.fail(TransportError(f"connection closed during the handshake ({why}), before WELCOME: the "
                                             "peer may refuse this agent's certificate or name, or (an agent before "
                                             "TOO_MANY_CONNECTIONS) be at its limits.max_peer_connections (its log "
                                             "says why)"))
