"""One peer agent: its control connection, its data path, and the transfers between us.

A :class:`PeerSession` lives as long as the peer is configured; its connections come and go.
The agent whose (site, node) sorts lower dials, the other accepts. While the peer's incarnation
stays the same, a reconnect *resumes* (only missing chunks and unacknowledged token frames are
sent again); a new incarnation means the peer restarted and every transfer with it fails.

This is the async shell: it dials, runs timers and moves frames. What to send when is decided
by the sans-IO core (:mod:`.protocol`), how chunks move by the data path (:mod:`pdd_wire.transport`).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Mapping
from typing import Any

import structlog

from .. import policy, transport
from ..config import Peer, parse_hostport
from ..errors import ErrorCode, FatalHandshakeError, ProtocolError, TransportError, peer_code
from ..loopwatch import LateTicks
from ..memory import BlockMap
from ..transfer import InTransfer, OutTransfer
from ..transport.tcp import FrameProtocol, TcpConnector, control_protocol
from ..transport.tcp_path import PathSettings
from ..wire import HEADER_SIZE, FrameType, Lane, decode_body, encode, encode_body
from ..wire import messages as m
from ..wire.frame import Frame
from ..wire.handshake import CAPABILITIES, MAX_CHUNK, Limits, check_welcome, choose_version, negotiate
from .acks import AckBatch
from .dialer import Dialer
from .host import SessionHost
from .lines import peer_lines
from .link import LinkState, Pings
from .outbox import REASON_SENT, Outbox
from .protocol import SendWindow, code_name
from .receiving import Receiver
from .sending import Sender
from .tokens import TokenRelay

log = structlog.get_logger("pdd_wire.session")

_LANE_NAMES = ("control", "token", "bulk")


class PeerSession:
    def __init__(self, host: SessionHost["PeerSession"], peer: Peer, index: int | None = None) -> None:
        self.host = host
        self.cfg = host.config
        self.peer = peer  # a fleet member's is replaced when it registers a new certificate
        self.key = f"{peer.site}/{peer.node}"
        # spreads sessions over the bulk threads (fleet members, not in config.peers, are numbered by the agent)
        self.index = host.config.peers.index(peer) if index is None else index
        self.dialer = (self.cfg.site, self.cfg.node) < (peer.site, peer.node)
        self.log = log.bind(peer=self.key)
        self.lines = peer_lines(host, self.key)  # the session's own lines, at most once per 30 s per peer
        self.metrics = host.metrics
        self.configured_streams = peer.streams or self.cfg.transfer.streams
        self.streams = self.configured_streams  # after the handshake: the smaller of both sides
        self.control: FrameProtocol | None = None
        self.remote_incarnation: int | None = None
        self.remote_caps: frozenset[str] | None = None  # what the peer advertised (None: not met yet)
        self.token = secrets.randbits(63) or 1  # bulk connections present it (listener side): a secret
        self.remote_token = 0
        self.chunk_bytes = self.cfg.transfer.chunk_bytes
        self.peer_max_chunk, self.peer_max_body = MAX_CHUNK, 4096  # (the body's floor until the peer says more)
        self.flow: SendWindow[OutTransfer] = SendWindow(self.cfg.transfer.credit_bytes)
        self.sender = Sender(self, self.flow)
        self.receiver = Receiver(self)
        self.tokens = TokenRelay(self)
        self.acks = AckBatch(self.send_frame)  # KV_ACKs of this loop turn, sent as ranges
        self.outbox = Outbox(self, 4 * self.cfg.transfer.max_transfers, self.cfg.limits.control_buffer_bytes // 4)
        self.up = asyncio.Event()
        self.down_since: float | None = time.monotonic()
        self.peer_goodbye: str | None = None  # the reason of the peer's last GOODBYE ("idle": fleet idle close)
        self._tasks: set[asyncio.Task] = set()
        self.closing = False  # close() began: nothing new opens on this session
        self._last_rx = time.monotonic()
        self.pings = Pings(self)
        self.link = LinkState(self.cfg, self.metrics, self.key, self.log)
        self.est = self.link.est
        self.lz = self.link.lz
        host_, port = parse_hostport(peer.address, "peer.address")
        server_name = peer.server_name or peer.node
        self.dialer_loop = Dialer(TcpConnector(host_, port, ssl_client=host.ssl_client, server_name=server_name),
                                  self.cfg.timeouts, new_conn=self._new_control, hello=self._hello,
                                  count_error=self.metrics.error, log=self.log,
                                  fingerprint=lambda: self.peer.fingerprint)
        to = self.cfg.timeouts
        self.data = transport.data_path(peer.transport, self, PathSettings(
            name=self.key, host=host_, port=port, server_name=server_name, site=self.cfg.site, node=self.cfg.node,
            dialer=self.dialer, connect_s=to.connect_s, handshake_s=to.handshake_s,
            backoff_max_s=to.reconnect_max_backoff_s, ucx_chunk_bytes=self.cfg.transfer.ucx_chunk_bytes,
            ucx_tls=self.cfg.transfer.ucx_tls, credit_bytes=self.cfg.transfer.credit_bytes,
            ssl_client=lambda: host.ssl_client(bulk=True), executor=host.work_executor,
            bulk_loop=lambda n: host.bulk_loop(self.index * self.configured_streams + n),
            remote_token=lambda: self.remote_token, stall_s=to.dead_after_s,
            on_streams=lambda n: self.metrics.bulk_streams.labels(peer=self.key).set(n), log=self.log))
        self.metrics.peer_up.labels(peer=self.key).set(0)

    # ------------------------------------------------------------------ what others read
    @property
    def is_up(self) -> bool:
        return self.control is not None and not self.control.closed and self.up.is_set()

    @property
    def out(self) -> dict[int, OutTransfer]:
        return self.flow.out

    @property
    def inn(self) -> dict[int, InTransfer]:
        return self.receiver.inn

    @property
    def routes(self):
        return self.receiver.routes

    @property
    def links(self) -> Mapping[int, Any]:
        """Bulk TCP connections up, by stream (empty on paths without them)."""
        return self.data.links

    @property
    def over_ucx(self) -> bool:
        """KV to this peer moves as UCX messages now (a status, for pages and tests)."""
        return self.data.active == "ucx"

    @property
    def goodput_Bps(self) -> float:
        return self.link.goodput_Bps

    @property
    def rtt_s(self) -> float | None:
        return self.link.rtt_s

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.dialer:
            self.spawn(self.dialer_loop.run(), "dial")
        self.spawn(self._tick_forever(), "tick")

    def spawn(self, coro, name: str) -> asyncio.Task:
        """Run ``coro`` as a task the session owns (cancelled and awaited by :meth:`close`)."""
        t = asyncio.create_task(coro, name=f"{self.key}:{name}")
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def close(self, reason: str = "shutdown") -> None:
        """End the session (GOODBYE ``reason``: "shutdown", or "idle" for a fleet idle close). When
        the agent stops, the peer is told of every transfer still open (KV_CANCEL SHUTTING_DOWN)
        before the GOODBYE, which gets a moment to leave: its engines hear now, not after its
        peer_give_up_s (proto/transfer.md §10)."""
        self.closing = self.dialer_loop.closing = True
        # What is still open: the agent stops, or (a fleet session closed) the session is gone.
        stopping = self.host.stopping
        code, why = ((ErrorCode.SHUTTING_DOWN, "agent shutting down") if stopping else
                     (ErrorCode.PEER_UNREACHABLE, f"the session with {self.key} was closed ({reason})"))
        if stopping and self.control is not None and not self.control.closed:
            await self._fail_all(code, why, notify_peer=True)
        self.tokens.close()  # no token frame after the GOODBYE
        if (c := self.control) is not None and not c.closed:
            try:  # what is queued (a token backlog) leaves first, then the close flushes TLS: bounded
                c.send(encode(FrameType.GOODBYE, encode_body(m.Goodbye(reason))), now=True)
                async with asyncio.timeout(1.0):
                    while not c.closed and c.unsent:
                        await asyncio.sleep(0.01)
                    c.close()
                    while not c.closed:
                        await asyncio.sleep(0.01)
            except (TransportError, TimeoutError):
                pass
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._drop_connections()
        await self._fail_all(code, why, notify_peer=False)
        self.tokens.close()
        await self.data.close()

    # ------------------------------------------------------------------ dialing
    def _hello(self) -> m.Hello:
        return m.Hello(versions=list(m.SUPPORTED_VERSIONS), site=self.cfg.site, node=self.cfg.node,
                       incarnation=self.host.incarnation, capabilities=self._capabilities(),
                       max_body=self.cfg.limits.max_body, max_chunk=MAX_CHUNK,
                       credit_bytes=self.cfg.transfer.credit_bytes, bulk_streams=self.configured_streams,
                       ucx_address=self.data.address(), ucx_tag_key=self.data.tag_key())

    def _on_welcome(self, conn: FrameProtocol, msg: m.Welcome) -> None:
        """Dialer side. Adopted here, in the frame handler, so that frames the listener sent right
        behind WELCOME (in the same read) find the session established (or are ignored: declined)."""
        try:
            check_welcome(msg, self.peer.site, self.peer.node, self.peer.address)
        except FatalHandshakeError as exc:
            conn.fail(exc)
            self.dialer_loop.failed(exc)
            return
        if self.dialer_loop.welcomed(conn, msg, first=self.remote_incarnation is None):
            self._established(conn, msg.incarnation, msg)

    def _capabilities(self) -> list[str]:
        off = {"offer.v1": not self.cfg.transfer.offers, "inline.v1": not self.cfg.transfer.inline_bytes}
        return [c for c in CAPABILITIES if not off.get(c)]

    def _new_control(self) -> FrameProtocol:
        lim, to = self.cfg.limits, self.cfg.timeouts  # stalled: nothing acknowledged for as long as silence
        conn = control_protocol(max_body=lim.max_body, max_unsent=lim.control_buffer_bytes, stall_s=to.dead_after_s)
        conn.on_frame = self._on_control_frame
        conn.on_lost = self._on_control_lost
        conn.on_framing_error = self.metrics.error
        return conn

    # ------------------------------------------------------------------ accepting
    def adopt_control(self, conn: FrameProtocol, hello: m.Hello) -> m.Welcome:
        """Listener side: a dialer's HELLO passed the agent's checks; take the connection."""
        version = choose_version(hello.versions)
        if self.control is not None and not self.control.closed:
            self.lines.line(self.log.info, "peer reconnected; dropping the previous control connection")
            old, self.control = self.control, None
            old.on_lost = lambda c, e: None
            old.abort()
            self._connection_down("replaced")
        conn.on_frame = self._on_control_frame
        conn.on_lost = self._on_control_lost  # (its on_framing_error counts already: inbound set it)
        welcome = m.Welcome(version=version, site=self.cfg.site, node=self.cfg.node,
                            incarnation=self.host.incarnation, session=self.token,
                            capabilities=self._capabilities(), max_body=self.cfg.limits.max_body,
                            max_chunk=MAX_CHUNK, credit_bytes=self.cfg.transfer.credit_bytes,
                            bulk_streams=self.configured_streams, resumed=self.remote_incarnation == hello.incarnation,
                            ucx_address=self.data.address(), ucx_tag_key=self.data.tag_key())
        conn.send(encode(FrameType.WELCOME, encode_body(welcome)))
        self._established(conn, hello.incarnation, hello)
        return welcome

    def adopt_bulk(self, stream: int, loop, conn: FrameProtocol) -> None:
        """An accepted bulk connection named this session (called on the main loop)."""
        self.data.adopt_bulk(stream, loop, conn)

    def bulk_lost(self, conn: FrameProtocol, stream: int, exc) -> None:
        """A bulk connection ended (main loop)."""
        self.data.bulk_lost(conn, stream, exc)

    # ------------------------------------------------------------------ connection state
    def _established(self, conn: FrameProtocol, incarnation: int, info: m.Hello | m.Welcome) -> None:
        first = self.remote_incarnation is None
        restarted = not first and self.remote_incarnation != incarnation
        why = (f"peer {self.key} restarted" if restarted else "" if first  # or a dialer's listener kept nothing
               else self.dialer_loop.session_lost(info, self.key))
        self.control = conn
        self._last_rx = time.monotonic()
        self.peer_goodbye = None
        if why:
            self.lines.line(self.log.warning, "peer restarted or kept no session: failing its transfers", reason=why)
            self.outbox.clear()  # it forgot what they would end anyway
            self.host.tokens_lost(self, why, ErrorCode.PEER_RESTARTED if restarted else ErrorCode.PEER_UNREACHABLE)
            self._peer_restarted(why)
        self.remote_incarnation = incarnation
        terms = negotiate(Limits(self.cfg.transfer.chunk_bytes, self.cfg.transfer.credit_bytes,
                                 self.configured_streams), info)
        self.remote_caps = terms.capabilities
        keyed = "ucx-keys.v1" in terms.capabilities and "ucx-keys.v1" in self._capabilities()
        self.data.use_tag_keys(info.ucx_tag_key if keyed else None)  # before anything is sent
        if isinstance(info, m.Welcome):
            self.remote_token = info.session
        self.chunk_bytes = terms.chunk_bytes
        self.peer_max_chunk = terms.peer_max_chunk
        self.peer_max_body = terms.peer_max_body
        self.flow.configure(terms.window)
        self.streams = terms.streams
        self.down_since = None
        self.up.set()
        self.metrics.peer_up.labels(peer=self.key).set(1)
        if not first:
            self.metrics.reconnects.labels(peer=self.key).inc()
        self.lines.state(self.log.info, "peer up", resumed=not first and not why, streams=self.streams)
        self.outbox.resend()  # first: what the last connection may have lost ends before anything new
        self.pings.send()  # an RTT at once (and the outbox's confirmation)
        self.receiver.session_up()
        self.sender.resume()
        self.tokens.resend_unacked()
        self.sender.pump()
        self.host.session_up(self)
        self.data.connected(info.ucx_address, streams=self.streams)

    def _on_control_lost(self, conn: FrameProtocol, exc) -> None:
        if conn is not self.control:
            self.dialer_loop.conn_lost(conn, exc)
            return
        self.lines.state(self.log.info, "control connection lost", error=str(exc) if exc else None)
        self._connection_down("control lost")

    def _connection_down(self, why: str) -> None:
        self.est.link_down()
        self.up.clear()
        self.control = None
        self.down_since = time.monotonic()
        self.metrics.peer_up.labels(peer=self.key).set(0)
        self._drop_connections()
        self.flow.connection_lost()
        self.sender.connection_lost()
        self.dialer_loop.failed(TransportError(f"connection lost during the handshake ({why})"))
        self.dialer_loop.lost.set()

    def _drop_connections(self) -> None:
        self.data.down()
        if self.control is not None:
            self.control.abort()

    def _peer_restarted(self, why: str) -> None:
        self.sender.fail_all(ErrorCode.PEER_RESTARTED, why, notify_peer=False)
        self.receiver.peer_restarted()
        self.tokens.clear()
        self.host.peer_lost(self, "peer_restarted")
        self.flow.peer_restarted()

    # ------------------------------------------------------------------ the data path reports (DataPathOwner)
    def lane_up(self, lane: int) -> None:
        self.flow.lane_up(lane)
        self.sender.pump()

    def lane_lost(self, lane: int) -> None:
        self.sender.lane_lost(lane)

    def send_failed(self, tid: int, k: int, why: str) -> None:
        self.sender.send_failed(tid, k, why)

    def chunk_arrived(self, tid: int, k: int, ok: bool, nbytes: int, claimed: bool, invalid: bool = False,
                      wrong_size: bool = False) -> None:
        """A data path finished reading chunk ``k`` (main loop)."""
        self.receiver.chunk_arrived(tid, k, ok, nbytes, claimed, invalid, wrong_size)

    def chunk_early(self, tid: int, wake) -> bool:
        """Any thread: hold a chunk of ``tid`` (no transfer open) until its KV_BEGIN was handled?"""
        return self.receiver.gate.hold(tid, wake)

    def reconnect(self, why: str) -> None:
        if self.control is not None:
            self.lines.line(self.log.info, "dropping the control connection", reason=why)
            self.control.abort()

    # ------------------------------------------------------------------ control frames
    def _on_control_frame(self, conn: FrameProtocol, frame: Frame) -> None:
        self._last_rx = time.monotonic()
        h = frame.header
        if conn is not self.control and h.type not in (FrameType.WELCOME, FrameType.ERROR):  # handshake.md §2
            return self._unexpected(conn, f"{FrameType(h.type).name} before WELCOME")
        if h.type == FrameType.KV_CHUNK:  # inline.v1: a small chunk on the control connection
            return self.receiver.inline_chunk(conn, frame)
        try:
            msg = decode_body(h.type, frame.body)
        except ProtocolError as exc:
            self.metrics.error(exc.code)
            conn.fail(exc)
            return
        lane_name = _LANE_NAMES[h.lane]
        self.metrics.child(self.metrics.frames, self.key, lane_name, "rx").inc()
        self.metrics.child(self.metrics.bytes, self.key, lane_name, "rx").inc(HEADER_SIZE + h.body_len)
        tid = h.transfer_id
        match msg:
            case m.Welcome() if self.dialer and self.control is None:
                self._on_welcome(conn, msg)
            case m.Ping():
                self.send_frame(FrameType.PONG, m.Pong(msg.nonce, msg.sent_ns))
            case m.Pong():
                self.pings.pong(msg)
            case m.KvBegin():
                self.receiver.on_begin(tid, msg, conn)
            case m.KvAccept():
                self.sender.on_accept(tid)
            case m.KvReject():
                self.sender.on_reject(tid, msg)
            case m.KvAck():
                self.sender.on_ack(tid, msg.first, msg.count)
            case m.KvNack():
                self.sender.on_nack(tid, msg.chunk, msg.code)
            case m.KvDone():
                self.sender.on_done(tid)
            case m.KvCancel() if msg.by_receiver:
                self.sender.on_cancel(tid, msg)
            case m.KvCancel():
                self.receiver.on_cancel(tid, msg)
            case m.KvResume():
                self.receiver.on_resume(tid, msg)
            case m.KvStatus():
                self.sender.on_status(tid, msg)
            case m.Tokens():
                self.tokens.on_tokens(msg)
            case m.TokensAck():
                self.tokens.on_ack(msg)
            case m.HandoffProgress() | m.HandoffCommit() | m.HandoffTaken() | m.HandoffRelease() | m.HandoffAbort():
                self.host.handoff_message(self, msg)
            case m.PrefixQuery():
                k = self.host.prefix_query(self, msg)
                self.send_frame(FrameType.PREFIX_MATCH, m.PrefixMatch(msg.request_id, k), tid=tid)
            case m.PrefixMatch():
                self.sender.on_prefix_match(tid, msg)
            case m.KvOffer() | m.KvWithdraw():
                self.sender.on_offer(msg)
            case m.RequestAbort():
                self.tokens.drop(msg.request_id)
                self.host.request_aborted(self, msg)
            case m.Error():  # the peer's last word on this connection (frames.md §4): nothing more is read
                self.lines.line(self.log.warning, "peer reported an error",  # one line per period, whatever the text
                                detail={"code": code_name(msg.code), "message": msg.message})
                self.metrics.error(peer_code(msg.code))  # (an unassigned code counts as PEER_ERROR: bounded labels)
                if self.control is None:
                    self.dialer_loop.refused(msg.code, msg.message)
                conn.abort()
            case m.Goodbye():
                self.lines.goodbye(self.log.info, msg.reason)
                self.peer_goodbye = msg.reason
                self.host.peer_goodbye(self, msg.reason)
            case _:
                self._unexpected(conn, f"unexpected {FrameType(h.type).name} on the control connection")

    def _unexpected(self, conn: FrameProtocol, what: str) -> None:
        self.metrics.error(ErrorCode.UNEXPECTED_FRAME)
        conn.fail(ProtocolError(what, ErrorCode.UNEXPECTED_FRAME))

    def send_frame(self, ftype: int, body, *, tid: int = 0, lane: int = Lane.CONTROL, now: bool = False) -> bool:
        """A control-connection frame on ``lane`` CONTROL or TOKEN (counted apart); False if down.
        ``now``: written at once with the frames queued before it, not at the end of the turn."""
        c = self.control
        if c is None or c.closed:
            return False
        if self.acks.hold(c, ftype, body, tid):  # a KV_ACK: goes as a range with the turn's frames
            return True
        frame = encode(ftype, encode_body(body), lane=lane, transfer_id=tid)
        try:
            c.send(frame, now=now)
        except TransportError as exc:
            if exc.code == ErrorCode.PEER_NOT_READING:
                self.metrics.error(exc.code)
                self.log.warning("control connection failed: the peer does not read", error=str(exc),
                                 code=exc.code.name)
            return False
        lane_name = _LANE_NAMES[lane]
        self.metrics.child(self.metrics.frames, self.key, lane_name, "tx").inc()
        self.metrics.child(self.metrics.bytes, self.key, lane_name, "tx").inc(len(frame[0]))
        return True

    def send_message(self, body, *, lane: int = Lane.TOKEN) -> bool:
        """A control message, its frame type from its body; False if down (the caller resends; a
        handoff's ABORT and RELEASE are kept in the outbox instead, their handoff may be forgotten)."""
        if isinstance(body, (m.HandoffAbort, m.HandoffRelease)):
            return self.outbox.send(("handoff", body.request_id, body.epoch), body)
        return self.send_frame(m.TYPE_OF[type(body)], body, lane=lane)

    def cancel_transfer(self, tid: int, msg: m.KvCancel) -> None:
        """KV_CANCEL, kept until the peer is known to have read it (it must not keep the transfer open)."""
        self.outbox.send(("cancel", tid, msg.by_receiver), msg, tid=tid)  # (transfer ids are each side's own)

    def tokens_arrived(self, msg: m.Tokens) -> None:
        self.host.tokens_received(self, msg)

    def count_error(self, code: int) -> None:
        self.metrics.error(code_name(code))

    def count_failure(self, direction: str, code: int) -> None:
        self.metrics.child(self.metrics.transfers, self.key, direction, code_name(code).lower()).inc()
        self.count_error(code)

    async def ping(self, timeout: float = 1.0) -> float | None:
        """One PING on the control lane; its round trip in seconds, or None if unanswered."""
        return await self.pings.ping(timeout)

    # ------------------------------------------------------------------ transfers (the agent's API)
    def start_send(self, engine, request_id: str, blocks: BlockMap, deadline_s: float,
                   hashes: list[int] | None = None, post_wait_s: float = 0.0) -> OutTransfer:
        """``post_wait_s``: the receiver holds the KV_BEGIN this long for its receive to be posted
        (KV_BEGIN.post_wait_ms; 0 = the receiver's default)."""
        return self.sender.start(engine, request_id, blocks, deadline_s, hashes, post_wait_s)

    def drop_out(self, t: OutTransfer) -> None:
        """Withdraw a transfer its engine was told never started (tells the peer, no event)."""
        self.sender.drop(t)

    async def prefix_lookup(self, request_id: str, hashes: list[int], timeout: float | None = None) -> int | None:
        """How many leading blocks of ``hashes`` the peer's node holds (leased for the request);
        None if the peer does not keep an inventory, is down, or does not answer in time."""
        return await self.sender.prefix_lookup(request_id, hashes, timeout)

    def accept_in(self, tid: int, begin: m.KvBegin, engine, dest: BlockMap, *, late: bool = False,
                  lz4: bool = True) -> InTransfer | None:
        """A KV_BEGIN matched a posted receive (``late``: after it waited; ``lz4`` False: no LZ4
        chunks): check it and open the transfer; a refusal goes to the peer and the posting engine."""
        return self.receiver.accept(tid, begin, engine, dest, late=late, lz4=lz4)

    def reject_in(self, tid: int, begin: m.KvBegin, code: int, message: str) -> None:
        self.receiver.reject(tid, begin, code, message)

    def fail_incoming(self, t: InTransfer, code: int, message: str, *, notify_peer: bool) -> None:
        """Fail an incoming transfer (scheduled: its memory is handed back once no data path
        writes into it; the engine then gets the failure)."""
        self.receiver.fail_later(t, code, message, notify_peer)

    async def cancel_request(self, request_id: str, code: int, message: str, engine=None, *,
                             notify_peer: bool = True) -> int:
        """Cancel every transfer of ``request_id`` (of ``engine`` when given); tells the peer."""
        outs, ins = self.transfers_of(request_id)
        outs, ins = [t for t in outs if engine in (None, t.engine)], [t for t in ins if engine in (None, t.engine)]
        for o in outs:
            self.sender.fail(o, code, message, notify_peer=notify_peer)
        for i in ins:
            await self.receiver.fail(i, code, message, notify_peer=notify_peer)
        return len(outs) + len(ins)

    def transfers_of(self, request_id: str) -> tuple[list[OutTransfer], list[InTransfer]]:  # indexed, no scan
        return ([self.out[k] for k in self.sender.by_request.get(request_id, ())],
                [self.inn[k] for k in self.receiver.by_request.get(request_id, ())])

    def send_abort(self, request_id: str, reason: str, spare: bool = False) -> bool:
        """Tell the peer the request is dead (REQUEST_ABORT), if it understands it: now, or once the
        session resumes (the outbox). Its offer for the request goes too (the peer withdraws nothing
        it learns is dead this way)."""
        self.tokens.drop(request_id)
        self.sender.offers.pop(request_id, None)
        if self.remote_caps is not None and "abort.v1" in self.remote_caps:
            msg = m.RequestAbort(request_id, reason[:REASON_SENT])
            return self.outbox.send(("abort", request_id), msg, spare=spare)
        return False

    async def engine_gone(self, engine) -> None:
        self.sender.fail_all(ErrorCode.ENGINE_GONE, "the sending engine disconnected", notify_peer=True,
                             engine=engine)
        await self.receiver.fail_all(ErrorCode.ENGINE_GONE, "the receiving engine disconnected", notify_peer=True,
                                     engine=engine)

    def send_tokens(self, request_id: str, tokens: list[int], *, handoff: bool = False) -> int:
        """Relay token IDs for ``request_id``; returns the index of the first one. ``handoff``:
        RLD's relay of a handoff (MD's agent keeps it before MD's engine registers)."""
        return self.tokens.send(request_id, tokens, handoff=handoff)

    def relaying_tokens(self, request_id: str) -> bool:
        """Token IDs of ``request_id`` are being relayed to this peer."""
        return request_id in self.tokens.tok_out

    # ------------------------------------------------------------------ heartbeat and housekeeping
    async def _tick_forever(self) -> None:
        to = self.cfg.timeouts
        late = LateTicks(to.heartbeat_s)  # after a stall of this process, read before judging
        while True:
            due = time.monotonic() + to.heartbeat_s
            await asyncio.sleep(to.heartbeat_s)
            now = time.monotonic()
            stalled = late.hold(due, now)  # the stall itself: pdd_wire.loopwatch logs it
            control = self.control
            if control is not None and self.is_up:
                if now - self._last_rx > to.dead_after_s and not stalled:
                    self.lines.line(self.log.warning, "peer silent; dropping the control connection",
                                    detail={"silent_s": round(now - self._last_rx, 2)})
                    control.abort()
                else:
                    self.pings.send()
                self.est.expire(now)
                self.link.decide_compression()
            elif self.down_since is not None and now - self.down_since > to.peer_give_up_s and not stalled:
                await self.give_up(f"peer {self.key} unreachable for {to.peer_give_up_s}s")
            if not stalled:
                self.sender.expire(now, to.chunk_ack_s)

    async def give_up(self, why: str, code: int = ErrorCode.PEER_UNREACHABLE) -> None:
        """Fail every transfer with the peer now: PEER_UNREACHABLE after peer_give_up_s down, or at
        once when a fleet member's lease expired; PEER_RESTARTED when its record has a new incarnation."""
        self.host.peer_lost(self, "peer_restarted" if code == ErrorCode.PEER_RESTARTED else "peer_unreachable")
        await self._fail_all(code, why, notify_peer=True)

    async def _fail_all(self, code: int, why: str, *, notify_peer: bool) -> None:
        self.sender.fail_all(code, why, notify_peer=notify_peer)
        await self.receiver.fail_all(code, why, notify_peer=notify_peer)

    # ------------------------------------------------------------------ link figures
    def link_figures(self) -> "policy.LinkFigures":
        """The live estimate of this link (:class:`~.estimator.LinkEstimator`): delivery rate
        while busy (falling back to finished transfers' goodput), the KV bytes still to send, and
        the control-lane RTT. Bandwidth is 0 (unknown) before any KV moved, or while the peer is
        down."""
        return self.link.figures(self.is_up, self.queue_bytes())

    def queue_bytes(self) -> int:
        """KV bytes accepted for this peer and not yet acknowledged."""
        return self.flow.queue_bytes()

    def predict(self, nbytes: int) -> float | None:
        """Seconds ``nbytes`` more KV to this peer would take now (None: bandwidth unknown)."""
        if not self.is_up:
            return None
        return self.link.predict(nbytes, self.queue_bytes())

    def describe(self) -> dict:
        return {"peer": self.key, **self.link.describe(self.queue_bytes()),
                **self.data.describe(), "address": self.peer.address, "transport": self.peer.transport,
                "role": "dialer" if self.dialer else "listener", "up": self.is_up,
                "bulk_streams_up": len(self.links), "bulk_streams": self.streams,
                "credit_window_bytes": self.flow.window, "bytes_in_flight": self.flow.in_flight_bytes,
                "chunk_bytes": self.chunk_bytes, "transfers_out": len(self.out), "transfers_in": len(self.inn)}
