"""The UCX progress engine: the UCX context and one task that drives every worker on it, on
the agent's own event loop or on a thread of its own.

Layout
------
* :class:`UcxLoop` owns the UCX context and one *progress engine* task that drives every
  worker on it (each :class:`~.ucx.UcxPeer` has one, and attaches itself as a
  :class:`Driven`). It runs on an asyncio loop: ``start(loop)`` puts it on the caller's
  running loop (the agent's main loop: what the agent does), ``start()`` on a thread with a
  uvloop of its own (tests and tools that drive UCX from synchronous code). One instance per
  event loop (or one threaded one) is shared through :func:`acquire_loop` /
  :func:`release_loop` (reference-counted: the last release stops it; a later acquire starts
  a fresh one, so an agent can start and stop any number of times in one process).
* Coroutines of a :class:`~.ucx.UcxPeer` run on that loop only (``await ucx_loop.run(...)``
  from any loop; ``ucx_loop.submit(...)`` from another thread).

Why on the agent's loop, not a thread of its own
-------------------------------------------------
It is what the best bare ucxx configuration on this machine does (``ucxx.init(progress_mode=
"blocking")``: the worker's epoll fd on the application's loop; ``scripts/bench --only ucx``
measures it next to ``polling`` and ``thread``), and it removes every thread hop: a send is
started, and its completion handled, by the code that asked for it, with no
``call_soon_threadsafe`` each way, no task or concurrent future per chunk, and no second
thread contending for the GIL. UCX's own work per progress call is small and bounded: a
rendezvous over shared memory is read in ``UCX_CMA_SEG_SIZE`` segments (512 KiB), one per
``progress_once()``, which releases the GIL. So a progress turn stops after ``turn_s``
(200 us) and gives the loop back; token frames wait at most one turn behind KV.

When the engine has nothing to do it arms every worker and sleeps until one of their epoll
fds fires (``add_reader`` on the loop: the agent's epoll, not a wake-up of another thread) or
a new operation kicks it; while requests are in flight it also wakes every ``SAFETY_WAKE_S``
(an event UCX never signalled). By default it does not poll after activity (``spin_s=0``):
on the agent's loop a spin is the loop itself turning, and every turn costs the CPU the
peer's copy needs (figures: docs/benchmarks.md, "UCX local path").

Why not ``ucxx``'s own asyncio layer (``ucxx.init`` / ``Endpoint.send``)
--------------------------------------------------------------------------
It keeps process-global state (one ``ApplicationContext``, progress tasks keyed by loop),
awaits every request with a ``sleep(0)`` poll, and its ``blocking`` mode arms the worker only
once (afterwards the level-triggered epoll fd fires on every loop turn): in effect both
processes of a transfer spin, which is why it is the fastest bare configuration on an idle
host and why an agent that shares its cores with an engine cannot work that way. We use the
objects that layer is built on (``ucxx._lib.libucxx``: context, worker, endpoint, request)
with our own engine.
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

import structlog
import uvloop

from ..errors import TransportError
from .ucx_lib import load, translate

SPIN_S = 100e-6          # on a thread of its own: poll this long after the last progress before sleeping
SPIN_YIELD = True        # sched_yield() while polling: a spinning waiter must not starve its peer
TURN_S = 200e-6          # on a shared loop: a progress turn gives the loop back after this long
THREAD_TURN_S = 5e-3     # on a thread of its own (the GIL is released while UCX progresses)
SAFETY_WAKE_S = 0.01     # while requests are in flight, sleep at most this long (missed events)
SWEEP_S = 1.0            # how often unclaimed messages and discard marks are expired
UCX_NICE = 5             # a thread of its own runs at nice +5 like the TCP bulk threads

T = TypeVar("T")
log = structlog.get_logger("pdd_wire.transport.ucx")


class Driven(Protocol):
    """What the progress engine drives (a :class:`~.ucx.UcxPeer`: one UCX worker and its
    requests). Everything here is called on the engine's loop only."""

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

    def poll(self, until: float) -> bool:
        """Progress the worker (until ``time.perf_counter()`` passes ``until`` at most) and take
        what it finished or received; True when anything moved."""
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
    """The UCX context and the progress engine, on an asyncio loop.

    ``options`` are UCX configuration options without the ``UCX_`` prefix (e.g.
    ``{"TLS": "sm,self"}``); they override the environment (a ``TLS`` option wins over
    ``UCX_TLS``; without one, ``UCX_TLS`` applies, else every transport). The context's
    transports are logged, and kept in :attr:`transports`. ``spin_s``: how long the engine
    keeps polling after activity before it sleeps (default: ``SPIN_S`` on a thread of its
    own, 0 on a shared loop).
    """

    def __init__(self, name: str = "pdd-ucx", *, options: dict[str, str] | None = None,
                 spin_s: float | None = None, unclaimed_ttl_s: float = 60.0,
                 turn_s: float | None = None) -> None:
        self.name = name
        self.options = dict(options or {})
        self._spin_s = spin_s
        self._turn_s = turn_s
        self.spin_s = 0.0
        self.turn_s = TURN_S
        self.unclaimed_ttl_s = unclaimed_ttl_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.context = None
        self.transports: list[str] = []  # "tl/device" of every UCX resource of the context
        self.own_thread = False
        self._thread: threading.Thread | None = None
        self._thread_id: int | None = None
        self._peers: list[Driven] = []
        self._engine: asyncio.Task | None = None
        self._stopping: asyncio.Task | None = None
        self._wake: asyncio.Future | None = None
        self._kicked = False
        self._stopped = False
        self._started = False
        self.stats = {"wakeups": 0, "safety_wakeups": 0, "turns": 0, "worker_failures": 0}

    # lifecycle -------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        if not self._started or self._stopped:
            return False
        if self.own_thread:
            return self._thread is not None and self._thread.is_alive()
        return self.loop is not None and not self.loop.is_closed()

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Import ucxx and create the UCX context; the engine runs on ``loop`` (the calling
        thread's running loop) or, without one, on a thread of its own. Raises
        :class:`TransportError` when UCX cannot be used."""
        if self._started:
            raise RuntimeError("UcxLoop already started")
        self._started = True
        mods = load()
        if loop is None:
            self.own_thread = True
            self.spin_s = SPIN_S if self._spin_s is None else self._spin_s
            self.turn_s = THREAD_TURN_S if self._turn_s is None else self._turn_s
            self.loop = own = uvloop.new_event_loop()
            started: concurrent.futures.Future[None] = concurrent.futures.Future()
            self._thread = threading.Thread(target=self._run, args=(own, mods, started), name=self.name,
                                            daemon=True)
            self._thread.start()
            try:
                started.result()
            except BaseException:
                self._thread.join(5)
                self._stopped = True
                raise
            return
        self.spin_s = 0.0 if self._spin_s is None else self._spin_s
        self.turn_s = TURN_S if self._turn_s is None else self._turn_s
        self.loop = loop
        self._thread_id = threading.get_ident()
        try:
            self._make_context(mods)
        except Exception as exc:  # noqa: BLE001 - UCX raises its own types and others
            self._stopped = True
            raise (translate(exc, "context creation") if isinstance(exc, mods.UCXError) else exc) from exc
        self._engine = loop.create_task(self._progress_engine(), name=f"{self.name}-engine")

    def _run(self, loop: asyncio.AbstractEventLoop, mods: SimpleNamespace,
             started: concurrent.futures.Future[None]) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), UCX_NICE)
        except (OSError, AttributeError):
            pass
        self._thread_id = threading.get_ident()
        asyncio.set_event_loop(loop)
        try:
            self._make_context(mods)
        except Exception as exc:  # noqa: BLE001 - UCX raises its own types and others
            started.set_exception(translate(exc, "context creation")
                                  if isinstance(exc, mods.UCXError) else exc)
            loop.close()
            return
        self._engine = loop.create_task(self._progress_engine(), name=f"{self.name}-engine")
        loop.call_soon(started.set_result, None)
        loop.run_forever()

    def _make_context(self, mods: SimpleNamespace) -> None:
        self.context = ctx = mods.L.UCXContext(self.options)
        self.transports = context_transports(ctx)
        tls = self.options.get("TLS")
        log.info("UCX context", name=self.name, transports=",".join(self.transports),
                 tls=tls if tls is not None else os.environ.get("UCX_TLS", "all"),
                 tls_from="option" if tls is not None else ("UCX_TLS" if "UCX_TLS" in os.environ else "UCX default"))

    async def _shutdown(self) -> None:
        """On the loop: close every peer (pending operations fail with TransportError), stop
        the engine, drop the UCX context."""
        peers = list(self._peers)
        for p in peers:
            p.begin_close()
        await asyncio.gather(*(p.wait_closed() for p in peers), return_exceptions=True)
        if self._engine is not None:
            self._engine.cancel()
            await asyncio.gather(self._engine, return_exceptions=True)
        if self.own_thread:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
        self.context = None  # UCX context goes once no worker refers to it

    def stop(self, timeout: float = 10.0) -> None:
        """Close every peer (pending operations fail with TransportError) and drop the UCX
        context. Idempotent. On a thread of its own: waits for that and ends the thread
        (callable from any thread but the loop's). On a shared loop, from that loop's thread:
        starts closing and returns (:meth:`aclose` waits)."""
        if self._stopped or not self._started:
            self._stopped = True
            return
        loop = self.event_loop()
        if not self.own_thread:
            self._stopped = True
            if threading.get_ident() == self._thread_id:
                if not loop.is_closed():
                    self._stopping = loop.create_task(self._shutdown(), name=f"{self.name}-stop")
            elif loop.is_running():
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout)
            return
        if threading.get_ident() == self._thread_id:
            raise RuntimeError("UcxLoop.stop() from its own thread")
        self._stopped = True
        assert self._thread is not None
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout)
            except Exception:  # noqa: BLE001,S110 - stopping anyway
                pass
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive() and not loop.is_closed():
            loop.close()

    async def aclose(self, timeout: float = 10.0) -> None:
        """:meth:`stop`, awaited from any loop (on a shared loop: until every peer has closed)."""
        if self.own_thread:
            await asyncio.to_thread(self.stop, timeout)
            return
        self.stop(timeout)
        if self._stopping is not None and threading.get_ident() == self._thread_id:
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(self._stopping)
            except TimeoutError:
                pass

    # running things on the loop --------------------------------------------------------
    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The engine's asyncio loop (once :meth:`start` has set it)."""
        if self.loop is None:
            raise RuntimeError("UcxLoop not started")
        return self.loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the engine's loop; a concurrent future of its result (block on it
        only from another thread)."""
        if self._stopped:
            coro.close()
            raise TransportError("UCX loop stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.event_loop())

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """``await ucx_loop.run(peer.send(...))`` from any loop (directly when already on the
        engine's). From another loop, cancelling the caller cancels the task on the engine's
        loop, but the caller resumes at once: to know that a buffer is free again, await
        :meth:`~.ucx.UcxPeer.cancel_recv` / ``cancel_transfer``."""
        if self.on_loop():
            if self._stopped:
                coro.close()
                raise TransportError("UCX loop stopped")
            return await coro
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
        """Drive ``p`` from now on (loop thread). Its epoll fd stays registered with the loop
        until :meth:`detach`: a sleep costs no ``epoll_ctl``."""
        self._peers = self._peers + [p]
        self.event_loop().add_reader(p.epoll_fd, self._on_event)
        self.kick()

    def detach(self, p: Driven) -> None:
        """Stop driving ``p`` (loop thread)."""
        self._peers = [q for q in self._peers if q is not p]
        try:
            self.event_loop().remove_reader(p.epoll_fd)
        except (ValueError, OSError):
            pass

    def _on_event(self) -> None:
        """A worker's epoll fd fired. Only a sleeping engine needs waking: an awake one
        progresses anyway, and arms (which says whether events are pending) before it sleeps.
        (The fd stays readable until the worker is armed again, so this may run each turn.)"""
        w = self._wake
        if w is not None:
            _resolve(w, None)

    async def _progress_engine(self) -> None:
        loop = asyncio.get_running_loop()
        last_busy = time.monotonic()
        next_sweep = last_busy + SWEEP_S
        spin_yield = SPIN_YIELD and self.own_thread
        while True:
            busy = False
            peers = self._peers
            until = time.perf_counter() + self.turn_s
            for p in peers:
                try:
                    if p.poll(until):
                        busy = True
                except Exception as exc:  # noqa: BLE001 - one worker's failure must not stop the others
                    log.exception("UCX worker failed; closing its peer", error=str(exc))
                    self.stats["worker_failures"] += 1
                    if p.closed:
                        self.detach(p)  # failing while it closes: abandoned (kept, never freed)
                    else:
                        p.begin_close()
                    busy = True
            self.stats["turns"] += 1
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
            # Optionally keep polling for a moment after anything happened: the next message
            # of a burst, or the reply to a send, comes within microseconds, and arming makes
            # the peer signal us by syscall.
            if now - last_busy < self.spin_s:
                if spin_yield:
                    os.sched_yield()
                await asyncio.sleep(0)
                continue
            # Nothing moved: arm every worker (False: events are pending, so progress again),
            # then sleep until one of their epoll fds fires or a new operation kicks us.
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
        timer = loop.call_later(timeout, _resolve, fut, "timeout") if timeout is not None else None
        try:
            why = await fut
        finally:
            self._wake = None
            if timer is not None:
                timer.cancel()
        self.stats["wakeups"] += 1
        if why == "timeout" and any(p.in_flight for p in peers):
            self.stats["safety_wakeups"] += 1


def context_transports(context: Any) -> list[str]:
    """``["self/memory", "posix/memory", "tcp/lo", ...]``: the resources of a UCX context, as
    its ``info`` (``ucp_context_print_info``) lists them."""
    try:
        info = str(context.info)
    except Exception:  # noqa: BLE001 - only for the log
        return []
    return [line.rsplit("--", 1)[1].strip() for line in info.splitlines()
            if "resource" in line and "--" in line]


def _resolve(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


# ------------------------------------------------------------------------------------------
# Shared instances: one per event loop, and one on a thread of its own
# ------------------------------------------------------------------------------------------
_shared_lock = threading.Lock()
_shared: dict[Any, list] = {}   # loop (None: the threaded one) -> [UcxLoop, users]


def acquire_loop(loop: asyncio.AbstractEventLoop | None = None, **kwargs) -> UcxLoop:
    """The shared :class:`UcxLoop` of ``loop`` (the calling thread's running loop; None: the
    process's threaded one), started on first use; pair with :func:`release_loop`.
    ``kwargs`` (UcxLoop options) only apply when this call starts it (other ``options`` than
    the running one's are logged, and not applied)."""
    with _shared_lock:
        entry = _shared.get(loop)
        if entry is None or not entry[0].running:
            ucx = UcxLoop(**kwargs)
            ucx.start(loop)
            entry = _shared[loop] = [ucx, 0]
        elif "options" in kwargs and dict(kwargs["options"] or {}) != entry[0].options:
            log.warning("the UCX context is shared and already made with other options; these are not applied",
                        running=entry[0].options, asked=kwargs["options"])
        entry[1] += 1
        return entry[0]


def _release(ucx: UcxLoop) -> bool:
    """Count one user of ``ucx`` off; True when it should stop now."""
    with _shared_lock:
        key = None if ucx.own_thread else ucx.loop
        entry = _shared.get(key)
        if entry is None or entry[0] is not ucx:
            return True
        entry[1] -= 1
        if entry[1] > 0:
            return False
        del _shared[key]
        return True


def release_loop(ucx: UcxLoop) -> None:
    """Give back what :func:`acquire_loop` returned; the last user stops it (on a shared
    loop, from its thread, the stop completes in the background: see :func:`arelease_loop`)."""
    if _release(ucx):
        ucx.stop()


async def arelease_loop(ucx: UcxLoop) -> None:
    """:func:`release_loop`, waiting until the last user's stop has completed."""
    if _release(ucx):
        await ucx.aclose()
