"""The agent's peer sessions, found by name (``site/node``), by site and by bulk token."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .errors import EngineRequestError, ErrorCode

if TYPE_CHECKING:
    from .session import PeerSession


class Peers:
    """Every configured peer's session; sessions live as long as the agent."""

    def __init__(self) -> None:
        self.by_key: dict[str, PeerSession] = {}  # "site/node"
        self.by_site: dict[str, list[PeerSession]] = collections.defaultdict(list)
        self.by_token: dict[int, PeerSession] = {}  # what its bulk connections present

    def add(self, s: "PeerSession") -> None:
        self.by_key[s.key] = s
        self.by_site[s.peer.site].append(s)
        self.by_token[s.token] = s

    def __iter__(self) -> Iterator["PeerSession"]:
        return iter(self.by_key.values())

    def __len__(self) -> int:
        return len(self.by_key)

    def get(self, key: str) -> "PeerSession | None":
        return self.by_key.get(key)

    def session_for(self, dest: str) -> "PeerSession":
        """The session an engine means by ``dest``: ``"B/b1"``, or ``"B"`` (its first peer that
        is up, else its first)."""
        if "/" in dest:
            s = self.by_key.get(dest)
        else:
            candidates = self.by_site.get(dest) or []
            s = next((c for c in candidates if c.is_up), candidates[0] if candidates else None)
        if s is None:
            raise EngineRequestError(f"no peer {dest!r} (known: {sorted(self.by_key)})", ErrorCode.UNKNOWN_PEER_SITE)
        return s

    def open_transfers(self) -> int:
        return sum(len(s.out) + len(s.inn) for s in self.by_key.values())
