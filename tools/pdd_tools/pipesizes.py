"""What the size of a bulk system call does on this host: ``python -m pdd_tools.pipesizes``.

Two measurements on the bare pipe (:mod:`~pdd_tools.benchpipe`), one JSON line per run:

* ``writes``: the wake probe (:mod:`~pdd_tools.wakeprobe`: three processes that only wake one
  another, a message every 2 ms) while the pipe streams, for each send size. A process woken on
  a CPU where another is inside a long system call (a send of 4 MiB copies 4 MiB, and on loopback
  also runs the receiving side's TCP) waits for that call to end on a kernel without forced
  preemption (``CONFIG_PREEMPT_NONE``, as here): this shows how long, against the goodput and
  sender CPU that smaller sends cost. It bears on the token path's floor under a transfer
  (docs/benchmarks.md, "System call sizes").
* ``reads``: the receiver's CPU per GB and reads per 4 MiB, a uvloop ``BufferedProtocol`` (each
  read takes what the socket holds, Python runs per read) against blocking ``recv_into`` with
  ``MSG_WAITALL`` (the kernel fills 4 MiB before returning), each with and without xxh3.

Both take about a minute with the defaults; the figures are for reading beside each other, not
targets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from pdd_wire.stats import percentile

from .benchpipe import RX_MODES, bare_pipe_split
from .wakeprobe import WakeProbe

MiB = 1 << 20
WRITES = (4 * MiB, 1 * MiB, 512 << 10, 256 << 10)


async def wake_during_pipe(write: int, gb: float = 8.0, settle_s: float = 0.8) -> dict:
    """The wake probe's p50/p99 during one bare-pipe run of about ``gb`` GB in ``write``-byte
    sends (messages sent from ``settle_s`` after the pipe starts until it ends)."""
    reps = max(1, int(gb * 1e9 / (64 * MiB)))
    job = asyncio.ensure_future(asyncio.to_thread(bare_pipe_split, 64 * MiB, reps, write=write))
    job.add_done_callback(lambda _: ended.append(time.perf_counter()))
    ended: list[float] = []
    await asyncio.sleep(settle_s)  # both processes started, filled their regions and streaming
    if job.done():
        raise RuntimeError(f"the pipe ended within {settle_s} s: make gb larger")
    t0 = time.perf_counter()
    probe = await WakeProbe.start()
    try:
        pipe = await job
    finally:
        samples = await probe.stop()
    under = [ms for _, when, ms in samples if t0 <= when <= ended[0]]
    p50, p99 = percentile(under, 50), percentile(under, 99)
    if len(under) < 100 or p50 is None or p99 is None:
        raise RuntimeError(f"only {len(under)} wake-probe messages during the pipe: make gb larger")
    return {"experiment": "writes", "write_bytes": write, "gbps": round(pipe["gbps"], 3),
            "tx_s_per_gb": round(pipe["tx_s_per_gb"], 4), "wake_p50_ms": round(p50, 3),
            "wake_p99_ms": round(p99, 3), "messages": len(under)}


def reads(rx: str, xxh3: bool, gb: float = 4.0) -> dict:
    reps = max(1, int(gb * 1e9 / (64 * MiB)))
    r = bare_pipe_split(64 * MiB, reps, rx=rx, xxh3=xxh3)
    return {"experiment": "reads", "rx": rx, "xxh3": xxh3, "gbps": round(r["gbps"], 3),
            "rx_s_per_gb": round(r["rx_s_per_gb"], 4), "rx_reads_per_4MiB": round(r["rx_reads_per_4MiB"], 1)}


async def run(rounds: int, writes: list[int], gb: float, only: str | None) -> list[dict]:
    out = []

    def emit(fig: dict) -> None:
        out.append(fig)
        print(json.dumps(fig), flush=True)

    for r in range(rounds):
        if only in (None, "writes"):
            for w in writes:
                emit({"round": r, **await wake_during_pipe(w, gb)})
        if only in (None, "reads"):
            for mode in RX_MODES:
                for xxh3 in (False, True):
                    emit({"round": r, **await asyncio.to_thread(reads, mode, xxh3, gb / 2)})
    if rounds > 1:
        for fig in _medians(out):
            print(json.dumps(fig), flush=True)
    return out


def _medians(figs: list[dict]) -> list[dict]:
    """One line per configuration: the median of each number over the rounds."""
    keys = {"writes": ("write_bytes",), "reads": ("rx", "xxh3")}
    groups: dict[tuple, list[dict]] = {}
    for f in figs:
        groups.setdefault((f["experiment"], *(f[k] for k in keys[f["experiment"]])), []).append(f)
    med = []
    for (exp, *conf), fs in groups.items():
        nums = {k: round(statistics.median(f[k] for f in fs), 4) for k, v in fs[0].items()
                if isinstance(v, float)}
        med.append({"experiment": exp, "median_of": len(fs), **dict(zip(keys[exp], conf)), **nums})
    return med


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdd_tools.pipesizes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each over every configuration (3)")
    ap.add_argument("--writes", default=",".join(map(str, WRITES)),
                    help="send sizes in bytes, comma-separated (4 MiB, 1 MiB, 512 KiB, 256 KiB)")
    ap.add_argument("--gb", type=float, default=8.0, help="GB a pipe run moves in 'writes' (half that in 'reads')")
    ap.add_argument("--only", choices=("writes", "reads"), help="one of the two measurements")
    args = ap.parse_args(argv)
    import uvloop

    uvloop.run(run(args.rounds, [int(w) for w in args.writes.split(",")], args.gb, args.only))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
