"""The agent's peer sessions, found by name (``site/node``), by site and by bulk token.

Configured peers (``[[peers]]``) have a session from start to stop. With a fleet
(``[fleet]``), ``discover`` opens one on first need: :meth:`Peers.session_for` is where every
need passes (``send_kv``, tokens, a handoff, a probe, an estimate), so a name it does not know
is asked of the membership before it is refused.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from .errors import EngineRequestError, ErrorCode

if TYPE_CHECKING:
    from .session import PeerSession


class Peers:
    """Every session the agent has now (configured peers, and fleet members in use)."""

    def __init__(self) -> None:
        self.by_key: dict[str, PeerSession] = {}  # "site/node"
        self.by_site: dict[str, list[PeerSession]] = collections.defaultdict(list)
        self.by_token: dict[int, PeerSession] = {}  # what its bulk connections present
        self.used_at: dict[str, float] = {}  # "site/node" -> last time a need named it (monotonic)
        # dest ("site" or "site/node") -> a new session for it, or None: the fleet's lazy peering
        self.discover: Callable[[str], PeerSession | None] | None = None
        # told of every session a need finds (the fleet knocks for a listener's session that is down)
        self.need: Callable[[PeerSession], None] | None = None

    def add(self, s: "PeerSession") -> None:
        self.by_key[s.key] = s
        self.by_site[s.peer.site].append(s)
        self.by_token[s.token] = s
        self.used_at[s.key] = time.monotonic()

    def remove(self, s: "PeerSession") -> None:
        """Forget ``s`` (a fleet session being closed): no need finds it any more."""
        if self.by_key.get(s.key) is not s:
            return
        del self.by_key[s.key]
        site = self.by_site[s.peer.site]
        site.remove(s)
        if not site:
            del self.by_site[s.peer.site]
        self.by_token.pop(s.token, None)
        self.used_at.pop(s.key, None)

    def __iter__(self) -> Iterator["PeerSession"]:
        return iter(self.by_key.values())

    def __len__(self) -> int:
        return len(self.by_key)

    def get(self, key: str) -> "PeerSession | None":
        return self.by_key.get(key)

    def sites(self) -> dict[str, set[str]]:
        """Site -> node names of the sessions there are (who may say HELLO)."""
        return {site: {s.peer.node for s in ss} for site, ss in self.by_site.items()}

    def session_for(self, dest: str) -> "PeerSession":
        """The session an engine means by ``dest``: ``"B/b1"``, or ``"B"`` (its first peer that
        is up, else its first; with a fleet and none there, a member of that site)."""
        if "/" in dest:
            s = self.by_key.get(dest)
        else:
            candidates = self.by_site.get(dest) or []
            s = next((c for c in candidates if c.is_up), candidates[0] if candidates else None)
        if s is None and self.discover is not None:
            s = self.discover(dest)
        if s is None:
            where = "" if self.discover is None else "not a member of the fleet either; "
            raise EngineRequestError(f"no peer {dest!r} ({where}known: {sorted(self.by_key)})",
                                     ErrorCode.UNKNOWN_PEER_SITE)
        self.used_at[s.key] = time.monotonic()
        if self.need is not None:
            self.need(s)
        return s

    def open_transfers(self) -> int:
        return sum(len(s.out) + len(s.inn) for s in self.by_key.values())
