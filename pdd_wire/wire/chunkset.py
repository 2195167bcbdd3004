"""A set of chunk indexes kept as the bits of one int, so a peer's frame costs what it changes.

Bit *k* stands for chunk *k*: the layout of the KV_STATUS ``have`` bitmap read little-endian
(byte ``k >> 3``, bit ``k & 7``), so a bitmap from the wire becomes a set with one C call. A
KV_ACK {first, count} or a KV_STATUS {have} is a range or a bitmap: with a Python ``set`` each
one walked every index it named, O(n_chunks) of interpreter work a 20-byte frame when a
receiver advertises a small ``max_chunk`` (65,536 chunks a transfer: about 8 ms a frame). Here
the whole-range work is done on machine words (n_chunks / 64 of them, microseconds), and
Python walks only the chunks a frame newly adds: each chunk at most once in a transfer's life.
"""

from __future__ import annotations

from collections.abc import Iterator


def members(bits: int) -> Iterator[int]:
    """The indexes of the bits set in ``bits`` (>= 0), ascending: C scans, a Python step per member."""
    if not bits:
        return
    s = format(bits, "b")[::-1]  # s[k] is bit k
    k = s.find("1")
    while k >= 0:
        yield k
        k = s.find("1", k + 1)


def span(first: int, end: int) -> int:
    """The bits of chunks ``first .. end-1`` (none when ``end <= first``)."""
    return ((1 << (end - first)) - 1) << first if end > first else 0


def from_bitmap(bm: bytes, n: int) -> int:
    """A KV_STATUS bitmap as bits, cut to chunks ``0 .. n-1`` (bits past them name no chunk)."""
    return int.from_bytes(bm, "little") & span(0, n)


def to_bitmap(bits: int, n: int) -> bytes:
    """``bits`` as the wire's bitmap for ``n`` chunks (``(n + 7) // 8`` bytes)."""
    return bits.to_bytes((n + 7) // 8, "little")


class ChunkSet:
    """Chunk indexes (>= 0) of one transfer; the sender's acknowledged chunks."""

    __slots__ = ("bits", "_count")

    def __init__(self) -> None:
        self.bits = 0
        self._count = 0

    def __contains__(self, k: object) -> bool:
        return isinstance(k, int) and k >= 0 and bool(self.bits >> k & 1)

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        return members(self.bits)

    def __repr__(self) -> str:
        return f"ChunkSet({sorted(self)})"

    def add(self, k: int) -> bool:
        """Add chunk ``k``; True if it was not there."""
        return bool(self.add_bits(1 << k))

    def add_bits(self, bits: int) -> list[int]:
        """Add the chunks of ``bits``; returns those that were not there, ascending."""
        fresh = bits & ~self.bits
        if not fresh:
            return []
        self.bits |= fresh
        self._count += fresh.bit_count()
        return list(members(fresh))

    def add_range(self, first: int, end: int) -> list[int]:
        """Add chunks ``first .. end-1``; returns those that were not there, ascending."""
        return self.add_bits(span(max(0, first), end))

    def missing(self, n: int) -> Iterator[int]:
        """Chunks ``0 .. n-1`` not in the set, ascending."""
        return members(span(0, n) & ~self.bits)
