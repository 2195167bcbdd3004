"""Requests a peer site gave up sending (its KV waited unposted past its lease, or it cancelled or
aborted the request): a receive posted for one later fails at once instead of holding its blocks
for its ttl (proto/transfer.md §6). Each site keeps its own share, so that no peer pushes another
site's records out; a record lasts ``ttl`` seconds, and expired ones go at each new one. Pure: the
time is passed in."""

from __future__ import annotations

import collections
from collections.abc import Iterable

Record = tuple[int, str, float]  # (code, reason, until)


class GivenUp:
    def __init__(self, per_site: int, ttl: float) -> None:
        self.per_site, self.ttl = per_site, ttl
        self.sites: dict[str, collections.OrderedDict[str, Record]] = {}

    def add(self, site: str, request_id: str, code: int, reason: str, now: float) -> None:
        for s in list(self.sites):  # a site that left keeps nothing for long
            old = self.sites[s]
            while old and next(iter(old.values()))[2] <= now:
                old.popitem(last=False)
            if not old:
                del self.sites[s]
        mine = self.sites.setdefault(site, collections.OrderedDict())
        mine[request_id] = (int(code), reason[:256], now + self.ttl)  # the reason may be the peer's text
        mine.move_to_end(request_id)
        while len(mine) > self.per_site:
            mine.popitem(last=False)

    def forget(self, site: str, request_id: str) -> Record | None:
        mine = self.sites.get(site)
        if mine is None:
            return None
        found = mine.pop(request_id, None)
        if not mine:
            del self.sites[site]
        return found

    def take(self, request_id: str, sites: Iterable[str], now: float) -> Record | None:
        """What a post for ``request_id`` from any of ``sites`` must fail with (forgotten now); a
        record past its time, not pruned yet, counts for nothing."""
        found = None
        for site in sites:
            rec = self.forget(site, request_id)
            if rec is not None and rec[2] > now:
                found = rec
        return found
