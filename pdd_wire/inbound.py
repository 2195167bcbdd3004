"""Inbound WAN connections: accept, read the preamble, and hand each connection to its session.

A control connection must say HELLO within ``timeouts.handshake_s``, naming a configured peer
(and, with TLS, presenting a certificate for it); the session then runs the handshake. A bulk
connection is adopted on a bulk thread and must say BULK_HELLO with the token of a live session.
Anything else is closed; ``limits.max_peer_connections`` bounds how many are open at once.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from .config import Config
from .errors import ErrorCode, FatalHandshakeError, PddWireError, ProtocolError, TransportError
from .metrics import Metrics
from .transport.bulk import BulkHandler
from .transport.tcp import KIND_CONTROL, BulkLoop, FrameProtocol, adopt, read_preamble
from .wire import FrameType, decode_body
from .wire import messages as m
from .wire.handshake import check_peer

if TYPE_CHECKING:
    from .peers import Peers
    from .session import PeerSession


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
        self._open = 0

    @property
    def open_connections(self) -> int:
        """WAN connections held open (the count ``limits.max_peer_connections`` caps)."""
        return self._open

    def listen(self, host: str, port: int, *, ssl_server=None, bulk_tls: bool = True) -> tuple[str, int]:
        """Bind and start accepting (TLS with ``ssl_server``, else plaintext); returns the bound
        address. ``bulk_tls`` false: bulk connections stay plaintext even with ``ssl_server``
        (the generated PKI: a bulk connection is bound to its TLS session by the secret token)."""
        self.ssl_server = ssl_server
        self.bulk_tls = bulk_tls and ssl_server is not None
        sock = socket.create_server((host, port), reuse_port=False, backlog=128)
        sock.setblocking(False)
        self._sock = sock
        self.address = sock.getsockname()[:2]
        self._accept_task = asyncio.create_task(self._accept_forever(), name="wan-accept")
        return self.address

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
            if self._open >= self.config.limits.max_peer_connections or self.refusing():
                self.log.warning("inbound connection refused: limits.max_peer_connections reached",
                                 remote=str(addr))
                sock.close()
                continue
            sock.setblocking(False)
            self._open += 1
            t = asyncio.create_task(self._serve(sock, addr, next(rr)))
            self._conns.add(t)
            t.add_done_callback(self._conns.discard)

    async def _serve(self, sock: socket.socket, addr, n: int) -> None:
        to = self.config.timeouts
        try:
            kind = await read_preamble(sock, to.handshake_s)
            if kind == KIND_CONTROL:
                conn = FrameProtocol(max_body=self.config.limits.max_body, max_payload=0)
                first = asyncio.get_running_loop().create_future()
                conn.on_frame = lambda c, f: first.done() or first.set_result(f)
                conn.on_lost = lambda c, e: first.done() or first.set_exception(
                    TransportError(f"closed before HELLO: {e}"))
                await adopt(sock, conn, ssl_ctx=self.ssl_server, timeout=to.handshake_s)
                try:
                    async with asyncio.timeout(to.handshake_s):
                        frame = await first
                except TimeoutError:
                    conn.fail(ProtocolError(f"no HELLO within {to.handshake_s}s", ErrorCode.HANDSHAKE_TIMEOUT))
                    raise
                self._on_hello(conn, frame)
                if not conn.closed:
                    await _wait_closed(conn)
            else:
                bulk = self.bulk_loop(n)
                main = asyncio.get_running_loop()
                conn = await asyncio.wrap_future(bulk.submit(self._adopt_bulk(sock, bulk, main)))
                await _wait_closed(conn, bulk)
        except FatalHandshakeError as exc:
            self.metrics.error(exc.code)
            self.log.warning("inbound connection refused", remote=str(addr), error=str(exc), code=exc.code.name)
            sock.close()
        except (TransportError, ProtocolError, TimeoutError, OSError) as exc:
            self.log.info("inbound connection failed", remote=str(addr), error=str(exc) or repr(exc))
            sock.close()
        finally:
            self._open -= 1

    def _on_hello(self, conn: FrameProtocol, frame) -> None:
        try:
            if frame.header.type != FrameType.HELLO:
                raise ProtocolError(f"expected HELLO, got frame type {frame.header.type}", ErrorCode.UNEXPECTED_FRAME)
            hello = decode_body(FrameType.HELLO, frame.body)
            check_peer(hello, self.config.peer_sites())
            session = self.peers.get(f"{hello.site}/{hello.node}")
            if session is None:
                raise FatalHandshakeError(f"{hello.site}/{hello.node} is not a configured peer",
                                          ErrorCode.UNKNOWN_PEER)
            self._check_cert(conn, session)
            session.adopt_control(conn, hello)
        except (ProtocolError, PddWireError) as exc:
            self.metrics.error(exc.code)
            self.log.warning("handshake refused", error=str(exc), code=exc.code.name)
            conn.fail(exc)

    def _check_cert(self, conn: FrameProtocol, session: "PeerSession") -> None:
        if self.ssl_server is None:
            return
        want = session.peer.server_name or session.peer.node
        if want not in conn.peer_names:
            raise FatalHandshakeError(f"certificate names {sorted(conn.peer_names)} do not include {want!r}",
                                      ErrorCode.IDENTITY_MISMATCH)

    async def _adopt_bulk(self, sock: socket.socket, bulk: BulkLoop, main) -> FrameProtocol:
        """On a bulk loop: TLS, then wait for BULK_HELLO naming a live session."""

        def resolve(msg: m.BulkHello):
            s = self.peers.by_token.get(msg.session)
            if s is None or (s.peer.site, s.peer.node) != (msg.site, msg.node):
                return None
            if self.bulk_tls and (s.peer.server_name or s.peer.node) not in handler.conn.peer_names:
                return None
            return s

        def on_attach(h: BulkHandler) -> None:
            main.call_soon_threadsafe(h.session.adopt_bulk, h.stream, bulk, h.conn)

        handler = BulkHandler(None, -1, main, resolve=resolve, on_attach=on_attach)
        timeout = self.config.timeouts.handshake_s
        await adopt(sock, handler.conn, ssl_ctx=self.ssl_server if self.bulk_tls else None, timeout=timeout)

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
