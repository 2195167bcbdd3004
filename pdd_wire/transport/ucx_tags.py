"""UCX tags: 64 bits = direction (1) | transfer id (40) | index (23); see :func:`tag_for`."""

from __future__ import annotations

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
    ever meet in one matching space. Bits 62..23 are the transfer id, bits 22..0 the index.
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
