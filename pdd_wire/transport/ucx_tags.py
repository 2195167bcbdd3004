"""UCX tags: 64 bits = direction (1) | transfer id (40) | index (23); see :func:`tag_for`.

Between agents that both advertise ``ucx-keys.v1`` the transfer id bits are not the transfer id
itself but its image under a keyed permutation (:class:`TagKey`), so that tags cannot be guessed
by what reaches a worker without being the peer.
"""

from __future__ import annotations

import hashlib

DIRECTION_BITS = 1
TRANSFER_ID_BITS = 40
INDEX_BITS = 23
assert DIRECTION_BITS + TRANSFER_ID_BITS + INDEX_BITS == 64
MAX_TRANSFER_ID = (1 << TRANSFER_ID_BITS) - 1   # ~1.1e12 transfers
MAX_INDEX = (1 << INDEX_BITS) - 1               # ~8.4M chunks/blocks per transfer
DIR_DIALER = 0      # transfer ids allocated by the agent that dialed the control connection
DIR_ACCEPTOR = 1    # transfer ids allocated by the agent that accepted it


def tag_for(direction: int, transfer_id: int, index: int) -> int:
    """The 64-bit UCX tag of chunk/block ``index`` of transfer ``transfer_id``.

    Bit 63 is ``direction``: which agent of the pair allocated ``transfer_id``
    (:data:`DIR_DIALER` / :data:`DIR_ACCEPTOR`), so both agents can number their transfers
    independently and KV moving A->B never shares a tag with KV moving B->A even if both
    ever meet in one matching space. Bits 62..23 are the transfer id (between agents that agreed
    ``ucx-keys.v1``, the caller passes its :class:`TagKey` image), bits 22..0 the index.
    All tags of one transfer share the top 41 bits (:func:`transfer_prefix`).
    """
    if direction not in (0, 1):
        raise ValueError(f"direction must be 0 or 1, got {direction!r}")
    if not 0 <= transfer_id <= MAX_TRANSFER_ID:
        raise ValueError(f"transfer id {transfer_id} does not fit in {TRANSFER_ID_BITS} bits")
    if not 0 <= index <= MAX_INDEX:
        raise ValueError(f"index {index} does not fit in {INDEX_BITS} bits")
    return (direction << 63) | (transfer_id << INDEX_BITS) | index


def tag_parts(tag: int) -> tuple[int, int, int]:
    """Inverse of :func:`tag_for`: ``(direction, transfer_id, index)``."""
    return tag >> 63, (tag >> INDEX_BITS) & MAX_TRANSFER_ID, tag & MAX_INDEX


def transfer_prefix(direction: int, transfer_id: int) -> int:
    """The bits all tags of one transfer share (``tag >> INDEX_BITS``)."""
    return tag_for(direction, transfer_id, 0) >> INDEX_BITS


# -- keyed transfer ids (capability ucx-keys.v1) ----------------------------------------------
HALF_BITS = TRANSFER_ID_BITS // 2
_HALF_MASK = (1 << HALF_BITS) - 1
ROUNDS = 4
_PERSON = b"pdd-ucx-tags.v1"


def plain(transfer_id: int) -> int:
    """The transfer id as the tag carries it without keys (``ucx-keys.v1`` not agreed)."""
    return transfer_id


class TagKey:
    """A keyed permutation of the 40 transfer-id bits of a tag (``ucx-keys.v1``), so that a
    process that can reach a UCX worker but is not the peer cannot tell the tags of transfers
    to come (transfer ids count from 1).

    A 4-round Feistel network over two 20-bit halves; round ``r``'s function is a 4-byte BLAKE2b
    (``digest_size=4``) of the half as 3 bytes little-endian, keyed with the 32-byte
    ``blake2b(bytes((direction, r)), key=key as 8 bytes little-endian, person="pdd-ucx-tags.v1",
    digest_size=32)``, read as a little-endian u32 of which the low 20 bits are kept
    (proto/handshake.md "UCX tag keys" says it byte for byte). Tags of
    the direction ``direction`` (:data:`DIR_DIALER` / :data:`DIR_ACCEPTOR`: who allocated the
    transfer id) are keyed with the ``ucx_tag_key`` of the agent that *receives* them. A
    bijection on 0 .. 2^40-1, so distinct transfer ids keep distinct tags; the chunk index bits
    are not touched (all tags of one transfer still share their top 41 bits). A few
    microseconds a transfer id (the data path caches it per transfer), never a cost per byte."""

    __slots__ = ("_rounds", "direction", "key")

    def __init__(self, key: int, direction: int) -> None:
        if not 0 < key < 1 << 64:
            raise ValueError(f"a tag key is 1 .. 2^64-1, got {key!r}")
        if direction not in (0, 1):
            raise ValueError(f"direction must be 0 or 1, got {direction!r}")
        self.key = key
        self.direction = direction
        secret = key.to_bytes(8, "little")
        self._rounds = tuple(
            hashlib.blake2b(key=hashlib.blake2b(bytes((direction, r)), key=secret, digest_size=32,
                                                person=_PERSON).digest(), digest_size=4)
            for r in range(ROUNDS))

    def _f(self, r: int, half: int) -> int:
        h = self._rounds[r].copy()
        h.update(half.to_bytes(3, "little"))
        return int.from_bytes(h.digest(), "little") & _HALF_MASK

    def __call__(self, transfer_id: int) -> int:
        """The transfer id as the tag carries it (a permutation of ``transfer_id``)."""
        if not 0 <= transfer_id <= MAX_TRANSFER_ID:
            raise ValueError(f"transfer id {transfer_id} does not fit in {TRANSFER_ID_BITS} bits")
        left, right = transfer_id >> HALF_BITS, transfer_id & _HALF_MASK
        for r in range(ROUNDS):
            left, right = right, left ^ self._f(r, right)
        return (left << HALF_BITS) | right

    def invert(self, wire_id: int) -> int:
        """The transfer id of a tag's ``wire_id`` (the inverse of calling this key)."""
        if not 0 <= wire_id <= MAX_TRANSFER_ID:
            raise ValueError(f"transfer id {wire_id} does not fit in {TRANSFER_ID_BITS} bits")
        left, right = wire_id >> HALF_BITS, wire_id & _HALF_MASK
        for r in reversed(range(ROUNDS)):
            left, right = right ^ self._f(r, left), left
        return (left << HALF_BITS) | right

    def __repr__(self) -> str:   # never the key
        return f"TagKey(direction={self.direction})"
