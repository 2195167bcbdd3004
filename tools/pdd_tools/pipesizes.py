"""What the size of a bulk system call does on this host: ``python -m pdd_tools.pipesizes``.

Two measurements on the bare pipe (:mod:`~pdd_tools.benchpipe`), one JSON line per run:

* ``writes``: the wake probe (:mod:`~pdd_tools.wakeprobe`: three processes that only wake one
  another, a message every 2 ms) while the pipe streams, for each send size. On a kernel without
  forced preemption (``CONFIG_PREEMPT_NONE``, as here) a process woken on a CPU where another is
  inside a long system call waits for up to the rest of that call; a send of 4 MiB copies 4 MiB,
  and on loopback also runs the receiving side's TCP. This shows how long that wait is, against
  the goodput and sender CPU that smaller sends cost. It bears on the token path's floor under a
  transfer (docs/benchmarks.md, "System call sizes").
* ``reads``: the receiver's CPU per GB and reads per 4 MiB, a uvloop ``BufferedProtocol`` (each
  read takes what the socket holds, Python runs per read) against blocking ``recv_into`` with
  ``MSG_WAITALL`` (the kernel fills 4 MiB before returning), each with and without xxh3.

With the defaults (three rounds) the whole run takes about a minute and a half; the figures are
for reading beside each other, not targets. A p99 of the 1,000-1,250 messages of one run moves a
lot between runs: compare rounds, not single lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics

from pdd_wire.stats import percentile

from .benchpipe import RX_MODES, bare_pipe_split
from .wakeprobe import WakeProbe

MiB = 1 << 20
WRITES = (4 * MiB, 1 * MiB, 512 << 10, 256 << 10)


async def wake_during_pipe(write: int, seconds: float = 3.0, settle_s: float = 0.5) -> dict:
    """The wake probe's p50/p99 while the bare pipe streams for ``seconds`` in ``write``-byte
    sends: the messages sent from ``settle_s`` after the sender's first byte to its last (its own
    clock), so every send size is sampled for the same time."""
    if seconds <= settle_s:
        raise ValueError(f"seconds must be more than {settle_s}, got {seconds}")
    probe = await WakeProbe.start()
    try:
        pipe = await asyncio.to_thread(bare_pipe_split, 64 * MiB, 0, write=write, seconds=seconds)
    finally:
        samples = await probe.stop()
    under = [ms for _, when, ms in samples if pipe["t0"] + settle_s <= when <= pipe["t1"]]
    p50, p99 = percentile(under, 50), percentile(under, 99)
    if len(under) < 100 or p50 is None or p99 is None:
        raise RuntimeError(f"only {len(under)} wake-probe messages while the pipe streamed: the machine is "
                           f"too busy for the probe, or seconds ({seconds}) too short")
    return {"experiment": "writes", "write_bytes": write, "gbps": round(pipe["gbps"], 3),
            "tx_s_per_gb": round(pipe["tx_s_per_gb"], 4), "wake_p50_ms": round(p50, 3),
            "wake_p99_ms": round(p99, 3), "messages": len(under)}


def reads(rx: str, xxh3: bool, seconds: float = 1.5) -> dict:
    """The receiver's CPU per GB and reads per 4 MiB in mode ``rx``, the pipe streaming for ``seconds``."""
    r = bare_pipe_split(64 * MiB, 0, rx=rx, xxh3=xxh3, seconds=seconds)
    return {"experiment": "reads", "rx": rx, "xxh3": xxh3, "gbps": round(r["gbps"], 3),
            "rx_s_per_gb": round(r["rx_s_per_gb"], 4), "rx_reads_per_4MiB": round(r["rx_reads_per_4MiB"], 1)}


async def run(rounds: int, writes: list[int], seconds: float, only: str | None) -> list[dict]:
    out = []

    def emit(fig: dict) -> None:
        out.append(fig)
        print(json.dumps(fig), flush=True)

    for r in range(rounds):
        if only in (None, "writes"):
            for w in writes:
                emit({"round": r, **await wake_during_pipe(w, seconds)})
        if only in (None, "reads"):
            for mode in RX_MODES:
                for xxh3 in (False, True):
                    emit({"round": r, **await asyncio.to_thread(reads, mode, xxh3, seconds / 2)})
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


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated byte counts, got {text!r}") from None
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"sizes must be > 0, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdd_tools.pipesizes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=_positive(int), default=3, help="rounds, each over every configuration (3)")
    ap.add_argument("--writes", type=_sizes, default=list(WRITES),
                    help="send sizes in bytes, comma-separated (4 MiB, 1 MiB, 512 KiB, 256 KiB)")
    ap.add_argument("--seconds", type=_positive(float), default=3.0,
                    help="how long the pipe streams in a 'writes' run (3; half of it in a 'reads' run); "
                         "the probe samples all but the first 0.5 s")
    ap.add_argument("--only", choices=("writes", "reads"), help="one of the two measurements")
    args = ap.parse_args(argv)
    import uvloop

    uvloop.run(run(args.rounds, args.writes, args.seconds, args.only))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
