"""CPU placement of the agent's threads (``[cpus]``: ``main``, ``bulk``), in Linux cpulist syntax.

The main thread carries every token frame, control frame and engine event; the bulk threads
carry the KV bytes (the kernel's copies, xxh3). Under a large transfer the bulk threads keep
their cores busy, and a token then waits for a core behind them (docs/benchmarks.md, "Token
frames under load"). On a node with cores to spare, ``cpus.bulk`` keeps the bulk threads off
the cores of ``cpus.main`` (and of the engines), so a token finds its core free.

Each set is applied with ``sched_setaffinity`` to one thread (on Linux a thread's own mask):
``main`` by the event loop's thread when the agent starts (threads it starts later, such as the
memory registration workers, inherit it), ``bulk`` by each bulk thread as it starts. A set must
lie within the CPUs the process was started on (``taskset``, systemd's ``CPUAffinity=``, a
cgroup's cpuset): :func:`check_allowed` says which do not.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from .errors import ConfigError

#: The highest CPU number a set may name (the kernel's NR_CPUS on big x86 builds is 8192).
MAX_CPU = 8191

#: The CPUs the process may use, as it was started (taskset, CPUAffinity=, the cpuset): taken
#: when this module is first imported, before any thread is placed (an agent placed on the same
#: thread earlier does not narrow what a second one may name).
_STARTED_ON = frozenset(os.sched_getaffinity(0))


def parse_cpus(text: str, key: str) -> frozenset[int]:
    """``"0-3,8,10-11"`` (the syntax of ``taskset -c`` and ``/sys/devices/system/cpu/online``) as
    a set of CPU numbers; ``""``: the empty set (no placement). :class:`ConfigError` on ``key``
    names what is wrong."""
    out: set[int] = set()
    text = text.strip()
    if not text:
        return frozenset()
    for part in text.split(","):
        part = part.strip()
        lo_s, dash, hi_s = part.partition("-")
        try:
            lo = int(lo_s, 10)
            hi = int(hi_s, 10) if dash else lo
        except ValueError:
            raise ConfigError(key, f"{part!r} is not a CPU number or a range such as 2-5 "
                                   f"(a list like \"0-3,8\")") from None
        if lo < 0 or hi < 0 or lo_s.strip() != lo_s or hi_s.strip() != hi_s:
            raise ConfigError(key, f"{part!r} is not a CPU number or a range such as 2-5")
        if hi < lo:
            raise ConfigError(key, f"range {part!r} ends before it starts")
        if hi > MAX_CPU:
            raise ConfigError(key, f"CPU {hi} is beyond {MAX_CPU}")
        out.update(range(lo, hi + 1))
    return frozenset(out)


def format_cpus(cpus: Iterable[int]) -> str:
    """The cpulist of ``cpus``, ranges folded: ``{0, 1, 2, 8}`` -> ``"0-2,8"``."""
    parts: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [c]
    if run:
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(parts)


def check_allowed(cpus: frozenset[int], key: str) -> None:
    """:class:`ConfigError` on ``key`` when ``cpus`` names a CPU this process may not run on
    (:func:`allowed`)."""
    if not cpus:
        return
    allowed = _STARTED_ON
    outside = cpus - allowed
    if outside:
        which = f"CPU {format_cpus(outside)} is" if len(outside) == 1 else f"CPUs {format_cpus(outside)} are"
        raise ConfigError(key, f"{which} not among the CPUs this process may use ({format_cpus(allowed)}: "
                               f"see taskset, systemd's CPUAffinity= or the cgroup's cpuset)")


def allowed() -> frozenset[int]:
    """The CPUs the process was started on, which a set may name."""
    return _STARTED_ON


def pin_this_thread(cpus: frozenset[int]) -> frozenset[int]:
    """Run the calling thread on ``cpus`` (nothing for the empty set); the thread's CPUs before."""
    before = frozenset(os.sched_getaffinity(0))
    if cpus:
        os.sched_setaffinity(0, cpus)
    return before


def this_thread() -> frozenset[int]:
    """The CPUs the calling thread may run on now."""
    return frozenset(os.sched_getaffinity(0))
