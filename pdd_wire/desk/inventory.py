"""Decode-side prefix inventory (DRC): which KV blocks the engines of this node hold, by hash.

A block's hash is chained: it covers the block's tokens and its parent's hash, per model and
block size (:func:`pdd_wire.engine.hashes.chain_hashes`, or the engine's own scheme --
vLLM's prefix-caching hashes work the same way), so equal hashes mean equal prefixes. Engines report what they store
(``kv_stored``) and ask before they evict (``kv_evict``); the index answers a sender's
PREFIX_QUERY with the longest run of leading hashes it holds, and holds those blocks under a
**lease** for the request until the engine has used them (``prefix_release``) or the lease
expires. While leased, a block is not evicted on request; a forced eviction *breaks* the lease,
and the request's transfer falls back to shipping those blocks.

Leases are keyed by (peer, request id): a peer's PREFIX_QUERY never touches another peer's
lease for the same request id. Each peer holds at most ``max_leases`` leases, of at most
``max_lease_blocks`` blocks together; its new lease drops its own oldest ones beyond that, never
another peer's. A query that matches nothing takes no lease. A lease that goes away early --
replaced by its peer's next query for the request, or dropped to stay within the peer's share --
is returned to the caller (the KV desk), which breaks the transfer relying on it: that transfer
restarts whole, never lands with another lease's blocks as its prefix.

Pure: no I/O and no clock of its own (times are passed in). Bounded by the blocks engines
registered (one entry per block they report).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

LeaseKey = tuple[str, str]  # (peer "site/node", request id)


@dataclass(eq=False)  # identity: a transfer holds the very lease it was matched with
class Lease:
    peer: str
    request_id: str
    hashes: list[int]
    expires: float
    broken: bool = False
    delivered: bool = False  # an engine was told its blocks (kv_received): it holds them until prefix_release

    @property
    def key(self) -> LeaseKey:
        return (self.peer, self.request_id)


@dataclass
class Held:
    """Where a block lives: the engine (opaque owner), its region id and block index."""

    owner: object
    region: int
    block: int
    leases: int = 0


@dataclass
class Inventory:
    max_leases: int = 65536  # per peer
    max_lease_blocks: int = 1 << 20  # per peer: the hashes its leases hold together
    blocks: dict[int, Held] = field(default_factory=dict)
    leases: "collections.OrderedDict[LeaseKey, Lease]" = field(default_factory=collections.OrderedDict)
    # peer -> its leases' request ids, oldest first, and the blocks they hold together
    by_peer: dict[str, "collections.OrderedDict[str, None]"] = field(default_factory=dict)
    peer_blocks: dict[str, int] = field(default_factory=dict)
    holders: dict[int, set[LeaseKey]] = field(default_factory=dict)  # hash -> the leases holding it
    by_request: dict[str, set[str]] = field(default_factory=dict)  # request id -> peers holding a lease
    at: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (id(owner), region, block) -> hash

    # -- what engines hold
    def stored(self, owner: object, hashes: list[int], places: list[tuple[int, int]]) -> list[Lease]:
        """``owner`` holds the block with ``hashes[i]`` at ``places[i]`` (region, block). A place
        that held another block no longer does (its leases break): one entry per place, so the
        index never outgrows the blocks engines registered. Returns the broken leases."""
        if len(hashes) != len(places):
            raise ValueError(f"{len(hashes)} hashes for {len(places)} blocks")
        broken: list[Lease] = []
        for h, (region, block) in zip(hashes, places):
            key = (id(owner), region, block)
            prev = self.at.get(key)
            if prev is not None and prev != h:
                broken += self.evict([prev], force=True)[2]
            old = self.blocks.get(h)
            if old is not None and (id(old.owner), old.region, old.block) != key:
                self.at.pop((id(old.owner), old.region, old.block), None)
            self.blocks[h] = Held(owner, region, block, old.leases if old else 0)
            self.at[key] = h
        return broken

    def evict(self, hashes: list[int], *, force: bool = False) -> tuple[list[int], list[int], list[Lease]]:
        """The engine wants to drop these blocks: returns (evicted, kept, broken leases).
        Leased blocks are kept unless ``force`` (the engine drops them anyway), which breaks
        the leases that held them."""
        evicted: list[int] = []
        kept: list[int] = []
        broken: list[Lease] = []
        for h in hashes:
            held = self.blocks.get(h)
            if held is None:
                continue
            if held.leases and not force:
                kept.append(h)
                continue
            del self.blocks[h]
            self.at.pop((id(held.owner), held.region, held.block), None)
            evicted.append(h)
            for key in self.holders.get(h, ()):  # the leases holding it (an index: no scan of every lease)
                lease = self.leases[key]
                if not lease.broken:
                    lease.broken = True
                    broken.append(lease)
        return evicted, kept, broken

    def forget_owner(self, owner: object) -> list[Lease]:
        """An engine went away: its blocks are gone; returns the leases that broke."""
        gone = [h for h, held in self.blocks.items() if held.owner is owner]
        return self.evict(gone, force=True)[2]

    # -- queries and leases
    def match(self, hashes: list[int]) -> int:
        """How many leading ``hashes`` are held (the longest matched prefix, in blocks)."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def lease(self, peer: str, request_id: str, hashes: list[int], now: float,
              ttl: float) -> tuple[int, list[Lease]]:
        """Match ``hashes`` and hold the matched blocks for ``peer``'s ``request_id`` until
        ``now + ttl``. Returns (matched blocks, the leases that went away: this peer's previous
        lease for the request, which the new one replaces, and this peer's oldest leases dropped
        to stay within its ``max_leases`` and ``max_lease_blocks``). Other peers' leases are not
        touched. Nothing matched: no lease is taken."""
        dropped = [old] if (old := self.release((peer, request_id))) is not None else []
        k = min(self.match(hashes), self.max_lease_blocks)
        if k == 0:
            return 0, dropped
        mine = self.by_peer.setdefault(peer, collections.OrderedDict())
        while mine and (len(mine) >= self.max_leases or self.peer_blocks[peer] + k > self.max_lease_blocks):
            oldest = self.release((peer, next(iter(mine))))
            assert oldest is not None
            dropped.append(oldest)
        lease = Lease(peer, request_id, list(hashes[:k]), now + ttl)
        for h in lease.hashes:
            self.blocks[h].leases += 1
            self.holders.setdefault(h, set()).add(lease.key)
        self.leases[lease.key] = lease
        self.by_request.setdefault(request_id, set()).add(peer)
        self.by_peer.setdefault(peer, mine)[request_id] = None
        self.peer_blocks[peer] = self.peer_blocks.get(peer, 0) + k
        return k, dropped

    def extend(self, key: LeaseKey, until: float) -> None:
        """Hold the lease at least until ``until`` (its transfer's deadline)."""
        lease = self.leases.get(key)
        if lease is not None:
            lease.expires = max(lease.expires, until)

    def get(self, key: LeaseKey) -> Lease | None:
        return self.leases.get(key)

    def current(self, lease: Lease) -> bool:
        """``lease`` is still held and whole (not broken, replaced, dropped or released)."""
        return not lease.broken and self.leases.get(lease.key) is lease

    def for_request(self, request_id: str) -> list[Lease]:
        return [self.leases[(peer, request_id)] for peer in sorted(self.by_request.get(request_id, ()))]

    def places(self, lease: Lease) -> list[tuple[int, int, int]]:
        """The blocks ``lease`` holds as ``[region, block, count]`` runs, in order ([] once it
        is no longer current)."""
        if not self.current(lease):
            return []
        runs: list[list[int]] = []
        for h in lease.hashes:
            held = self.blocks[h]
            if runs and runs[-1][0] == held.region and runs[-1][1] + runs[-1][2] == held.block:
                runs[-1][2] += 1
            else:
                runs.append([held.region, held.block, 1])
        return [(r[0], r[1], r[2]) for r in runs]

    def release(self, key: LeaseKey) -> Lease | None:
        """End the lease ``key``; returns it (None: there was none)."""
        lease = self.leases.pop(key, None)
        if lease is None:
            return None
        peers = self.by_request.get(lease.request_id)
        if peers is not None:
            peers.discard(lease.peer)
            if not peers:
                del self.by_request[lease.request_id]
        mine = self.by_peer.get(lease.peer)
        if mine is not None:
            mine.pop(lease.request_id, None)
            self.peer_blocks[lease.peer] -= len(lease.hashes)
            if not mine:
                del self.by_peer[lease.peer], self.peer_blocks[lease.peer]
        for h in lease.hashes:
            held = self.blocks.get(h)
            if held is not None and held.leases:
                held.leases -= 1
            keys = self.holders.get(h)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self.holders[h]
        return lease

    def expire(self, now: float) -> list[Lease]:
        """Drop leases past their time; returns them."""
        gone = [key for key, lease in self.leases.items() if lease.expires <= now]
        return [lease for key in gone if (lease := self.release(key)) is not None]
