"""A real engine process for tests: connects to an agent with EngineClient, registers memory,
posts a spare receive, starts sending or receiving one request's KV, prints "started", then
sleeps until it is killed.

    python engine_proc.py --socket A.sock --role send --request r --size N --block B --to B --seed 7
    python engine_proc.py --socket B.sock --role recv --request r --size N --block B --fd 5

``--fd``: register that (inherited, mappable) fd instead of fresh memory, so the test can watch
the pages. ``--seed``: fresh memory is filled with ``random.Random(seed).randbytes(size)``.
"""

from __future__ import annotations

import argparse
import asyncio
import random

from pdd_wire import EngineClient, SharedMemory


async def main(a: argparse.Namespace) -> None:
    async with EngineClient(a.socket, a.name) as eng:
        if a.fd is not None:
            region = await eng.register(a.fd, block_bytes=a.block, size=a.size)
        else:
            mem = SharedMemory(a.size)
            mem.buf[:] = random.Random(a.seed).randbytes(a.size)
            region = await eng.register(mem, block_bytes=a.block)
        if a.spare:
            await eng.post_recv(a.spare, [region.blocks(0, 1)])
        blocks = [region.blocks(0, region.n_blocks)]
        if a.role == "send":
            await eng.send_kv(a.request, blocks, to=[a.to])
        else:
            await eng.post_recv(a.request, blocks)
        print("started", flush=True)
        await asyncio.sleep(3600)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--name", default="doomed")
    ap.add_argument("--role", choices=("send", "recv"), required=True)
    ap.add_argument("--request", required=True)
    ap.add_argument("--spare", default="")
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--block", type=int, required=True)
    ap.add_argument("--to", default="B")
    ap.add_argument("--fd", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    asyncio.run(main(ap.parse_args()))
