"""The simulated model: :func:`token_at` plays it (every engine that decodes request ``r``
produces the same token at position ``i``, as greedy decoding of one model does), so a test can
check the stream a user would see (:func:`check_stream`)."""

from __future__ import annotations

import hashlib


def token_at(request_id: str, position: int, vocab: int = 32000) -> int:
    """The token a (simulated, greedy) model produces for ``request_id`` at ``position``."""
    h = hashlib.blake2b(f"{request_id}:{position}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") % vocab


def check_stream(request_id: str, n_tokens: int, *sides: dict[int, int]) -> None:
    """The ownership invariant over what the engines emitted: every position 0..n-1 emitted by
    exactly one side, with the model's token, and each side's positions contiguous."""
    seen: dict[int, int] = {}
    for side in sides:
        for pos, tok in side.items():
            if pos in seen:
                raise AssertionError(f"{request_id}: position {pos} emitted twice")
            seen[pos] = tok
        if side and sorted(side) != list(range(min(side), max(side) + 1)):
            raise AssertionError(f"{request_id}: one side's positions have a gap: {sorted(side)}")
    missing = [i for i in range(n_tokens) if i not in seen]
    if missing:
        raise AssertionError(f"{request_id}: positions never emitted: {missing[:10]} ({len(missing)})")
    extra = [i for i in seen if i >= n_tokens]
    if extra:
        raise AssertionError(f"{request_id}: positions past the end emitted: {extra[:10]}")
    wrong = [i for i in range(n_tokens) if seen[i] != token_at(request_id, i)]
    if wrong:
        raise AssertionError(f"{request_id}: wrong tokens at {wrong[:10]}")
