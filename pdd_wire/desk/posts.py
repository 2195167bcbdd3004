"""What the KV desk (:mod:`.kv`) keeps per request: a posted receive, a KV_BEGIN waiting for
its post, and the engine a request belongs to here."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ..memory import BlockMap, as_extents
from ..wire import messages as m

if TYPE_CHECKING:
    from ..engine_server import EngineConn
    from ..session import PeerSession


class Post:
    """Blocks an engine lent for one request's incoming KV."""

    __slots__ = ("request_id", "engine", "blocks", "from_site", "ttl", "timer", "expires", "max_skip", "offered")

    def __init__(self, request_id: str, engine: "EngineConn", blocks: BlockMap, from_site: str | None,
                 ttl: float, max_skip: int | None = None) -> None:
        self.max_skip = max_skip  # post_recv.max_skip_blocks: leading blocks a matched prefix may cover
        self.request_id = request_id
        self.engine = engine
        self.blocks = blocks
        self.from_site = from_site
        self.ttl = ttl
        self.timer: asyncio.TimerHandle | None = None
        self.expires = 0.0  # loop time
        self.offered: list["PeerSession"] = []  # the sessions it was offered to (KV_OFFER)


class Unposted:
    """A KV_BEGIN that came before its request's post: it waits for one, up to a timer."""

    __slots__ = ("session", "tid", "begin", "timer", "since")

    def __init__(self, session: "PeerSession", tid: int, begin: m.KvBegin, timer: asyncio.TimerHandle) -> None:
        self.session = session
        self.tid = tid
        self.begin = begin
        self.timer = timer
        self.since = timer.when()  # orders the waits of one request: the oldest matches first


class Owner:
    """The engine a request belongs to here, and the peer sites tied to it (None: any site)."""

    __slots__ = ("engine", "sites")

    def __init__(self, engine: "EngineConn", sites: frozenset[str] | None) -> None:
        self.engine = engine
        self.sites = sites

    def allows(self, site: str) -> bool:
        return self.sites is None or site in self.sites

    def room_for_tokens(self, site: str) -> bool:
        """Whether a relayed frame from ``site`` may come to this owner now: not while its engine
        has a quarter of its event queue unread (frames from sites not tied to it are dropped)."""
        return self.engine.closed or not self.allows(site) or not self.engine.full_for_tokens


def blockmap(ec: "EngineConn", blocks) -> BlockMap:
    """``blocks`` ([region, first, count] runs) of ``ec``'s registered regions, validated."""
    return BlockMap(ec.regions, as_extents(blocks))
