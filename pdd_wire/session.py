"""One peer agent: its control connection, its bulk connections, and the transfers between us.

A :class:`PeerSession` lives as long as the peer is configured. Its connections come and go:
the agent whose (site, node) sorts lower dials, the other accepts. While the peer's
incarnation stays the same, a reconnect *resumes*: every open transfer asks which chunks the
receiver holds (KV_RESUME / KV_STATUS) and only the missing ones are sent again; unacknowledged
token frames are resent and the receiver drops what it already delivered. A new incarnation
means the peer restarted: every transfer with it fails with PEER_RESTARTED.

Chunks are scheduled here, on the main loop, under a credit window (unacknowledged bytes in
flight, the smaller of the two agents' ``credit_bytes``), and striped over the bulk
connections, least loaded first. The bulk threads compute checksums and do the I/O.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import time
from typing import TYPE_CHECKING, Protocol

import structlog

from . import policy
from .config import Config, Peer, parse_hostport
from .errors import (ErrorCode, FatalHandshakeError, HandshakeError, PddWireError, ProtocolError, TransferError,
                     TransportError)
from .log import limited
from .memory import BlockMap, chunk_range, scatter
from .transfer import InTransfer, OutTransfer, Route, State
from .bulk import BulkHandler, Compression, bulk_send
from .probe import LinkEstimator
from .relay import TokenRelay
from .transport import ucx
from .transport.tcp import KIND_BULK, KIND_CONTROL, BulkLoop, FrameProtocol, dial
from .wire import HEADER_SIZE, FrameType, Lane, decode_body, encode, encode_body
from .wire import messages as m
from .wire.frame import Frame
from .wire.handshake import CAPABILITIES, choose_version, negotiate_limit

if TYPE_CHECKING:
    from .metrics import Metrics

log = structlog.get_logger("pdd_wire.session")


def code_name(code: int) -> str:
    """The name of a wire error code; codes from a newer peer print as numbers."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"CODE_{int(code)}"


class SessionHost(Protocol):
    """What a session needs from the agent (implemented by :class:`pdd_wire.agent.Agent`)."""

    config: Config
    metrics: "Metrics"
    incarnation: int

    def next_transfer_id(self) -> int: ...
    def transfer_ended(self) -> None: ...
    def bulk_loop(self, stream: int) -> BulkLoop: ...
    def ssl_client(self): ...
    def incoming_begin(self, session: "PeerSession", tid: int, begin: m.KvBegin) -> None: ...
    def kv_received(self, t: InTransfer) -> None: ...
    def kv_sent(self, t: OutTransfer) -> None: ...
    def transfer_failed(self, t, direction: str, code: int, message: str) -> None: ...
    def tokens_received(self, session: "PeerSession", msg: m.Tokens) -> None: ...
    def incoming_cancelled(self, session: "PeerSession", tid: int, msg: m.KvCancel) -> None: ...
    def handoff_message(self, session: "PeerSession", msg) -> None: ...
    def session_up(self, session: "PeerSession") -> None: ...
    def peer_lost(self, session: "PeerSession", reason: str) -> None: ...
    def request_aborted(self, session: "PeerSession", msg: m.RequestAbort) -> None: ...
    def prefix_query(self, session: "PeerSession", msg: m.PrefixQuery) -> int: ...


class BulkLink:
    """The main loop's view of one bulk connection (which lives on ``loop``)."""

    def __init__(self, stream: int, loop: BulkLoop, conn: FrameProtocol) -> None:
        self.stream = stream
        self.loop = loop
        self.conn = conn
        self.outstanding = 0  # bytes dispatched on it and not yet acknowledged


_LANE_NAMES = ("control", "token", "bulk")


class PeerSession:
    def __init__(self, host: SessionHost, peer: Peer) -> None:
        self.host = host
        self.cfg = host.config
        self.peer = peer
        self.key = f"{peer.site}/{peer.node}"
        self.index = host.config.peers.index(peer)  # spreads sessions over the bulk threads
        self.dialer = (self.cfg.site, self.cfg.node) < (peer.site, peer.node)
        self.log = log.bind(peer=self.key)
        self.m = host.metrics
        self.configured_streams = peer.streams or self.cfg.transfer.streams
        self.streams = self.configured_streams  # after the handshake: the smaller of both sides
        self.control: FrameProtocol | None = None
        self.remote_incarnation: int | None = None
        self.remote_caps: frozenset[str] | None = None  # what the peer advertised (None: not met yet)
        self.token = random.getrandbits(63)  # bulk connections present it (listener side)
        self.remote_token = 0
        self.links: dict[int, BulkLink] = {}
        self.out: dict[int, OutTransfer] = {}
        self.inn: dict[int, InTransfer] = {}
        self.routes: dict[int, Route] = {}  # read by bulk threads; mutated only here
        self.completed_in: collections.OrderedDict[int, str] = collections.OrderedDict()
        self.window = self.cfg.transfer.credit_bytes
        self.credit = self.window
        self.chunk_bytes = self.cfg.transfer.chunk_bytes
        self.peer_max_chunk = 64 << 20
        self.peer_max_body = 4096  # the format's floor until the peer says more
        self.inflight: dict[tuple[int, int], tuple[int, int, float]] = {}
        self.rr: collections.deque[int] = collections.deque()
        self.tokens = TokenRelay(self)
        # KV_CANCELs that could not be sent (peer down), sent on reconnect; bounded.
        self.cancel_later: collections.deque[tuple[int, m.KvCancel]] = collections.deque(
            maxlen=2 * self.cfg.transfer.max_transfers)
        self.up = asyncio.Event()
        self.down_since: float | None = time.monotonic()
        self._lost = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._stream_tasks: dict[int, asyncio.Task] = {}
        self._closing = False
        self._last_rx = time.monotonic()
        self._ping_nonce = itertools.count(1)
        self.rtt_s: float | None = None
        self.est = LinkEstimator()
        self.acked_bytes = 0  # KV bytes acknowledged by the peer, ever
        self.lz = Compression(shuffle=self.cfg.transfer.compress_shuffle)
        self.lz.on = self.cfg.transfer.compress == "on"
        self.ack_log: collections.deque[tuple[float, int]] | None = None  # (time, acked_bytes) while probing
        self._ping_waiters: dict[int, asyncio.Future] = {}
        self._lookups: dict[str, list[asyncio.Future]] = {}  # PREFIX_QUERYs of choose_pipeline
        # The same-site UCX path: KV chunks as tagged UCX messages instead of bulk TCP streams.
        self.ucx: ucx.UcxPeer | None = None
        self.ucx_loop: ucx.UcxLoop | None = None
        self.ucx_ready = False  # endpoint to the peer's worker made (this connection)
        self._ucx_remote = b""
        self._dir_out = ucx.DIR_DIALER if self.dialer else ucx.DIR_ACCEPTOR
        self._dir_in = ucx.DIR_ACCEPTOR if self.dialer else ucx.DIR_DIALER
        self.goodput_Bps = 0.0  # EWMA of finished transfers' goodput
        self.m.peer_up.labels(peer=self.key).set(0)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._main = asyncio.get_running_loop()
        if self.peer.transport == "ucx":
            ok, why = ucx.available()
            if ok:
                self.ucx_loop = ucx.acquire_loop()
                self.ucx = ucx.UcxPeer(self.ucx_loop, name=self.key)
                self.log.info("KV to this peer goes over UCX", ucx=why)
            else:
                self.log.warning("transport = 'ucx' but UCX is unavailable; KV to this peer uses TCP", reason=why)
        if self.dialer:
            self._spawn(self._dial_forever(), "dial")
        self._spawn(self._tick_forever(), "tick")

    def _spawn(self, coro, name: str) -> asyncio.Task:
        t = asyncio.create_task(coro, name=f"{self.key}:{name}")
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def close(self) -> None:
        self._closing = True
        if self.control is not None and not self.control.closed:
            try:
                self.control.send(encode(FrameType.GOODBYE, encode_body(m.Goodbye("shutdown"))))
            except TransportError:
                pass
        for t in list(self._tasks) + list(self._stream_tasks.values()):
            t.cancel()
        await asyncio.gather(*self._tasks, *self._stream_tasks.values(), return_exceptions=True)
        self._drop_connections()
        for t in list(self.out.values()):
            self._fail_out(t, ErrorCode.SHUTTING_DOWN, "agent shutting down", notify_peer=False)
        for t in list(self.inn.values()):
            await self._fail_in(t, ErrorCode.SHUTTING_DOWN, "agent shutting down", notify_peer=False)
        if self.ucx is not None:
            self.ucx.close()
            try:
                async with asyncio.timeout(5):
                    await self.ucx_loop.run(self.ucx.wait_closed())
            except (TimeoutError, TransportError, RuntimeError):
                pass
            ucx.release_loop(self.ucx_loop)
            self.ucx = None

    @property
    def is_up(self) -> bool:
        return self.control is not None and not self.control.closed and self.up.is_set()

    # ------------------------------------------------------------------ dialing
    async def _dial_forever(self) -> None:
        backoff = 0.05
        host, port = parse_hostport(self.peer.address, "peer.address")
        to = self.cfg.timeouts
        while not self._closing:
            self._lost.clear()
            try:
                conn = self._new_control()
                await dial(host, port, KIND_CONTROL, conn, ssl_ctx=self.host.ssl_client(),
                           server_name=self.peer.server_name or self.peer.node, timeout=to.connect_s)
                hello = m.Hello(versions=list(m.SUPPORTED_VERSIONS), site=self.cfg.site, node=self.cfg.node,
                                incarnation=self.host.incarnation, capabilities=list(CAPABILITIES),
                                max_body=self.cfg.limits.max_body, max_chunk=64 << 20,
                                credit_bytes=self.cfg.transfer.credit_bytes, bulk_streams=self.configured_streams,
                                ucx_address=self.ucx.local_address() if self.ucx else b"")
                self._handshake_wait = asyncio.get_running_loop().create_future()
                self._handshake_conn = conn
                conn.send(encode(FrameType.HELLO, encode_body(hello)))
                try:
                    async with asyncio.timeout(to.handshake_s):
                        await self._handshake_wait
                except BaseException:
                    conn.abort()
                    raise
                backoff = 0.05
                await self._lost.wait()
            except FatalHandshakeError as exc:
                self.log.error("handshake refused", error=str(exc), code=exc.code.name)
                if not getattr(exc, "counted", False):
                    self.m.error(exc.code)
                backoff = to.reconnect_max_backoff_s
            except (TransportError, HandshakeError, TimeoutError, OSError) as exc:
                limited(self, self.log.info, "peer not reachable", error=str(exc) or type(exc).__name__)
            if self._closing:
                return
            await asyncio.sleep(backoff * (0.5 + random.random() / 2))
            backoff = min(backoff * 2, to.reconnect_max_backoff_s)

    def _on_welcome(self, conn: FrameProtocol, msg: m.Welcome) -> None:
        """Dialer side. Adopted here, in the frame handler, so that frames the listener sent
        right behind WELCOME (in the same read) already find the session established."""
        hw = getattr(self, "_handshake_wait", None)
        try:
            if msg.version not in m.SUPPORTED_VERSIONS:
                raise FatalHandshakeError(f"peer chose protocol version {msg.version}, not one we offered",
                                          ErrorCode.UNSUPPORTED_PROTOCOL_VERSION)
            if (msg.site, msg.node) != (self.peer.site, self.peer.node):
                raise FatalHandshakeError(f"{self.peer.address} answered as {msg.site}/{msg.node}, "
                                          f"expected {self.key}", ErrorCode.IDENTITY_MISMATCH)
        except FatalHandshakeError as exc:
            conn.fail(exc)
            if hw is not None and not hw.done():
                hw.set_exception(exc)
            return
        self._established(conn, msg.incarnation, msg)
        if hw is not None and not hw.done():
            hw.set_result(msg)

    def _new_control(self) -> FrameProtocol:
        conn = FrameProtocol(max_body=self.cfg.limits.max_body, max_payload=0)
        conn.on_frame = self._on_control_frame
        conn.on_lost = self._on_control_lost
        return conn

    # ------------------------------------------------------------------ accepting
    def adopt_control(self, conn: FrameProtocol, hello: m.Hello) -> m.Welcome:
        """Listener side: a dialer's HELLO passed the agent's checks; take the connection."""
        version = choose_version(hello.versions)
        if self.control is not None and not self.control.closed:
            self.log.info("peer reconnected; dropping the previous control connection")
            old, self.control = self.control, None
            old.on_lost = lambda c, e: None
            old.abort()
            self._connection_down("replaced")
        conn.on_frame = self._on_control_frame
        conn.on_lost = self._on_control_lost
        welcome = m.Welcome(version=version, site=self.cfg.site, node=self.cfg.node,
                            incarnation=self.host.incarnation, session=self.token,
                            capabilities=list(CAPABILITIES), max_body=self.cfg.limits.max_body,
                            max_chunk=64 << 20, credit_bytes=self.cfg.transfer.credit_bytes,
                            bulk_streams=self.configured_streams,
                            resumed=self.remote_incarnation == hello.incarnation,
                            ucx_address=self.ucx.local_address() if self.ucx else b"")
        conn.send(encode(FrameType.WELCOME, encode_body(welcome)))
        self._established(conn, hello.incarnation, hello)
        return welcome

    def adopt_bulk(self, stream: int, loop: BulkLoop, conn: FrameProtocol) -> None:
        """A bulk connection attached (called on the main loop)."""
        if not self.is_up or conn.closed:
            loop.call(conn.abort)
            return
        old = self.links.get(stream)
        if old is not None:
            self._bulk_down(old)
            old.loop.call(old.conn.abort)
        self.links[stream] = BulkLink(stream, loop, conn)
        self.m.bulk_streams.labels(peer=self.key).set(len(self.links))
        self._pump()

    # ------------------------------------------------------------------ connection state
    def _established(self, conn: FrameProtocol, incarnation: int, info) -> None:
        first = self.remote_incarnation is None
        restarted = not first and self.remote_incarnation != incarnation
        self.control = conn
        self._last_rx = time.monotonic()
        if restarted:
            self.log.warning("peer restarted; failing every transfer with it")
            self.cancel_later.clear()  # it forgot those transfers anyway
            self._peer_restarted()
        self.remote_incarnation = incarnation
        self.remote_caps = frozenset(info.capabilities)
        if isinstance(info, m.Welcome):
            self.remote_token = info.session
        self.chunk_bytes = min(self.cfg.transfer.chunk_bytes, info.max_chunk)
        self.peer_max_chunk = info.max_chunk
        self.peer_max_body = info.max_body
        self.window = max(negotiate_limit(self.cfg.transfer.credit_bytes, info.credit_bytes), self.chunk_bytes)
        self.streams = max(1, min(self.configured_streams, info.bulk_streams))
        self.credit = self.window - sum(n for _, n, _ in self.inflight.values())
        self.down_since = None
        self.up.set()
        self.m.peer_up.labels(peer=self.key).set(1)
        if not first:
            self.m.reconnects.labels(peer=self.key).inc()
        self.log.info("peer up", resumed=not first and not restarted, streams=self.streams)
        self._ping()  # an RTT at once
        while self.cancel_later:
            tid, cancel = self.cancel_later.popleft()
            self._send(FrameType.KV_CANCEL, cancel, tid=tid)
        self._resume()
        self.host.session_up(self)
        if self.ucx is not None and info.ucx_address:
            if not self.ucx_ready:
                self._spawn(self._ucx_connect(info.ucx_address), "ucx-connect")
            elif info.ucx_address != self._ucx_remote:
                # The peer restarted with a new UCX worker; ours is bound to its old one. Start
                # over with a fresh worker (a new handshake carries its address).
                self._spawn(self._ucx_renew(), "ucx-renew")
        elif self.dialer:
            for s in range(self.streams):
                self._start_stream(s)

    @property
    def over_ucx(self) -> bool:
        return self.ucx is not None and self.ucx_ready

    async def _ucx_connect(self, remote: bytes) -> None:
        try:
            await self.ucx_loop.run(self.ucx.connect(remote))
        except (TransportError, RuntimeError) as exc:
            self.log.error("UCX endpoint failed; KV to this peer waits", error=str(exc))
            return
        self._ucx_remote = remote
        self.ucx_ready = True
        self.log.info("UCX endpoint up")
        self._pump()

    async def _ucx_renew(self) -> None:
        old, self.ucx, self.ucx_ready = self.ucx, ucx.UcxPeer(self.ucx_loop, name=self.key), False
        old.close()
        if self.control is not None:
            self.control.abort()

    async def _ucx_send(self, tid: int, k: int, views) -> None:
        """On the UCX loop. A chunk whose blocks are not contiguous is gathered first (a copy)."""
        buf = views[0] if len(views) == 1 else b"".join(views)
        await self.ucx.send(ucx.tag_for(self._dir_out, tid, k), buf)

    def _ucx_sent(self, tid: int, k: int, fut) -> None:
        """A UCX send ended (main loop): a failure requeues the chunk; delivery is acked on control."""
        if fut.cancelled() or fut.exception() is None:
            return
        self.log.warning("UCX send failed", transfer_id=tid, chunk=k, error=str(fut.exception()))
        self._uninflight(tid, k)
        t = self.out.get(tid)
        if t is not None:
            t.retransmits += 1
            self.m.retransmits.labels(peer=self.key, reason="ucx_error").inc()
            asyncio.get_running_loop().call_later(0.1, self._requeue, t, k)

    async def _ucx_recv(self, t: InTransfer, k: int, main: asyncio.AbstractEventLoop) -> None:
        """On the UCX loop: receive chunk ``k`` straight into the posted blocks (staged only when
        they are not contiguous). No xxh3 here: UCX moves the bytes memory to memory (RDMA carries
        its own link CRC), and the checksum pass would cost as much as the copy."""
        start, end = chunk_range(k, t.total, t.chunk_bytes)
        views = t.route.claim(k, end - start)
        if views is None:
            return
        ok = False
        try:
            tag = ucx.tag_for(self._dir_in, t.tid, k)
            if len(views) == 1:
                await self.ucx.recv(tag, views[0])
            else:
                staging = bytearray(end - start)
                await self.ucx.recv(tag, staging)
                scatter(staging, views)
            ok = True
        except (TransferError, TransportError, asyncio.CancelledError):
            pass
        finally:
            t.route.settle(k, ok)
        if ok:
            main.call_soon_threadsafe(self.chunk_arrived, t.tid, k, True, end - start, True)

    def _on_control_lost(self, conn: FrameProtocol, exc) -> None:
        if conn is not self.control:
            hw = getattr(self, "_handshake_wait", None)
            if conn is getattr(self, "_handshake_conn", None) and hw is not None and not hw.done():
                hw.set_exception(TransportError(f"connection closed during the handshake: {exc}"))
            return
        self.log.info("control connection lost", error=str(exc) if exc else None)
        self._connection_down("control lost")

    def _connection_down(self, why: str) -> None:
        self.est.link_down()
        self.up.clear()
        self.control = None
        self.down_since = time.monotonic()
        self.m.peer_up.labels(peer=self.key).set(0)
        self._drop_connections()
        for t in self.out.values():
            if t.state == State.MOVING:
                t.state = State.RESUMING
        hw = getattr(self, "_handshake_wait", None)
        if hw is not None and not hw.done():
            hw.set_exception(TransportError(f"connection lost during the handshake ({why})"))
        self._lost.set()

    def _drop_connections(self) -> None:
        for t in self._stream_tasks.values():
            t.cancel()
        self._stream_tasks.clear()
        for link in list(self.links.values()):
            self._bulk_down(link)
            link.loop.call(link.conn.abort)
        if self.control is not None:
            self.control.abort()

    def _bulk_down(self, link: BulkLink) -> None:
        if self.links.get(link.stream) is link:
            del self.links[link.stream]
        self.m.bulk_streams.labels(peer=self.key).set(len(self.links))
        requeued = 0
        for key, (stream, n, _) in list(self.inflight.items()):
            if stream != link.stream:
                continue
            del self.inflight[key]
            self.credit += n
            t = self.out.get(key[0])
            if t is not None and key[1] not in t.acked:
                t.pending.appendleft(key[1])
                t.retransmits += 1
                requeued += 1
                self._ready(t)
        if requeued:
            self.m.retransmits.labels(peer=self.key, reason="connection_lost").inc(requeued)
        self.m.inflight_bytes.labels(peer=self.key).set(self.window - self.credit)

    def bulk_lost(self, link_conn: FrameProtocol, stream: int, exc) -> None:
        """A bulk connection ended (main loop)."""
        link = self.links.get(stream)
        if link is not None and link.conn is link_conn:
            self.log.info("bulk connection lost", stream=stream, error=str(exc) if exc else None)
            self._bulk_down(link)
            if self.dialer and self.is_up and not self._closing:
                self._start_stream(stream, delay=0.05)
        self._pump()

    def _start_stream(self, stream: int, delay: float = 0.0) -> None:
        old = self._stream_tasks.get(stream)
        if old is not None and not old.done():
            return
        self._stream_tasks[stream] = asyncio.create_task(self._dial_stream(stream, delay),
                                                         name=f"{self.key}:bulk{stream}")

    async def _dial_stream(self, stream: int, delay: float) -> None:
        backoff = max(delay, 0.05)
        host, port = parse_hostport(self.peer.address, "peer.address")
        bulk = self.host.bulk_loop(self.index * self.configured_streams + stream)
        main = asyncio.get_running_loop()
        if delay:
            await asyncio.sleep(delay)
        while self.is_up and not self._closing:
            fut = bulk.submit(self._bulk_connect(host, port, stream, main))
            try:
                conn = await asyncio.wrap_future(fut)
                self.adopt_bulk(stream, bulk, conn)
                return
            except asyncio.CancelledError:
                fut.cancel()
                raise
            except (TransportError, OSError, TimeoutError) as exc:
                self.log.info("bulk connect failed", stream=stream, error=str(exc))
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.cfg.timeouts.reconnect_max_backoff_s)

    async def _bulk_connect(self, host: str, port: int, stream: int, main: asyncio.AbstractEventLoop):
        """Runs on the bulk loop: dial, present the session token, wait for BULK_WELCOME."""
        conn = self.make_bulk_protocol(stream, main)
        welcomed = asyncio.get_running_loop().create_future()
        conn.bulk_welcomed = welcomed
        await dial(host, port, KIND_BULK, conn, ssl_ctx=self.host.ssl_client(),
                   server_name=self.peer.server_name or self.peer.node, timeout=self.cfg.timeouts.connect_s)
        conn.send(encode(FrameType.BULK_HELLO, encode_body(
            m.BulkHello(session=self.remote_token, stream=stream, site=self.cfg.site, node=self.cfg.node))))
        try:
            async with asyncio.timeout(self.cfg.timeouts.handshake_s):
                await welcomed
        except BaseException:
            conn.abort()
            raise
        return conn

    def make_bulk_protocol(self, stream: int, main: asyncio.AbstractEventLoop) -> FrameProtocol:
        """A bulk connection's protocol for this session (created on its bulk loop)."""
        return BulkHandler(self, stream, main).conn

    # ------------------------------------------------------------------ control frames
    def _on_control_frame(self, conn: FrameProtocol, frame: Frame) -> None:
        self._last_rx = time.monotonic()
        h = frame.header
        try:
            msg = decode_body(h.type, frame.body)
        except ProtocolError as exc:
            self.m.error(exc.code)
            conn.fail(exc)
            return
        lane_name = _LANE_NAMES[h.lane]
        self.m.frames.labels(peer=self.key, lane=lane_name, direction="rx").inc()
        self.m.bytes.labels(peer=self.key, lane=lane_name, direction="rx").inc(HEADER_SIZE + h.body_len)
        match msg:
            case m.Welcome() if self.dialer and self.control is None:
                self._on_welcome(conn, msg)
            case m.Ping():
                self._send(FrameType.PONG, m.Pong(msg.nonce, msg.sent_ns))
            case m.Pong():
                rtt = (time.monotonic_ns() - msg.sent_ns) / 1e9
                self.rtt_s = rtt
                self.est.pong(msg.nonce, rtt)
                self.m.rtt_seconds.labels(peer=self.key).observe(rtt)
                w = self._ping_waiters.pop(msg.nonce, None)
                if w is not None and not w.done():
                    w.set_result(rtt)
            case m.KvBegin():
                self._on_begin(h.transfer_id, msg)
            case m.KvAccept():
                self._on_accept(h.transfer_id)
            case m.KvReject():
                t = self.out.get(h.transfer_id)
                if t is not None:
                    self._fail_out(t, msg.code, msg.message, notify_peer=False)
            case m.KvAck():
                self._on_ack(h.transfer_id, msg.first, msg.count)
            case m.KvNack():
                self._on_nack(h.transfer_id, msg.chunk, msg.code)
            case m.KvDone():
                self._on_done(h.transfer_id)
            case m.KvCancel():
                self._on_cancel(h.transfer_id, msg)
            case m.KvResume():
                self._on_resume(h.transfer_id, msg)
            case m.KvStatus():
                self._on_status(h.transfer_id, msg)
            case m.Tokens():
                self.tokens.on_tokens(msg)
            case m.TokensAck():
                self.tokens.on_ack(msg)
            case m.HandoffProgress() | m.HandoffCommit() | m.HandoffTaken() | m.HandoffRelease() | m.HandoffAbort():
                self.host.handoff_message(self, msg)
            case m.PrefixQuery():
                k = self.host.prefix_query(self, msg)
                self._send(FrameType.PREFIX_MATCH, m.PrefixMatch(msg.request_id, k), tid=h.transfer_id)
            case m.PrefixMatch():
                self._on_prefix_match(h.transfer_id, msg)
            case m.RequestAbort():
                self.tokens.drop(msg.request_id)
                self.host.request_aborted(self, msg)
            case m.Error():
                self.log.warning("peer reported an error", code=code_name(msg.code), message=msg.message)
                self.m.error(code_name(msg.code))
                hw = getattr(self, "_handshake_wait", None)
                if self.control is None and hw is not None and not hw.done():
                    cls = FatalHandshakeError if 200 <= msg.code < 300 else HandshakeError
                    try:
                        code = ErrorCode(msg.code)
                    except ValueError:
                        code = ErrorCode.INTERNAL
                    exc = cls(f"peer refused: {msg.message}", code)
                    exc.counted = True  # the ERROR frame was counted above
                    hw.set_exception(exc)
            case m.Goodbye():
                self.log.info("peer said goodbye", reason=msg.reason)
            case _:
                exc = ProtocolError(f"unexpected {FrameType(h.type).name} on the control connection",
                                    ErrorCode.UNEXPECTED_FRAME)
                self.m.error(exc.code)
                conn.fail(exc)

    def _ping(self) -> int:
        nonce = next(self._ping_nonce)
        if self._send(FrameType.PING, m.Ping(nonce, time.monotonic_ns())):
            self.est.ping_sent(nonce, time.monotonic())
        return nonce

    async def ping(self, timeout: float = 1.0) -> float | None:
        """One PING on the control lane; its round trip in seconds, or None if unanswered."""
        fut = asyncio.get_running_loop().create_future()
        nonce = self._ping()
        self._ping_waiters[nonce] = fut
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:
            return None
        finally:
            self._ping_waiters.pop(nonce, None)

    def _cancel(self, tid: int, msg: m.KvCancel) -> None:
        """KV_CANCEL now, or at the next reconnect if the peer is unreachable: a transfer given
        up on while the link was down must not stay open on the other side once it is back."""
        if not self._send(FrameType.KV_CANCEL, msg, tid=tid):
            self.cancel_later.append((tid, msg))

    def send_message(self, body, *, lane: int = Lane.TOKEN) -> bool:
        """Send a control message whose frame type follows from its body (handoff messages);
        False if the control connection is down (the caller resends on reconnect)."""
        return self._send(m.TYPE_OF[type(body)], body, lane=lane)

    def _send(self, ftype: int, body, *, tid: int = 0, lane: int = Lane.CONTROL) -> bool:
        c = self.control
        if c is None or c.closed:
            return False
        frame = encode(ftype, encode_body(body), lane=lane, transfer_id=tid)
        try:
            c.send(frame)
        except TransportError:
            return False
        lane_name = _LANE_NAMES[lane]
        self.m.frames.labels(peer=self.key, lane=lane_name, direction="tx").inc()
        self.m.bytes.labels(peer=self.key, lane=lane_name, direction="tx").inc(len(frame[0]))
        return True

    # ------------------------------------------------------------------ sending KV
    def start_send(self, engine, request_id: str, blocks: BlockMap, deadline_s: float,
                   hashes: list[int] | None = None) -> OutTransfer:
        if len(self.out) >= self.cfg.transfer.max_transfers:
            raise PddWireError(f"{len(self.out)} transfers open to {self.key} (limit transfer.max_transfers)",
                               ErrorCode.TOO_MANY_TRANSFERS)
        loop = asyncio.get_running_loop()
        chunk = self.chunk_bytes
        if self.over_ucx:  # never above the credit window, or it could never be sent
            chunk = max(self.chunk_bytes, min(self.cfg.transfer.ucx_chunk_bytes, self.peer_max_chunk, self.window))
        t = OutTransfer(self.host.next_transfer_id(), request_id, engine, self.key, blocks,
                        chunk, loop.time() + deadline_s)
        self.out[t.tid] = t
        t.timer = loop.call_at(t.deadline, self._deadline_out, t)
        self.m.inflight.labels(direction="out").inc()
        if hashes and blocks.n_blocks > 1 and self.is_up and "prefix.v1" in (self.remote_caps or ()):
            # Ask first which leading blocks the receiver's node holds; at least one block is
            # always sent (the last one is usually partial and never shared anyway).
            t.hashes = hashes[:min(len(hashes), blocks.n_blocks - 1)]
            t.state = State.QUERYING
            self._send(FrameType.PREFIX_QUERY, m.PrefixQuery(request_id, t.hashes,
                                                             int(self.cfg.transfer.prefix_lease_s * 1000)), tid=t.tid)
            wait = max(self.cfg.transfer.prefix_query_s, 4 * (self.est.rtt_s or 0.0))
            t.query_timer = loop.call_later(wait, self._query_unanswered, t)
        else:
            self._announce(t)
        return t

    def _query_unanswered(self, t: OutTransfer) -> None:
        if self.out.get(t.tid) is t and t.state == State.QUERYING:
            self.log.info("no PREFIX_MATCH in time; sending every block", request_id=t.request_id)
            t.state = State.ANNOUNCED
            self._announce(t)

    async def prefix_lookup(self, request_id: str, hashes: list[int], timeout: float | None = None) -> int | None:
        """How many leading blocks of ``hashes`` the peer's node holds (leased for the request);
        None if the peer does not keep an inventory, is down, or does not answer in time."""
        if not self.is_up or "prefix.v1" not in (self.remote_caps or ()):
            return None
        fut = asyncio.get_running_loop().create_future()
        self._lookups.setdefault(request_id, []).append(fut)
        self._send(FrameType.PREFIX_QUERY, m.PrefixQuery(request_id, hashes,
                                                         int(self.cfg.transfer.prefix_lease_s * 1000)))
        wait = timeout or max(self.cfg.transfer.prefix_query_s, 4 * (self.est.rtt_s or 0.0))
        try:
            async with asyncio.timeout(wait):
                return await fut
        except TimeoutError:
            return None
        finally:
            waiters = self._lookups.get(request_id, [])
            if fut in waiters:
                waiters.remove(fut)
            if not waiters:
                self._lookups.pop(request_id, None)

    def _on_prefix_match(self, tid: int, msg: m.PrefixMatch) -> None:
        if tid == 0:
            for fut in self._lookups.pop(msg.request_id, []):
                if not fut.done():
                    fut.set_result(msg.matched)
            return
        t = self.out.get(tid)
        if t is None or t.state != State.QUERYING or t.request_id != msg.request_id:
            return
        if t.query_timer is not None:
            t.query_timer.cancel()
        k = max(0, min(msg.matched, len(t.hashes or ()), t.blocks.n_blocks - 1))
        n = t.blocks.n_blocks
        if k:
            t.skip = k
            t.blocks = t.full_blocks.after_blocks(k)
            self.m.prefix_bytes_saved.labels(peer=self.key).inc(k * t.blocks.block_bytes)
        self.m.prefix_hit_ratio.observe(k / n)
        t.state = State.ANNOUNCED
        self._announce(t)

    def _restart_full(self, t: OutTransfer, message: str) -> None:
        """The receiver lost the prefix it matched (a broken lease): send the request again,
        every block, as a new transfer. The engine sees only the new transfer's outcome."""
        self.log.warning("receiver lost the matched prefix; sending every block", request_id=t.request_id,
                         transfer_id=t.tid, reason=message)
        self.m.retransmits.labels(peer=self.key, reason="prefix_lost").inc(t.n_chunks)
        left = t.deadline - asyncio.get_running_loop().time()
        if left <= 0:
            self.host.transfer_failed(t, "out", int(ErrorCode.TRANSFER_TIMEOUT), "deadline passed")
            return
        self.start_send(t.engine, t.request_id, t.full_blocks, left)

    def _announce(self, t: OutTransfer) -> None:
        remaining = max(1, int((t.deadline - asyncio.get_running_loop().time()) * 1000))
        self._send(FrameType.KV_BEGIN, m.KvBegin(t.request_id, t.total, t.chunk_bytes, t.n_chunks,
                                                  t.blocks.block_bytes, t.blocks.n_blocks, remaining, t.skip),
                   tid=t.tid)

    def _on_accept(self, tid: int) -> None:
        t = self.out.get(tid)
        if t is None or t.state != State.ANNOUNCED:
            return
        t.state = State.MOVING
        t.queue_all()
        self._ready(t)
        self._pump()

    def _ready(self, t: OutTransfer) -> None:
        if t.tid not in self.rr:
            self.rr.append(t.tid)

    def _pump(self) -> None:
        """Dispatch chunks while credit and bulk connections allow, round robin over transfers."""
        if not self.is_up or not (self.links or self.over_ucx):
            return
        links = list(self.links.values())
        while self.rr:
            t = self.out.get(self.rr[0])
            if t is None or t.state != State.MOVING or not t.pending:
                self.rr.popleft()
                continue
            k = t.pending[0]
            if k in t.acked or (t.tid, k) in self.inflight:
                t.pending.popleft()
                continue
            views = t.chunk(k)
            n = sum(len(v) for v in views)
            if n > self.credit:
                return
            t.pending.popleft()
            self.rr.rotate(-1)
            self.credit -= n
            if self.over_ucx:
                self.inflight[(t.tid, k)] = (-1, n, time.monotonic())
                fut = self.ucx_loop.submit(self._ucx_send(t.tid, k, views))
                fut.add_done_callback(lambda f, tid=t.tid, k=k: self._main.call_soon_threadsafe(
                    self._ucx_sent, tid, k, f))
                continue
            pool = links if t.streams_limit is None else [lk for lk in links if lk.stream < t.streams_limit] or links
            link = min(pool, key=lambda lk: lk.outstanding)
            link.outstanding += n
            self.inflight[(t.tid, k)] = (link.stream, n, time.monotonic())
            link.loop.call(bulk_send, link.conn, t.tid, k, views, self._lz_for(t))
        self.m.inflight_bytes.labels(peer=self.key).set(self.window - self.credit)

    def _on_ack(self, tid: int, first: int, count: int) -> None:
        t = self.out.get(tid)
        if t is None:
            return
        count = max(0, min(count, t.n_chunks - first))  # the peer's numbers bound no loop of ours
        now = time.monotonic()
        acked = 0
        for k in range(first, first + count):
            sent = self._uninflight(tid, k)
            if sent is not None:
                self.m.chunk_seconds.observe(now - sent)
            if t is not None and k not in t.acked:
                t.acked.add(k)
                acked += self._count_tx(t, k)
        self._pump()
        if acked:
            self.acked_bytes += acked
            if self.ack_log is not None:
                self.ack_log.append((now, self.acked_bytes))
            self.est.on_ack(now, acked, busy=bool(self.inflight))

    def _count_tx(self, t: OutTransfer, k: int) -> int:
        start, end = chunk_range(k, t.total, t.chunk_bytes)
        self.m.bytes.labels(peer=self.key, lane="bulk", direction="tx").inc(end - start)
        self.m.chunks.labels(peer=self.key, direction="tx").inc()
        return end - start

    def _on_nack(self, tid: int, k: int, code: int = ErrorCode.CHUNK_CHECKSUM) -> None:
        self._uninflight(tid, k)
        t = self.out.get(tid)
        if t is None or k in t.acked:
            return
        t.retransmits += 1
        if code == ErrorCode.CHUNK_BUSY:
            self.m.retransmits.labels(peer=self.key, reason="busy").inc()
            asyncio.get_running_loop().call_later(0.05, self._requeue, t, k)
            return
        self.m.retransmits.labels(peer=self.key, reason="checksum").inc()
        self.log.warning("chunk failed its checksum at the receiver; sending it again",
                         transfer_id=tid, request_id=t.request_id, chunk=k)
        self._requeue(t, k)

    def _uninflight(self, tid: int, k: int) -> float | None:
        """Take chunk k off the in-flight books (credit back); returns when it was sent."""
        entry = self.inflight.pop((tid, k), None)
        if entry is None:
            return None
        stream, n, sent = entry
        self.credit += n
        link = self.links.get(stream)
        if link is not None:
            link.outstanding -= n
        return sent

    def _requeue(self, t: OutTransfer, k: int) -> None:
        if self.out.get(t.tid) is t and k not in t.acked and (t.tid, k) not in self.inflight:
            t.pending.appendleft(k)
            self._ready(t)
            self._pump()

    def _on_done(self, tid: int) -> None:
        t = self.out.pop(tid, None)
        if t is None:
            return
        self._release_out(t)
        t.state = State.DONE
        dt = time.monotonic() - t.started
        self.m.transfers.labels(peer=self.key, direction="out", outcome="done").inc()
        self.m.transfer_seconds.labels(direction="out").observe(dt)
        if t.total >= 1 << 20 and dt > 0:  # small transfers measure the RTT, not the bandwidth
            rate = t.total / dt
            self.goodput_Bps = rate if not self.goodput_Bps else 0.8 * self.goodput_Bps + 0.2 * rate
        self.host.kv_sent(t)

    def _release_out(self, t: OutTransfer) -> None:
        self.host.transfer_ended()
        if t.timer is not None:
            t.timer.cancel()
        if t.query_timer is not None:
            t.query_timer.cancel()
        for k in range(t.n_chunks):
            self._uninflight(t.tid, k)
        self.m.inflight.labels(direction="out").dec()
        self.m.inflight_bytes.labels(peer=self.key).set(self.window - self.credit)

    def _fail_out(self, t: OutTransfer, code: int, message: str, *, notify_peer: bool) -> None:
        if self.out.pop(t.tid, None) is None:
            return
        self._release_out(t)
        t.state = State.FAILED
        if code == ErrorCode.PREFIX_LOST and t.skip and not notify_peer:
            self._restart_full(t, message)
            return
        if notify_peer:
            self._cancel(t.tid, m.KvCancel(t.request_id, int(code), message, False))
        self.m.transfers.labels(peer=self.key, direction="out", outcome=code_name(code).lower()).inc()
        self.m.error(code_name(code))
        self.host.transfer_failed(t, "out", int(code), message)

    def drop_out(self, t: OutTransfer) -> None:
        """Withdraw a transfer its engine was told never started (tells the peer, no event)."""
        if self.out.pop(t.tid, None) is None:
            return
        self._release_out(t)
        t.state = State.FAILED
        self._send(FrameType.KV_CANCEL, m.KvCancel(t.request_id, int(ErrorCode.TRANSFER_CANCELLED),
                                                   "withdrawn by the sender", False), tid=t.tid)

    def _deadline_out(self, t: OutTransfer) -> None:
        self._fail_out(t, ErrorCode.TRANSFER_TIMEOUT, "transfer deadline passed before the receiver confirmed",
                       notify_peer=True)

    # ------------------------------------------------------------------ receiving KV
    def _on_begin(self, tid: int, begin: m.KvBegin) -> None:
        if tid in self.inn:
            t = self.inn[tid]
            if t.state == State.MOVING:
                self._send(FrameType.KV_ACCEPT, m.KvAccept(begin.request_id), tid=tid)
            return
        if tid in self.completed_in:
            self._send(FrameType.KV_DONE, m.KvDone(begin.request_id, begin.total_bytes), tid=tid)
            return
        self.host.incoming_begin(self, tid, begin)

    def accept_in(self, tid: int, begin: m.KvBegin, engine, dest: BlockMap) -> InTransfer | None:
        """The agent matched a KV_BEGIN with a posted receive: check it and open the transfer.
        A refusal is sent to the peer and told to the posting engine (its post is used up)."""
        problem = None
        if dest.total != begin.total_bytes or dest.block_bytes != begin.block_bytes:
            problem = (ErrorCode.SIZE_MISMATCH,
                       f"sender has {begin.n_blocks} blocks of {begin.block_bytes} bytes, receiver posted "
                       f"{dest.n_blocks} blocks of {dest.block_bytes} bytes")
        elif begin.chunk_bytes <= 0 or begin.chunk_bytes > 64 << 20 or \
                begin.n_chunks != -(-begin.total_bytes // begin.chunk_bytes):
            problem = (ErrorCode.MALFORMED_BODY, "inconsistent chunking in KV_BEGIN")
        elif len(self.inn) >= self.cfg.transfer.max_transfers:
            problem = (ErrorCode.TOO_MANY_TRANSFERS, "receiver has too many open transfers")
        loop = asyncio.get_running_loop()
        budget = begin.deadline_ms / 1000 if begin.deadline_ms else self.cfg.transfer.default_deadline_s
        t = InTransfer(tid, begin.request_id, engine, self.key, dest, begin.chunk_bytes,
                       loop.time() + budget, loop=loop)
        if problem is not None:
            self.reject_in(tid, begin, *problem)
            t.state = State.FAILED
            self.host.transfer_failed(t, "in", int(problem[0]), problem[1])
            return None
        t.state = State.MOVING
        self.inn[tid] = t
        self.routes[tid] = t.route
        # The receiver's own clock bounds it too, a little past the sender's, so both sides end.
        t.timer = loop.call_at(t.deadline + 1.0, lambda: self._spawn(
            self._fail_in(t, ErrorCode.TRANSFER_TIMEOUT, "transfer deadline passed", notify_peer=True), "deadline"))
        self.m.inflight.labels(direction="in").inc()
        if self.over_ucx:
            for k in range(t.n_chunks):  # waiting receives cost nothing until their message comes
                self.ucx_loop.submit(self._ucx_recv(t, k, loop))
        self._send(FrameType.KV_ACCEPT, m.KvAccept(begin.request_id), tid=tid)
        return t

    def reject_in(self, tid: int, begin: m.KvBegin, code: int, message: str) -> None:
        self.m.error(code_name(code))
        self.log.warning("refused incoming KV", transfer_id=tid, request_id=begin.request_id,
                         code=code_name(code), reason=message)
        self._send(FrameType.KV_REJECT, m.KvReject(begin.request_id, int(code), message), tid=tid)

    def chunk_arrived(self, tid: int, k: int, ok: bool, nbytes: int, claimed: bool, invalid: bool = False) -> None:
        """A bulk thread finished reading chunk ``k`` (main loop)."""
        t = self.inn.get(tid)
        if invalid:
            if t is not None:
                self._spawn(self._fail_in(t, ErrorCode.MALFORMED_BODY,
                                          f"chunk {k} of {nbytes} bytes does not fit the announced transfer",
                                          notify_peer=True), "invalid")
            return
        if not claimed:
            # Not written: a duplicate of a verified chunk is acknowledged again, anything
            # else (a cancelled or finished transfer) is dropped.
            if (t is not None and k in t.route.verified) or tid in self.completed_in:
                self.m.duplicates.labels(peer=self.key).inc()
                self._send(FrameType.KV_ACK, m.KvAck(k, 1), tid=tid)
            elif t is not None:
                # Another connection still holds this chunk (one that died mid-chunk and has
                # not noticed yet): ask for it again a little later.
                self._send(FrameType.KV_NACK, m.KvNack(k, int(ErrorCode.CHUNK_BUSY)), tid=tid)
            return
        if t is None:
            return
        if not ok:
            self.m.checksum_failures.labels(peer=self.key).inc()
            self.m.error(ErrorCode.CHUNK_CHECKSUM)
            self.log.warning("chunk payload checksum failed; asking for it again", transfer_id=tid,
                             request_id=t.request_id, chunk=k)
            self._send(FrameType.KV_NACK, m.KvNack(k), tid=tid)
            return
        self.m.bytes.labels(peer=self.key, lane="bulk", direction="rx").inc(nbytes)
        self.m.chunks.labels(peer=self.key, direction="rx").inc()
        self._send(FrameType.KV_ACK, m.KvAck(k, 1), tid=tid)
        if t.route.complete and t.state == State.MOVING:
            t.state = State.DONE
            self._spawn(self._complete_in(t), f"complete{tid}")

    async def _complete_in(self, t: InTransfer) -> None:
        await t.route.close()
        self._forget_in(t)
        self.completed_in[t.tid] = t.request_id
        while len(self.completed_in) > 4 * self.cfg.transfer.max_transfers:
            self.completed_in.popitem(last=False)
        self._send(FrameType.KV_DONE, m.KvDone(t.request_id, t.total), tid=t.tid)
        self.m.transfers.labels(peer=self.key, direction="in", outcome="done").inc()
        self.m.transfer_seconds.labels(direction="in").observe(time.monotonic() - t.started)
        self.host.kv_received(t)

    async def _quiesce(self, route: Route) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(route.close()), 1.0)
        except TimeoutError:
            # A bulk connection is stalled in the middle of one of this transfer's chunks:
            # cut the session's bulk connections so the claim is released.
            self.log.warning("bulk connection stalled mid-chunk; resetting bulk connections")
            for link in list(self.links.values()):
                link.loop.call(link.conn.abort)
            await route.quiesced

    def _forget_in(self, t: InTransfer) -> None:
        if self.inn.pop(t.tid, None) is not None:
            self.m.inflight.labels(direction="in").dec()
            self.host.transfer_ended()
        self.routes.pop(t.tid, None)
        if t.timer is not None:
            t.timer.cancel()

    async def _fail_in(self, t: InTransfer, code: int, message: str, *, notify_peer: bool) -> None:
        if self.inn.get(t.tid) is not t or t.state in (State.FAILED, State.DONE):
            return
        t.state = State.FAILED
        self.routes.pop(t.tid, None)
        if self.ucx is not None and self.ucx_loop.running:
            try:
                await self.ucx_loop.run(self.ucx.cancel_transfer(self._dir_in, t.tid, drain_s=5.0))
            except TransportError:
                pass
        await self._quiesce(t.route)  # no bulk thread (nor UCX) writes into the blocks after this
        self._forget_in(t)
        if notify_peer:
            self._cancel(t.tid, m.KvCancel(t.request_id, int(code), message, True))
        self.m.transfers.labels(peer=self.key, direction="in", outcome=code_name(code).lower()).inc()
        self.m.error(code_name(code))
        self.host.transfer_failed(t, "in", int(code), message)

    def _on_cancel(self, tid: int, msg: m.KvCancel) -> None:
        reason = f"cancelled by peer {self.key}: {msg.message}"
        if msg.by_receiver:
            t = self.out.get(tid)
            if t is not None:
                self._fail_out(t, msg.code, reason, notify_peer=False)
        else:
            t = self.inn.get(tid)
            if t is not None:
                self._spawn(self._fail_in(t, msg.code, reason, notify_peer=False), f"cancel{tid}")
            self.host.incoming_cancelled(self, tid, msg)

    # ------------------------------------------------------------------ cancellation from engines
    async def cancel_request(self, request_id: str, code: int, message: str, engine=None, *,
                             notify_peer: bool = True) -> int:
        """Cancel every transfer of ``request_id`` (of ``engine`` when given); tells the peer."""
        n = 0
        for t in [t for t in self.out.values() if t.request_id == request_id and engine in (None, t.engine)]:
            self._fail_out(t, code, message, notify_peer=notify_peer)
            n += 1
        for t in [t for t in self.inn.values() if t.request_id == request_id and engine in (None, t.engine)]:
            await self._fail_in(t, code, message, notify_peer=notify_peer)
            n += 1
        return n

    def has_request(self, request_id: str) -> bool:
        return any(t.request_id == request_id for t in self.out.values()) or \
            any(t.request_id == request_id for t in self.inn.values())

    def send_abort(self, request_id: str, reason: str) -> bool:
        """Tell the peer the request is dead (REQUEST_ABORT), if it is up and understands it."""
        self.tokens.drop(request_id)
        if self.is_up and self.remote_caps is not None and "abort.v1" in self.remote_caps:
            return self._send(FrameType.REQUEST_ABORT, m.RequestAbort(request_id, reason), lane=Lane.TOKEN)
        return False

    async def engine_gone(self, engine) -> None:
        for t in [t for t in self.out.values() if t.engine is engine]:
            self._fail_out(t, ErrorCode.ENGINE_GONE, "the sending engine disconnected", notify_peer=True)
        for t in [t for t in self.inn.values() if t.engine is engine]:
            await self._fail_in(t, ErrorCode.ENGINE_GONE, "the receiving engine disconnected", notify_peer=True)

    # ------------------------------------------------------------------ resume after a reconnect
    def _resume(self) -> None:
        for t in list(self.out.values()):
            if t.state == State.QUERYING:  # the answer may be lost: do not wait for it
                if t.query_timer is not None:
                    t.query_timer.cancel()
                t.state = State.ANNOUNCED
            if t.state == State.ANNOUNCED:
                self._announce(t)
            elif t.state == State.RESUMING:
                self._send(FrameType.KV_RESUME, m.KvResume(t.request_id), tid=t.tid)
        self.tokens.resend_unacked()
        self._pump()

    def _on_resume(self, tid: int, msg: m.KvResume) -> None:
        t = self.inn.get(tid)
        if t is not None:
            bm = m.bitmap_from(t.route.snapshot(), t.route.n_chunks)
            self._send(FrameType.KV_STATUS, m.KvStatus(msg.request_id, 1, bm), tid=tid)
        elif tid in self.completed_in:
            self._send(FrameType.KV_STATUS, m.KvStatus(msg.request_id, 2), tid=tid)
        else:
            self._send(FrameType.KV_STATUS, m.KvStatus(msg.request_id, 0), tid=tid)

    def _on_status(self, tid: int, msg: m.KvStatus) -> None:
        t = self.out.get(tid)
        if t is None:
            return
        if msg.state == 2:
            self._on_done(tid)
        elif msg.state == 1:
            have = m.bitmap_members(msg.have, t.n_chunks) - t.acked
            t.acked |= have
            for k in have:  # their acks were lost with the connection
                self._count_tx(t, k)
            missing = [k for k in range(t.n_chunks) if k not in t.acked and (tid, k) not in self.inflight]
            t.pending = collections.deque(missing)
            t.state = State.MOVING
            if missing:
                t.retransmits += len(missing)
                self._ready(t)
                self._pump()
        else:
            self._fail_out(t, ErrorCode.PEER_RESTARTED, "the receiver no longer knows this transfer",
                           notify_peer=False)

    def _peer_restarted(self) -> None:
        for t in list(self.out.values()):
            self._fail_out(t, ErrorCode.PEER_RESTARTED, f"peer {self.key} restarted", notify_peer=False)
        for t in list(self.inn.values()):
            self._spawn(self._fail_in(t, ErrorCode.PEER_RESTARTED, f"peer {self.key} restarted",
                                      notify_peer=False), "restart")
        self.completed_in.clear()
        self.tokens.clear()
        self.host.peer_lost(self, "peer_restarted")
        self.inflight.clear()
        for link in self.links.values():
            link.outstanding = 0

    # ------------------------------------------------------------------ tokens
    def send_tokens(self, request_id: str, tokens: list[int], *, handoff: bool = False) -> int:
        """Relay token IDs for ``request_id``; returns the index of the first one. ``handoff``:
        RLD's relay of a handoff (MD's agent keeps it before MD's engine registers)."""
        return self.tokens.send(request_id, tokens, handoff=handoff)

    # ------------------------------------------------------------------ heartbeat and housekeeping
    async def _tick_forever(self) -> None:
        to = self.cfg.timeouts
        while True:
            await asyncio.sleep(to.heartbeat_s)
            now = time.monotonic()
            if self.is_up:
                if now - self._last_rx > to.dead_after_s:
                    self.log.warning("peer silent; dropping the control connection",
                                     silent_s=round(now - self._last_rx, 2))
                    self.control.abort()
                else:
                    self._ping()
                self.est.expire(now)
                self._decide_compression()
            elif self.down_since is not None and now - self.down_since > to.peer_give_up_s:
                self.host.peer_lost(self, "peer_unreachable")
                for t in list(self.out.values()):
                    self._fail_out(t, ErrorCode.PEER_UNREACHABLE,
                                   f"peer {self.key} unreachable for {to.peer_give_up_s}s", notify_peer=True)
                for t in list(self.inn.values()):
                    await self._fail_in(t, ErrorCode.PEER_UNREACHABLE,
                                        f"peer {self.key} unreachable for {to.peer_give_up_s}s", notify_peer=True)
            stale = [key for key, (_, _, sent) in self.inflight.items() if now - sent > to.chunk_ack_s]
            for tid, k in stale:
                self._uninflight(tid, k)
                t = self.out.get(tid)
                if t is not None:
                    t.retransmits += 1
                    self.m.retransmits.labels(peer=self.key, reason="ack_timeout").inc()
                    self._requeue(t, k)

    def _lz_for(self, t: OutTransfer) -> Compression | None:
        if self.cfg.transfer.compress == "off" or "lz4.v1" not in (self.remote_caps or ()):
            return None
        return self.lz if t.compressible else None

    def _decide_compression(self) -> None:
        """Each heartbeat: compress when it raises goodput on this link (transfer.compress)."""
        mode = self.cfg.transfer.compress
        lz = self.lz
        if mode != "auto":
            lz.on = mode == "on"
        else:
            bw = self.est.bandwidth_Bps or self.goodput_Bps
            if lz.on and lz.est.ratio:
                bw /= lz.est.ratio  # while compressing, KV delivered outruns the wire by the ratio
            was, lz.on = lz.on, bw > 0 and lz.est.decide(bw)
            if was != lz.on:
                self.log.info("lz4 compression " + ("on" if lz.on else "off"), link_Bps=round(bw),
                              ratio=round(lz.est.ratio or 0, 3), compress_Bps=round(lz.est.compress_Bps or 0))
        self.m.compression_on.labels(peer=self.key).set(1 if lz.on else 0)
        self.m.compression_ratio.labels(peer=self.key).set(lz.est.ratio or 0)
        self.m.compressed_chunks.labels(peer=self.key).set(lz.chunks)
        self.m.compression_saved.labels(peer=self.key).set(lz.saved)

    def link_figures(self) -> "policy.LinkFigures":
        """The live estimate of this link (:class:`pdd_wire.probe.LinkEstimator`): delivery rate
        while busy (falling back to finished transfers' goodput), the KV bytes still to send, and
        the control-lane RTT. Bandwidth is 0 (unknown) before any KV moved, or while the peer is
        down."""
        bw = self.est.bandwidth_Bps or self.goodput_Bps
        return policy.LinkFigures(bandwidth_Bps=bw if self.is_up else 0.0,
                                  queue_bytes=self.queue_bytes(), rtt_s=self.est.rtt_s or self.rtt_s or 0.0)

    def queue_bytes(self) -> int:
        """KV bytes accepted for this peer and not yet acknowledged."""
        return sum(max(0, t.total - len(t.acked) * t.chunk_bytes) for t in self.out.values())

    def predict(self, nbytes: int) -> float | None:
        """Seconds ``nbytes`` more KV to this peer would take now (None: bandwidth unknown)."""
        if not self.is_up:
            return None
        return self.est.predict(nbytes, self.queue_bytes(), fallback_Bps=self.goodput_Bps)

    def describe(self) -> dict:
        return {"peer": self.key, "goodput_Bps": round(self.goodput_Bps),
                "link": self.est.describe(self.queue_bytes()),
                "compression": {"mode": self.cfg.transfer.compress, "on": self.lz.on, "chunks": self.lz.chunks,
                                "bytes_saved": self.lz.saved, "ratio": self.lz.est.ratio,
                                "compress_Bps": self.lz.est.compress_Bps},
                "data_path": "ucx" if self.over_ucx else "tcp", "address": self.peer.address, "transport": self.peer.transport,
                "role": "dialer" if self.dialer else "listener", "up": self.is_up,
                "bulk_streams_up": len(self.links), "bulk_streams": self.streams,
                "rtt_ms": round(self.rtt_s * 1e3, 3) if self.rtt_s is not None else None,
                "credit_window_bytes": self.window, "bytes_in_flight": self.window - self.credit,
                "chunk_bytes": self.chunk_bytes,
                "transfers_out": len(self.out), "transfers_in": len(self.inn)}
