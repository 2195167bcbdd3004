"""Chained block hashes: how an engine names the KV blocks of a prefix (``send_kv(block_hashes=...)``,
``kv_stored``) so that the agents' prefix inventory can match them across engines."""

from __future__ import annotations

import xxhash

MASK = (1 << 64) - 1


def chain_hashes(tokens: list[int], block_tokens: int, *, model: str = "", parent: int = 0) -> list[int]:
    """Chained 64-bit hashes of the full blocks of ``tokens``: block ``i``'s hash covers its
    tokens and block ``i-1``'s hash (``parent`` for the first), salted by ``model`` and the block
    size. A trailing partial block gets no hash (it is never shared)."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be > 0")
    out = []
    h = parent
    salt = f"{model}/{block_tokens}".encode()
    for i in range(0, len(tokens) - block_tokens + 1, block_tokens):
        x = xxhash.xxh3_64(salt)
        x.update(h.to_bytes(8, "little"))
        x.update(b"".join(t.to_bytes(4, "little") for t in tokens[i:i + block_tokens]))
        h = x.intdigest()
        out.append(h)
    return out


def layer_hashes(chain: list[int], layers: int) -> list[int]:
    """One hash per agent block when a KV block is cut into one agent block per layer (vLLM's
    connector does): block ``i``'s layer ``l`` gets a hash of (``chain[i]``, ``l``), in the byte
    stream's order (block by block, each block's layers). ``layers=1`` names each block by its
    layer 0, which is how a router asks for a prompt's blocks."""
    return [xxhash.xxh3_64_intdigest(h.to_bytes(8, "little") + layer.to_bytes(4, "little"))
            for h in chain for layer in range(layers)]
