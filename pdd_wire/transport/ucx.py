"""UCX local path: KV between agents on the same node (or the same RDMA fabric) over ``ucxx``.

Layout
------
* :class:`UcxLoop` is a thread running its own asyncio loop (like :class:`~.tcp.BulkLoop`); it
  owns the UCX context and one *progress engine* task that drives every worker on it. One
  process-wide instance is shared through :func:`acquire_loop` / :func:`release_loop`
  (reference-counted: the last release stops it; a later acquire starts a fresh one, so an
  agent can start and stop any number of times in one process).
* :class:`UcxPeer` is one peer agent: its own UCX worker (so tags of different peers never
  meet in one matching queue), whose address (:meth:`UcxPeer.local_address`) travels to the
  peer over our TCP control connection, and one endpoint made from the peer's address
  (:meth:`UcxPeer.connect`). Its coroutines run on the :class:`UcxLoop` only
  (``ucx_loop.submit(peer.send(...))`` or ``await ucx_loop.run(peer.recv(...))`` from
  another loop).
* Messages are UCX tagged messages; :func:`tag_for` packs (direction, transfer id, index).

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

Receiving: "pull" matching, and what cancel guarantees
------------------------------------------------------
A :meth:`UcxPeer.recv` does **not** post a UCX receive up front. The engine probes the
worker for arrived messages (``ucp_tag_probe_nb`` with remove); a message whose tag has a
waiting receive is received into that buffer with its message handle
(``ucp_tag_msg_recv_nbx``), one that has none is kept (a later ``recv`` of that tag takes it
at once). So:

* cancelling a receive whose message has not arrived (task cancel, :meth:`UcxPeer.cancel_recv`,
  :meth:`UcxPeer.cancel_transfer`) is immediate and **guarantees no write ever happens into
  that buffer**: UCX was never given it;
* once the message has arrived, the receive is committed; UCX cannot cancel a matched
  receive (``ucp_request_cancel`` only removes *unmatched* receives), so cancelling then
  *waits until UCX has finished writing* and only then returns/raises. Either way, **when
  ``recv`` returns or raises, UCX no longer touches the buffer**; ``send`` keeps the same
  rule for its (read-only) buffer;
* a message of another length than the posted buffer is never written into it: the receive
  fails with ``SIZE_MISMATCH`` and the message is drained;
* messages nobody will take (their receive was cancelled, or never posted) are drained
  (received with a 1-byte buffer, which UCX completes as truncated) when
  :meth:`UcxPeer.cancel_transfer` marked them, or after ``unclaimed_ttl_s``, so the
  sender's rendezvous send completes and releases its buffer. A completed ``send`` therefore
  does not mean the peer kept the bytes: delivery is acknowledged on the control lane.
* :meth:`UcxPeer.close` fails the receives still waiting at once (UCX never had their
  buffers), flushes and closes the endpoint, and then ends whatever UCX still holds: a
  request UCX never finishes (the peer vanished mid-rendezvous) fails with
  ``TransportError`` and its buffer view, with the worker, stays referenced for ever, so
  nothing is unmapped under UCX (the worker is never progressed again, so nothing in this
  process writes to it; over ``sm`` and ``tcp`` the writes into a receive buffer are made by
  our own progress calls: ``sm`` rendezvous is a CMA *read* by the receiver).

Hazard: error handling is off; a dead peer is not noticed, and CMA failures are fatal
-------------------------------------------------------------------------------------
Endpoints are made with UCX peer error handling off (``connect(error_handling=False)``):
with it on, UCX refuses shared memory (``posix``/``sysv`` have "no peer failure handler", the
endpoint is ``UCXXUnreachableError``) and only ``tcp`` remains (0.5-2 GB/s here). The price,
measured here:

* over ``sm`` UCX does not notice that the peer process died: small (eager) sends to it
  still "complete", rendezvous sends never do, receives wait. Liveness must come from the
  control connection, which then closes the :class:`UcxPeer`. Over ``tcp`` the sends fail
  with ``UCXXConnectionResetError`` (a ``TransportError`` here).
* over ``sm`` the rendezvous protocol (>= 8 KiB) is "zero-copy read from remote" by **CMA**
  (``process_vm_readv`` of the sender's memory). A failing CMA call with error handling off
  is *unhandled*, and UCX turns it into a fatal log and ``abort()`` of the **receiving
  process** (seen with a sender that freed its buffer early: ``cma_ep.c:85
  process_vm_readv(...) returned -1: Bad address``, exit 134). A peer agent that dies while
  we read its memory can therefore take this agent down. This module keeps every send
  buffer referenced until its request completes (our side never causes it).
  ``UCX_TLS=posix,self`` (no CMA: rendezvous by copies through the shared segment) avoids
  remote memory access altogether.
* a malformed worker address makes UCX fail an assertion and abort, so :meth:`UcxPeer.connect`
  checks the address header's version nibble against ours; addresses must come from the
  authenticated control connection.

Process-global effects of importing ucxx
----------------------------------------
``import ucxx`` writes ``UCX_MEMTYPE_CACHE=n``, ``UCX_RNDV_THRESH=8192``,
``UCX_RNDV_FRAG_MEM_TYPE=cuda``, ``UCX_MAX_RNDV_RAILS=1`` (and, with a GPU, maybe
``UCX_CUDA_COPY_MAX_REG_RATIO``) into ``os.environ``, where every child process inherits
them; UCX 1.21 no longer knows ``UCX_MEMTYPE_CACHE`` and warns "unused environment variable"
at every context creation. :func:`_load` imports ucxx lazily (never at ``pdd_wire`` import)
and puts ``os.environ`` back as it was; UCX options then come from the real environment
(``UCX_TLS``, ...) and from :class:`UcxLoop`'s ``options``. UCX logs to *stdout*
(``UCX_LOG_FILE=/dev/stderr`` in the environment before the first import moves it); closing
a tcp endpoint whose peer closed first logs a harmless ``flush.c ... error during flush:
Connection reset by remote peer``. Creating the UCX context probes CMA (read from UCX's
``cma_md.c``, not reproducible on this VM, which has no Yama): with
``kernel.yama.ptrace_scope=1`` UCX calls ``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``, i.e.
any process of our uid may then ptrace the agent; with scope 2 it needs ``CAP_SYS_PTRACE``,
otherwise (or when a seccomp filter refuses ``process_vm_writev``) CMA is simply left out and
``sm`` rendezvous goes by copy.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import threading
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import uvloop

from ..errors import ErrorCode, TransferError, TransportError

# ------------------------------------------------------------------------------------------
# Tags: 64 bits = direction (1) | transfer id (40) | index (23)
# ------------------------------------------------------------------------------------------
DIRECTION_BITS = 1
TRANSFER_ID_BITS = 40
INDEX_BITS = 23
assert DIRECTION_BITS + TRANSFER_ID_BITS + INDEX_BITS == 64
MAX_TRANSFER_ID = (1 << TRANSFER_ID_BITS) - 1   # ~1.1e12 transfers
MAX_INDEX = (1 << INDEX_BITS) - 1               # ~8.4M chunks/blocks per transfer
DIR_DIALER = 0      # transfer ids allocated by the agent that dialed the control connection
DIR_ACCEPTOR = 1    # transfer ids allocated by the agent that accepted it


def tag_for(direction: int, transfer_id: int, index: int) -> int:
    """The 64-bit UCX tag of chunk/block ``index`` of transfer ``transfer_id``.

    Bit 63 is ``direction``: which agent of the pair allocated ``transfer_id``
    (:data:`DIR_DIALER` / :data:`DIR_ACCEPTOR`), so both agents can number their transfers
    independently and KV moving A->B never shares a tag with KV moving B->A even if both
    ever meet in one matching space. Bits 62..23 are the transfer id, bits 22..0 the index.
    All tags of one transfer share the top 41 bits (:func:`transfer_prefix`).
    """
    if direction not in (0, 1):
        raise ValueError(f"direction must be 0 or 1, got {direction!r}")
    if not 0 <= transfer_id <= MAX_TRANSFER_ID:
        raise ValueError(f"transfer id {transfer_id} does not fit in {TRANSFER_ID_BITS} bits")
    if not 0 <= index <= MAX_INDEX:
        raise ValueError(f"index {index} does not fit in {INDEX_BITS} bits")
    return (direction << 63) | (transfer_id << INDEX_BITS) | index


def tag_parts(tag: int) -> tuple[int, int, int]:
    """Inverse of :func:`tag_for`: ``(direction, transfer_id, index)``."""
    return tag >> 63, (tag >> INDEX_BITS) & MAX_TRANSFER_ID, tag & MAX_INDEX


def transfer_prefix(direction: int, transfer_id: int) -> int:
    """The bits all tags of one transfer share (``tag >> INDEX_BITS``)."""
    return tag_for(direction, transfer_id, 0) >> INDEX_BITS


# ------------------------------------------------------------------------------------------
# Lazy import
# ------------------------------------------------------------------------------------------
_import_lock = threading.Lock()
_mods: SimpleNamespace | None = None
_import_error: str | None = None
#: What ``import ucxx`` wrote into os.environ (and we undid), for the record.
UCXX_IMPORT_ENV: dict[str, str] = {}


def _load() -> SimpleNamespace:
    """Import ucxx once (thread-safe), leaving ``os.environ`` as it found it."""
    global _mods, _import_error
    with _import_lock:
        if _mods is not None:
            return _mods
        if _import_error is not None:   # failed before: a retry would fail the same way
            raise TransportError(_import_error)
        before = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "UCXPY_"))}
        try:
            import ucxx
            from ucxx._lib import libucxx
            from ucxx._lib.arr import Array
            from ucxx.types import Tag, TagMask
        except ImportError as exc:
            _import_error = (f"ucxx is not importable ({type(exc).__name__}: {exc}); "
                             "install the 'ucx' extra: pip install 'pdd-wire[ucx]'")
            raise TransportError(_import_error) from exc
        except OSError as exc:
            _import_error = f"ucxx could not load the UCX libraries: {exc}"
            raise TransportError(_import_error) from exc
        except Exception as exc:  # a broken install shows up as anything
            _import_error = f"ucxx failed to import: {type(exc).__name__}: {exc}"
            raise TransportError(_import_error) from exc
        finally:
            for k in [k for k in os.environ if k.startswith(("UCX_", "UCXPY_"))]:
                if k not in before:
                    UCXX_IMPORT_ENV[k] = os.environ.pop(k)
                elif os.environ[k] != before[k]:
                    UCXX_IMPORT_ENV[k] = os.environ[k]
                    os.environ[k] = before[k]
        _mods = SimpleNamespace(
            L=libucxx, Array=Array, Tag=Tag, TagMask=TagMask, UCXError=libucxx.UCXError,
            version=str(getattr(ucxx, "__version__", "?")),
            ucx_version=".".join(map(str, libucxx.get_ucx_version())),
        )
        return _mods


def available() -> tuple[bool, str]:
    """``(True, "ucxx 0.52.00, UCX 1.21.0")`` when the UCX path can be used, else
    ``(False, why)``. Imports ucxx on first call (never at ``pdd_wire`` import time)."""
    try:
        m = _load()
    except TransportError as exc:
        return False, str(exc)
    return True, f"ucxx {m.version}, UCX {m.ucx_version}"


def _translate(exc: BaseException, what: str) -> TransportError:
    """A UCX exception as a TransportError naming the UCX error."""
    name = type(exc).__name__
    code = ErrorCode.PEER_UNREACHABLE
    if "Truncated" in name:
        code = ErrorCode.SIZE_MISMATCH
    elif "Canceled" in name:
        code = ErrorCode.TRANSFER_CANCELLED
    err = TransportError(f"UCX {what} failed: {name}: {exc}", code)
    err.ucx_error = name  # type: ignore[attr-defined]
    return err


def _view(buf: Any, *, writable: bool) -> memoryview:
    """Our own flat byte view of ``buf`` (the caller releasing theirs cannot unmap ours)."""
    mv = memoryview(buf)
    if writable and mv.readonly:
        raise ValueError("recv needs a writable buffer")
    if not mv.c_contiguous:
        raise ValueError("buffer must be contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


# ------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------
SPIN_S = 100e-6          # poll this long after the last progress before arming and sleeping
SPIN_YIELD = True        # sched_yield() while polling: a spinning waiter must not starve its peer
SAFETY_WAKE_S = 0.01     # while requests are in flight, sleep at most this long (missed events)
SWEEP_S = 1.0            # how often unclaimed messages and discard marks are expired
CLOSE_S = 2.0            # how long an endpoint close may take before the worker is abandoned
UCX_NICE = 5             # like the TCP bulk threads: the control loop gets the CPU first


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
        self._peers: list[UcxPeer] = []
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
        mods = _load()
        self.loop = uvloop.new_event_loop()
        started = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(mods, started), name=self.name,
                                        daemon=True)
        self._thread.start()
        try:
            started.result()
        except BaseException:
            self._thread.join(5)
            self._stopped = True
            raise

    def _run(self, mods: SimpleNamespace, started: concurrent.futures.Future) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), UCX_NICE)
        except (OSError, AttributeError):
            pass
        self._thread_id = threading.get_ident()
        asyncio.set_event_loop(self.loop)
        try:
            self.context = mods.L.UCXContext(self.options)
        except Exception as exc:  # noqa: BLE001 - UCX raises its own types and others
            started.set_exception(_translate(exc, "context creation")
                                  if isinstance(exc, mods.UCXError) else exc)
            self.loop.close()
            return
        self._engine = self.loop.create_task(self._progress_engine(), name=f"{self.name}-engine")
        self.loop.call_soon(started.set_result, None)
        self.loop.run_forever()

    def stop(self, timeout: float = 10.0) -> None:
        """Close every peer (pending operations fail with TransportError), drop the UCX
        context and end the thread. Idempotent; callable from any thread but the loop's."""
        if self._stopped or self._thread is None:
            self._stopped = True
            return
        if threading.get_ident() == self._thread_id:
            raise RuntimeError("UcxLoop.stop() from its own thread")
        self._stopped = True
        if self._thread.is_alive():
            async def _shutdown() -> None:
                peers = list(self._peers)
                for p in peers:
                    p._close_now()
                await asyncio.gather(*(p._closed_fut for p in peers), return_exceptions=True)
                if self._engine is not None:
                    self._engine.cancel()
                    await asyncio.gather(self._engine, return_exceptions=True)
                rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in rest:
                    t.cancel()
                await asyncio.gather(*rest, return_exceptions=True)
                self.context = None  # UCX context goes once no worker refers to it
            try:
                asyncio.run_coroutine_threadsafe(_shutdown(), self.loop).result(timeout)
            except Exception:  # noqa: BLE001,S110 - stopping anyway
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive() and not self.loop.is_closed():
            self.loop.close()

    # running things on the loop --------------------------------------------------------
    def submit(self, coro: Awaitable) -> concurrent.futures.Future:
        """Run ``coro`` on this loop; a concurrent future of its result."""
        if self._stopped:
            coro.close()  # type: ignore[attr-defined]
            raise TransportError("UCX loop stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Awaitable) -> Any:
        """``await ucx_loop.run(peer.send(...))`` from another event loop. Cancelling the
        caller cancels the task on the UCX loop, but the caller resumes at once: to know that
        a buffer is free again, await :meth:`UcxPeer.cancel_recv` / ``cancel_transfer``."""
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
        self.loop.call_soon_threadsafe(_do)
        return fut.result(timeout)

    def on_loop(self) -> bool:
        return threading.get_ident() == self._thread_id

    # engine ----------------------------------------------------------------------------
    def _kick(self) -> None:
        self._kicked = True
        w = self._wake
        if w is not None:
            _resolve(w, None)

    def _add_peer(self, p: UcxPeer) -> None:
        self._peers = self._peers + [p]
        self._kick()

    def _remove_peer(self, p: UcxPeer) -> None:
        self._peers = [q for q in self._peers if q is not p]

    async def _progress_engine(self) -> None:
        loop = asyncio.get_running_loop()
        last_busy = time.monotonic()
        next_sweep = last_busy + SWEEP_S
        while True:
            busy = False
            peers = self._peers
            for p in peers:
                if p._poll():
                    busy = True
            now = time.monotonic()
            if now >= next_sweep:
                for p in peers:
                    p._sweep(now)
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
            if not all(p._arm() for p in peers):
                continue
            timeout = None
            if any(p._inflight or p._closed for p in peers):
                timeout = SAFETY_WAKE_S
            if any(p._arrived or p._discard or p._discard_tags for p in peers):
                timeout = min(timeout or SWEEP_S, max(0.0, next_sweep - now))
            await self._sleep(loop, peers, timeout)
            last_busy = time.monotonic()

    async def _sleep(self, loop, peers, timeout: float | None) -> None:
        fut = loop.create_future()
        self._wake = fut
        fds = [p._epfd for p in peers]
        for fd in fds:
            loop.add_reader(fd, self._kick)
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
        if why == "timeout" and any(p._inflight for p in peers):
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


# ------------------------------------------------------------------------------------------
# Peers
# ------------------------------------------------------------------------------------------
_WAITING, _STARTED, _DONE = 0, 1, 2
DRAIN_SCRATCH = 1  # bytes: unwanted messages are drained as truncated receives


class _Op:
    __slots__ = ("arr", "fut", "kind", "nbytes", "req", "state", "tag", "view")

    def __init__(self, kind: str, tag: int, view: memoryview, arr, fut: asyncio.Future) -> None:
        self.kind = kind
        self.tag = tag
        self.view = view
        self.arr = arr
        self.req = None
        self.fut = fut
        self.state = _WAITING
        self.nbytes = view.nbytes


class UcxPeer:
    """One peer agent over UCX. Construct from any thread (the worker is made on the UCX
    loop); the coroutines run on the :class:`UcxLoop` only."""

    def __init__(self, ucx: UcxLoop, name: str = "") -> None:
        if not ucx.running:
            raise TransportError("UCX loop is not running")
        self.ucx = ucx
        self.name = name
        self._m = _load()
        self._closed = False
        self._ep = None
        self._inflight: dict[int, _Op] = {}                      # id(op) -> op (UCX owns the buffer)
        self._waiting: dict[int, collections.deque] = {}         # tag -> ops without a message yet
        self._arrived: dict[int, collections.deque] = {}         # tag -> (probe result, when)
        self._discard: dict[int, float] = {}                     # transfer prefix -> until
        self._discard_tags: dict[int, float] = {}                # tag -> until (one message)
        self._drains: dict[int, tuple] = {}                      # id(req) -> (req, scratch)
        self._closing = None                                     # the endpoint close request
        self._closed_fut: asyncio.Future | None = None
        self._close_deadline = 0.0
        self._any_tag = self._m.Tag(0)
        self._any_mask = self._m.TagMask(0)
        self.stats = collections.Counter()
        ucx.call(self._open)

    def _open(self) -> None:
        try:
            self._worker = self._m.L.UCXWorker(self.ucx.context)
            self._worker.init_blocking_progress_mode()
        except self._m.UCXError as exc:
            raise _translate(exc, "worker creation") from exc
        self._epfd = self._worker.epoll_file_descriptor
        self._address = bytes(memoryview(self._worker.address))
        self.ucx._add_peer(self)

    # public ----------------------------------------------------------------------------
    def local_address(self) -> bytes:
        """This peer's UCX worker address, to send to the peer over the control connection."""
        return self._address

    @property
    def closed(self) -> bool:
        return self._closed

    def pending(self) -> dict[str, int]:
        """Counts of receives waiting for their message, operations UCX holds a buffer for,
        and arrived messages nobody has claimed yet."""
        return {"waiting": sum(len(q) for q in self._waiting.values()),
                "in_flight": len(self._inflight),
                "unclaimed": sum(len(q) for q in self._arrived.values())}

    async def connect(self, remote_address: bytes, *, error_handling: bool = False) -> None:
        """An endpoint to the peer's worker. ``error_handling`` stays off by default: with it
        on, UCX refuses shared memory (see the module docstring)."""
        self._check()
        if self._ep is not None:
            raise RuntimeError("already connected")
        L = self._m.L
        remote_address = bytes(remote_address)
        # UCX parses the address without checking it: a malformed one fails an assertion and
        # aborts the process. It comes from an authenticated peer; this catches the obvious.
        if not remote_address or (remote_address[0] & 0x0F) != (self._address[0] & 0x0F):
            raise TransportError("not a UCX worker address of this UCX version")
        try:
            addr = L.UCXAddress.create_from_buffer(remote_address)
            self._ep = L.UCXEndpoint.create_from_worker_address(self._worker, addr, error_handling)
        except self._m.UCXError as exc:
            raise _translate(exc, "connect") from exc
        self.ucx._kick()

    async def send(self, tag: int, buf) -> None:
        """Send ``buf`` as one tagged message. ``buf`` must stay unchanged until this returns;
        the view is held until UCX is done with it, even when the caller is cancelled (UCX
        cannot cancel a send: cancellation waits until the peer has taken or drained it)."""
        self._check()
        if self._ep is None:
            raise RuntimeError("send before connect")
        view = _view(buf, writable=False)
        op = _Op("send", tag, view, self._m.Array(view), asyncio.get_running_loop().create_future())
        try:
            op.req = self._ep.tag_send(op.arr, self._m.Tag(tag))
        except self._m.UCXError as exc:
            raise _translate(exc, f"send of tag {tag:#x}") from exc
        op.state = _STARTED
        self._track(op)
        self.stats["sends"] += 1
        await self._wait(op)
        self.stats["bytes_sent"] += op.nbytes

    async def recv(self, tag: int, buf) -> None:
        """Receive the message tagged ``tag`` straight into ``buf`` (writable, exactly the
        message's length). See the module docstring for what cancellation guarantees."""
        self._check()
        view = _view(buf, writable=True)
        op = _Op("recv", tag, view, self._m.Array(view), asyncio.get_running_loop().create_future())
        queue = self._arrived.get(tag)
        if queue:
            probe, _ = queue.popleft()
            if not queue:
                del self._arrived[tag]
            self._start_recv(op, probe)
        else:
            self._waiting.setdefault(tag, collections.deque()).append(op)
            self.ucx._kick()
        self.stats["recvs"] += 1
        await self._wait(op)
        self.stats["bytes_received"] += op.nbytes

    async def cancel_recv(self, tag: int, *, drain_s: float | None = None) -> bool:
        """Cancel the receives waiting on ``tag``: they raise ``TransferError``
        (``TRANSFER_CANCELLED``) and their buffers were never handed to UCX. Returns True
        when there was such a receive. A receive whose data was already landing is left to
        finish; this returns once it has (the buffer is then free either way). A message of
        ``tag`` that arrived unclaimed, or arrives within ``drain_s`` (default
        ``unclaimed_ttl_s``), is drained so that its sender completes."""
        self._check_thread()
        found = False
        for op in self._waiting.pop(tag, ()):
            found = True
            self._fail(op, TransferError(f"receive of tag {tag:#x} cancelled before its data came",
                                         ErrorCode.TRANSFER_CANCELLED))
            self.stats["cancelled_unstarted"] += 1
        arrived = self._arrived.pop(tag, ())
        for probe, _ in arrived:
            self._drain(probe)
        if not arrived:
            self._discard_tags[tag] = time.monotonic() + self._drain_s(drain_s)
        await self._quiesce(lambda t: t == tag)
        return found

    async def cancel_transfer(self, direction: int, transfer_id: int, *, drain_s: float | None = None) -> int:
        """Cancel every receive of one transfer (as :meth:`cancel_recv`), drain its messages
        that arrived or will arrive within ``drain_s`` (default: ``unclaimed_ttl_s``), and wait
        for its receives that were already landing. Returns how many receives were cancelled
        before their data came."""
        self._check_thread()
        prefix = transfer_prefix(direction, transfer_id)
        n = 0
        for tag in [t for t in self._waiting if t >> INDEX_BITS == prefix]:
            for op in self._waiting.pop(tag):
                self._fail(op, TransferError(f"transfer {transfer_id} cancelled before its data came",
                                             ErrorCode.TRANSFER_CANCELLED))
                n += 1
        self.stats["cancelled_unstarted"] += n
        for tag in [t for t in self._arrived if t >> INDEX_BITS == prefix]:
            for probe, _ in self._arrived.pop(tag):
                self._drain(probe)
        self._discard[prefix] = time.monotonic() + self._drain_s(drain_s)
        await self._quiesce(lambda t: t >> INDEX_BITS == prefix)
        return n

    def close(self) -> None:
        """Close, without blocking: receives still waiting for their message fail at once with
        TransportError (UCX never had their buffers); the endpoint is flushed and closed while
        the engine keeps progressing (at most ``CLOSE_S``); then every operation still in
        flight ends (completed, or failed with TransportError) and the worker is released
        (:meth:`wait_closed`). An operation UCX never finished (the peer vanished mid-way)
        keeps its buffer view, and the worker, referenced for ever: nothing is freed under UCX.
        Idempotent, from any thread."""
        if self._closed or not self.ucx.running:
            return
        if self.ucx.on_loop():
            self._close_now()
        else:
            self.ucx.call(self._close_now)

    # internals -------------------------------------------------------------------------
    def _drain_s(self, drain_s: float | None) -> float:
        return self.ucx.unclaimed_ttl_s if drain_s is None else drain_s

    def _check(self) -> None:
        self._check_thread()
        if self._closed:
            raise TransportError("UCX peer closed")

    def _check_thread(self) -> None:
        if not self.ucx.on_loop():
            raise RuntimeError("UcxPeer coroutines run on its UcxLoop: ucx_loop.submit(...) / "
                               "await ucx_loop.run(...)")

    def _track(self, op: _Op) -> None:
        if op.req.completed:
            self._finish(op)
        else:
            self._inflight[id(op)] = op
            self.ucx._kick()

    def _finish(self, op: _Op) -> None:
        self._inflight.pop(id(op), None)
        op.state = _DONE
        try:
            op.req.check_error()
        except self._m.UCXError as exc:
            if not op.fut.done():
                op.fut.set_exception(_translate(exc, f"{op.kind} of tag {op.tag:#x}"))
        else:
            if not op.fut.done():
                op.fut.set_result(None)
        op.req = op.arr = None
        op.view.release()

    def _fail(self, op: _Op, exc: BaseException) -> None:
        op.state = _DONE
        if not op.fut.done():
            op.fut.set_exception(exc)
        op.arr = None
        op.view.release()

    async def _wait(self, op: _Op) -> None:
        cancelled = False
        while not op.fut.done():
            try:
                await asyncio.shield(op.fut)
            except asyncio.CancelledError:
                if op.fut.done():             # finished meanwhile: still a cancellation
                    cancelled = True
                    break
                if op.state == _WAITING:      # never handed to UCX: nothing can write to it
                    self._unwait(op)
                    self.stats["cancelled_unstarted"] += 1
                    raise
                cancelled = True              # UCX owns the buffer: wait for it to let go
                self.stats["cancel_waited"] += 1
            except BaseException:  # noqa: BLE001 - the op's own outcome, raised below
                break
        if cancelled:
            if op.fut.done() and not op.fut.cancelled():
                op.fut.exception()            # retrieved: the cancellation wins
            raise asyncio.CancelledError
        op.fut.result()

    def _unwait(self, op: _Op) -> None:
        q = self._waiting.get(op.tag)
        if q is not None:
            try:
                q.remove(op)
            except ValueError:
                pass
            if not q:
                del self._waiting[op.tag]
        op.state = _DONE
        op.fut.cancel()
        op.arr = None
        op.view.release()

    async def _quiesce(self, match: Callable[[int], bool]) -> None:
        while True:
            busy = [op.fut for op in self._inflight.values() if op.kind == "recv" and match(op.tag)]
            if not busy:
                return
            self.stats["cancel_waited"] += len(busy)
            await asyncio.wait(busy)

    def _start_recv(self, op: _Op, probe) -> None:
        if probe.length != op.nbytes:
            self._drain(probe)
            self._fail(op, TransportError(
                f"message tagged {op.tag:#x} is {probe.length} bytes, the receive buffer "
                f"{op.nbytes}", ErrorCode.SIZE_MISMATCH))
            return
        try:
            op.req = self._worker.tag_recv_with_handle(op.arr, probe)
        except self._m.UCXError as exc:
            self._fail(op, _translate(exc, f"recv of tag {op.tag:#x}"))
            return
        op.state = _STARTED
        self._track(op)

    def _drain(self, probe) -> None:
        """Receive an unwanted message into a scratch byte: UCX completes it as truncated,
        and a rendezvous sender gets its completion."""
        scratch = bytearray(DRAIN_SCRATCH)
        try:
            req = self._worker.tag_recv_with_handle(self._m.Array(scratch), probe)
        except self._m.UCXError:
            return
        self.stats["drained"] += 1
        if not req.completed:
            self._drains[id(req)] = (req, scratch)

    def _on_message(self, probe, now: float) -> None:
        tag = probe.sender_tag.value
        q = self._waiting.get(tag)
        if q:
            op = q.popleft()
            if not q:
                del self._waiting[tag]
            self._start_recv(op, probe)
            return
        if self._closed or self._discard_tags.pop(tag, None) is not None or (tag >> INDEX_BITS) in self._discard:
            # (closing: nobody will claim it, and teardown does not drain the arrived table)
            self._drain(probe)
            return
        self._arrived.setdefault(tag, collections.deque()).append((probe, now))
        self.stats["unexpected"] += 1

    def _poll(self) -> bool:
        """Progress the worker, complete finished requests, take arrived messages (loop thread)."""
        w = self._worker
        if w is None:
            return False
        if self._closed:
            w.progress()
            self._drain_arrivals()
            if self._closing is None or self._closing.completed or time.monotonic() > self._close_deadline:
                self._teardown(time.monotonic())
                return True
        busy = w.progress_once()
        if busy:
            w.progress()
            for op in [op for op in self._inflight.values() if op.req.completed]:
                self._finish(op)
            if self._drains:
                for key in [k for k, (r, _) in self._drains.items() if r.completed]:
                    del self._drains[key]
        now = None
        while True:
            probe = w.tag_probe(self._any_tag, self._any_mask, True)
            if not probe.matched:
                break
            busy = True
            self._on_message(probe, now if now is not None else (now := time.monotonic()))
        return busy

    def _drain_arrivals(self) -> None:
        """Drain every message UCX holds unclaimed (a closing worker must not keep any: its
        destructor would receive each one in full, reading a dead peer's memory over CMA)."""
        w = self._worker
        while True:
            probe = w.tag_probe(self._any_tag, self._any_mask, True)
            if not probe.matched:
                return
            self._drain(probe)

    def _arm(self) -> bool:
        if self._worker is None:
            return True
        try:
            return self._worker.arm()
        except self._m.UCXError:
            return False

    def _sweep(self, now: float) -> None:
        for marks in (self._discard, self._discard_tags):
            for key in [k for k, until in marks.items() if until <= now]:
                del marks[key]
        ttl = self.ucx.unclaimed_ttl_s
        for tag in [t for t, q in self._arrived.items() if q[0][1] + ttl <= now]:
            q = self._arrived[tag]
            while q and q[0][1] + ttl <= now:
                self._drain(q.popleft()[0])
                self.stats["unclaimed_expired"] += 1
            if not q:
                del self._arrived[tag]

    def _close_now(self) -> None:
        """Start closing (loop thread): fail what UCX never held, start the endpoint close."""
        if self._closed:
            return
        self._closed = True
        err = TransportError("UCX peer closed")
        for q in self._waiting.values():
            for op in q:
                self._fail(op, err)
        self._waiting.clear()
        for q in self._arrived.values():
            for probe, _ in q:
                self._drain(probe)
        self._arrived.clear()
        self._closed_fut = self.ucx.loop.create_future()
        self._close_deadline = time.monotonic() + CLOSE_S
        if self._ep is not None:
            # Not close_blocking(): it progresses only this worker, and a flush that needs the
            # peer (tcp, a peer on this same loop) would wait for ever. The engine keeps
            # progressing us until the close request completes (or CLOSE_S passes).
            try:
                self._closing = self._ep.close()
            except Exception:  # noqa: BLE001 - closing anyway
                self._closing = None
        self.ucx._kick()

    def _teardown(self, now: float) -> None:
        """Finish closing (loop thread): every operation ends; the worker goes (or, when UCX
        still holds something, is kept for ever together with the buffers it holds)."""
        w = self._worker
        closing = self._closing
        clean = closing is None or closing.completed
        w.progress()
        self._drain_arrivals()
        w.progress()
        for op in list(self._inflight.values()):
            if op.req.completed:
                self._finish(op)
            else:   # UCX cannot let go of it: fail the caller, keep the buffer referenced
                self._inflight.pop(id(op), None)
                if not op.fut.done():
                    op.fut.set_exception(TransportError(
                        f"UCX peer closed with its {op.kind} of tag {op.tag:#x} unfinished"))
                _orphans.append(op)
                clean = False
        for req, scratch in self._drains.values():
            if not req.completed:
                _orphans.append((req, scratch))
                clean = False
        self._drains.clear()
        self.ucx._remove_peer(self)
        try:
            self.ucx.loop.remove_reader(self._epfd)
        except (ValueError, OSError):
            pass
        if not clean:
            # Dropping an endpoint whose close did not finish blocks in its destructor until
            # the peer answers; keep it, and its worker, instead.
            _orphans.append((self._ep, closing, w))
            self.stats["orphaned"] += 1
        self._ep = self._closing = None
        self._worker = None
        if not self._closed_fut.done():
            self._closed_fut.set_result(None)

    async def wait_closed(self) -> None:
        """After :meth:`close`: returns once every operation has ended and the worker is gone."""
        self._check_thread()
        if not self._closed:
            raise RuntimeError("wait_closed() before close()")
        await asyncio.shield(self._closed_fut)


#: Operations UCX never finished when their peer closed: kept so their buffers stay mapped.
_orphans: list = []
