"""One peer's burst of small frames against another peer's round trips through the same agent
(``scripts/bench --only flood``).

An agent (site B, a ``pdd-wired`` subprocess, plaintext WAN on loopback) has two peers, both
written here from proto/ alone: a well-behaved one (A/a1, in this process) that sends a PING every
2 ms on a fixed schedule (answered or not: no coordinated omission) and times each PONG, and a
flooding one (C/c1, a subprocess of its own, as another machine would be) that writes bursts of
10,000 PINGs every 0.5 s (20,000 frames a second, about 1.2 MB/s) and reads its PONGs. The
figure is the well-behaved peer's round-trip p99 while the flood runs, against its idle p99
measured just before in the same run:

* ``peer_rtt_p99_beside_a_flood`` (ms; ratio = flooded p99 / idle p99);
* ``peer_rtt_p99_beside_costly_frames``: the same, the other peer writing bursts of 16 TOKENS
  frames of 200,000 token IDs each (a few ms of the agent's work a frame) every 0.5 s.

The agent handles at most ``transport.tcp.FRAMES_PER_TURN`` frames of one control connection per
loop turn, and none past ``TURN_BUDGET_S`` of their handling (the rest of a 64 KiB read waits for
the next turn): a burst costs the other peer a slice, not the whole burst. The note gives the
agent's CPU during the flood (what the flood costs it) and the PONGs the flooder got (every PING
of it is answered).

    python -m pdd_tools.bench_flood [--json] [--seconds 5] [--kind pings|tokens]
    python -m pdd_tools.bench_flood --flood PORT --seconds S [--kind ...]   # the flooding peer alone
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdd_wire.stats import percentile
from pdd_wire.transport.tcp import FRAMES_PER_TURN, KIND_CONTROL, TURN_BUDGET_S, preamble
from pdd_wire.wire import FrameReader, FrameType, Lane, decode_body, encode_body, encode_bytes
from pdd_wire.wire import messages as m

from .harness import free_port

BURST = 10_000  # PINGs in one write
BURST_EVERY_S = 0.5
COSTLY_BURST, COSTLY_TOKENS = 16, 200_000  # TOKENS frames in one write, token IDs in each
FIGURE = {"pings": "peer_rtt_p99_beside_a_flood", "tokens": "peer_rtt_p99_beside_costly_frames"}
PING_EVERY_S = 0.002


class Peer:
    """A peer written from proto/ alone: preamble, HELLO, then frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.frames = FrameReader(max_body=1 << 20)
        self.pending: list = []

    @classmethod
    async def hello(cls, port: int, site: str, node: str) -> "Peer":
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(preamble(KIND_CONTROL))
        p = cls(r, w)
        p.send(FrameType.HELLO, m.Hello(versions=[1], site=site, node=node, incarnation=int(time.time()),
                                        capabilities=["kv.v1", "tokens.v1"]))
        t, _ = await p.next()
        if t != FrameType.WELCOME:
            raise RuntimeError(f"the agent answered HELLO with {FrameType(t).name}")
        return p

    def send(self, ftype: int, body) -> None:
        self.writer.write(encode_bytes(ftype, encode_body(body)))

    async def next(self):
        while not self.pending:
            data = await self.reader.read(1 << 16)
            if not data:
                raise ConnectionError("the agent closed the connection")
            self.pending += self.frames.feed(data)
        f = self.pending.pop(0)
        return f.header.type, decode_body(f.header.type, f.body)


def _burst(kind: str, i: int) -> tuple[bytes, int]:
    """The ``i``-th burst's bytes, and its frames."""
    if kind == "pings":
        return encode_bytes(FrameType.PING, encode_body(m.Ping(nonce=7, sent_ns=1))) * BURST, BURST
    first = i * COSTLY_BURST * COSTLY_TOKENS  # one stream, in order: each frame is delivered (no owner: dropped)
    return b"".join(encode_bytes(FrameType.TOKENS, encode_body(m.Tokens("flood", first + j * COSTLY_TOKENS,
                                                                         [7] * COSTLY_TOKENS)), lane=Lane.TOKEN)
                    for j in range(COSTLY_BURST)), COSTLY_BURST


async def flood(port: int, seconds: float, kind: str = "pings") -> None:
    """The flooding peer (its own process): bursts of frames, then a PING; prints what it sent and got back."""
    peer = await Peer.hello(port, "C", "c1")
    pongs = 0

    async def count() -> None:
        nonlocal pongs
        while True:
            t, _ = await peer.next()
            pongs += t == (FrameType.PONG if kind == "pings" else FrameType.TOKENS_ACK)

    counting = asyncio.create_task(count())
    print("flooding", flush=True)
    sent, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        burst, n = _burst(kind, sent)
        peer.writer.write(burst)
        sent += n
        await peer.writer.drain()
        await asyncio.sleep(BURST_EVERY_S)
    took = time.monotonic() - t0  # the flood's own time (each burst and its pause), not the wait below
    await asyncio.sleep(1.0)  # the last PONGs
    counting.cancel()
    print(json.dumps({"sent": sent, "pongs": pongs, "seconds": round(took, 3)}), flush=True)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _rtts(peer: Peer, seconds: float, first: int) -> list[float]:
    """Round trips (ms) of PINGs sent every PING_EVERY_S on a fixed schedule, whether or not the
    last one was answered: a stall of the agent delays every PING due during it, as it delays
    every token frame, where a PING sent only after the last PONG would count it once."""
    sent: dict[int, float] = {}
    out: list[float] = []

    async def read() -> None:
        while True:
            t, body = await peer.next()
            if t == FrameType.PONG and (at := sent.pop(body.nonce, None)) is not None:
                out.append((time.perf_counter() - at) * 1e3)

    reading = asyncio.create_task(read())
    t0 = time.perf_counter()
    nonce = first
    try:
        while (now := time.perf_counter()) - t0 < seconds:
            due = t0 + (nonce - first) * PING_EVERY_S
            if now < due:
                await asyncio.sleep(due - now)
            sent[nonce] = time.perf_counter()
            peer.send(FrameType.PING, m.Ping(nonce=nonce, sent_ns=1))
            nonce += 1
        async with asyncio.timeout(5):
            while sent:
                await asyncio.sleep(0.01)
    finally:
        reading.cancel()
    return out


async def measure(seconds: float = 5.0, kind: str = "pings") -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="pdd-flood-"))
    port, admin = free_port(), free_port()
    unused = [free_port(), free_port()]  # the agent dials its peers there in vain: they dial it
    (tmp / "B.toml").write_text(
        f'site = "B"\nnode = "b1"\n[listen]\nwan = "127.0.0.1:{port}"\nadmin = "127.0.0.1:{admin}"\n'
        f'engine_socket = "{tmp}/B.sock"\n'
        f'[[peers]]\nsite = "A"\nnode = "a1"\naddress = "127.0.0.1:{unused[0]}"\nstreams = 1\n'
        f'[[peers]]\nsite = "C"\nnode = "c1"\naddress = "127.0.0.1:{unused[1]}"\nstreams = 1\n'
        '[tls]\nallow_plaintext = true\n[log]\nformat = "json"\n')
    with open(tmp / "agent.log", "wb") as log:
        agent = subprocess.Popen([sys.executable, "-m", "pdd_wire", "--site", "B", "--config", str(tmp / "B.toml")],
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    flooder = None
    try:
        async with asyncio.timeout(20):
            while True:
                try:
                    peer = await Peer.hello(port, "A", "a1")
                    break
                except OSError:
                    if agent.poll() is not None:
                        raise RuntimeError(f"the agent exited; see {tmp}/agent.log") from None
                    await asyncio.sleep(0.1)
        await _rtts(peer, 0.5, 1)  # warm up
        idle = await _rtts(peer, seconds / 2, 10_000)
        flooder = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pdd_tools.bench_flood", "--flood", str(port), "--seconds", str(seconds),
            "--kind", kind, stdout=asyncio.subprocess.PIPE)
        assert flooder.stdout is not None
        await asyncio.wait_for(flooder.stdout.readline(), 20)  # "flooding"
        await asyncio.sleep(0.2)
        cpu0, t0 = _cpu_s(agent.pid), time.monotonic()
        flooded = await _rtts(peer, seconds - 0.5, 100_000)
        cores = (_cpu_s(agent.pid) - cpu0) / (time.monotonic() - t0)
        tail = json.loads(await asyncio.wait_for(flooder.stdout.readline(), seconds + 20))
        await flooder.wait()
        peer.writer.close()
    finally:
        if flooder is not None and flooder.returncode is None:
            flooder.kill()
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    p99, idle_p99 = percentile(flooded, 99) or 0.0, percentile(idle, 99) or 0.0
    what, answers = ((f"{BURST} PINGs", "PONGs") if kind == "pings" else
                     (f"{COSTLY_BURST} TOKENS frames of {COSTLY_TOKENS} token IDs", "TOKENS_ACKs"))
    return {"figure": FIGURE[kind], "value": round(p99, 3), "unit": "ms",
            "baseline": "the same peer's idle p99, same run", "baseline_value": round(idle_p99, 3),
            "note": f"another peer writes {what} every {BURST_EVERY_S} s ({tail['sent']} sent, "
                    f"{tail['pongs']} {answers} back); {len(flooded)} round trips flooded, p50 "
                    f"{percentile(flooded, 50) or 0:.2f} ms, max {max(flooded):.2f}; {len(idle)} idle, p50 "
                    f"{percentile(idle, 50) or 0:.2f} ms; agent CPU during the flood {cores:.2f} cores "
                    f"({cores / (tail['sent'] / tail['seconds']) * 1e6:.1f} us per flood frame); "
                    f"FRAMES_PER_TURN {FRAMES_PER_TURN}, TURN_BUDGET_S {TURN_BUDGET_S}; load average "
                    f"{os.getloadavg()[0]:.1f}"}


async def add_figures(figs, quick: bool) -> None:
    """``scripts/bench --only flood``."""
    for kind in FIGURE:
        row = await measure(3.0 if quick else 6.0, kind)
        figs.add(row["figure"], row["value"], row["unit"], row["baseline"], row["baseline_value"], note=row["note"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--flood", type=int, metavar="PORT", help="be the flooding peer of the agent at PORT")
    ap.add_argument("--kind", choices=sorted(FIGURE), default="pings", help="what the flooding peer writes")
    args = ap.parse_args(argv)
    if args.flood:
        asyncio.run(flood(args.flood, args.seconds, args.kind))
        return 0
    row = asyncio.run(measure(args.seconds, args.kind))
    if args.json:
        print(json.dumps(row))
    else:
        print(f"{row['figure']:30} {row['value']:>8} {row['unit']:3} (baseline {row['baseline_value']} ms, ratio "
              f"{row['value'] / row['baseline_value']:.2f}) {row['note']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
