"""A set of chunk indexes kept as a bitmap, so a peer's frame costs what it changes.

Bit *k* stands for chunk *k*, in the layout of the KV_STATUS ``have`` bitmap: byte ``k >> 3``,
bit ``k & 7``. A KV_ACK {first, count} or a KV_STATUS {have} names a range or a bitmap: with a
Python ``set`` each one walked every index it named, O(n_chunks) of interpreter work a 20-byte
frame when a receiver advertises a small ``max_chunk`` (65,536 chunks a transfer: about 8 ms a
frame). Here one chunk is one byte of the bitmap, a range only the bytes it covers (through one
``int``, so the work is in C: range / 64 machine words), a wire bitmap the whole (n_chunks / 64
words, microseconds); Python walks only the chunks a frame newly adds, each at most once in a
transfer's life.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


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
    return int.from_bytes(bm[:(n + 7) >> 3], "little") & span(0, n)


def bitmap_from(chunks: Iterable[int], n: int) -> bytes:
    """The wire's bitmap (``(n + 7) // 8`` bytes) of ``chunks``, each in ``0 .. n-1``."""
    out = bytearray((n + 7) // 8)
    for i in chunks:
        out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


class ChunkSet:
    """Chunk indexes (>= 0) of one transfer; the sender's acknowledged chunks. Grows as needed."""

    __slots__ = ("_bm", "_count")

    def __init__(self) -> None:
        self._bm = bytearray()  # the wire's bitmap layout
        self._count = 0

    def __contains__(self, k: object) -> bool:
        return isinstance(k, int) and 0 <= k < len(self._bm) << 3 and bool(self._bm[k >> 3] >> (k & 7) & 1)

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        return members(self.bits)

    def __repr__(self) -> str:
        return f"ChunkSet({sorted(self)})"

    @property
    def bits(self) -> int:
        """The set as one int (bit k: chunk k)."""
        return int.from_bytes(self._bm, "little")

    def add(self, k: int) -> bool:
        """Add chunk ``k``; True if it was not there."""
        return bool(self.add_range(k, k + 1))

    def add_range(self, first: int, end: int) -> list[int]:
        """Add chunks ``first .. end-1``; returns those that were not there, ascending. Touches the
        bytes of the range only."""
        first = max(0, first)
        if end <= first:
            return []
        if end == first + 1:  # one chunk (the usual KV_ACK): one byte
            i, bit = first >> 3, 1 << (first & 7)
            if len(self._bm) <= i:
                self._bm.extend(bytes(i + 1 - len(self._bm)))
            if self._bm[i] & bit:
                return []
            self._bm[i] |= bit
            self._count += 1
            return [first]
        a, b = first >> 3, (end + 7) >> 3
        return self._merge(a, b, span(first - (a << 3), end - (a << 3)))

    def add_bits(self, bits: int) -> list[int]:
        """Add the chunks of ``bits`` (a whole bitmap as an int); returns those that were not there."""
        if bits <= 0:
            return []
        return self._merge(0, (bits.bit_length() + 7) >> 3, bits)

    def _merge(self, a: int, b: int, bits: int) -> list[int]:
        """OR ``bits`` (relative to byte ``a``) into bytes ``a .. b-1``; the chunks it added."""
        if len(self._bm) < b:
            self._bm.extend(bytes(b - len(self._bm)))
        old = int.from_bytes(self._bm[a:b], "little")
        fresh = bits & ~old
        if not fresh:
            return []
        self._bm[a:b] = (old | fresh).to_bytes(b - a, "little")
        self._count += fresh.bit_count()
        base = a << 3
        return [base + k for k in members(fresh)]

    def missing(self, n: int) -> Iterator[int]:
        """Chunks ``0 .. n-1`` not in the set, ascending."""
        return members(span(0, n) & ~int.from_bytes(self._bm[:(n + 7) >> 3], "little"))
