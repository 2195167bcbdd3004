"""One side of a two-process UCX test: ``python ucx_peer.py <scenario> <role>``.

Talks to the test over stdin/stdout, one ``@@``-prefixed line per message (UCX may log to
stdout too): it prints ``@@ADDR <hex>`` (its worker address), reads the peer's the same way,
runs the scenario and prints ``@@RESULT <json>``; then waits for ``@@BYE``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys

import xxhash

from pdd_wire.memory import SharedMemory
from pdd_wire.transport import ucx

BULK = 64 << 20


def say(line: str) -> None:
    sys.stdout.write("@@" + line + "\n")
    sys.stdout.flush()


def hear() -> str:
    while True:
        line = sys.stdin.readline()
        if not line:
            raise SystemExit("test went away")
        if line.startswith("@@"):
            return line[2:].strip()


def pattern(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def ooo_sizes() -> dict[int, int]:
    """tag -> size: eager (< 8 KiB) and rendezvous messages, 48 of them."""
    rnd = random.Random(5)
    return {ucx.tag_for(ucx.DIR_DIALER, 7, i): rnd.choice([1, 64, 5000, 9000, 200_000, 1 << 20])
            for i in range(48)}


async def bulk(peer: ucx.UcxPeer, role: str) -> dict:
    mem = SharedMemory(BULK)
    tag = ucx.tag_for(ucx.DIR_ACCEPTOR, 123456789, 42)
    try:
        if role == "send":
            mem.buf[:] = pattern(1, BULK)
            await peer.send(tag, mem.buf)
            return {"xxh3": xxhash.xxh3_128_hexdigest(mem.buf)}
        recv = asyncio.ensure_future(peer.recv(tag, mem.buf))
        await peer.send(1, b"go")  # the sender starts once our receive is posted
        await recv
        return {"xxh3": xxhash.xxh3_128_hexdigest(mem.buf), "intact": bytes(mem.buf) == pattern(1, BULK)}
    finally:
        mem.close()


async def ooo(peer: ucx.UcxPeer, role: str) -> dict:
    sizes = ooo_sizes()
    tags = list(sizes)
    if role == "send":
        go = bytearray(2)
        await peer.recv(1, go)
        random.Random(11).shuffle(tags)
        sends = [asyncio.ensure_future(peer.send(t, pattern(t & 0xFFFF, sizes[t]))) for t in tags]
        await asyncio.gather(*sends)
        return {"sent": len(sends)}
    random.Random(12).shuffle(tags)
    early, late = tags[:24], tags[24:]
    bufs = {t: bytearray(sizes[t]) for t in tags}
    recvs = [asyncio.ensure_future(peer.recv(t, bufs[t])) for t in early]
    await peer.send(1, b"go")
    # the other half arrives before anyone asks for it: wait until it all sits unclaimed
    for _ in range(100_000):
        if peer.pending()["unclaimed"] == len(late):
            break
        await asyncio.sleep(0.001)
    unclaimed = peer.pending()["unclaimed"]
    recvs += [asyncio.ensure_future(peer.recv(t, bufs[t])) for t in reversed(late)]
    await asyncio.gather(*recvs)
    wrong = [hex(t) for t in tags if bytes(bufs[t]) != pattern(t & 0xFFFF, sizes[t])]
    return {"unclaimed_before_post": unclaimed, "wrong": wrong, "received": len(recvs)}


def main() -> None:
    scenario, role = sys.argv[1], sys.argv[2]
    loop = ucx.acquire_loop()
    peer = ucx.UcxPeer(loop, role)
    say("ADDR " + peer.local_address().hex())
    remote = bytes.fromhex(hear().split()[1])

    async def run() -> dict:
        await peer.connect(remote)
        if scenario == "idle":   # connected, doing nothing: the test kills us
            return {}
        if scenario == "bulk":
            if role == "send":
                await peer.recv(1, bytearray(2))
            return await bulk(peer, role)
        return await ooo(peer, role)

    result = loop.submit(run()).result(120)
    say("RESULT " + json.dumps(result))
    hear()
    peer.close()
    ucx.release_loop(loop)


if __name__ == "__main__":
    main()
