"""KV_ACKs as ranges: the acks a session sends in one loop turn, merged per transfer.

KV_ACK carries ``{first, count}`` (proto/transfer.md §7). Chunks that land in the same turn of
the session's loop (several bulk connections, or a loop that fell behind) are acknowledged by
one frame per contiguous run instead of one frame each: less to encode, send and decode, and
one ``on_ack`` at the sender instead of ``count``. The runs go out when the control
connection writes the turn's frames (its ``on_flush``), or before any other frame the session
sends, so that no frame overtakes an ack that was due before it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..wire import FrameType
from ..wire import messages as m


class AckBatch:
    """The acks of one control connection not yet sent, as runs ``[first, count]`` per
    transfer (in the order first acked). ``send(ftype, body, tid=...)``: the session's
    send_frame, which hands every frame to :meth:`hold` first."""

    def __init__(self, send: Callable[..., bool]) -> None:
        self.send = send
        self.conn: Any = None  # the connection the held acks are for
        self.runs: dict[int, list[list[int]]] = {}
        self._sending = False

    def hold(self, conn: Any, ftype: int, body: Any, tid: int) -> bool:
        """Called with every frame the session sends on ``conn``: True if it is a KV_ACK and is
        held (sent with the turn's frames); for any other frame, what is held is sent first."""
        if self._sending or not conn.coalesce:  # (a control connection always writes once per turn)
            return False
        if ftype != FrameType.KV_ACK:
            if self.runs:
                self.flush(self.conn)
            return False
        if conn is not self.conn:
            self.runs.clear()
            self.conn = conn
        if not self.runs:
            conn.on_flush = lambda: self.flush(conn)
            conn.flush_soon()
        self.add(tid, body.first, body.count)
        return True

    def add(self, tid: int, first: int, count: int) -> None:
        runs = self.runs.setdefault(tid, [])
        if runs:
            last = runs[-1]
            if last[0] + last[1] == first:  # right after the last run
                last[1] += count
                return
            if first + count == last[0]:  # right before it (another bulk connection was quicker)
                last[0] = first
                last[1] += count
                return
        runs.append([first, count])

    def flush(self, conn: Any) -> None:
        """Send the held runs (dropped if ``conn`` is no longer theirs or has closed: the
        reconnect's KV_STATUS tells the sender what was verified)."""
        runs, self.runs = self.runs, {}
        if conn is not self.conn or conn.closed:
            return
        sending, self._sending = self._sending, True  # a nested flush (fail() within a send) keeps it
        try:
            for tid, rs in runs.items():
                for first, count in rs:
                    self.send(FrameType.KV_ACK, m.KvAck(first, count), tid=tid)
        finally:
            self._sending = sending
