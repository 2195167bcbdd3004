"""The UCX progress engine: a thread with its own asyncio loop, the UCX context, and one task
that drives every worker on it.

Layout
------
* :class:`UcxLoop` is a thread running its own asyncio loop (like :class:`~.tcp.BulkLoop`); it
  owns the UCX context and one *progress engine* task that drives every worker on it (each
  :class:`~.ucx.UcxPeer` has one, and attaches itself as a :class:`Driven`). One
  process-wide instance is shared through :func:`acquire_loop` / :func:`release_loop`
  (reference-counted: the last release stops it; a later acquire starts a fresh one, so an
  agent can start and stop any number of times in one process).
* Coroutines of a :class:`~.ucx.UcxPeer` run on the :class:`UcxLoop` only
  (``ucx_loop.submit(peer.send(...))`` or ``await ucx_loop.run(peer.recv(...))`` from
  another loop).

Why not ``ucxx``'s own asyncio layer (``ucxx.init`` / ``Endpoint.send``)
--------------------------------------------------------------------------
It keeps process-global state (one ``ApplicationContext``, progress tasks keyed by loop),
awaits every request with a ``sleep(0)`` poll, and its ``blocking`` mode arms the worker only
once (afterwards the level-triggered epoll fd fires on every loop turn): in effect both
processes of a transfer spin. We use the objects that layer is built on
(``ucxx._lib.libucxx``: context, worker, endpoint, request) with our own progress engine on
the :class:`UcxLoop`: after any activity it keeps polling for ``SPIN_S`` (``progress()``
and ``sched_yield()`` release the GIL), then arms the workers and sleeps on their epoll
fds, so an idle agent costs no CPU. The ``sched_yield()`` while spinning is what keeps a busy
host usable: a spinning sender otherwise takes the core its receiver's copy needs (figures:
``scripts/bench --only ucx``, which also measures bare ucxx and ``ucx_perftest``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from types import SimpleNamespace
from typing import Any, Protocol, TypeVar

import uvloop

from ..errors import TransportError
from .ucx_lib import load, translate

SPIN_S = 100e-6          # poll this long after the last progress before arming and sleeping
SPIN_YIELD = True        # sched_yield() while polling: a spinning waiter must not starve its peer
SAFETY_WAKE_S = 0.01     # while requests are in flight, sleep at most this long (missed events)
SWEEP_S = 1.0            # how often unclaimed messages and discard marks are expired
UCX_NICE = 5             # like the TCP bulk threads: the control loop gets the CPU first

T = TypeVar("T")


class Driven(Protocol):
    """What the progress engine drives (a :class:`~.ucx.UcxPeer`: one UCX worker and its
    requests). Everything here is called on the loop thread only."""

    #: The worker's epoll fd, which fires once the armed worker has events.
    epoll_fd: int

    @property
    def closed(self) -> bool: ...

    @property
    def in_flight(self) -> int:
        """How many requests UCX holds a buffer for."""
        ...

    @property
    def has_expiring(self) -> bool:
        """Whether :meth:`sweep` has something to expire (unclaimed messages, discard marks)."""
        ...

    def poll(self) -> bool:
        """Progress the worker and take what it finished or received; True when anything moved."""
        ...

    def arm(self) -> bool:
        """Arm the worker's epoll fd; False when events are pending (progress again instead)."""
        ...

    def sweep(self, now: float) -> None:
        """Expire what is due at ``now`` (monotonic)."""
        ...

    def begin_close(self) -> None:
        """Start closing now; the engine's polls finish it."""
        ...

    async def wait_closed(self) -> None: ...


class UcxLoop:
    """A thread with its own uvloop, the UCX context, and the progress engine.

    ``options`` are UCX configuration options without the ``UCX_`` prefix (e.g.
    ``{"TLS": "sm,self"}``); they override the environment.
    """

    def __init__(self, name: str = "pdd-ucx", *, options: dict[str, str] | None = None,
                 spin_s: float = SPIN_S, unclaimed_ttl_s: float = 60.0) -> None:
        self.name = name
        self.options = dict(options or {})
        self.spin_s = spin_s
        self.unclaimed_ttl_s = unclaimed_ttl_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.context = None
        self._thread: threading.Thread | None = None
        self._thread_id: int | None = None
        self._peers: list[Driven] = []
        self._engine: asyncio.Task | None = None
        self._wake: asyncio.Future | None = None
        self._kicked = False
        self._stopped = False
        self.stats = {"wakeups": 0, "safety_wakeups": 0}

    # lifecycle -------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    def start(self) -> None:
        """Import ucxx, start the thread, create the UCX context on it. Raises
        :class:`TransportError` when UCX cannot be used."""
        if self._thread is not None:
            raise RuntimeError("UcxLoop already started")
        mods = load()
        self.loop = loop = uvloop.new_event_loop()
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(loop, mods, started), name=self.name,
                                        daemon=True)
        self._thread.start()
        try:
            started.result()
        except BaseException:
            self._thread.join(5)
            self._stopped = True
            raise

    def _run(self, loop: asyncio.AbstractEventLoop, mods: SimpleNamespace,
             started: concurrent.futures.Future[None]) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), UCX_NICE)
        except (OSError, AttributeError):
            pass
        self._thread_id = threading.get_ident()
        asyncio.set_event_loop(loop)
        try:
            self.context = mods.L.UCXContext(self.options)
        except Exception as exc:  # noqa: BLE001 - UCX raises its own types and others
            started.set_exception(translate(exc, "context creation")
                                  if isinstance(exc, mods.UCXError) else exc)
            loop.close()
            return
        self._engine = loop.create_task(self._progress_engine(), name=f"{self.name}-engine")
        loop.call_soon(started.set_result, None)
        loop.run_forever()

    def stop(self, timeout: float = 10.0) -> None:
        """Close every peer (pending operations fail with TransportError), drop the UCX
        context and end the thread. Idempotent; callable from any thread but the loop's."""
        if self._stopped or self._thread is None:
            self._stopped = True
            return
        if threading.get_ident() == self._thread_id:
            raise RuntimeError("UcxLoop.stop() from its own thread")
        self._stopped = True
        loop = self.event_loop()
        if self._thread.is_alive():
            async def _shutdown() -> None:
                peers = list(self._peers)
                for p in peers:
                    p.begin_close()
                await asyncio.gather(*(p.wait_closed() for p in peers), return_exceptions=True)
                if self._engine is not None:
                    self._engine.cancel()
                    await asyncio.gather(self._engine, return_exceptions=True)
                rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in rest:
                    t.cancel()
                await asyncio.gather(*rest, return_exceptions=True)
                self.context = None  # UCX context goes once no worker refers to it
            try:
                asyncio.run_coroutine_threadsafe(_shutdown(), loop).result(timeout)
            except Exception:  # noqa: BLE001,S110 - stopping anyway
                pass
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive() and not loop.is_closed():
            loop.close()

    # running things on the loop --------------------------------------------------------
    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The thread's asyncio loop (once :meth:`start` has made it)."""
        if self.loop is None:
            raise RuntimeError("UcxLoop not started")
        return self.loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on this loop; a concurrent future of its result."""
        if self._stopped:
            coro.close()
            raise TransportError("UCX loop stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.event_loop())

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """``await ucx_loop.run(peer.send(...))`` from another event loop. Cancelling the
        caller cancels the task on the UCX loop, but the caller resumes at once: to know that
        a buffer is free again, await :meth:`~.ucx.UcxPeer.cancel_recv` / ``cancel_transfer``."""
        return await asyncio.wrap_future(self.submit(coro))

    def call(self, fn: Callable, *args, timeout: float = 30.0) -> Any:
        """``fn(*args)`` on the loop thread, waiting for its result (directly when already on it)."""
        if threading.get_ident() == self._thread_id:
            return fn(*args)
        if self._stopped:
            raise TransportError("UCX loop stopped")
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def _do() -> None:
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)
        self.event_loop().call_soon_threadsafe(_do)
        return fut.result(timeout)

    def on_loop(self) -> bool:
        return threading.get_ident() == self._thread_id

    # engine ----------------------------------------------------------------------------
    def kick(self) -> None:
        """Something new to progress: poll again now (wakes a sleeping engine). Loop thread."""
        self._kicked = True
        w = self._wake
        if w is not None:
            _resolve(w, None)

    def attach(self, p: Driven) -> None:
        """Drive ``p`` from now on (loop thread)."""
        self._peers = self._peers + [p]
        self.kick()

    def detach(self, p: Driven) -> None:
        """Stop driving ``p`` (loop thread)."""
        self._peers = [q for q in self._peers if q is not p]

    async def _progress_engine(self) -> None:
        loop = asyncio.get_running_loop()
        last_busy = time.monotonic()
        next_sweep = last_busy + SWEEP_S
        while True:
            busy = False
            peers = self._peers
            for p in peers:
                if p.poll():
                    busy = True
            now = time.monotonic()
            if now >= next_sweep:
                for p in peers:
                    p.sweep(now)
                next_sweep = now + SWEEP_S
            if busy or self._kicked:
                self._kicked = False
                last_busy = now
                await asyncio.sleep(0)
                continue
            # Keep polling for a moment after anything happened, whether or not something is
            # pending: the next message of a burst, or the reply to a send, comes within
            # microseconds, and arming makes the peer signal us by syscall (64 B round trip
            # 60 us when sleeping whenever nothing was pending, 34 us this way; bare ucxx 20).
            if now - last_busy < self.spin_s:
                if SPIN_YIELD:
                    os.sched_yield()
                await asyncio.sleep(0)
                continue
            # Nothing moved for a while: arm every worker (False: events are pending, so
            # progress again), then sleep until one of their epoll fds fires or a new
            # operation kicks us.
            if not all(p.arm() for p in peers):
                continue
            timeout = None
            if any(p.in_flight or p.closed for p in peers):
                timeout = SAFETY_WAKE_S
            if any(p.has_expiring for p in peers):
                timeout = min(timeout or SWEEP_S, max(0.0, next_sweep - now))
            await self._sleep(loop, peers, timeout)
            last_busy = time.monotonic()

    async def _sleep(self, loop: asyncio.AbstractEventLoop, peers: Sequence[Driven],
                     timeout: float | None) -> None:
        fut = loop.create_future()
        self._wake = fut
        fds = [p.epoll_fd for p in peers]
        for fd in fds:
            loop.add_reader(fd, self.kick)
        timer = loop.call_later(timeout, _resolve, fut, "timeout") if timeout is not None else None
        try:
            why = await fut
        finally:
            self._wake = None
            if timer is not None:
                timer.cancel()
            for fd in fds:
                try:
                    loop.remove_reader(fd)
                except (ValueError, OSError):
                    pass
        self.stats["wakeups"] += 1
        if why == "timeout" and any(p.in_flight for p in peers):
            self.stats["safety_wakeups"] += 1


def _resolve(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


# ------------------------------------------------------------------------------------------
# Process-wide shared loop
# ------------------------------------------------------------------------------------------
_shared_lock = threading.Lock()
_shared: UcxLoop | None = None
_shared_users = 0


def acquire_loop(**kwargs) -> UcxLoop:
    """The process-wide :class:`UcxLoop`, started on first use; pair with :func:`release_loop`.
    ``kwargs`` (UcxLoop options) only apply when this call starts it."""
    global _shared, _shared_users
    with _shared_lock:
        if _shared is None or not _shared.running:
            loop = UcxLoop(**kwargs)
            loop.start()
            _shared, _shared_users = loop, 0
        _shared_users += 1
        return _shared


def release_loop(loop: UcxLoop) -> None:
    """Give back what :func:`acquire_loop` returned; the last user stops it."""
    global _shared, _shared_users
    with _shared_lock:
        if loop is not _shared:
            loop.stop()
            return
        _shared_users -= 1
        if _shared_users > 0:
            return
        _shared = None
    loop.stop()
