"""Inbound WAN connections: accept, read the preamble, and hand each connection to its session.

A control connection must say HELLO within ``timeouts.handshake_s``, naming a configured peer
(and, with TLS, presenting a certificate for it); the session then runs the handshake. With a
fleet, a member without a session is given one first if etcd lists it (``admit``), its
registered certificate fingerprint pinned; a HELLO from a member this agent dials is a knock:
refused with DIAL_BACK, and dialed (proto/handshake.md §8). A bulk
connection is adopted on a bulk thread and must say BULK_HELLO with the token of a live session.
Anything else is closed.

Two pools, so that connections nobody has authenticated cannot lock a peer out: a connection
still in its handshake (preamble, TLS, HELLO / BULK_HELLO) holds one of ``limits.max_handshakes``
slots for at most ``timeouts.handshake_s`` in all, and when the pool is full the one of lowest
rank, oldest first, is closed for the newcomer. The rank counts only what the agent has verified,
never what the peer has merely sent (proto/handshake.md §2): no whole preamble (0); a preamble and
nothing proven yet (1: a control connection in TLS or, plaintext, before HELLO; a bulk connection
before its BULK_HELLO names a live session, which in TLS mode ``auto`` is plaintext); mutual TLS
done (2); a bulk connection attached to its session (3). Unauthenticated input thus reaches rank 1
at most, and there competes oldest first: a peer gets in that finishes its handshake before the
flood opens ``max_handshakes`` connections after it. Authenticated connections count against
``limits.max_peer_connections`` (:class:`Room`): one over it is refused in so many words, ERROR
TOO_MANY_CONNECTIONS answering its HELLO or BULK_HELLO (proto/handshake.md §2), so that its
dialer can tell a full listener from a refused certificate.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .config import Config
from .errors import ErrorCode, FatalHandshakeError, PddWireError, ProtocolError, TransportError
from .log import limited
from .metrics import Metrics
from .pki import peer_fingerprint
from .transport.bulk import BulkHandler
from .transport.bulk_loop import BulkLoop
from .transport.tcp import KIND_CONTROL, FrameProtocol, adopt, control_protocol, read_preamble
from .wire import FrameType, decode_body
from .wire import messages as m
from .wire.handshake import check_peer

if TYPE_CHECKING:
    from .peers import Peers
    from .session import PeerSession


# Ranks of a connection in its handshake (Handshaking.stage), by what the agent has verified.
NO_PREAMBLE = 0  # not even a whole preamble
UNVERIFIED = 1  # a preamble, nothing proven: anyone can get this far with 8 bytes
VERIFIED = 2  # mutual TLS done: the peer's certificate chains to the CA
ATTACHED = 3  # a bulk connection whose BULK_HELLO named a live session (leaving the pool)


class Handshaking:
    """One inbound connection before its HELLO / BULK_HELLO: what :meth:`close` must end."""

    __slots__ = ("sock", "addr", "task", "conn", "bulk", "pending_bulk", "stage")

    def __init__(self, sock: socket.socket, addr) -> None:
        self.sock = sock
        self.addr = addr
        self.stage = NO_PREAMBLE  # what the agent has verified so far: the rank _cut_oldest cuts by
        self.task: asyncio.Task | None = None
        self.conn: FrameProtocol | None = None  # once adopted
        self.bulk: BulkLoop | None = None  # the loop that owns ``conn`` (bulk connections)
        self.pending_bulk = None  # the bulk thread's adoption, while under way

    def close(self) -> None:
        """End it, whichever loop holds it now."""
        if self.conn is not None:
            if self.bulk is None:
                self.conn.abort()
            else:
                self.bulk.call(self.conn.abort)
        elif self.pending_bulk is not None:
            bulk = self.bulk
            self.pending_bulk.add_done_callback(
                lambda f: f.cancelled() or f.exception() is not None or bulk.call(f.result().abort))
        else:
            self.sock.close()


class Room:
    """The authenticated connections (``limits.max_peer_connections``). A place is taken on the
    main loop (a control connection, at its first frame) or on a bulk thread (a bulk connection,
    at a BULK_HELLO naming a live session, before BULK_WELCOME), and given back by the
    connection's close callback."""

    __slots__ = ("limit", "taken", "_lock")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken = 0
        self._lock = threading.Lock()

    def take(self, *, over: bool = False) -> bool:
        """A place, if one is free (``over``: even if none is, for a connection that replaces one
        whose place comes back as it closes)."""
        with self._lock:
            if self.taken >= self.limit and not over:
                return False
            self.taken += 1
            return True

    def give(self) -> None:
        with self._lock:
            self.taken -= 1


class Inbound:
    """Accepts on the WAN listener. ``bulk_loop(n)`` picks the bulk thread of the n-th bulk
    connection; ``refusing()`` is true once the agent stops."""

    def __init__(self, config: Config, metrics: Metrics, peers: "Peers", *, bulk_loop: Callable[[int], BulkLoop],
                 refusing: Callable[[], bool], log) -> None:
        self.config = config
        self.metrics = metrics
        self.peers = peers
        self.bulk_loop = bulk_loop
        self.ssl_server = None  # the TLS server context, given to listen()
        self.bulk_tls = False  # bulk connections run TLS too (configured certificates only)
        self.refusing = refusing
        self.log = log
        self.address: tuple[str, int] | None = None
        self._sock: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()
        self._handshaking: dict[Handshaking, None] = {}  # oldest first
        self.room = Room(config.limits.max_peer_connections)
        self.full = 0  # connections refused TOO_MANY_CONNECTIONS
        self._unplaced = 0  # control connections checked while the room was full (knocks, replacements)
        self.cut = 0  # handshakes closed for a newcomer (the pool was full)
        self._cut_logged = 0.0
        # Fleet: ``await admit(site, node, names, fingerprint)`` gives a member without a session
        # one, once the connection's certificate (``names`` None: plaintext) is the one etcd lists
        # for it; FatalHandshakeError when it is not.
        self.admit: Callable[[str, str, frozenset[str] | None, str], Awaitable[object]] | None = None

    @property
    def open_connections(self) -> int:
        """WAN connections held open, in their handshake or authenticated."""
        return len(self._handshaking) + self.room.taken

    @property
    def handshaking(self) -> int:
        """Connections still in their handshake (the count ``limits.max_handshakes`` caps)."""
        return len(self._handshaking)

    def listen(self, host: str, port: int, *, ssl_server=None, bulk_tls: bool = True) -> tuple[str, int]:
        """Bind and start accepting (TLS with ``ssl_server``, else plaintext); returns the bound
        address. ``bulk_tls`` false: bulk connections stay plaintext even with ``ssl_server``
        (the generated PKI: a bulk connection is bound to its TLS session by the secret token)."""
        self.ssl_server = ssl_server
        self.bulk_tls = bulk_tls and ssl_server is not None
        self._check_room()
        sock = socket.create_server((host, port), reuse_port=False, backlog=128)
        sock.setblocking(False)
        self._sock = sock
        self.address = sock.getsockname()[:2]
        self._accept_task = asyncio.create_task(self._accept_forever(), name="wan-accept")
        return self.address

    def _check_room(self) -> None:
        """Warn at start when the static peers that dial this agent open more connections than
        ``limits.max_peer_connections`` holds (one control and ``streams`` bulk connections each):
        some of them would be refused TOO_MANY_CONNECTIONS at every attempt. (A fleet's sessions
        come and go with need: docs/operator.md says how to size it.)"""
        c = self.config
        me = (c.site, c.node)
        need = sum(1 + (p.streams or c.transfer.streams) for p in c.peers if (p.site, p.node) < me)
        if need > c.limits.max_peer_connections:
            self.log.warning("limits.max_peer_connections is below what the peers that dial this agent open: some "
                             "will be refused TOO_MANY_CONNECTIONS", max_peer_connections=c.limits.max_peer_connections,
                             needed=need)

    async def stop_accepting(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            await asyncio.gather(self._accept_task, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()

    async def close(self) -> None:
        """End the connections still being set up (sessions own the others)."""
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        rr = itertools.count()
        while True:
            sock, addr = await loop.sock_accept(self._sock)
            if self.refusing():
                sock.close()
                continue
            if len(self._handshaking) >= self.config.limits.max_handshakes:
                self._cut_oldest()
            sock.setblocking(False)
            h = Handshaking(sock, addr)
            self._handshaking[h] = None
            h.task = t = asyncio.create_task(self._serve(h, next(rr)))
            self._conns.add(t)
            t.add_done_callback(self._conns.discard)
            # sock_accept does not yield while connections are queued: let the newcomer read its
            # preamble before the next is accepted, or a flood in the backlog cuts it unread.
            await asyncio.sleep(0)

    def _cut_oldest(self) -> None:
        """Close the handshake of lowest rank (what the agent has verified), the oldest of those."""
        old = min(self._handshaking, key=lambda h: h.stage)  # min keeps the first (oldest) of equals
        del self._handshaking[old]
        if old.task is not None and not old.task.done():
            # Its task may be waiting in sock_recv on the raw socket. Closed under that wait, the
            # socket's number goes to the next socket opened while the loop still holds a reader
            # for it: the next socket's reader is then never registered, or is removed when the
            # wait is cancelled, and its reads are never seen (an engine connection, a peer's).
            # So the task lets go of the socket first, and then it is closed.
            old.task.add_done_callback(lambda _task, h=old: h.close())
            old.task.cancel()
        else:
            old.close()
        self.cut += 1
        self.metrics.error(ErrorCode.HANDSHAKE_TIMEOUT)
        now = time.monotonic()
        if now - self._cut_logged >= 1.0:  # a flood would log a line per connection
            self._cut_logged = now
            self.log.warning("inbound handshake cut: limits.max_handshakes connections were still in theirs",
                             remote=str(old.addr), cut_so_far=self.cut)

    def _leave_pool(self, h: Handshaking) -> None:
        """``h`` passed its handshake: it leaves the handshake pool (its place in the room is taken
        apart); a connection cut for a newcomer meanwhile goes no further (the cut closes it)."""
        if h not in self._handshaking:
            raise TransportError("closed while in its handshake: limits.max_handshakes were in theirs")
        del self._handshaking[h]

    def _full_error(self) -> ProtocolError:
        limits = self.config.limits
        return ProtocolError(f"{self.config.site}/{self.config.node} has its limits.max_peer_connections "
                             f"({limits.max_peer_connections}) authenticated connections open: dial again later",
                             ErrorCode.TOO_MANY_CONNECTIONS)

    def _may_check_unplaced(self, frame) -> bool:
        """The room is full: whether this first frame is a HELLO that may go on to §4's checks
        without a place (proto/handshake.md §2): a fleet knock (its sender sorts higher, so this
        agent dials it: it needs no place) or a replacement of its sender's live control
        connection (which held one); and fewer than limits.max_handshakes such are being checked."""
        if frame.header.type != FrameType.HELLO or self._unplaced >= self.config.limits.max_handshakes:
            return False
        try:
            hello = decode_body(FrameType.HELLO, frame.body)
        except ProtocolError:
            return False
        if (hello.site, hello.node) > (self.config.site, self.config.node):
            return self.admit is not None  # a knock (only a fleet knocks)
        return self._replaceable(self.peers.get(f"{hello.site}/{hello.node}"))

    @staticmethod
    def _replaceable(session: "PeerSession | None") -> bool:
        """``session`` is this agent's listener side with a live control connection (an inbound
        one: it holds a place, given back when a HELLO replacing it aborts it)."""
        return session is not None and not session.dialer and session.control is not None \
            and not session.control.closed

    def _refuse_full(self, conn: FrameProtocol, addr) -> None:
        self.metrics.error(ErrorCode.TOO_MANY_CONNECTIONS)
        self._refused_full(addr, "control")
        conn.fail(self._full_error())

    def _refused_full(self, addr, kind: str) -> None:
        """A connection was refused TOO_MANY_CONNECTIONS (main loop; the ERROR is on its way)."""
        self.full += 1
        limited(self, self.log.warning, "inbound connection refused: limits.max_peer_connections are open",
                connection=kind, limit=self.config.limits.max_peer_connections, code="TOO_MANY_CONNECTIONS",
                remote=_host(addr), detail={"refused_so_far": self.full})

    async def _serve(self, h: Handshaking, n: int) -> None:
        to = self.config.timeouts
        loop = asyncio.get_running_loop()
        try:
            try:
                async with asyncio.timeout(to.handshake_s):  # the whole handshake, every step together
                    kind = await read_preamble(h.sock, to.handshake_s)
                    h.stage = UNVERIFIED
                    if kind == KIND_CONTROL:
                        conn = h.conn = control_protocol(max_body=self.config.limits.max_body,
                                                         max_unsent=self.config.limits.control_buffer_bytes,
                                                         stall_s=to.dead_after_s)
                        first = loop.create_future()
                        # HELLO comes alone: what follows it in the same read is dropped (handshake.md §2)
                        conn.on_frame = lambda c, f: first.done() or (first.set_result(f), c.drop_rest_of_read())
                        conn.on_lost = lambda c, e: first.done() or first.set_exception(
                            TransportError(f"closed before HELLO: {e}"))
                        conn.on_framing_error = self.metrics.error
                        await adopt(h.sock, conn, ssl_ctx=self.ssl_server, timeout=to.handshake_s)
                        if self.ssl_server is not None:  # plaintext: a HELLO proves nothing yet
                            h.stage = VERIFIED
                        frame = await first
                    else:
                        h.bulk = bulk = self.bulk_loop(n)
                        attached = loop.create_future()
                        # (a handshake cut meanwhile never awaits it: its exception is no news)
                        attached.add_done_callback(lambda f: f.cancelled() or f.exception())
                        h.pending_bulk = bulk.submit(self._adopt_bulk(h, bulk, loop, attached))
                        conn = await asyncio.wrap_future(h.pending_bulk)
                        h.conn, h.pending_bulk = conn, None
                        if self.bulk_tls:  # plaintext (TLS mode auto): only the token will tell
                            h.stage = VERIFIED
                        await attached
            except TimeoutError:
                if h.conn is not None and h.bulk is None:
                    h.conn.fail(ProtocolError(f"no HELLO within {to.handshake_s}s", ErrorCode.HANDSHAKE_TIMEOUT))
                raise
            self._leave_pool(h)
            if kind == KIND_CONTROL:
                # A place now if one is free. If not, only a HELLO that needs none (a knock) or
                # frees one (it replaces the peer's control connection) is checked further, at
                # most limits.max_handshakes of them at once; any other first frame is refused.
                placed = self.room.take()
                if placed:
                    conn.add_close_callback(self.room.give)
                elif not self._may_check_unplaced(frame):
                    self._refuse_full(conn, h.addr)
                    return
                self._unplaced += not placed
                try:
                    admitted = await self._admit(conn, frame)
                finally:
                    self._unplaced -= not placed
                if admitted:
                    self._on_hello(conn, frame, placed, h.addr)
                if not conn.closed:
                    await _wait_closed(conn)
            else:  # its place was taken at its BULK_HELLO (_adopt_bulk), before BULK_WELCOME
                await _wait_closed(conn, bulk)
        except FatalHandshakeError as exc:
            self.metrics.error(exc.code)
            limited(self, self.log.warning, "inbound connection refused", remote=_host(h.addr), error=str(exc),
                    code=exc.code.name)
            h.close()
        except ProtocolError as exc:  # the preamble (BAD_MAGIC, UNSUPPORTED_FRAME_VERSION): no reply, no TLS yet
            self.metrics.error(exc.code)
            limited(self, self.log.info, "inbound connection failed", remote=_host(h.addr), error=str(exc),
                    code=exc.code.name)
            h.close()
        except (PddWireError, TimeoutError, OSError) as exc:  # transport; a config error of a session
            limited(self, self.log.info, "inbound connection failed", remote=_host(h.addr),
                    error=str(exc) or repr(exc))
            h.close()
        except Exception as exc:  # a bug of ours: this connection ends, and its place is given back with it
            self.metrics.error(ErrorCode.INTERNAL)
            limited(self, self.log.error, "inbound connection failed: internal error", remote=_host(h.addr),
                    detail={"error": repr(exc)[:200]}, exc_info=True)
            h.close()
        finally:
            if h in self._handshaking:
                del self._handshaking[h]
                h.close()  # cancelled (the agent stops) while still in its handshake

    async def _admit(self, conn: FrameProtocol, frame) -> bool:
        """Fleet: a HELLO from a member this agent has no session with yet gets one first, if
        etcd lists it (read now when the watch has not shown it yet, within handshake_s) and the
        connection's certificate is the one it registered (else refused here, before any session
        or dial exists: checks 4 and 4a of proto/handshake.md §4). False: refused."""
        if self.admit is None or frame.header.type != FrameType.HELLO:
            return True
        try:
            hello = decode_body(FrameType.HELLO, frame.body)
        except ProtocolError:
            return True  # _on_hello refuses it
        if self.peers.get(f"{hello.site}/{hello.node}") is not None:
            return True
        tls = self.ssl_server is not None
        names = frozenset(conn.peer_names) if tls else None
        fingerprint = peer_fingerprint(conn.transport) if tls and conn.transport is not None else ""
        try:
            async with asyncio.timeout(self.config.timeouts.handshake_s):
                await self.admit(hello.site, hello.node, names, fingerprint)
        except TimeoutError:
            pass  # refused by _on_hello as an unknown peer
        except FatalHandshakeError as exc:
            self._refuse(conn, exc)
            return False
        return True

    def _refuse(self, conn: FrameProtocol, exc: ProtocolError | PddWireError) -> None:
        self.metrics.error(exc.code)
        limited(self, self.log.warning, "handshake refused", error=str(exc), code=exc.code.name)
        conn.fail(exc)

    def _on_hello(self, conn: FrameProtocol, frame, placed: bool = True, addr=None) -> None:
        """Checks 1-4b of proto/handshake.md §4, then the room (``placed``: the connection holds a
        place already), then the session adopts ``conn``."""
        try:
            if frame.header.type != FrameType.HELLO:
                raise ProtocolError(f"expected HELLO, got frame type {frame.header.type}", ErrorCode.UNEXPECTED_FRAME)
            hello = decode_body(FrameType.HELLO, frame.body)
            check_peer(hello, self.peers.sites())
            session = self.peers.get(f"{hello.site}/{hello.node}")
            if session is None:
                raise FatalHandshakeError(f"{hello.site}/{hello.node} is not a configured peer",
                                          ErrorCode.UNKNOWN_PEER)
            self._check_cert(conn, session)
            if self.admit is not None and session.dialer:
                # A knock (proto/handshake.md §8): the peer needs the session, and this agent is
                # the one that dials it.
                session.dialer_loop.wake()
                limited(self, self.log.info, "knocked: dialing back", peer=session.key)
                conn.fail(PddWireError(f"{self.config.site}/{self.config.node} dials you: dialing now",
                                       ErrorCode.DIAL_BACK))
                return
            if not placed:
                if not self.room.take(over=self._replaceable(session)):
                    self._refuse_full(conn, addr)  # (its control connection closed meanwhile)
                    return
                conn.add_close_callback(self.room.give)
            session.adopt_control(conn, hello)
        except (ProtocolError, PddWireError) as exc:
            self._refuse(conn, exc)

    def _check_cert(self, conn: FrameProtocol, session: "PeerSession") -> None:
        if self.ssl_server is None:
            return
        want = session.peer.server_name or session.peer.node  # a fleet member's: always its node
        if want not in conn.peer_names:
            raise FatalHandshakeError(f"certificate names {sorted(conn.peer_names)} do not include {want!r}",
                                      ErrorCode.IDENTITY_MISMATCH)
        pinned = session.peer.fingerprint  # a fleet member's registered certificate
        if pinned and conn.transport is not None and (got := peer_fingerprint(conn.transport)) != pinned:
            raise FatalHandshakeError(f"{session.key}'s certificate {got} is not the pinned {pinned} "
                                      "(peers[].fingerprint, or the fleet member's registered one)",
                                      ErrorCode.IDENTITY_MISMATCH)

    async def _adopt_bulk(self, h: Handshaking, bulk: BulkLoop, main, attached: asyncio.Future) -> FrameProtocol:
        """On a bulk loop: TLS, then wait for BULK_HELLO naming a live session (``attached``, a
        future of the main loop, is set then, and ``h`` ranks ATTACHED; or it fails if the
        connection ends first)."""
        sock = h.sock

        def resolve(msg: m.BulkHello):
            s = self.peers.by_token.get(msg.session)
            if s is None or (s.peer.site, s.peer.node) != (msg.site, msg.node):
                return None
            if self.bulk_tls and (s.peer.server_name or s.peer.node) not in handler.conn.peer_names:
                return None
            if not self.room.take():  # the handler answers ERROR TOO_MANY_CONNECTIONS (and counts it)
                main.call_soon_threadsafe(self._refused_full, h.addr, "bulk")
                raise self._full_error()
            handler.conn.add_close_callback(self.room.give)
            return s

        def settle(exc: BaseException | None) -> None:
            if not attached.done():
                if exc is None:
                    h.stage = ATTACHED  # now, on the main loop: no cut can fall between
                    attached.set_result(None)
                else:
                    attached.set_exception(exc)

        def on_attach(h: BulkHandler) -> None:
            main.call_soon_threadsafe(h.session.adopt_bulk, h.stream, bulk, h.conn)
            main.call_soon_threadsafe(settle, None)

        handler = BulkHandler(None, -1, main, resolve=resolve, on_attach=on_attach, count_error=self.metrics.error,
                              stall_s=self.config.timeouts.dead_after_s)
        timeout = self.config.timeouts.handshake_s
        try:
            await adopt(sock, handler.conn, ssl_ctx=self.ssl_server if self.bulk_tls else None, timeout=timeout)
        except asyncio.CancelledError:  # cut for a newcomer, or the agent stops
            handler.conn.abort()
            sock.close()
            raise
        handler.conn.add_close_callback(lambda: main.call_soon_threadsafe(
            settle, TransportError("closed before BULK_HELLO")))

        def no_hello() -> None:
            if handler.session is None and not handler.conn.closed:
                handler.conn.fail(ProtocolError(f"no BULK_HELLO within {timeout}s", ErrorCode.HANDSHAKE_TIMEOUT))

        asyncio.get_running_loop().call_later(timeout, no_hello)
        return handler.conn


async def _wait_closed(conn: FrameProtocol, bulk: BulkLoop | None = None) -> None:
    """Keeps the inbound-connection count honest for as long as the connection lives."""
    loop = asyncio.get_running_loop()
    ended = loop.create_future()

    def on_close() -> None:
        loop.call_soon_threadsafe(lambda: ended.done() or ended.set_result(None))

    if bulk is None:
        conn.add_close_callback(on_close)
    else:
        bulk.call(conn.add_close_callback, on_close)
    await ended


def _host(addr) -> str:
    """A peer address's host: the port changes with every attempt (a log line's repeat key)."""
    return str(addr[0]) if isinstance(addr, tuple) and addr else str(addr)
