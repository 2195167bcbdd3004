"""CPU placement of the agent's threads (``[cpus]``: ``main``, ``bulk``), in Linux cpulist syntax.

The main thread carries every token frame, control frame and engine event; the bulk threads
carry the KV bytes (the kernel's copies, xxh3). Under a large transfer the bulk threads keep
their cores busy, and a token then waits for a core behind them (docs/benchmarks.md, "CPU
placement"). On a node with cores to spare, ``cpus.bulk`` keeps the bulk threads off the cores
of ``cpus.main`` (and of the engines), so a token finds its core free.

Each set is applied with ``sched_setaffinity`` to one thread (on Linux a thread's own mask):
``main`` by the event loop's thread when the agent starts (:func:`pin_main`), ``bulk`` by each
bulk thread as it starts. Threads the agent starts for other KV work (memory registration's
page-in, the agent's executor for the UCX path's staging copies) run on the bulk set, or on the
CPUs the process was started on when there is none, not on ``main``. A set must lie within the CPUs
the process was started on (``taskset``, systemd's ``CPUAffinity=``, a cgroup's cpuset):
:func:`check_allowed` says which do not.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterable

from .errors import ConfigError

#: The highest CPU number a set may name (the kernel's NR_CPUS on big x86 builds is 8192).
MAX_CPU = 8191
#: The longest cpulist accepted (a list of every CPU of a big machine, one by one, is shorter).
MAX_TEXT = 4096

_PART = re.compile(r"([0-9]+)(?:-([0-9]+))?", re.ASCII)

#: The CPUs the process may use, as it was started (taskset, CPUAffinity=, the cpuset): taken
#: when this module is first imported, before any thread is placed.
_STARTED_ON = frozenset(os.sched_getaffinity(0))

# The calling thread's pin_main record: [mask before, the set, agents holding it]. Thread-local:
# it ends with its thread (a thread id is reused once its thread has ended).
_local = threading.local()


def parse_cpus(text: str, key: str) -> frozenset[int]:
    """``"0-3,8,10-11"`` (the syntax of ``taskset -c`` and ``/sys/devices/system/cpu/online``) as
    a set of CPU numbers; ``""``: the empty set (no placement). :class:`ConfigError` on ``key``
    names what is wrong."""
    if len(text) > MAX_TEXT:
        raise ConfigError(key, f"{len(text)} characters: a cpulist is at most {MAX_TEXT}")
    text = text.strip()
    if not text:
        return frozenset()
    mask = 0
    for part in text.split(","):
        m = _PART.fullmatch(part.strip())
        if m is None:
            raise ConfigError(key, f"{part.strip()!r} is not a CPU number or a range such as 2-5 "
                                   f"(a list like \"0-3,8\")")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ConfigError(key, f"range {part.strip()!r} ends before it starts")
        if hi > MAX_CPU:
            raise ConfigError(key, f"CPU {hi} is beyond {MAX_CPU}")
        mask |= ((1 << (hi - lo + 1)) - 1) << lo
    return frozenset(i for i in range(mask.bit_length()) if mask >> i & 1)


def format_cpus(cpus: Iterable[int]) -> str:
    """The cpulist of ``cpus``, ranges folded: ``{0, 1, 2, 8}`` -> ``"0-2,8"``."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive CPUs
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def allowed() -> frozenset[int]:
    """The CPUs the process was started on, which a set may name."""
    return _STARTED_ON


def check_allowed(cpus: frozenset[int], key: str) -> None:
    """:class:`ConfigError` on ``key`` when ``cpus`` names a CPU this process may not run on
    (:func:`allowed`)."""
    outside = cpus - _STARTED_ON
    if outside:
        which = f"CPU {format_cpus(outside)} is" if len(outside) == 1 else f"CPUs {format_cpus(outside)} are"
        raise ConfigError(key, f"{which} not among the CPUs this process may use ({format_cpus(_STARTED_ON)}: "
                               f"see taskset, systemd's CPUAffinity= or the cgroup's cpuset)")


def pin_quietly(cpus: frozenset[int]) -> None:
    """Run the calling worker thread on ``cpus`` (nothing for the empty set). Its work must not
    fail for its placement: if the kernel refuses (a CPU gone offline), it runs where it was."""
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)


def this_thread() -> frozenset[int]:
    """The CPUs the calling thread may run on now."""
    return frozenset(os.sched_getaffinity(0))


def pin_main(cpus: frozenset[int], key: str) -> None:
    """Place the calling thread (an agent's event loop) on ``cpus``. Agents that share a thread
    (run in-process, as the tests do) must agree on it; the thread gets its CPUs back when the
    last of them calls :func:`unpin_main`. :class:`ConfigError` on ``key`` otherwise, or when the
    kernel refuses the set."""
    rec = getattr(_local, "pin", None)
    if rec is not None:
        if rec[1] != cpus:
            raise ConfigError(key, f"another agent of this thread runs it on CPUs {format_cpus(rec[1])}: "
                                   "agents sharing a thread share its placement")
        rec[2] += 1
        return
    before = this_thread()
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        raise ConfigError(key, f"the event loop cannot run on CPUs {format_cpus(cpus)}: {exc.strerror}") from None
    _local.pin = [before, cpus, 1]


def unpin_main() -> None:
    """One agent of the calling thread is done with :func:`pin_main`'s placement; the last one
    gives the thread the CPUs it had before the first. Called from the thread pin_main placed."""
    rec = getattr(_local, "pin", None)
    if rec is None:
        return
    rec[2] -= 1
    if rec[2] > 0:
        return
    _local.pin = None
    try:
        os.sched_setaffinity(0, rec[0])
    except OSError:  # a CPU it had went offline meanwhile: it keeps the agent's set
        pass


def pinned_here() -> bool:
    """Whether an agent has placed the calling thread (:func:`pin_main`): threads it starts would
    inherit that placement."""
    return getattr(_local, "pin", None) is not None
