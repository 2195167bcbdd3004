"""Control frames that end something at the peer and must reach it even if the connection they
were written to dies: KV_CANCEL, REQUEST_ABORT, and a handoff's HANDOFF_ABORT and HANDOFF_RELEASE
(``proto/transfer.md`` §10 and §11, ``proto/handoff.md`` §8).

A frame written to a control connection can still be lost: a silent link is found dead only
after ``timeouts.dead_after_s``, and what was written meanwhile goes with the connection. So each
such frame is kept, per peer, until a PONG answers a PING written after it on the same connection
(the peer reads its control connection in order, so it read the frame first; one PING follows at
the end of the loop turn, so this takes a round trip), and is sent again,
first of all, when the session resumes after a reconnect. A frame that could not be written (the
peer down) waits for that resume. None of these frames is answered and each is idempotent at the
peer: a second copy finds nothing left to end. After a peer restart (or a session neither side
resumes) they are dropped: the peer kept nothing they could end.

Bounded per peer: ``4 x transfer.max_transfers`` frames and a quarter of
``limits.control_buffer_bytes`` (so that sending them all again never makes the connection look
unread), the oldest dropped first (its peer then ends that state on its own clock: a transfer's
deadline, a receive's ``ttl_s``, a handoff's deadline). *Spare* frames go first: an engine's
REQUEST_ABORT for a request it held nothing of here ends nothing this agent knows of, so one
engine aborting thousands of unknown ids never pushes out another's KV_CANCEL; a spare frame is
not even written while the control connection has half of its buffer unsent.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Protocol

from ..wire import HEADER_SIZE, Lane, encode_body
from ..wire import messages as m
from ..wire.frame import LANE_OF

#: An engine's abort reason goes to peers cut to this many characters (the wire takes 4096): 16 KiB
#: reasons let one engine's aborts fill a peer's control connection.
REASON_SENT = 256


class OutboxLink(Protocol):
    """What the outbox needs of its session (a :class:`~pdd_wire.session.PeerSession`)."""

    log: Any
    pings: Any  # its :class:`~.link.Pings`
    closing: bool
    control: Any  # its control connection (a FrameProtocol, with paced_room()), or None while down

    def send_frame(self, ftype: int, body: Any, *, tid: int = 0, lane: int = Lane.CONTROL) -> bool: ...


class Outbox:
    """The frames of one peer session kept until the peer is known to have read them."""

    def __init__(self, session: OutboxLink, cap: int, cap_bytes: int) -> None:
        self.s = session
        self.cap, self.cap_bytes = cap, cap_bytes
        #: key -> (body, transfer id, the last PING written before it or None: unwritten, size); the
        #: frame type and lane follow from the body
        self._kept: collections.OrderedDict[tuple, tuple[Any, int, int | None, int]] = collections.OrderedDict()
        self._spare: collections.OrderedDict[tuple, None] = collections.OrderedDict()  # keys of spare frames
        self.bytes = 0  # the frames' sizes on the wire, together
        self.last_ping = 0  # the nonce of the last PING written (pings count up from 1)
        self._confirmed = 0  # the newest PING a PONG has answered
        self.dropped = 0  # frames dropped unconfirmed because the outbox was full
        self._ping_due = False

    def __len__(self) -> int:
        return len(self._kept)

    def send(self, key: tuple, body: Any, *, tid: int = 0, spare: bool = False) -> bool:
        """Write ``body``'s frame now if the control connection is up, and keep it until confirmed.
        ``key`` names what it ends (a later frame with the same key replaces it). ``spare``: it
        ends nothing known here; dropped first when full, and at once while the connection is
        short of room."""
        spare = spare and (key not in self._kept or key in self._spare)  # a copy keeps what was kept
        conn = self.s.control
        if spare and conn is not None and not conn.closed and conn.paced_room() <= 0:
            self._dropped()
            return False
        written = self._write(body, tid)
        if written and not self._ping_due:  # confirmed within a round trip, not a heartbeat
            self._ping_due = True
            asyncio.get_running_loop().call_soon(self._ping)
        self.forget(key)
        size = HEADER_SIZE + len(encode_body(body))
        self._kept[key] = (body, tid, self.last_ping if written else None, size)
        self.bytes += size
        if spare:
            self._spare[key] = None
        while len(self._kept) > self.cap or self.bytes > self.cap_bytes:
            self.forget(next(iter(self._spare or self._kept)))
            self._dropped()
        return written

    def _dropped(self) -> None:
        self.dropped += 1
        if self.dropped == 1 or self.dropped % 1024 == 0:
            self.s.log.warning("outbox full: an unconfirmed cancel or abort was dropped (the peer ends it on its "
                               "own clock; spare ones, aborts of requests unknown here, first)",
                               dropped=self.dropped, cap=self.cap)

    def _write(self, body: Any, tid: int) -> bool:
        ftype = m.TYPE_OF[type(body)]
        return self.s.send_frame(ftype, body, tid=tid, lane=LANE_OF[ftype])

    def _ping(self) -> None:
        self._ping_due = False
        if not self.s.closing:  # GOODBYE is the last frame
            self.s.pings.send()

    def ping_written(self, nonce: int) -> None:
        self.last_ping = nonce

    def pong(self, nonce: int) -> None:
        """The peer answered PING ``nonce``: it read every frame written before that PING. Frames
        are kept in the order written (a resend writes them all again, in order), so the walk
        stops at the first written after that PING: a PONG costs what it confirms, and one for a
        PING already confirmed, or never written, costs nothing (a peer may send PONGs at will)."""
        if not self._confirmed < nonce <= self.last_ping:
            return
        self._confirmed = nonce
        done = []
        for key, (_, _, ping, _) in self._kept.items():
            if ping is None:  # not written (the peer was down): it waits for the resend
                continue
            if ping >= nonce:
                break
            done.append(key)
        for key in done:
            self.forget(key)

    def resend(self) -> None:
        """The session resumed on a new control connection: every frame kept goes again, in order
        (before anything else is sent on it); a PING written after them confirms them."""
        for key, (body, tid, _, size) in list(self._kept.items()):
            self._kept[key] = (body, tid, self.last_ping if self._write(body, tid) else None, size)

    def forget(self, key: tuple) -> None:
        """Keep the frame under ``key`` no longer (confirmed, or replaced by a newer one)."""
        kept = self._kept.pop(key, None)
        if kept is not None:
            self.bytes -= kept[3]
            self._spare.pop(key, None)

    def clear(self) -> None:
        """The peer restarted, or kept nothing of the session: nothing is left there to end."""
        self._kept.clear()
        self._spare.clear()
        self.bytes = 0
