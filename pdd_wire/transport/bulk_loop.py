"""The bulk threads: each runs a uvloop of its own for bulk connections, so KV I/O never holds
the main loop (and the GIL only for the Python part of each chunk)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import os
import threading
from collections.abc import Callable

import uvloop

BULK_NICE = 5

PR_SET_NAME = 15


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in ``top -H``, ``ps -L`` and ``/proc/<pid>/task/*/comm``
    (at most 15 bytes; Python 3.11 names only its own Thread object)."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass


class BulkLoop:
    """A thread running its own uvloop, for bulk connections (named ``name`` for the OS too:
    ``pdd-bulk-N``, so ``top -H`` and the benchmarks tell bulk CPU from the main loop's)."""

    def __init__(self, name: str, cpus: frozenset[int] = frozenset()) -> None:
        self.name = name
        self.cpus = cpus  # the CPUs it runs on (cpus.bulk); empty: those of the thread that starts it
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = threading.Event()
        self._error: OSError | None = None

    def _run(self) -> None:
        name_os_thread(self.name)
        # Bulk threads yield the CPU to the control loop: on a saturated host the kernel runs
        # the main thread (token and control frames) first. Per-thread on Linux.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BULK_NICE)
        except (OSError, AttributeError):
            pass
        if self.cpus:  # per-thread on Linux, as the nice value
            try:
                os.sched_setaffinity(0, self.cpus)
            except OSError as exc:
                self._error = exc
                self._started.set()
                self.loop.close()
                return
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    def start(self) -> None:
        """Start the thread; OSError when it cannot be placed on ``cpus`` (it has ended then)."""
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    @property
    def native_id(self) -> int | None:
        """The OS thread id (``/proc/<pid>/task/<tid>``), once started."""
        return self._thread.native_id

    def call(self, fn: Callable, *args) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout: float = 5.0) -> None:
        if not self._thread.is_alive():
            return

        async def _close_all() -> None:
            tasks = [t for t in asyncio.all_tasks(self.loop) if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.submit(_close_all()).result(timeout)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()
