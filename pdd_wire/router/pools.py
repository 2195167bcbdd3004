"""The router's pools at run time: which ``vllm serve`` members serve each role (P, RLD, MD),
what each has in flight through this router, and RLD's live load.

Membership is live: :meth:`Pools.add` and :meth:`Pools.remove` change it while the router
runs (a membership source -- a config reload, etcd -- calls them; docs/router.md, *Pools*). A
request keeps the :class:`Upstream` it picked until it ends, so removing a member never cuts a
request that is using it; new requests no longer pick it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import Gauge

from .config import Member

ROLES = ("P", "RLD", "MD")


class NoMember(LookupError):
    """A role's pool has no member to pick (the router answers 502): not any LookupError, so a
    KeyError of the router's own stays its own fault."""


@dataclass(eq=False)
class Load:
    """A member's last load figure (0 = idle, 1 = every slot in use; may exceed 1) and when
    it was read (``time.monotonic``); ``at`` 0: never."""

    value: float = 0.0
    at: float = 0.0
    asked: float = 0.0  # when the scrape that read it was sent
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0


@dataclass(eq=False)
class Upstream:
    """A pool member at run time."""

    pool: str
    member: Member
    inflight: int = 0
    load: Load = field(default_factory=Load)
    removed: bool = False  # taken out of its pool: in-flight requests finish, nothing new picks it

    @property
    def url(self) -> str:
        return self.member.url.rstrip("/")


class Pools:
    """The members of each role. ``pick(role)`` is least-loaded (fewest requests in flight
    through this router; ties round-robin); ``using(u)`` counts a request on ``u`` while it runs.

    ``inflight``: the gauge of requests in flight per member (labels ``pool``, ``member``).
    ``on_change(role, upstream, added)`` is called after each add or remove (the router closes
    what it held for a removed member there)."""

    def __init__(self, inflight: Gauge | None = None,
                 on_change: Callable[[str, Upstream, bool], None] | None = None) -> None:
        self._members: dict[str, list[Upstream]] = {r: [] for r in ROLES}
        self._turn = {r: itertools.count() for r in ROLES}
        self._gauge = inflight
        self._on_change = on_change

    @classmethod
    def from_config(cls, pools, inflight: Gauge | None = None,
                    on_change: Callable[[str, Upstream, bool], None] | None = None) -> "Pools":
        p = cls(inflight, on_change)
        for role in ROLES:
            for m in getattr(pools, role):
                p.add(role, m)
        return p

    def members(self, role: str) -> list[Upstream]:
        """The members of ``role`` now (a copy)."""
        return list(self._members[self._role(role)])

    def add(self, role: str, member: Member) -> Upstream:
        """Add ``member`` to ``role``; a member with the same URL is replaced (its requests in
        flight finish on the old one). Returns the new member."""
        members = self._members[self._role(role)]
        old = next((u for u in members if u.url == member.url.rstrip("/")), None)
        if old is not None:
            self.remove(role, old.url)
        u = Upstream(role, member)
        members.append(u)
        if self._on_change is not None:
            self._on_change(role, u, True)
        return u

    def remove(self, role: str, url: str) -> Upstream | None:
        """Take the member at ``url`` out of ``role`` (None: there was none)."""
        members = self._members[self._role(role)]
        u = next((u for u in members if u.url == url.rstrip("/")), None)
        if u is None:
            return None
        members.remove(u)
        u.removed = True
        if u.inflight == 0:
            self._forget(u)
        if self._on_change is not None:
            self._on_change(role, u, False)
        return u

    def pick(self, role: str, exclude: tuple[Upstream, ...] = ()) -> Upstream:
        """The least-loaded member of ``role`` (NoMember: none)."""
        ring = self.ranked(role, exclude)
        if not ring:
            raise NoMember(f"pool {role} has no member")
        return ring[0]

    def ranked(self, role: str, exclude: tuple[Upstream, ...] = ()) -> list[Upstream]:
        """The members of ``role`` least-loaded first; equals in round-robin order."""
        members = [u for u in self._members[self._role(role)] if u not in exclude]
        if not members:
            return []
        start = next(self._turn[role]) % len(members)
        ring = members[start:] + members[:start]
        return sorted(ring, key=lambda u: u.inflight)  # stable: the rotation breaks ties

    @contextlib.contextmanager
    def using(self, u: Upstream) -> Iterator[Upstream]:
        u.inflight += 1
        if self._gauge is not None:
            self._gauge.labels(pool=u.pool, member=u.url).inc()
        try:
            yield u
        finally:
            u.inflight -= 1
            if self._gauge is not None:
                self._gauge.labels(pool=u.pool, member=u.url).dec()
            if u.removed and u.inflight == 0:
                self._forget(u)

    def _forget(self, u: Upstream) -> None:
        """A removed member's last request ended: drop its gauge (unless a member with the same
        URL came back)."""
        if self._gauge is not None and not any(v.url == u.url for v in self._members[u.pool]):
            with contextlib.suppress(KeyError):
                self._gauge.remove(u.pool, u.url)

    def __iter__(self) -> Iterator[Upstream]:
        return iter([u for r in ROLES for u in self._members[r]])

    @staticmethod
    def _role(role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"no pool {role!r} (pools: {', '.join(ROLES)})")
        return role
