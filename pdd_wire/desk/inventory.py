"""Decode-side prefix inventory (DRC): which KV blocks the engines of this node hold, by hash.

A block's hash is chained: it covers the block's tokens and its parent's hash, per model and
block size (:func:`pdd_wire.engine.hashes.chain_hashes`, or the engine's own scheme --
vLLM's prefix-caching hashes work the same way), so equal hashes mean equal prefixes. Engines report what they store
(``kv_stored``) and ask before they evict (``kv_evict``); the index answers a sender's
PREFIX_QUERY with the longest run of leading hashes it holds, and holds those blocks under a
**lease** for the request until the engine has used them (``prefix_release``) or the lease
expires. While leased, a block is not evicted on request; a forced eviction *breaks* the lease,
and the request's transfer falls back to shipping those blocks.

Pure: no I/O and no clock of its own (times are passed in). Bounded by the blocks engines
registered (one entry per block they report).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class Lease:
    request_id: str
    hashes: list[int]
    expires: float
    broken: bool = False


@dataclass
class Held:
    """Where a block lives: the engine (opaque owner), its region id and block index."""

    owner: object
    region: int
    block: int
    leases: int = 0


@dataclass
class Inventory:
    max_leases: int = 65536
    blocks: dict[int, Held] = field(default_factory=dict)
    leases: "collections.OrderedDict[str, Lease]" = field(default_factory=collections.OrderedDict)
    at: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (id(owner), region, block) -> hash

    # -- what engines hold
    def stored(self, owner: object, hashes: list[int], places: list[tuple[int, int]]) -> list[str]:
        """``owner`` holds the block with ``hashes[i]`` at ``places[i]`` (region, block). A place
        that held another block no longer does (its leases break): one entry per place, so the
        index never outgrows the blocks engines registered. Returns the broken leases."""
        if len(hashes) != len(places):
            raise ValueError(f"{len(hashes)} hashes for {len(places)} blocks")
        broken: list[str] = []
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

    def evict(self, hashes: list[int], *, force: bool = False) -> tuple[list[int], list[int], list[str]]:
        """The engine wants to drop these blocks: returns (evicted, kept, broken request ids).
        Leased blocks are kept unless ``force`` (the engine drops them anyway), which breaks
        the leases that held them."""
        evicted, kept, broken = [], [], []
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
            if held.leases:
                for lease in self.leases.values():
                    if not lease.broken and h in lease.hashes:
                        lease.broken = True
                        broken.append(lease.request_id)
        return evicted, kept, broken

    def forget_owner(self, owner: object) -> list[str]:
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

    def lease(self, request_id: str, hashes: list[int], now: float, ttl: float) -> tuple[int, list[str]]:
        """Match ``hashes`` and hold the matched blocks for ``request_id`` until ``now + ttl``
        (a new lease for the request replaces the old one). Returns (matched blocks, request
        ids whose leases were dropped to stay within ``max_leases``)."""
        self.release(request_id)
        k = self.match(hashes)
        dropped = []
        while len(self.leases) >= self.max_leases:
            rid, _ = next(iter(self.leases.items()))
            self.release(rid)
            dropped.append(rid)
        lease = Lease(request_id, list(hashes[:k]), now + ttl)
        for h in lease.hashes:
            self.blocks[h].leases += 1
        self.leases[request_id] = lease
        return k, dropped

    def extend(self, request_id: str, until: float) -> None:
        """Hold the request's lease at least until ``until`` (its transfer's deadline)."""
        lease = self.leases.get(request_id)
        if lease is not None:
            lease.expires = max(lease.expires, until)

    def get(self, request_id: str) -> Lease | None:
        return self.leases.get(request_id)

    def places(self, request_id: str) -> list[tuple[int, int, int]]:
        """The leased blocks of ``request_id`` as ``[region, block, count]`` runs, in order."""
        lease = self.leases.get(request_id)
        if lease is None or lease.broken:
            return []
        runs: list[list[int]] = []
        for h in lease.hashes:
            held = self.blocks[h]
            if runs and runs[-1][0] == held.region and runs[-1][1] + runs[-1][2] == held.block:
                runs[-1][2] += 1
            else:
                runs.append([held.region, held.block, 1])
        return [(r[0], r[1], r[2]) for r in runs]

    def release(self, request_id: str) -> bool:
        lease = self.leases.pop(request_id, None)
        if lease is None:
            return False
        for h in lease.hashes:
            held = self.blocks.get(h)
            if held is not None and held.leases:
                held.leases -= 1
        return True

    def expire(self, now: float) -> list[str]:
        """Drop leases past their time; returns their request ids."""
        gone = [rid for rid, lease in self.leases.items() if lease.expires <= now]
        for rid in gone:
            self.release(rid)
        return gone
