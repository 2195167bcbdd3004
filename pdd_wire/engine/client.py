"""``EngineClient``: how an engine adapter talks to its local pdd-wire agent.

The engine registers its KV memory once, then asks the agent to move blocks and token IDs and
listens for events. Every call is a request answered by the agent; failures raise
:class:`EngineRequestError` carrying the agent's :class:`~pdd_wire.errors.ErrorCode`.

Example (prefill side, site A, sending one request's KV to site B)::

    from pdd_wire import EngineClient, SharedMemory

    async with EngineClient("/run/pdd-wire/pdd-wire-A.sock", engine="prefill-0") as eng:
        mem = SharedMemory(256 << 20)               # the engine's KV pool, shared by fd
        kv = await eng.register(mem, block_bytes=2 << 20)
        await eng.send_kv("req-42", [kv.blocks(0, 16)], to=["B"])
        done = await eng.wait("req-42")            # KvSent, or TransferFailed with a reason
        await eng.send_tokens("req-42", "B", [101, 7592, 2088])

Decode side, site B::

        kv = await eng.register(mem, block_bytes=2 << 20)
        await eng.post_recv("req-42", [kv.blocks(32, 16)], from_site="A")
        ev = await eng.wait("req-42", kinds=OUTCOMES)  # KvReceived: blocks 32..47 hold the KV
                                                          # (or TransferFailed, RequestAborted)
        tokens = await eng.wait_tokens("req-42")   # TokensReceived
"""

from __future__ import annotations

import array
import asyncio
import collections
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import EngineRequestError, ErrorCode, TransportError
from ..memory import SharedMemory
from . import protocol as p
from .events import HANDOFF_EVENTS, OUTCOMES, TRANSFER_OUTCOMES, EventBox, EventOverflow

__all__ = ["EngineClient", "RegionHandle", "EventOverflow", "HANDOFF_EVENTS", "OUTCOMES", "TRANSFER_OUTCOMES"]


@dataclass(frozen=True)
class RegionHandle:
    """A registered region: ``region`` is the agent's id for it."""

    region: int
    size: int
    block_bytes: int

    @property
    def n_blocks(self) -> int:
        return self.size // self.block_bytes

    def blocks(self, first: int, count: int) -> tuple[int, int, int]:
        """Blocks ``first .. first+count-1`` of this region, as an extent for send/post."""
        if first < 0 or count <= 0 or first + count > self.n_blocks:
            raise ValueError(f"blocks {first}..{first + count - 1} outside 0..{self.n_blocks - 1}")
        return (self.region, first, count)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class EngineClient:
    """Async client of the engine socket.

    Args:
        path: the agent's engine socket (``listen.engine_socket`` in its config).
        engine: a name for logs and ``/v1/status``.
        max_events: events kept, all requests together, until the engine takes them; past
            that, waits raise :class:`EventOverflow` (the engine is not taking its events).
        max_request_events: events kept for one request (its outcomes, and separately its token
            and handoff stream); past that, waits on that request raise :class:`EventOverflow`.
        on_overflow: called with a request id (``None``: the whole client) when events for it
            are first lost, for engines that poll :meth:`events` rather than wait.

    Events are delivered per request (:mod:`pdd_wire.engine.events`): a waiter sees only its
    request's events, in the order the agent sent them, and is woken only by those.
    """

    def __init__(self, path: str, engine: str = "engine", *, max_events: int = 100_000,
                 max_request_events: int = 10_000, on_overflow: Callable[[str | None], None] | None = None) -> None:
        self.path = path
        self.engine = engine
        self.agent: dict = {}
        self._sock: socket.socket | None = None
        self._ids = 0
        self._pending: dict[int, asyncio.Future] = {}
        self._events = EventBox(max_events=max_events, max_request_events=max_request_events,
                                on_overflow=on_overflow)
        self._reading = False  # the socket is registered with the loop's reader callbacks
        self._decoder = p.Decoder(to_agent=False)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed_exc: BaseException | None = None
        self._ended: asyncio.Future[BaseException] | None = None  # set when the connection ends
        self._wlock: asyncio.Lock | None = None
        self._expected: collections.OrderedDict[str, None] = collections.OrderedDict()  # wait_tokens asked

    async def connect(self) -> "EngineClient":
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, self.path)
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot reach the agent at {self.path}: {exc.strerror or exc}") from exc
        self._sock = sock
        self._wlock = asyncio.Lock()
        self._ended = loop.create_future()
        # Replies and events are read in a reader callback, not a task looping on sock_recv: that
        # re-registered the socket with epoll and stepped a task for every message, the largest item
        # of the clients' CPU per transfer here (docs/benchmarks.md, "Inline chunks").
        self._loop = loop
        loop.add_reader(sock.fileno(), self._readable)
        self._reading = True
        try:
            self.agent = await self._call(p.Hello(engine=self.engine, pid=os.getpid()))
        except BaseException:
            await self.close()  # the socket and its reader go with the failed connect
            raise
        return self

    async def __aenter__(self) -> "EngineClient":
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        self._stop_reading()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._fail_pending(TransportError("client closed"))
        if self._events.closed is None:
            self._events.close(TransportError("client closed"))
        self._end(TransportError("client closed"))

    # -- requests ----------------------------------------------------------------------------
    async def register(self, mem: SharedMemory | int, *, block_bytes: int, size: int | None = None,
                       name: str = "") -> RegionHandle:
        """Share memory with the agent. ``mem`` is a :class:`SharedMemory` or a mappable fd
        (then ``size`` is required). The agent maps the same pages; the fd stays the caller's."""
        fd = mem.fd if isinstance(mem, SharedMemory) else int(mem)
        size = mem.size if isinstance(mem, SharedMemory) else size
        if size is None:
            raise ValueError("size is required when registering a raw fd")
        res = await self._call(p.Register(size=size, block_bytes=block_bytes, name=name), fd=fd)
        return RegionHandle(res["region"], size, block_bytes)

    async def deregister(self, region: RegionHandle) -> None:
        await self._call(p.Deregister(region=region.region))

    async def post_recv(self, request_id: str, blocks: Iterable[tuple[int, int, int]], *,
                        from_site: str | None = None, ttl_s: float | None = None,
                        max_skip_blocks: int | None = None) -> None:
        """Allow KV for ``request_id`` to land in ``blocks``; the agent writes nowhere else. If no
        transfer claims them within ``ttl_s`` (default ``transfer.post_ttl_s``) they are handed
        back with a ``transfer_failed`` event. ``max_skip_blocks``: at most this many leading blocks
        may be left out because this node holds them (prefix inventory); None: no limit."""
        await self._call(p.PostRecv(request_id=request_id, blocks=list(blocks), from_site=from_site, ttl_s=ttl_s,
                                    max_skip_blocks=max_skip_blocks))

    async def send_kv(self, request_id: str, blocks: Iterable[tuple[int, int, int]], *, to: list[str],
                      deadline_s: float | None = None, block_hashes: list[int] | None = None,
                      lease_s: float | None = None) -> list[dict]:
        """Send ``blocks`` to every destination in ``to`` (``"B"`` or ``"B/b1"``); one transfer
        each, reading the same pages. Returns ``[{"to": peer, "transfer_id": n}, ...]``.
        ``block_hashes`` (one chained hash per block, :func:`pdd_wire.engine.hashes.chain_hashes`):
        a destination whose node holds a leading run of them receives only the rest.
        ``lease_s``: how long each destination holds the KV for its receive to be posted (the
        blocks stay pinned meanwhile); default: the receiver's ``transfer.unposted_wait_s``."""
        res = await self._call(p.SendKv(request_id=request_id, blocks=list(blocks), to=list(to),
                                        deadline_s=deadline_s, block_hashes=block_hashes, lease_s=lease_s))
        return res["transfers"]

    async def send_tokens(self, request_id: str, to: str, tokens: list[int]) -> int:
        """Relay token IDs on the control lane; returns the sequence number of the first one."""
        res = await self._call(p.SendTokens(request_id=request_id, to=to, tokens=list(tokens)))
        return res["seq"]

    async def expect_tokens(self, request_id: str, from_site: str | None = None) -> int:
        """Take the token IDs peers relay for ``request_id`` (from ``from_site`` only; None = any
        site). Posting its receive or sending its KV or tokens does this too; tokens reach no
        other engine. Those that came before are delivered now; returns how many frames."""
        self._expected[request_id] = None
        self._expected.move_to_end(request_id)
        while len(self._expected) > 4096:  # asking again is harmless
            self._expected.popitem(last=False)
        res = await self._call(p.ExpectTokens(request_id=request_id, from_site=from_site))
        return res["delivered"]

    async def abort(self, request_id: str, reason: str = "aborted by engine") -> int:
        res = await self._call(p.Abort(request_id=request_id, reason=reason))
        return res.get("cancelled", 0)

    async def status(self) -> dict:
        return await self._call(p.Status())

    async def choose_pipeline(self, request_id: str, *, to: str, input_tokens: int, prefix_hit_tokens: int = 0,
                              expected_output_tokens: int, kv_bytes_per_token: int,
                              block_hashes: list[int] | None = None, block_tokens: int = 0) -> dict:
        """The agent's pipeline choice for a request (``P-MD``, ``P-RLD-MD`` or, only through
        the anomalous-traffic filter, ``P-RLD``), from the live link to ``to``. With
        ``block_hashes`` (and ``block_tokens`` per block) the matched prefix comes from ``to``'s
        prefix inventory (one round trip; the blocks are leased for the request's send).
        Returns ``{"pipeline", "reason", "predicted_wan_s", "prefix_hit_tokens",
        "prefix_source", "detail", "link": {...}}``."""
        return await self._call(p.ChoosePipeline(
            request_id=request_id, to=to, input_tokens=input_tokens, prefix_hit_tokens=prefix_hit_tokens,
            expected_output_tokens=expected_output_tokens, kv_bytes_per_token=kv_bytes_per_token,
            block_hashes=block_hashes, block_tokens=block_tokens))

    async def kv_stored(self, blocks: Iterable[tuple[int, int, int]], hashes: list[int]) -> int:
        """Decode side: this engine holds these blocks (``hashes[i]`` for the i-th block) and
        may reuse them: the node's prefix inventory. Returns the blocks the inventory holds."""
        return (await self._call(p.KvStored(blocks=list(blocks), hashes=list(hashes))))["held"]

    async def kv_evict(self, hashes: list[int], *, force: bool = False) -> dict:
        """Decode side: ask to drop blocks. Returns ``{"evicted": [...], "kept": [...]}``: keep
        the ``kept`` ones (leased to a request in flight) unless ``force``."""
        return await self._call(p.KvEvict(hashes=list(hashes), force=force))

    async def prefix_release(self, request_id: str) -> bool:
        """Decode side: the request's reused prefix blocks were used; end their lease."""
        return (await self._call(p.PrefixRelease(request_id=request_id)))["released"]

    async def estimate(self, to: str, nbytes: int) -> dict:
        """How long ``nbytes`` of KV to ``to`` would take now (``seconds``; None while the link's
        bandwidth is unknown), with the live link figures it comes from."""
        return await self._call(p.Estimate(to=to, bytes=nbytes))

    async def set_load(self, load: float) -> None:
        """Report this engine's decode load (0 = idle, 1 = every slot in use). RLD engines report
        it; the handoff mode policy (one-shot when busy, catch-up with headroom) reads it."""
        await self._call(p.SetLoad(load=load))

    # -- handoff (proto/handoff.md; events: Emit, Extend, StopGenerating, StartGenerating, HandoffDone)
    async def handoff_rld(self, request_id: str, to: str, *, epoch: int = 0,
                          deadline_s: float | None = None) -> dict:
        """RLD: this engine decodes ``request_id`` and hands its output to MD at ``to``. Report
        each generated token with :meth:`handoff_tokens`; emit only what ``Emit`` events allow."""
        return await self._call(p.HandoffRld(request_id=request_id, to=to, epoch=epoch, deadline_s=deadline_s))

    async def handoff_md(self, request_id: str, from_site: str, *, epoch: int = 0,
                         deadline_s: float | None = None) -> dict:
        """MD: take ``request_id`` over from RLD at ``from_site`` once its posted KV is here.
        Answer each ``Extend`` event with :meth:`handoff_extended`; decode from ``StartGenerating``."""
        return await self._call(p.HandoffMd(request_id=request_id, from_site=from_site, epoch=epoch,
                                            deadline_s=deadline_s))

    async def handoff_tokens(self, request_id: str, tokens: list[int], *, last: bool = False) -> str:
        """Tokens this engine generated for a handoff request; returns who owns the output now."""
        res = await self._call(p.HandoffTokens(request_id=request_id, tokens=list(tokens), last=last))
        return res["owner"]

    async def handoff_extended(self, request_id: str, absorbed: int) -> str:
        """MD: the extend in flight is done (every relayed token < ``absorbed`` is in the KV)."""
        res = await self._call(p.HandoffExtended(request_id=request_id, absorbed=absorbed))
        return res["owner"]

    async def handoff_fail(self, request_id: str, reason: str = "md_failed") -> str:
        """MD: this engine cannot take the request over; before it started, RLD keeps it."""
        res = await self._call(p.HandoffFail(request_id=request_id, reason=reason))
        return res["owner"]

    # -- events (delivered per request: pdd_wire.engine.events) ----------------------------------
    async def wait(self, request_id: str, *, kinds: tuple[type, ...] = TRANSFER_OUTCOMES,
                   timeout: float | None = None) -> p.Msg:
        """The next event of one of ``kinds`` for ``request_id`` (removed from its mailbox).
        The default, ``TRANSFER_OUTCOMES``, is a transfer's end: ``KvSent``, ``KvReceived`` or
        ``TransferFailed``. A receive that no transfer claimed yet can also end with
        ``RequestAborted`` (a peer aborted the request): wait for ``OUTCOMES`` on a posted
        receive (``kinds=OUTCOMES``), or a peer's abort is only seen at the timeout.

        Raises :class:`EventOverflow` if events for the request (or the client) were lost and
        none of ``kinds`` is kept, the connection's error if it ended, ``TimeoutError``."""
        return await self._events.wait(request_id, kinds, timeout)

    async def wait_tokens(self, request_id: str, *, timeout: float | None = None) -> p.TokensReceived:
        """The next relayed token frame of ``request_id``. The first wait on a request for which
        this client never called :meth:`expect_tokens` calls it first (from any site)."""
        if request_id not in self._expected:
            await self.expect_tokens(request_id)
        ev = await self.wait(request_id, kinds=(p.TokensReceived,), timeout=timeout)
        assert isinstance(ev, p.TokensReceived)
        return ev

    def take(self, request_id: str, *, kinds: tuple[type, ...] = HANDOFF_EVENTS) -> list[p.Msg]:
        """Every kept event of ``kinds`` for ``request_id``, in order, without waiting."""
        return self._events.take(request_id, kinds)

    async def next_event(self, *, timeout: float | None = None) -> p.Msg:
        """The oldest event of any request (for an engine that handles all its events in one task)."""
        return await self._events.next_event(timeout)

    async def wait_for(self, predicate: Callable[[p.Msg], bool], *, timeout: float | None = None) -> p.Msg:
        """The oldest event ``predicate`` accepts, of any request (e.g. :class:`~.protocol.Shutdown`).
        It looks at every kept event and wakes on each new one: prefer :meth:`wait`."""
        return await self._events.wait_for(predicate, timeout=timeout)

    def events(self) -> list[p.Msg]:
        """Take every event received so far, in arrival order."""
        return self._events.take_all()

    def forget(self, request_id: str) -> int:
        """Drop the events kept for ``request_id`` and its overflow mark; returns how many."""
        self._expected.pop(request_id, None)
        return self._events.forget(request_id)

    # -- plumbing ----------------------------------------------------------------------------
    async def _call(self, msg: p.Msg, *, fd: int | None = None) -> dict:
        sock, wlock = self._sock, self._wlock
        if sock is None or wlock is None:
            raise TransportError("not connected")
        if self._closed_exc is not None:
            raise _again(self._closed_exc)  # a new one each call: re-raising one would grow its traceback
        self._ids += 1
        msg.id = self._ids
        fut = asyncio.get_running_loop().create_future()
        self._pending[msg.id] = fut
        data = p.encode(msg)
        async with wlock:
            if fd is None:
                await asyncio.get_running_loop().sock_sendall(sock, data)
            else:
                await self._sendmsg_fd(sock, data, fd)
        reply = await fut
        if isinstance(reply, p.Err):
            raise EngineRequestError(reply.message, ErrorCode(reply.code))
        return reply.result

    async def _sendmsg_fd(self, sock: socket.socket, data: bytes, fd: int) -> None:
        loop = asyncio.get_running_loop()
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        while True:
            try:
                n = sock.sendmsg([data], anc)
                break
            except (BlockingIOError, InterruptedError):
                w: asyncio.Future[None] = loop.create_future()
                loop.add_writer(sock.fileno(), _wake, w)
                try:
                    await w
                finally:
                    loop.remove_writer(sock.fileno())
        if n < len(data):
            await loop.sock_sendall(sock, data[n:])  # the fd went with the first byte

    def _stop_reading(self) -> None:
        if self._reading and self._sock is not None and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
        self._reading = False

    def _readable(self) -> None:
        """The socket is readable (on the loop): take what is there, hand each message on."""
        sock = self._sock
        if sock is None:
            return
        try:
            data = sock.recv(256 * 1024)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._broken(TransportError(f"engine socket failed: {exc}"))
            return
        if not data:  # the agent let go of this engine's memory before closing (proto/engine.md §6)
            self._broken(self._closed_exc or TransportError("the agent closed the engine socket"))
            return
        try:
            for msg in self._decoder.feed(data):
                if isinstance(msg, (p.Ok, p.Err)) and msg.id:
                    fut = self._pending.pop(msg.id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif isinstance(msg, p.Err):
                    # The agent ends the connection: calls fail now, but the connection has ended
                    # (wait_closed, waits) only at its end-of-file, once the agent let go of our memory.
                    ended = EngineRequestError(msg.message, ErrorCode(msg.code))
                    self._closed_exc = ended
                    self._fail_pending(ended)
                else:
                    self._events.put(msg)
        except (TransportError, EngineRequestError) as exc:
            self._broken(exc)
        except Exception as exc:
            self._broken(TransportError(f"engine socket failed: {exc}"))

    def _broken(self, exc: BaseException) -> None:
        """The connection cannot go on: every pending call and every wait raises ``exc``."""
        self._stop_reading()
        self._closed_exc = exc
        self._fail_pending(exc)
        self._events.close(exc)
        self._end(exc)

    def _end(self, exc: BaseException) -> None:
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(exc)

    @property
    def broken(self) -> BaseException | None:
        """The error that ended the connection, or is ending it (an ``err`` with id 0 came and
        the agent's end-of-file has not yet: the engine's memory is not free yet); None while
        it serves."""
        return self._closed_exc

    @property
    def closed(self) -> bool:
        """The connection has ended (the agent's end-of-file, or :meth:`close`)."""
        return self._ended is not None and self._ended.done()

    async def wait_closed(self) -> BaseException:
        """Until the connection ends -- the agent stopped or dropped it, or :meth:`close` -- and
        the error that ended it. Lost events (an overflow) do not end it."""
        if self._ended is None:
            raise TransportError("not connected")
        return await asyncio.shield(self._ended)

    def _fail_pending(self, exc: BaseException) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._pending.clear()


def _again(exc: BaseException) -> BaseException:
    """A fresh exception like ``exc`` (its type, code and message)."""
    if isinstance(exc, (EngineRequestError, TransportError)):
        return type(exc)(str(exc), exc.code)
    return exc
