"""Notices when the event loop stops turning, and says where it is stuck.

Everything the agent promises in bounded time (heartbeats, acknowledgements, token frames) runs
on one event loop: a callback that blocks it (slow code, a page fault storm, a lock) or a
process starved of CPU shows up first as peers dropped for silence, far from its cause. A
watch thread beside the loop sees a beat the loop stamps every ``period_s``; when the beat is
older than ``warn_s`` it logs ``event loop blocked`` once, with the loop thread's stack at that
moment (the code that blocks it, or the selector's wait when the process was not scheduled),
and ``event loop turning again`` (a warning too) with the whole stall's length once the loop
runs. When the whole process did not run (SIGSTOP, a starved cgroup), the watch thread stood
still too: the loop's next turn logs ``event loop blocked`` itself, with a ``cause`` instead of
a stack. Stalls are counted in ``pddwire_loop_stalls_total`` and ``pddwire_loop_stall_seconds``.

Several agents (and a router) may share one loop (the tests run them in-process): one watch per
loop, shared, reference-counted, with the first owner's ``warn_s``; each owner's metrics count
the stalls and the first owner's logger reports them.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from collections.abc import Callable

_watches: dict[int, "LoopWatch"] = {}
_lock = threading.Lock()
_STACK_FRAMES = 16  # innermost frames of the loop thread's stack put in the log line


class LoopWatch:
    def __init__(self, loop: asyncio.AbstractEventLoop, warn_s: float, period_s: float) -> None:
        self.loop, self.warn_s, self.period_s = loop, warn_s, period_s
        self.owners: list[tuple[object, Callable[[float], None]]] = []  # (log, count(stall_s))
        self._tid = threading.get_ident()  # created on the loop's thread
        self._beat = time.monotonic()
        self._reported = 0.0  # the beat of the stall already reported (0: none)
        self._stop = threading.Event()
        self._decide = threading.Lock()  # the beat's age is judged by one thread at a time
        self._looked = time.monotonic()  # when the watch thread last looked at the beat
        self._handle: asyncio.TimerHandle | None = None
        self._thread = threading.Thread(target=self._watch, name="pdd-loopwatch", daemon=True)

    def start(self) -> None:
        self._handle = self.loop.call_later(self.period_s, self._tick)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()
        self._thread.join(timeout=2 * self.period_s + 1)

    def _tick(self) -> None:  # on the loop
        now = time.monotonic()
        with self._decide:  # one report per stall: the watch thread's, or else this one
            stalled_s = now - self._beat - self.period_s  # beyond the tick's own wait
            seen = bool(self._reported) and self._reported == self._beat
            watch_stood = now - self._looked > 2 * self.period_s  # the watch thread did not run either
            self._beat, self._reported = now, 0.0
        if seen:
            self._log("warning", "event loop turning again", blocked_s=round(stalled_s, 3))
        elif stalled_s >= self.warn_s:  # ended before the watch thread looked: reported here, no stack
            self._log("warning", "event loop blocked", blocked_s=round(stalled_s, 3),
                      cause="the process did not run (stopped, or starved of CPU)" if watch_stood else
                      "it ended before the watch looked (no stack taken)")
        if stalled_s >= self.warn_s:
            for _, count in list(self.owners):
                count(stalled_s)
        self._handle = self.loop.call_later(self.period_s, self._tick)

    def _watch(self) -> None:  # on the watch thread
        while not self._stop.wait(self.period_s / 2):
            with self._decide:
                self._looked = time.monotonic()
                beat = self._beat
                age = time.monotonic() - beat - self.period_s
                if age < self.warn_s or self._reported == beat:
                    continue
                self._reported = beat
            frame = sys._current_frames().get(self._tid)
            stack = traceback.format_stack(frame)[-_STACK_FRAMES:] if frame is not None else []
            self._log("warning", "event loop blocked", blocked_s=round(age, 3),
                      stack="".join(stack).rstrip())

    def _log(self, level: str, event: str, **kw) -> None:
        owners = list(self.owners)  # the watch thread logs too, while an owner may leave
        if owners:
            getattr(owners[0][0], level)(event, **kw)


class LateTicks:
    """For a periodic check that judges a peer (silence, unreachability, missing acknowledgements):
    ``hold(due, now)`` is True when this tick is too late to judge. A tick late by over
    ``max(period_s, 1 s)`` means this process did not run (its loop blocked, the process stopped
    or starved of CPU): the peer's frames of that time may be waiting unread (uvloop runs due
    timers before it polls the sockets), so the verdict waits until the loop has read them. One
    tick held, never two in a row: a loop always this late still judges."""

    def __init__(self, period_s: float) -> None:
        self.late_s = max(period_s, 1.0)
        self.held = False

    def hold(self, due: float, now: float) -> bool:
        self.held = now - due > self.late_s and not self.held
        return self.held


def watch(owner_log, count: Callable[[float], None], warn_s: float, period_s: float = 0.1) -> Callable[[], None]:
    """Watch the running loop (one watch per loop, shared) and report its stalls of ``warn_s``
    or more to ``owner_log`` (a structlog logger) and ``count(stall_s)``; returns the function
    that ends this owner's part (the watch stops with its last owner). ``warn_s <= 0``: none."""
    if warn_s <= 0:
        return lambda: None
    loop = asyncio.get_running_loop()
    with _lock:
        w = _watches.get(id(loop))
        if w is None or w.loop is not loop:
            w = _watches[id(loop)] = LoopWatch(loop, warn_s, period_s)
            w.start()
        entry = (owner_log, count)
        w.owners.append(entry)

    def unwatch() -> None:
        with _lock:
            if entry in w.owners:
                w.owners.remove(entry)
            if not w.owners and _watches.get(id(loop)) is w:
                del _watches[id(loop)]
                w.stop()
    return unwatch
