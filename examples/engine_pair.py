"""Two engines and their agents: a prefill engine on site A sends a request's KV and its first
tokens to a decode engine on site B, which checks every byte that landed.

Run two agents, then this (the embedded default needs no config file):

    pdd-wired --site A &
    pdd-wired --site B &
    python examples/engine_pair.py

It finds the engine sockets the way the daemons put them (``default_engine_socket``);
``--socket-a``/``--socket-b`` name others (``listen.engine_socket`` in an agent's config).
Exit status 0 when the KV and the tokens arrived intact.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from pdd_wire import EngineClient, SharedMemory
from pdd_wire.config import default_engine_socket
from pdd_wire.engine import protocol as p
from pdd_wire.engine.client import OUTCOMES

BLOCK = 1 << 20  # bytes per KV block
BLOCKS = 16  # blocks of KV the request has
TOKENS = [101, 7592, 2088]  # e.g. the relay decoder's first tokens


async def prefill(socket: str, request_id: str, to: str, posted: asyncio.Event) -> bytes:
    """Site A: register a KV pool, fill the request's blocks, send them and the tokens to ``to``."""
    async with EngineClient(socket, "prefill-0") as eng:
        with SharedMemory(64 * BLOCK) as pool:  # the KV pool, shared with the agent by fd
            kv = await eng.register(pool, block_bytes=BLOCK)
            kv_bytes = os.urandom(BLOCKS * BLOCK)  # what a prefill step would have computed
            pool.buf[:len(kv_bytes)] = kv_bytes
            await posted.wait()  # not required: KV that arrives first waits transfer.unposted_wait_s
            await eng.send_kv(request_id, [kv.blocks(0, BLOCKS)], to=[to], deadline_s=30)
            await eng.send_tokens(request_id, to, TOKENS)
            ev = await eng.wait(request_id, timeout=60)
            if not isinstance(ev, p.KvSent):
                raise SystemExit(f"prefill: the send failed: {ev}")
            print(f"prefill (site {eng.agent['site']}): sent {ev.bytes} bytes to {ev.peer} in {ev.seconds:.3f} s")
            return kv_bytes


async def decode(socket: str, request_id: str, from_site: str, posted: asyncio.Event) -> tuple[bytes, list[int]]:
    """Site B: post where the request's KV may land, then wait for it and for the tokens."""
    async with EngineClient(socket, "decode-0") as eng:
        with SharedMemory(64 * BLOCK) as pool:
            kv = await eng.register(pool, block_bytes=BLOCK)
            await eng.post_recv(request_id, [kv.blocks(32, BLOCKS)], from_site=from_site)
            posted.set()
            ev = await eng.wait(request_id, kinds=OUTCOMES, timeout=60)  # a peer's abort ends a post too
            if not isinstance(ev, p.KvReceived):
                raise SystemExit(f"decode: the receive failed: {ev}")
            toks = await eng.wait_tokens(request_id, timeout=60)
            print(f"decode (site {eng.agent['site']}): {ev.bytes} bytes in blocks 32..{32 + BLOCKS - 1}, "
                  f"tokens {toks.tokens}")
            return bytes(pool.buf[32 * BLOCK:(32 + BLOCKS) * BLOCK]), toks.tokens


async def run(socket_a: str, socket_b: str, site_a: str, site_b: str) -> int:
    posted = asyncio.Event()
    request_id = f"req-{os.getpid()}"
    sent, (landed, tokens) = await asyncio.gather(prefill(socket_a, request_id, site_b, posted),
                                                  decode(socket_b, request_id, site_a, posted))
    ok = sent == landed and tokens == TOKENS
    print("every byte and token arrived intact" if ok else "MISMATCH: the KV or the tokens differ")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket-a", default=default_engine_socket("A"), help="site A's engine socket")
    ap.add_argument("--socket-b", default=default_engine_socket("B"), help="site B's engine socket")
    ap.add_argument("--site-a", default="A")
    ap.add_argument("--site-b", default="B")
    args = ap.parse_args(argv)
    return asyncio.run(run(args.socket_a, args.socket_b, args.site_a, args.site_b))


if __name__ == "__main__":
    sys.exit(main())
