"""The agent: composes the WAN listener, the peer sessions, the engine socket and the admin
server, and owns their lifecycle.

Start-up is phased (bulk threads, listeners, sessions; ``ready`` is set once every listener is
bound). Shutdown is phased too: stop accepting, tell engines, let transfers finish within the
grace period, cancel the rest with a reason, release memory, stop.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import random
import socket
import time

import structlog

from . import policy, systemd
from .config import Config, parse_hostport
from .engine import protocol as p
from .engine_server import EngineConn, EngineServer
from .errors import (EngineRequestError, ErrorCode, FatalHandshakeError, PddWireError, ProtocolError, TransportError,
                     check_duration)
from .memory import HOST_FD, BlockMap, HostRegion, as_extents
from .metrics import Metrics
from .bulk import BulkHandler
from .handoffs import Handoffs
from .inventory import Inventory
from .probe import PROBE_PREFIX, PROBE_SCRATCH_BYTES, PROBE_TRANSFER_BYTES, ProbeSink, run_probe
from .session import PeerSession
from .transfer import InTransfer, OutTransfer
from .transport.tcp import (KIND_CONTROL, BulkLoop, FrameProtocol, adopt, client_tls_context, read_preamble,
                            server_tls_context)
from .wire import FrameType, decode_body
from .wire import messages as m
from .wire.handshake import check_peer

log = structlog.get_logger("pdd_wire.agent")


MAX_REQUEST_ID = 256  # bytes; every control frame about a request carries it


class Post:
    __slots__ = ("request_id", "engine", "blocks", "from_site", "ttl", "timer", "expires", "max_skip")

    def __init__(self, request_id: str, engine: EngineConn, blocks: BlockMap, from_site: str | None,
                 ttl: float, max_skip: int | None = None) -> None:
        self.max_skip = max_skip  # post_recv.max_skip_blocks: leading blocks a matched prefix may cover
        self.request_id = request_id
        self.engine = engine
        self.blocks = blocks
        self.from_site = from_site
        self.ttl = ttl
        self.timer: asyncio.TimerHandle | None = None
        self.expires = 0.0  # loop time


class Agent:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        self.incarnation = random.getrandbits(63) or 1
        self.log = log.bind(site=config.site, node=config.node)
        self._tids = itertools.count(1)
        self._region_ids = itertools.count(1)
        self.sessions: dict[str, PeerSession] = {}
        self.by_site: dict[str, list[PeerSession]] = collections.defaultdict(list)
        self.by_token: dict[int, PeerSession] = {}
        self.regions: dict[int, HostRegion] = {}
        self.posts: dict[str, Post] = {}
        self.pending_begins: dict[str, tuple[PeerSession, int, m.KvBegin, asyncio.TimerHandle]] = {}
        # Requests whose sender gave up before their receive was posted (request_id -> (code,
        # reason, until)): a post for one fails at once instead of waiting out its ttl.
        self.gave_up: collections.OrderedDict[str, tuple[int, str, float]] = collections.OrderedDict()
        self.owners: collections.OrderedDict[str, EngineConn] = collections.OrderedDict()
        self.bulk_loops: list[BulkLoop] = []
        self.engine_server: EngineServer | None = None
        self.admin = None
        self.wan_address: tuple[str, int] | None = None
        self.ready = asyncio.Event()
        self._transfer_ended = asyncio.Event()  # set by sessions whenever a transfer ends
        self.stopping = False
        self._listen_sock: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._audit_task: asyncio.Task | None = None
        self._inbound: set[asyncio.Task] = set()
        self._inbound_conns = 0
        self._ssl_server = self._ssl_client = None
        self.started = time.time()
        self.handoffs = Handoffs(self)
        self.inventory = Inventory(max_leases=config.transfer.max_transfers * 4)
        self.predictions: collections.OrderedDict[tuple[str, str], float] = collections.OrderedDict()
        self.probe_sink = ProbeSink()
        self._probe_region: HostRegion | None = None
        self._probe_filled = False
        self._probing: set[str] = set()
        tls = config.tls
        if tls.enabled:
            self._ssl_server = server_tls_context(tls.cert, tls.key, tls.ca)
            self._ssl_client = client_tls_context(tls.cert, tls.key, tls.ca)

    # ------------------------------------------------------------------ SessionHost
    def next_transfer_id(self) -> int:
        return next(self._tids)

    def transfer_ended(self) -> None:
        self._transfer_ended.set()

    def bulk_loop(self, stream: int) -> BulkLoop:
        return self.bulk_loops[stream % len(self.bulk_loops)]

    def ssl_client(self):
        return self._ssl_client

    # ------------------------------------------------------------------ start and stop
    async def start(self) -> None:
        cfg = self.config
        if not cfg.tls.enabled:
            if cfg.tls.allow_plaintext:
                self.log.warning("WAN connections are PLAINTEXT and unauthenticated (tls.allow_plaintext = true)")
            else:
                self.log.info("WAN connections are plaintext: loopback only")
        for i in range(cfg.transfer.bulk_threads):
            bl = BulkLoop(f"pdd-bulk-{i}")
            bl.start()
            self.bulk_loops.append(bl)
        host, port = parse_hostport(cfg.listen.wan, "listen.wan")
        sock = socket.create_server((host, port), reuse_port=False, backlog=128)
        sock.setblocking(False)
        self._listen_sock = sock
        self.wan_address = sock.getsockname()[:2]
        self._accept_task = asyncio.create_task(self._accept_forever(), name="wan-accept")
        uids = {os.getuid()} | ({cfg.listen.engine_uid} if cfg.listen.engine_uid is not None else set())
        gids = {cfg.listen.engine_gid} if cfg.listen.engine_gid is not None else set()
        self.engine_server = EngineServer(cfg.listen.engine_socket, cfg.listen.engine_socket_mode,
                                          handler=self._engine_request, on_gone=self._engine_gone,
                                          max_engines=cfg.limits.max_engines, max_message=16 << 20,
                                          allowed_uids=uids, allowed_gids=gids, on_error=self.metrics.error,
                                          max_out=cfg.limits.engine_queue_bytes)
        await self.engine_server.start()
        if cfg.listen.admin:
            from .admin import AdminServer

            self.admin = AdminServer(self)
            await self.admin.start()
        for peer in cfg.peers:
            s = PeerSession(self, peer)
            self.sessions[s.key] = s
            self.by_site[peer.site].append(s)
            self.by_token[s.token] = s
            s.start()
        self._audit_task = asyncio.create_task(self._audit_forever(), name="lease-audit")
        self.ready.set()
        self.log.info("agent ready", wan=f"{self.wan_address[0]}:{self.wan_address[1]}",
                      engine_socket=cfg.listen.engine_socket,
                      admin=self.admin.address if self.admin else None, peers=list(self.sessions))
        systemd.notify_ready(f"serving {len(self.sessions)} peers")

    def open_transfers(self) -> int:
        return sum(len(s.out) + len(s.inn) for s in self.sessions.values())

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Stop accepting, let transfers finish within ``grace_s``, cancel the rest, release all."""
        if self.stopping:
            return
        self.stopping = True
        grace = self.config.timeouts.shutdown_grace_s if grace_s is None else grace_s
        systemd.notify_stopping()
        self.log.info("shutting down", open_transfers=self.open_transfers(), grace_s=grace)
        for task in (self._accept_task, self._audit_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._listen_sock is not None:
            self._listen_sock.close()
        if self.engine_server is not None:
            await self.engine_server.stop_accepting()
            self.engine_server.broadcast(p.Shutdown(grace_s=grace))
        try:
            async with asyncio.timeout(grace):
                while self.open_transfers():
                    self._transfer_ended.clear()
                    await self._transfer_ended.wait()
        except TimeoutError:
            pass
        left = self.open_transfers()
        if left:
            self.log.warning("grace period over; cancelling transfers", cancelled=left)
        for bt in self.pending_begins.values():
            bt[3].cancel()
        self.handoffs.shutdown()
        await asyncio.gather(*(s.close() for s in self.sessions.values()), return_exceptions=True)
        for t in list(self._inbound):
            t.cancel()
        await asyncio.gather(*self._inbound, return_exceptions=True)
        if self.engine_server is not None:
            await self.engine_server.close()
        for r in list(self.regions.values()):
            r.close()
        self.regions.clear()
        if self._probe_region is not None:
            self._probe_region.close()
        if self.admin is not None:
            await self.admin.stop()
        for bl in self.bulk_loops:
            await asyncio.to_thread(bl.stop)
        self.log.info("stopped")

    # ------------------------------------------------------------------ inbound WAN connections
    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        rr = itertools.count()
        while True:
            sock, addr = await loop.sock_accept(self._listen_sock)
            if self._inbound_conns >= self.config.limits.max_peer_connections or self.stopping:
                self.log.warning("inbound connection refused: limits.max_peer_connections reached",
                                 remote=str(addr))
                sock.close()
                continue
            sock.setblocking(False)
            self._inbound_conns += 1
            t = asyncio.create_task(self._inbound_conn(sock, addr, next(rr)))
            self._inbound.add(t)
            t.add_done_callback(self._inbound.discard)

    async def _inbound_conn(self, sock: socket.socket, addr, n: int) -> None:
        to = self.config.timeouts
        try:
            kind = await read_preamble(sock, to.handshake_s)
            if kind == KIND_CONTROL:
                conn = FrameProtocol(max_body=self.config.limits.max_body, max_payload=0)
                first = asyncio.get_running_loop().create_future()
                conn.on_frame = lambda c, f: first.done() or first.set_result(f)
                conn.on_lost = lambda c, e: first.done() or first.set_exception(
                    TransportError(f"closed before HELLO: {e}"))
                await adopt(sock, conn, ssl_ctx=self._ssl_server, timeout=to.handshake_s)
                try:
                    async with asyncio.timeout(to.handshake_s):
                        frame = await first
                except TimeoutError:
                    conn.fail(ProtocolError(f"no HELLO within {to.handshake_s}s", ErrorCode.HANDSHAKE_TIMEOUT))
                    raise
                self._on_hello(conn, frame)
                if not conn.closed:
                    await self._wait_closed(conn)
            else:
                bulk = self.bulk_loop(n)
                main = asyncio.get_running_loop()
                conn = await asyncio.wrap_future(bulk.submit(self._adopt_bulk(sock, bulk, main)))
                await self._wait_closed(conn, bulk)
        except FatalHandshakeError as exc:
            self.metrics.error(exc.code)
            self.log.warning("inbound connection refused", remote=str(addr), error=str(exc), code=exc.code.name)
            sock.close()
        except (TransportError, ProtocolError, TimeoutError, OSError) as exc:
            self.log.info("inbound connection failed", remote=str(addr), error=str(exc) or repr(exc))
            sock.close()
        finally:
            self._inbound_conns -= 1

    async def _wait_closed(self, conn: FrameProtocol, bulk: BulkLoop | None = None) -> None:
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

    def _on_hello(self, conn: FrameProtocol, frame) -> None:
        try:
            if frame.header.type != FrameType.HELLO:
                raise ProtocolError(f"expected HELLO, got frame type {frame.header.type}", ErrorCode.UNEXPECTED_FRAME)
            hello = decode_body(FrameType.HELLO, frame.body)
            check_peer(hello, self.config.peer_sites())
            session = self.sessions.get(f"{hello.site}/{hello.node}")
            if session is None:
                raise FatalHandshakeError(f"{hello.site}/{hello.node} is not a configured peer",
                                          ErrorCode.UNKNOWN_PEER)
            self._check_cert(conn, session)
            session.adopt_control(conn, hello)
        except (ProtocolError, PddWireError) as exc:
            self.metrics.error(exc.code)
            self.log.warning("handshake refused", error=str(exc), code=exc.code.name)
            conn.fail(exc)

    def _check_cert(self, conn: FrameProtocol, session: PeerSession) -> None:
        if self._ssl_server is None:
            return
        want = session.peer.server_name or session.peer.node
        if want not in conn.peer_names:
            raise FatalHandshakeError(f"certificate names {sorted(conn.peer_names)} do not include {want!r}",
                                      ErrorCode.IDENTITY_MISMATCH)

    async def _adopt_bulk(self, sock: socket.socket, bulk: BulkLoop, main) -> FrameProtocol:
        """On a bulk loop: TLS, then wait for BULK_HELLO naming a live session."""

        def resolve(msg: m.BulkHello):
            s = self.by_token.get(msg.session)
            if s is None or (s.peer.site, s.peer.node) != (msg.site, msg.node):
                return None
            if self._ssl_server is not None and (s.peer.server_name or s.peer.node) not in handler.conn.peer_names:
                return None
            return s

        def on_attach(h: BulkHandler) -> None:
            main.call_soon_threadsafe(h.session.adopt_bulk, h.stream, bulk, h.conn)

        handler = BulkHandler(None, -1, main, resolve=resolve, on_attach=on_attach)
        timeout = self.config.timeouts.handshake_s
        await adopt(sock, handler.conn, ssl_ctx=self._ssl_server, timeout=timeout)

        def no_hello() -> None:
            if handler.session is None and not handler.conn.closed:
                handler.conn.fail(ProtocolError(f"no BULK_HELLO within {timeout}s", ErrorCode.HANDSHAKE_TIMEOUT))

        asyncio.get_running_loop().call_later(timeout, no_hello)
        return handler.conn

    # ------------------------------------------------------------------ events from sessions
    def incoming_begin(self, session: PeerSession, tid: int, begin: m.KvBegin) -> None:
        if begin.request_id.startswith(PROBE_PREFIX):
            self._accept_probe(session, tid, begin)
            return
        self.gave_up.pop(begin.request_id, None)  # sent (again): a post for it may match
        post = self.posts.get(begin.request_id)
        if post is not None:
            self._match(session, tid, begin, post)
            return
        waiting = self.pending_begins.get(begin.request_id)
        if waiting is not None:
            if waiting[0] is session and waiting[1] == tid:
                return  # the same KV_BEGIN again (resent after a reconnect): still waiting
            session.reject_in(tid, begin, ErrorCode.DUPLICATE_TRANSFER,
                              f"another transfer for request {begin.request_id!r} is already waiting")
            return
        if len(self.pending_begins) >= self.config.transfer.max_transfers:
            session.reject_in(tid, begin, ErrorCode.TOO_MANY_TRANSFERS, "cannot hold another unposted transfer")
            return
        wait = self._unposted_wait(begin)
        timer = asyncio.get_running_loop().call_later(wait, self._unposted_expired, begin.request_id)
        self.pending_begins[begin.request_id] = (session, tid, begin, timer)

    def _unposted_wait(self, begin: m.KvBegin) -> float:
        """How long an unposted KV_BEGIN waits: the sender's lease (post_wait_ms) up to
        transfer.post_ttl_s, else transfer.unposted_wait_s."""
        t = self.config.transfer
        return min(begin.post_wait_ms / 1000, t.post_ttl_s) if begin.post_wait_ms > 0 else t.unposted_wait_s

    def _unposted_expired(self, request_id: str) -> None:
        entry = self.pending_begins.pop(request_id, None)
        if entry is not None:
            session, tid, begin, _ = entry
            reason = f"no receive posted for request {request_id!r} within {self._unposted_wait(begin):g}s"
            self._gave_up(request_id, ErrorCode.NOT_POSTED, f"the sender's KV waited for this receive and was "
                                                            f"dropped ({reason})")
            session.reject_in(tid, begin, ErrorCode.NOT_POSTED, reason)

    def _gave_up(self, request_id: str, code: int, reason: str) -> None:
        """Remember (bounded, for transfer.post_ttl_s) that nothing will be sent for ``request_id``."""
        until = asyncio.get_running_loop().time() + self.config.transfer.post_ttl_s
        self.gave_up[request_id] = (int(code), reason, until)
        self.gave_up.move_to_end(request_id)
        while len(self.gave_up) > self.config.transfer.max_transfers * 4:
            self.gave_up.popitem(last=False)

    def _match(self, session: PeerSession, tid: int, begin: m.KvBegin, post: Post) -> None:
        if post.from_site is not None and post.from_site != session.peer.site:
            session.reject_in(tid, begin, ErrorCode.NOT_POSTED,
                              f"request {begin.request_id!r} was posted for site {post.from_site!r} only")
            return
        dest = post.blocks
        skip = begin.skip_blocks
        if skip:
            lease = self.inventory.get(begin.request_id)
            if post.max_skip is not None and skip > post.max_skip:
                # The receiving engine counts fewer of them as its own (post_recv.max_skip_blocks).
                session.reject_in(tid, begin, ErrorCode.PREFIX_LOST,
                                  f"{skip} prefix blocks matched for {begin.request_id!r}, but its receive allows "
                                  f"at most {post.max_skip}")
                return
            if lease is None or lease.broken or len(lease.hashes) < skip or skip >= post.blocks.n_blocks:
                # The prefix this sender was promised is gone: it sends every block instead;
                # the post stays for that transfer.
                session.reject_in(tid, begin, ErrorCode.PREFIX_LOST,
                                  f"the {skip} prefix blocks matched for {begin.request_id!r} are no longer held")
                return
            dest = post.blocks.after_blocks(skip)
        self._drop_post(begin.request_id)
        t = session.accept_in(tid, begin, post.engine, dest)
        if t is not None:
            t.reused_blocks = skip
            t.post = post
            if skip:  # the matched blocks stay leased while the suffix is on its way
                self.inventory.extend(begin.request_id, t.deadline + 1.0)

    def incoming_cancelled(self, session: PeerSession, tid: int, msg: m.KvCancel) -> None:
        entry = self.pending_begins.get(msg.request_id)
        if entry is not None and entry[0] is session and entry[1] == tid:
            entry[3].cancel()
            del self.pending_begins[msg.request_id]
            self._gave_up(msg.request_id, ErrorCode.TRANSFER_CANCELLED,
                          f"the sender cancelled its KV before this receive was posted: {msg.message}")

    # ------------------------------------------------------------------ probes
    def _probe_blocks(self, nbytes: int, *, sending: bool = False) -> BlockMap:
        """``nbytes`` (whole MiB) of the probe scratch region, made on first use; filled with
        random bytes the first time this agent sends from it (incompressible, as KV looks to a
        link that compresses)."""
        if self._probe_region is None:
            from .memory import SharedMemory

            mem = SharedMemory(PROBE_SCRATCH_BYTES)
            fd = os.dup(mem.fd)
            mem.close()
            self._probe_region = HostRegion(-1, fd, PROBE_SCRATCH_BYTES, 1 << 20, owner=self.probe_sink)
            self._probe_filled = False
        r = self._probe_region
        if sending and not self._probe_filled:
            r.view()[:] = os.urandom(PROBE_SCRATCH_BYTES)
            self._probe_filled = True
        return BlockMap({r.region_id: r}, as_extents([(r.region_id, 0, nbytes >> 20)]))

    def _accept_probe(self, session: PeerSession, tid: int, begin: m.KvBegin) -> None:
        if begin.total_bytes > PROBE_SCRATCH_BYTES or begin.total_bytes % (1 << 20) or begin.block_bytes != 1 << 20:
            session.reject_in(tid, begin, ErrorCode.SIZE_MISMATCH,
                              f"probe transfers are whole MiB blocks up to {PROBE_SCRATCH_BYTES >> 20} MiB")
            return
        session.accept_in(tid, begin, self.probe_sink, self._probe_blocks(begin.total_bytes))

    async def probe(self, peer: str, seconds: float = 4.0, streams: int | None = None) -> dict:
        """Measure the link to ``peer`` (site or site/node) through the real WAN path."""
        self._refuse_when_stopping()
        if not 0.2 <= seconds <= 120:
            raise EngineRequestError(f"seconds must be in [0.2, 120], got {seconds}", ErrorCode.BAD_REQUEST)
        if streams is not None and not 1 <= streams <= 64:
            raise EngineRequestError(f"streams must be in 1..64, got {streams}", ErrorCode.BAD_REQUEST)
        session = self._session_for(peer)
        if not session.is_up:
            raise EngineRequestError(f"peer {session.key} is not connected", ErrorCode.PEER_UNREACHABLE)
        if session.key in self._probing:
            raise EngineRequestError(f"a probe of {session.key} is already running", ErrorCode.LIMIT_EXCEEDED)
        self._probing.add(session.key)
        try:
            self.log.info("probe started", peer=session.key, seconds=seconds, streams=streams)
            res = await run_probe(session, self._probe_blocks(PROBE_TRANSFER_BYTES, sending=True), self.probe_sink,
                                  seconds=seconds, streams=streams)
            self.log.info("probe done", **{k: v for k, v in res.items() if k != "peer"}, peer=session.key)
            return res
        finally:
            self._probing.discard(session.key)

    def _estimate(self, msg: p.Estimate) -> dict:
        if msg.bytes < 0:
            raise EngineRequestError(f"bytes must be >= 0, got {msg.bytes}", ErrorCode.BAD_REQUEST)
        s = self._session_for(msg.to)
        return {"peer": s.key, "up": s.is_up, "seconds": s.predict(msg.bytes)} | s.est.describe(s.queue_bytes())

    def kv_received(self, t: InTransfer) -> None:
        skip = t.reused_blocks
        reused = self.inventory.places(t.request_id) if skip else []
        t.engine.send(p.KvReceived(request_id=t.request_id, transfer_id=t.tid, peer=t.peer_key, bytes=t.total,
                                   seconds=round(time.monotonic() - t.started, 6), reused_blocks=skip,
                                   reused=reused))
        if t.engine is not self.probe_sink:
            self.handoffs.kv_received(t.request_id)

    def _prediction_checked(self, t: OutTransfer) -> None:
        """The pipeline choice predicted this request's WAN time: record how it came out."""
        pred = self.predictions.pop((t.request_id, t.peer_key), None)
        if pred is None:
            return
        predicted = pred
        real = time.monotonic() - t.started
        self.metrics.wan_prediction.observe(real / predicted if predicted > 0 else float("inf"))
        self.log.info("WAN time against its prediction", request_id=t.request_id, peer=t.peer_key,
                      predicted_s=round(predicted, 4), real_s=round(real, 4))

    def kv_sent(self, t: OutTransfer) -> None:
        self._prediction_checked(t)
        t.engine.send(p.KvSent(request_id=t.request_id, transfer_id=t.tid, peer=t.peer_key, bytes=t.total,
                               seconds=round(time.monotonic() - t.started, 6)))

    def transfer_failed(self, t, direction: str, code: int, message: str) -> None:
        if direction == "in" and code == ErrorCode.PREFIX_LOST and t.reused_blocks:
            # Our matched prefix broke mid-transfer: the sender starts over with every block;
            # post the whole receive again for it. The engine sees only the outcome of that.
            post = t.post
            if not self.stopping and not post.engine.closed and t.request_id not in self.posts:
                self._add_post(Post(t.request_id, post.engine, post.blocks, post.from_site, post.ttl, post.max_skip))
                return
        self.log.warning("transfer failed", request_id=t.request_id, transfer_id=t.tid, peer=t.peer_key,
                         direction=direction, code=ErrorCode(code).name, reason=message)
        t.engine.send(p.TransferFailed(request_id=t.request_id, transfer_id=t.tid, peer=t.peer_key,
                                       direction=direction, code=int(code), reason=message))
        if direction == "in" and t.engine is not self.probe_sink:
            self.handoffs.kv_failed(t.request_id, "kv_cancelled")

    # ------------------------------------------------------------------ prefix inventory
    def prefix_query(self, session: PeerSession, msg: m.PrefixQuery) -> int:
        """A sender asks how many leading blocks of a chain this node holds: lease them."""
        if len(msg.hashes) > 1 << 16 or msg.lease_ms <= 0:
            return 0
        ttl = min(msg.lease_ms / 1000, self.config.transfer.prefix_lease_s * 4)
        k, _ = self.inventory.lease(msg.request_id, msg.hashes, asyncio.get_running_loop().time(), ttl)
        return k

    def _kv_stored(self, ec: EngineConn, msg: p.KvStored) -> dict:
        bm = self._blockmap(ec, msg.blocks)
        if len(msg.hashes) != bm.n_blocks:
            raise EngineRequestError(f"{len(msg.hashes)} hashes for {bm.n_blocks} blocks", ErrorCode.BAD_REQUEST)
        places = [(e.region, e.block + i) for e in bm.extents for i in range(e.count)]
        self._prefix_broken(self.inventory.stored(ec, msg.hashes, places))
        self.metrics.inventory_blocks.set(len(self.inventory.blocks))
        return {"held": len(self.inventory.blocks)}

    def _kv_evict(self, ec: EngineConn, msg: p.KvEvict) -> dict:
        mine = [h for h in msg.hashes if (b := self.inventory.blocks.get(h)) is not None and b.owner is ec]
        evicted, kept, broken = self.inventory.evict(mine, force=msg.force)
        self._prefix_broken(broken)
        self.metrics.inventory_blocks.set(len(self.inventory.blocks))
        return {"evicted": evicted, "kept": kept}

    def _prefix_broken(self, request_ids: list[str]) -> None:
        """Leased prefix blocks were dropped anyway: transfers relying on them start over."""
        for rid in request_ids:
            self.metrics.prefix_leases_broken.inc()
            self.inventory.release(rid)
            for s in self.sessions.values():
                for t in [t for t in s.inn.values() if t.request_id == rid and t.reused_blocks]:
                    s._spawn(s._fail_in(t, ErrorCode.PREFIX_LOST, "matched prefix blocks were evicted",
                                        notify_peer=True), "prefix-lost")

    def request_aborted(self, session: PeerSession, msg: m.RequestAbort) -> None:
        """A peer's engine aborted the request: end what we hold for it on that site's behalf
        and tell our engines (proto/transfer.md §10)."""
        rid, reason = msg.request_id, msg.reason or "aborted by the peer"
        self.metrics.request_aborts.labels(direction="rx").inc()
        told: set[EngineConn] = set()
        if session.has_request(rid):
            told |= {t.engine for t in list(session.out.values()) + list(session.inn.values()) if t.request_id == rid}
            session._spawn(session.cancel_request(rid, ErrorCode.TRANSFER_CANCELLED, f"aborted at {session.key}: "
                                                  f"{reason}", notify_peer=False), "abort")
        post = self.posts.get(rid)
        if post is not None and post.from_site in (None, session.peer.site):
            self._drop_post(rid)
            told.add(post.engine)
        entry = self.pending_begins.get(rid)
        if entry is not None and entry[0] is session:
            entry[3].cancel()
            del self.pending_begins[rid]
            # Its KV waited unposted and is gone: a receive posted later for it fails at once.
            self._gave_up(rid, ErrorCode.TRANSFER_CANCELLED, f"aborted at {session.key}: {reason}")
        ec = self.handoffs.request_aborted(session, rid, reason)
        if ec is not None:
            told.add(ec)
        owner = self.owners.pop(rid, None)
        if owner is not None:
            told.add(owner)
        for e in told:
            if not e.closed:
                e.send(p.RequestAborted(request_id=rid, reason=reason, origin=session.key))
        if told:
            self.log.info("request aborted by a peer", request_id=rid, peer=session.key, reason=reason,
                          engines=len(told))

    def handoff_message(self, session: PeerSession, msg) -> None:
        self.handoffs.on_message(session, msg)

    def session_up(self, session: PeerSession) -> None:
        self.handoffs.session_up(session)

    def peer_lost(self, session: PeerSession, reason: str) -> None:
        self.handoffs.peer_lost(session, reason)

    def tokens_received(self, session: PeerSession, msg: m.Tokens) -> None:
        if self.handoffs.on_tokens(session, msg):
            return  # the request's MD engine gets them as extend events
        ev = p.TokensReceived(request_id=msg.request_id, peer=session.key, seq=msg.seq, tokens=msg.tokens)
        owner = self.owners.get(msg.request_id)
        if owner is not None and not owner.closed:
            owner.send(ev)
        elif self.engine_server is not None:
            self.engine_server.broadcast(ev)

    # ------------------------------------------------------------------ engine requests
    async def _engine_request(self, ec: EngineConn, msg: p.Msg, fd: int | None) -> dict | None:
        match msg:
            case p.Hello():
                ec.name = f"{msg.engine}#{ec.number}"
                ec.log = ec.log.bind(engine=ec.name)
                self.metrics.engines.set(len(self.engine_server.engines))
                return {"site": self.config.site, "node": self.config.node, "protocol": p.ENGINE_PROTOCOL_VERSION,
                        "peers": sorted(self.sessions), "chunk_bytes": self.config.transfer.chunk_bytes}
            case p.Register():
                return self._register(ec, msg, fd)
            case p.Deregister():
                await self._deregister(ec, msg.region)
                return None
            case p.PostRecv():
                return self._post(ec, msg)
            case p.SendKv():
                return self._send_kv(ec, msg)
            case p.SendTokens():
                self._refuse_when_stopping()
                self._check_request_id(msg.request_id)
                if any(not 0 <= t < 1 << 32 for t in msg.tokens):
                    raise EngineRequestError("token IDs must be in 0..2^32-1", ErrorCode.BAD_REQUEST)
                if self.handoffs.owns_relay(msg.request_id):
                    raise EngineRequestError(f"request {msg.request_id!r} is in a handoff: report its tokens with "
                                             f"handoff_tokens", ErrorCode.BAD_REQUEST)
                seq = self._session_for(msg.to).send_tokens(msg.request_id, msg.tokens)
                return {"seq": seq}
            case p.Abort():
                return {"cancelled": await self._abort(ec, msg.request_id, msg.reason)}
            case p.Status():
                return self.describe()
            case p.ChoosePipeline():
                return await self._choose_pipeline(msg)
            case p.Estimate():
                return self._estimate(msg)
            case p.KvStored():
                return self._kv_stored(ec, msg)
            case p.KvEvict():
                return self._kv_evict(ec, msg)
            case p.PrefixRelease():
                return {"released": self.inventory.release(msg.request_id)}
            case p.SetLoad():
                if not 0 <= msg.load < float("inf"):
                    raise EngineRequestError(f"load must be a number >= 0, got {msg.load}", ErrorCode.BAD_REQUEST)
                ec.load = msg.load
                return None
            case p.HandoffRld():
                return self.handoffs.start_rld(ec, msg)
            case p.HandoffMd():
                return self.handoffs.start_md(ec, msg)
            case p.HandoffTokens():
                return self.handoffs.tokens(ec, msg)
            case p.HandoffExtended():
                return self.handoffs.extended(ec, msg)
            case p.HandoffFail():
                return self.handoffs.fail(ec, msg)
        raise EngineRequestError(f"unknown request {type(msg).__name__}", ErrorCode.BAD_REQUEST)

    @staticmethod
    def _check_request_id(request_id: str) -> None:
        if not 0 < len(request_id.encode()) <= MAX_REQUEST_ID:
            raise EngineRequestError(f"request_id must be 1..{MAX_REQUEST_ID} bytes, got {len(request_id.encode())}",
                                     ErrorCode.BAD_REQUEST)
        if request_id.startswith(PROBE_PREFIX[0]):
            raise EngineRequestError("request ids starting with a NUL character are reserved (probes)",
                                     ErrorCode.BAD_REQUEST)

    async def _choose_pipeline(self, msg: p.ChoosePipeline) -> dict:
        session = self._session_for(msg.to)
        hit = msg.prefix_hit_tokens
        source = "engine"
        if msg.block_hashes:
            if msg.block_tokens <= 0:
                raise EngineRequestError("block_tokens must be > 0 with block_hashes", ErrorCode.BAD_REQUEST)
            k = await session.prefix_lookup(msg.request_id, list(msg.block_hashes))
            if k is not None:
                hit, source = min(msg.input_tokens, k * msg.block_tokens), "inventory"
        try:
            req = policy.RequestFigures(input_tokens=msg.input_tokens, prefix_hit_tokens=hit,
                                        expected_output_tokens=msg.expected_output_tokens)
        except ValueError as exc:
            raise EngineRequestError(str(exc), ErrorCode.BAD_REQUEST) from exc
        link = session.link_figures()
        try:
            d = policy.choose_pipeline(req, link, msg.kv_bytes_per_token, self.config.policy.pipeline)
        except ValueError as exc:
            raise EngineRequestError(str(exc), ErrorCode.BAD_REQUEST) from exc
        self.metrics.pipelines.labels(pipeline=d.pipeline, reason=d.reason).inc()
        if d.predicted_wan_s is not None and d.pipeline != "P-RLD":
            self.predictions[(msg.request_id, session.key)] = d.predicted_wan_s
            while len(self.predictions) > self.config.transfer.max_transfers * 4:
                self.predictions.popitem(last=False)
        self.log.info("pipeline chosen", request_id=msg.request_id, pipeline=d.pipeline, reason=d.reason,
                      predicted_wan_s=d.predicted_wan_s, detail=d.detail)
        return {"pipeline": d.pipeline, "reason": d.reason, "predicted_wan_s": d.predicted_wan_s,
                "prefix_hit_tokens": hit, "prefix_source": source,
                "detail": d.detail, "link": {"bandwidth_Bps": link.bandwidth_Bps, "queue_bytes": link.queue_bytes,
                                             "rtt_s": link.rtt_s, "peer": session.key}}

    def _refuse_when_stopping(self) -> None:
        if self.stopping:
            raise EngineRequestError("agent is shutting down", ErrorCode.SHUTTING_DOWN)

    def _register(self, ec: EngineConn, msg: p.Register, fd: int) -> dict:
        try:
            self._refuse_when_stopping()
            if msg.kind != HOST_FD:
                raise EngineRequestError(f"memory kind {msg.kind!r} not supported here (known: {HOST_FD!r})",
                                         ErrorCode.BAD_REQUEST)
            if msg.block_bytes <= 0 or msg.size < msg.block_bytes:
                raise EngineRequestError(f"size {msg.size} and block_bytes {msg.block_bytes} do not make a block",
                                         ErrorCode.BAD_REQUEST)
            if len(ec.regions) >= self.config.limits.max_regions:
                raise EngineRequestError("limits.max_regions reached for this engine", ErrorCode.LIMIT_EXCEEDED)
        except BaseException:
            os.close(fd)
            raise
        rid = next(self._region_ids)
        region = HostRegion(rid, fd, msg.size, msg.block_bytes, owner=ec)  # closes fd
        ec.regions[rid] = region
        self.regions[rid] = region
        self.metrics.regions.set(len(self.regions))
        self.metrics.region_bytes.inc(msg.size)
        ec.log.info("region registered", region=rid, size=msg.size, block_bytes=msg.block_bytes)
        return {"region": rid, "blocks": region.n_blocks}

    async def _deregister(self, ec: EngineConn, rid: int) -> None:
        region = ec.regions.get(rid)
        if region is None:
            raise EngineRequestError(f"region {rid} is not registered by this engine", ErrorCode.UNKNOWN_REGION)
        for s in self.sessions.values():
            for t in [t for t in list(s.out.values()) + list(s.inn.values()) if id(region) in t.blocks.regions]:
                await s.cancel_request(t.request_id, ErrorCode.TRANSFER_CANCELLED, "region deregistered", ec)
        for rid_, post in list(self.posts.items()):
            if id(region) in post.blocks.regions:
                self._drop_post(rid_)
        self._drop_region(ec, rid)

    def _drop_region(self, ec: EngineConn, rid: int) -> None:
        region = ec.regions.pop(rid)
        self.regions.pop(rid, None)
        self.metrics.region_bytes.dec(region.size)
        self.metrics.regions.set(len(self.regions))
        region.close()

    def _blockmap(self, ec: EngineConn, blocks) -> BlockMap:
        return BlockMap(ec.regions, as_extents(blocks))

    def _post(self, ec: EngineConn, msg: p.PostRecv) -> None:
        self._refuse_when_stopping()
        self._check_request_id(msg.request_id)
        if msg.request_id in self.posts:
            raise EngineRequestError(f"request {msg.request_id!r} already has a posted receive",
                                     ErrorCode.DUPLICATE_TRANSFER)
        if len(self.posts) >= self.config.transfer.max_transfers * 4:
            raise EngineRequestError("too many posted receives", ErrorCode.LIMIT_EXCEEDED)
        ttl = check_duration("ttl_s", self.config.transfer.post_ttl_s if msg.ttl_s is None else msg.ttl_s)
        if msg.max_skip_blocks is not None and msg.max_skip_blocks < 0:
            raise EngineRequestError(f"max_skip_blocks must be >= 0, got {msg.max_skip_blocks}", ErrorCode.BAD_REQUEST)
        gone = self.gave_up.pop(msg.request_id, None)
        if gone is not None and gone[2] > asyncio.get_running_loop().time():
            raise EngineRequestError(gone[1], ErrorCode(gone[0]))
        post = self._add_post(Post(msg.request_id, ec, self._blockmap(ec, msg.blocks), msg.from_site, ttl,
                                   msg.max_skip_blocks))
        self._own(msg.request_id, ec)
        waiting = self.pending_begins.pop(msg.request_id, None)
        if waiting is not None:
            session, tid, begin, timer = waiting
            timer.cancel()
            self._match(session, tid, begin, post)

    def _add_post(self, post: Post) -> Post:
        """Hold ``post`` for its engine until a transfer claims it or its ttl runs out."""
        loop = asyncio.get_running_loop()
        post.expires = loop.time() + post.ttl
        post.timer = loop.call_at(post.expires, self._post_expired, post.request_id, post)
        self.posts[post.request_id] = post
        return post

    def _drop_post(self, request_id: str) -> Post | None:
        post = self.posts.pop(request_id, None)
        if post is not None and post.timer is not None:
            post.timer.cancel()
        return post

    def _post_expired(self, request_id: str, post: Post) -> None:
        """The post's lease ran out with no transfer: hand the blocks back to the engine."""
        if self.posts.get(request_id) is not post:
            return
        self._drop_post(request_id)
        self.metrics.leases_expired.labels(kind="post").inc()
        reason = "no transfer claimed the posted receive before its ttl_s (transfer.post_ttl_s)"
        self.log.warning("posted receive expired", request_id=request_id, engine=post.engine.name)
        post.engine.send(p.TransferFailed(request_id=request_id, transfer_id=0, peer="", direction="in",
                                          code=int(ErrorCode.TRANSFER_TIMEOUT), reason=reason))
        self.handoffs.kv_failed(request_id, "post_expired")

    def _own(self, request_id: str, ec: EngineConn) -> None:
        self.owners[request_id] = ec
        self.owners.move_to_end(request_id)
        while len(self.owners) > self.config.transfer.max_transfers * 16:
            self.owners.popitem(last=False)

    def _session_for(self, dest: str) -> PeerSession:
        if "/" in dest:
            s = self.sessions.get(dest)
        else:
            candidates = self.by_site.get(dest) or []
            s = next((c for c in candidates if c.is_up), candidates[0] if candidates else None)
        if s is None:
            raise EngineRequestError(f"no peer {dest!r} (known: {sorted(self.sessions)})", ErrorCode.UNKNOWN_PEER_SITE)
        return s

    def _send_kv(self, ec: EngineConn, msg: p.SendKv) -> dict:
        self._refuse_when_stopping()
        if not msg.to:
            raise EngineRequestError("send_kv needs at least one destination in 'to'", ErrorCode.BAD_REQUEST)
        sessions = [self._session_for(d) for d in msg.to]
        if len({s.key for s in sessions}) != len(sessions):
            raise EngineRequestError("the same peer is named twice in 'to'", ErrorCode.BAD_REQUEST)
        blocks = self._blockmap(ec, msg.blocks)  # validated once, read by every destination
        if msg.block_hashes is not None and len(msg.block_hashes) != blocks.n_blocks:
            raise EngineRequestError(f"{len(msg.block_hashes)} block_hashes for {blocks.n_blocks} blocks",
                                     ErrorCode.BAD_REQUEST)
        self._check_request_id(msg.request_id)
        deadline = check_duration("deadline_s", msg.deadline_s if msg.deadline_s is not None
                                  else self.config.transfer.default_deadline_s)
        lease = 0.0 if msg.lease_s is None else check_duration("lease_s", msg.lease_s)
        for s in sessions:
            if len(s.out) >= self.config.transfer.max_transfers:
                raise EngineRequestError(f"{len(s.out)} transfers open to {s.key} (limit transfer.max_transfers)",
                                         ErrorCode.TOO_MANY_TRANSFERS)
        self._own(msg.request_id, ec)
        out = []
        started = []
        try:
            for s in sessions:
                t = s.start_send(ec, msg.request_id, blocks, deadline, hashes=msg.block_hashes, post_wait_s=lease)
                started.append((s, t))
                out.append({"to": s.key, "transfer_id": t.tid})
        except BaseException:
            for s, t in started:  # all or nothing: the engine got an error, so no event either
                s.drop_out(t)
            raise
        return {"transfers": out}

    async def _abort(self, ec: EngineConn, request_id: str, reason: str) -> int:
        self._check_request_id(request_id)
        self.metrics.request_aborts.labels(direction="tx").inc()
        n = self.handoffs.abort(ec, request_id, reason)  # its HANDOFF_ABORT goes before REQUEST_ABORT
        for s in self.sessions.values():
            s.send_abort(request_id, reason)
        for s in self.sessions.values():
            n += await s.cancel_request(request_id, ErrorCode.TRANSFER_CANCELLED, reason, ec)
        post = self.posts.get(request_id)
        if post is not None and post.engine is ec:
            self._drop_post(request_id)
            n += 1
        entry = self.pending_begins.pop(request_id, None)
        if entry is not None:
            entry[3].cancel()
            entry[0].reject_in(entry[1], entry[2], ErrorCode.TRANSFER_CANCELLED, reason)
        return n

    async def _engine_gone(self, ec: EngineConn) -> None:
        """Cancel the engine's transfers (peers are told), drop its posts, release its memory."""
        self.handoffs.engine_gone(ec)
        for s in self.sessions.values():
            await s.engine_gone(ec)
        for rid, post in list(self.posts.items()):
            if post.engine is ec:
                self._drop_post(rid)
        for rid in list(ec.regions):
            self._drop_region(ec, rid)
        for rid in [r for r, e in self.owners.items() if e is ec]:
            del self.owners[rid]
        self._prefix_broken(self.inventory.forget_owner(ec))
        self.metrics.inventory_blocks.set(len(self.inventory.blocks))
        self.metrics.engines.set(len(self.engine_server.engines) if self.engine_server else 0)

    # ------------------------------------------------------------------ leases
    def audit(self) -> tuple[dict[str, int], int]:
        """Blocks the agent holds for peers (posted receives, transfers in and out), and how many
        of them are *stranded*: held past their lease -- their engine is gone, their peer has
        been unreachable longer than ``dead_after_s + peer_give_up_s`` plus a heartbeat, or a
        post outlived its ttl by a heartbeat. Every path that ends a lease releases the blocks
        before then, so stranded reads 0 unless something is wrong."""
        to = self.config.timeouts
        now, mono = asyncio.get_running_loop().time(), time.monotonic()
        slack = 2 * to.heartbeat_s
        lease = to.peer_give_up_s + slack
        pinned = {"post": 0, "send": 0, "recv": 0}
        stranded = 0
        for post in self.posts.values():
            n = post.blocks.n_blocks
            pinned["post"] += n
            if self._engine_dead(post.engine, mono, slack) or now > post.expires + slack:
                stranded += n
        for s in self.sessions.values():
            gone = s.down_since is not None and mono - s.down_since > lease
            for kind, ts in (("send", s.out), ("recv", s.inn)):
                for t in ts.values():
                    n = t.blocks.n_blocks
                    pinned[kind] += n
                    if self._engine_dead(t.engine, mono, slack) or gone:
                        stranded += n
        return pinned, stranded

    @staticmethod
    def _engine_dead(ec: EngineConn, mono: float, slack: float) -> bool:
        return ec.closed and mono - ec.closed_at > slack

    async def _audit_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.timeouts.heartbeat_s)
            pinned, stranded = self.audit()
            for _ in self.inventory.expire(asyncio.get_running_loop().time()):
                self.metrics.leases_expired.labels(kind="prefix").inc()
            for s in self.sessions.values():
                est, key = s.est, s.key
                self.metrics.link_bandwidth.labels(peer=key).set(est.bandwidth_Bps or s.goodput_Bps)
                self.metrics.link_rtt.labels(peer=key).set(est.rtt_s or 0.0)
                self.metrics.link_jitter.labels(peer=key).set(est.jitter_s)
                self.metrics.link_loss.labels(peer=key).set(est.loss)
                self.metrics.link_queue.labels(peer=key).set(s.queue_bytes())
            for kind, n in pinned.items():
                self.metrics.pinned_blocks.labels(kind=kind).set(n)
            self.metrics.stranded_blocks.set(stranded)
            if stranded:
                self.log.error("blocks held past their lease", stranded=stranded, pinned=pinned)

    # ------------------------------------------------------------------ status
    def describe(self) -> dict:
        pinned, stranded = self.audit()
        return {
            "site": self.config.site, "node": self.config.node, "incarnation": self.incarnation,
            "uptime_s": round(time.time() - self.started, 3), "stopping": self.stopping,
            "wan": f"{self.wan_address[0]}:{self.wan_address[1]}" if self.wan_address else None,
            "engine_socket": self.config.listen.engine_socket,
            "peers": [s.describe() for s in self.sessions.values()],
            "transfers": [t.describe() | {"direction": d} for s in self.sessions.values()
                          for d, ts in (("out", s.out), ("in", s.inn)) for t in ts.values()],
            "engines": [{"name": e.name, "pid": e.pid, "regions": len(e.regions)}
                        for e in (self.engine_server.engines.values() if self.engine_server else [])],
            "regions": len(self.regions), "posted_receives": len(self.posts),
            "unposted_waiting": len(self.pending_begins),
            "handoffs": self.handoffs.describe(),
            "pinned_blocks": pinned, "stranded_blocks": stranded,
        }
