"""A session's own log lines ("peer up", "peer said goodbye", "control connection lost", ...),
written at most once per period for each peer.

A peer that opens sessions in a loop (a fleet member that sends GOODBYE "idle" right after each
WELCOME, a peer whose connection drops as soon as it is up) made the session write those lines
every time, without limit. They go through :func:`pdd_wire.log.limited` with an owner per
(agent, peer) that outlives the session (a fleet member's session is a new object each time it
opens): the first of each line (its event and fields) goes out, the same line within
:data:`PERIOD_S` is only counted, and the next one after that carries ``repeated=N``.

A line that says the peer is up or down (:meth:`PeerLines.state`) must not leave the log saying
the opposite of what holds: when the latest one was held back, it is written once the period
has passed, with ``latest=True`` (the state the lines held back ended in), unless a line that
went out since says the same.
"""

from __future__ import annotations

import asyncio
import collections
import weakref
from typing import Any

from ..log import limited

PERIOD_S = 30.0
#: Peers whose lines an agent remembers (the least recently heard of is forgotten first; its
#: next line is then written as a first one).
MAX_PEERS = 4096

_Line = tuple[Any, str, dict[str, Any]]  # the log method, the event, its fields

_agents: "weakref.WeakKeyDictionary[object, collections.OrderedDict[str, PeerLines]]" = \
    weakref.WeakKeyDictionary()


def peer_lines(host: object, key: str) -> "PeerLines":
    """The lines of peer ``key`` for the agent ``host`` (the same object for each of its sessions)."""
    try:
        peers = _agents.setdefault(host, collections.OrderedDict())
    except TypeError:  # a host that cannot be weakly referenced: lines per session
        return PeerLines()
    lines = peers.get(key)
    if lines is None:
        if len(peers) >= MAX_PEERS:
            peers.popitem(last=False)
        lines = peers[key] = PeerLines()
    else:
        peers.move_to_end(key)
    return lines


def _same(a: _Line | None, b: _Line | None) -> bool:
    """The same line as far as a reader can tell (two sessions' loggers are two objects)."""
    if a is None or b is None:
        return a is b
    return (getattr(a[0], "__name__", ""), a[1], a[2]) == (getattr(b[0], "__name__", ""), b[1], b[2])


class PeerLines:
    """One peer's session lines for one agent: the owner :func:`limited` keeps their repeats by."""

    __slots__ = ("__weakref__", "_state", "_said", "_settle")

    def __init__(self) -> None:
        self._state: _Line | None = None  # the latest line saying the peer is up or down
        self._said: _Line | None = None  # the latest such line that went out
        self._settle: asyncio.TimerHandle | None = None

    def line(self, method: Any, event: str, *, detail: dict | None = None, **fields: Any) -> bool:
        """``method(event, **fields, **detail)`` unless it repeats (``detail`` does not make a line new)."""
        return limited(self, method, event, every_s=PERIOD_S, detail=detail, **fields)

    def goodbye(self, method: Any, reason: str) -> bool:
        """A peer's GOODBYE: the reasons the spec names make lines of their own; any other text
        (the peer's to vary) rides along with one line per period."""
        named = reason in ("shutdown", "idle")
        return self.line(method, "peer said goodbye", reason=reason if named else "other",
                         detail=None if named else {"text": reason})

    def state(self, method: Any, event: str, **fields: Any) -> None:
        """A line saying the peer is up or down now; held back, it is written after the period
        if no line written since says the same."""
        self._state = (method, event, fields)
        if self.line(method, event, **fields):
            self._said = self._state
        elif self._settle is None:
            try:
                self._settle = asyncio.get_running_loop().call_later(PERIOD_S, self._settled)
            except RuntimeError:  # no loop: nothing runs later
                pass

    def _settled(self) -> None:
        self._settle = None
        if self._state is not None and not _same(self._state, self._said):
            method, event, fields = self._state
            method(event, **fields, latest=True)
            self._said = self._state
