"""The agent: composes the WAN listener, the peer sessions, the engine socket, the desks and the
admin server, and owns their lifecycle.

Who does what (each gets its collaborators from here and never sees the agent):

- :mod:`~pdd_wire.inbound` accepts WAN connections and hands them to their sessions;
- :mod:`~pdd_wire.session` (one per peer) moves frames, KV and tokens, and calls back the
  ``SessionHost`` methods below, which route each event to its desk;
- :mod:`~pdd_wire.engine_handlers` answers engine requests from :mod:`~pdd_wire.engine_server`;
- :mod:`~pdd_wire.fleet` (with ``[fleet]``) registers this agent in etcd, watches the other
  members, and opens sessions with them on first need (``Peers.discover``, ``Inbound.admit``);
- :mod:`~pdd_wire.desk.kv` holds posts and matches them, fans sends out, ends aborted requests;
- :mod:`~pdd_wire.desk.handoff` drives the handoff state machines; :mod:`~pdd_wire.desk.probes`
  runs link probes; :mod:`~pdd_wire.admin` serves /healthz, /metrics and /v1/status.

Start-up is phased (bulk threads, WAN listener, engine socket, admin, sessions; ``ready`` is set
and systemd told once every listener is bound). Shutdown is phased too: stop accepting, tell
engines, let transfers finish within the grace period, cancel the rest with a reason, release
memory, stop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import os
import random
import ssl
import time

import structlog
from prometheus_client.metrics import MetricWrapperBase

from . import loopwatch, placement, systemd
from .admin import AdminServer
from .config import Config, parse_hostport
from .desk.admission import Gate
from .desk.handoff import HandoffDesk
from .desk.inventory import Inventory
from .desk.kv import KvDesk
from .desk.probes import ProbeDesk, is_probe
from .engine import protocol as p
from .engine_handlers import EngineRequests
from .engine_server import EngineServer
from .errors import ConfigError, ErrorCode
from .fleet import FleetMetrics, Membership, record
from .fleet.peering import FleetPeering
from .fleet.record import EngineRec, LinkRec, Live, MemberRecord
from .inbound import Inbound
from .metrics import Metrics
from .peers import Peers
from .pki import Pki, cert_fingerprint, log_tls_mode, tls_files
from .rundir import engine_access_problems
from .session import PeerSession
from .transfer import InTransfer, OutTransfer
from .transport.bulk_loop import BulkLoop
from .transport.tls import client_tls_context, server_tls_context
from .wire import messages as m
from .wire.handshake import CAPABILITIES

log = structlog.get_logger("pdd_wire.agent")


class Agent:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        self.incarnation = random.getrandbits(63) or 1
        self.log = log.bind(site=config.site, node=config.node)
        self.started = time.time()
        self.config_path: str | None = None  # shown in /v1/status: which file this agent runs on
        self.ready = asyncio.Event()
        self._tids = 0
        self._transfer_ended = asyncio.Event()  # set by sessions whenever a transfer ends
        self._ssl_server: ssl.SSLContext | None = None
        self._ssl_client: ssl.SSLContext | None = None
        self.pki: Pki | None = None  # the TLS files, resolved (or generated) at start
        self._unwatch_loop = lambda: None
        # Bulk connections run TLS with configured certificates; with the generated PKI (loopback
        # only) they are bound to the TLS-authenticated session by its secret token instead
        # (proto/handshake.md §5: TLS on loopback bulk cost 3x of the goodput here).
        self._bulk_tls = config.tls.mode == "files"
        self.bulk_loops: list[BulkLoop] = []
        self._pinned = False  # the event loop's thread placed on cpus.main (placement.pin_main)
        # Copies off the loop (the UCX path's staging) on the KV work's CPUs; None: the loop's default.
        self.work_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.gate = Gate()
        self.peers = Peers()
        self.sessions = self.peers.by_key  # "site/node" -> PeerSession
        self.inventory = Inventory(max_leases=config.transfer.max_transfers * 4)
        self.handoffs = HandoffDesk(config, self.metrics, self.peers, self.gate)
        self.kv = KvDesk(config, self.metrics, self.peers, self.gate, self.handoffs, self.inventory, self.log)
        self.posts = self.kv.posts
        self.probes = ProbeDesk(self.peers, self.gate, self.log)
        self.requests = EngineRequests(config, self.metrics, self.peers, self.gate, self.kv, self.handoffs,
                                       self.describe, self.log)
        self.regions = self.requests.regions
        self.inbound = Inbound(config, self.metrics, self.peers, bulk_loop=self.bulk_loop,
                               refusing=lambda: self.stopping, log=self.log)
        self.engine_server: EngineServer | None = None
        self.admin: AdminServer | None = None
        self.wan_address: tuple[str, int] | None = None
        self._audit_task: asyncio.Task | None = None
        self.membership: Membership | None = None
        self.fleet: FleetPeering | None = None
        if config.fleet.enabled:
            fm = FleetMetrics(self.metrics.registry)
            self.membership = Membership(config.fleet, fm, logger=self.log)
            self.fleet = FleetPeering(config, self.peers, self.membership, fm, new_session=self._fleet_session,
                                      busy=self._busy_sessions, log=self.log, forget=self._forget_series,
                                      on_retire=self._tokens_undelivered)
            self.membership.on_event = self.fleet.on_event
            self.peers.discover = self.fleet.discover
            self.peers.need = self.fleet.need
            self.inbound.admit = self.fleet.admit

    @property
    def stopping(self) -> bool:
        return self.gate.closed

    # ------------------------------------------------------------------ start and stop
    async def start(self) -> None:
        cfg = self.config
        # 0. the event loop's thread on cpus.main; the threads that carry KV work (bulk, page-in,
        #    the worker pool's copies) on cpus.bulk, else where the process was started
        main_cpus, bulk_cpus = cfg.cpus.main_set, cfg.cpus.bulk_set
        placement.check_allowed(main_cpus, "cpus.main")
        placement.check_allowed(bulk_cpus, "cpus.bulk")
        # (threads inherit their creator's CPUs: with the loop's thread placed, by this agent or by
        # another sharing it in-process, they must be placed explicitly)
        work = bulk_cpus or (placement.allowed() if main_cpus or placement.pinned_here() else frozenset())
        self.requests.work_cpus = work
        if main_cpus:
            placement.pin_main(main_cpus, "cpus.main")
            self._pinned = True
        if work:
            self.work_executor = concurrent.futures.ThreadPoolExecutor(
                thread_name_prefix="pdd-work", initializer=placement.pin_quietly, initargs=(work,))
        self.pki = tls_files(cfg)  # may generate the deployment PKI (ConfigError: unusable directory)
        if self.pki is not None:
            self._ssl_server = server_tls_context(self.pki.cert, self.pki.key, self.pki.ca)
            self._ssl_client = client_tls_context(self.pki.cert, self.pki.key, self.pki.ca)
        log_tls_mode(self.log, cfg, self.pki)
        self._unwatch_loop = loopwatch.watch(self.log, self._loop_stalled, cfg.timeouts.loop_stall_warn_s)
        # 1. bulk threads, then every listener (a failure here leaves nothing serving: the caller
        #    runs shutdown(), which stops whatever did start)
        for i in range(cfg.transfer.bulk_threads):
            bl = BulkLoop(f"pdd-bulk-{i}", work)
            try:
                bl.start()
            except OSError as exc:
                where = "" if bulk_cpus else " (where the process was started: cpus.bulk is unset)"
                raise ConfigError("cpus.bulk", f"bulk thread {i} cannot run on CPUs {placement.format_cpus(work)}"
                                               f"{where}: {exc.strerror}") from None
            self.bulk_loops.append(bl)
        if main_cpus or bulk_cpus:
            self.log.info("threads placed", **self.cpus())
        if bulk_cpus and cfg.transfer.bulk_threads > len(bulk_cpus):
            # A bulk thread descheduled while it holds the GIL stops the event loop until it runs
            # again (docs/operator.md, "CPU placement"): one core each keeps that from happening.
            self.log.warning("more bulk threads than bulk CPUs: token frames may wait behind them",
                             bulk_threads=cfg.transfer.bulk_threads, bulk_cpus=cfg.cpus.bulk)
        if main_cpus and not bulk_cpus:
            self.log.warning("cpus.main without cpus.bulk: the bulk threads may run on the event loop's CPUs too",
                             bulk_cpus=placement.format_cpus(work))
        if main_cpus & bulk_cpus:
            self.log.warning("cpus.main and cpus.bulk share CPUs: the bulk threads take them from the event loop",
                             shared=placement.format_cpus(main_cpus & bulk_cpus))
        self.wan_address = self.inbound.listen(*parse_hostport(cfg.listen.wan, "listen.wan"),
                                               ssl_server=self._ssl_server, bulk_tls=self._bulk_tls)
        uids = {os.getuid()} | ({cfg.listen.engine_uid} if cfg.listen.engine_uid is not None else set())
        gids = {cfg.listen.engine_gid} if cfg.listen.engine_gid is not None else set()
        self.engine_server = EngineServer(cfg.listen.engine_socket, cfg.listen.engine_socket_mode,
                                          handler=self.requests.handle, on_gone=self.requests.engine_gone,
                                          now_handler=self.requests.handle_now, now_types=EngineRequests.NOW,
                                          max_engines=cfg.limits.max_engines, max_message=16 << 20,
                                          allowed_uids=uids, allowed_gids=gids, socket_gid=cfg.listen.engine_gid,
                                          on_error=self.metrics.error,
                                          max_out=cfg.limits.engine_queue_bytes,
                                          read_deadline_s=cfg.timeouts.engine_read_s,
                                          max_per_uid=min(cfg.limits.max_engines_per_uid, cfg.limits.max_engines))
        self.requests.engines = self.engine_server
        await self.engine_server.start()
        for problem in engine_access_problems(cfg.listen.engine_socket, cfg.listen.engine_socket_mode,
                                              cfg.listen.engine_uid, cfg.listen.engine_gid):
            self.log.warning("engines of another user cannot reach the engine socket", problem=problem)
        if cfg.listen.admin:
            self.admin = AdminServer(cfg.listen.admin, self)
            await self.admin.start()
        # 2. sessions (they dial or wait to be dialled), the lease audit; 3. ready
        for peer in cfg.peers:
            s = PeerSession(self, peer)
            self.peers.add(s)
            s.start()
        if self.membership is not None and self.fleet is not None:
            self.fleet.tls = self.pki is not None
            if self.pki is None:
                self.log.warning("FLEET WITH PLAINTEXT: peers are NOT authenticated; whoever can write etcd or "
                                 "reach listen.wan can pose as any member (tls.allow_plaintext)")
            self.membership.me = self._member_record()
            try:
                record.check_size(self.membership.me)
            except ValueError as exc:
                raise ConfigError("fleet.engines", str(exc)) from None
            await self.membership.start()  # etcd away at start is a state, not a failure: it is retried
            try:  # the first listing, so that a need right after READY finds the members: bounded
                async with asyncio.timeout(cfg.fleet.request_s):
                    await self.membership.listed.wait()
            except TimeoutError:
                self.log.warning("etcd has not listed the members yet: ready without them",
                                 wait_s=cfg.fleet.request_s)
        self._audit_task = asyncio.create_task(self._audit_forever(), name="lease-audit")
        self.ready.set()
        self.log.info("agent ready", wan=f"{self.wan_address[0]}:{self.wan_address[1]}",
                      engine_socket=cfg.listen.engine_socket,
                      admin=self.admin.address if self.admin else None, peers=list(self.sessions))
        systemd.notify_ready(f"serving {len(self.sessions)} peers")

    def open_transfers(self) -> int:
        return self.peers.open_transfers()

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Stop accepting, let transfers finish within ``grace_s``, cancel the rest, release all."""
        if self.stopping:
            return
        self.gate.closed = True
        try:
            await self._shutdown(grace_s)
        finally:  # also when a step failed: the thread's placement and the workers go with the agent
            if self.work_executor is not None:
                self.work_executor.shutdown(wait=False)
                self.work_executor = None
            if self._pinned:  # an agent run in-process gives its thread back (the last of those sharing it)
                placement.unpin_main()
                self._pinned = False

    async def _shutdown(self, grace_s: float | None) -> None:
        grace = self.config.timeouts.shutdown_grace_s if grace_s is None else grace_s
        systemd.notify_stopping()
        self.log.info("shutting down", open_transfers=self.open_transfers(), grace_s=grace)
        # 1. stop accepting; leave the fleet (the record goes with its lease: nobody dials us now)
        await self.inbound.stop_accepting()
        if self.membership is not None and self.fleet is not None:
            await self.fleet.close()
            await self.membership.stop()
        if self._audit_task is not None:
            self._audit_task.cancel()
            await asyncio.gather(self._audit_task, return_exceptions=True)
        if self.engine_server is not None:
            await self.engine_server.stop_accepting()
            self.engine_server.broadcast(p.Shutdown(grace_s=grace))
        self.kv.shutdown()  # the KV waiting for posts nobody will make is refused now
        # 2. let transfers finish
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
        # 3. cancel the rest, telling peers and engines
        self.handoffs.shutdown()
        await asyncio.gather(*(s.close() for s in self.peers), return_exceptions=True)
        await self.inbound.close()
        if self.engine_server is not None:
            await self.engine_server.close()
        # 4. release memory, stop the rest
        self.requests.close()
        self.probes.close()
        if self.admin is not None:
            await self.admin.stop()
        for bl in self.bulk_loops:
            await asyncio.to_thread(bl.stop)
        self._unwatch_loop()
        self.log.info("stopped")

    def _loop_stalled(self, stall_s: float) -> None:
        self.metrics.loop_stalls.inc()
        self.metrics.loop_stall_seconds.observe(stall_s)

    # ------------------------------------------------------------------ SessionHost (called by sessions)
    def next_transfer_id(self) -> int:
        self._tids += 1
        return self._tids

    def transfer_ended(self) -> None:
        self._transfer_ended.set()

    def bulk_loop(self, stream: int) -> BulkLoop:
        return self.bulk_loops[stream % len(self.bulk_loops)]

    def ssl_client(self, bulk: bool = False):
        return self._ssl_client if self._bulk_tls or not bulk else None

    def incoming_begin(self, session: PeerSession, tid: int, begin: m.KvBegin) -> None:
        if is_probe(begin.request_id):
            self.probes.incoming_begin(session, tid, begin)
        else:
            self.kv.incoming_begin(session, tid, begin)

    def kv_received(self, t: InTransfer) -> None:
        self.kv.kv_received(t, handoff=t.engine is not self.probes.sink)

    def kv_sent(self, t: OutTransfer) -> None:
        self.kv.kv_sent(t)

    def transfer_failed(self, t, direction: str, code: int, message: str) -> None:
        self.kv.transfer_failed(t, direction, code, message, handoff=t.engine is not self.probes.sink)

    def tokens_received(self, session: PeerSession, msg: m.Tokens) -> None:
        if self.handoffs.on_tokens(session, msg):
            return  # the request's MD engine gets them as extend events
        self.kv.tokens_received(session, msg)

    def tokens_room(self, session: PeerSession, request_id: str) -> bool:
        """Whether a relayed frame of ``request_id`` may be delivered now; if not, the relay leaves
        it unacknowledged and asks for it again later (proto/transfer.md §12)."""
        e = self.handoffs.live.get(request_id)
        if e is not None and e.role == "MD" and e.session is session:
            return True  # MD's relay: extends of at most MAX_EXTEND_TOKENS, one at a time
        owner = self.kv.owners.get(request_id)
        return owner is None or owner.room_for_tokens(session.peer.site)

    def incoming_cancelled(self, session: PeerSession, tid: int, msg: m.KvCancel) -> None:
        self.kv.incoming_cancelled(session, tid, msg)

    def handoff_message(self, session: PeerSession, msg) -> None:
        self.handoffs.on_message(session, msg)

    # ------------------------------------------------------------------ the fleet (with [fleet])
    def _fleet_session(self, peer, index: int) -> PeerSession:
        s = PeerSession(self, peer, index=index)
        self.peers.add(s)
        s.start()
        return s

    def _forget_series(self, key: str) -> None:
        """Every metric series labelled with the closed fleet session's ``peer`` (gauges,
        counters, histograms): their labels would otherwise grow with every member ever met."""
        self.metrics.drop_children(key)
        for metric in vars(self.metrics).values():
            if not isinstance(metric, MetricWrapperBase):
                continue
            for family in metric.collect():
                gone = {tuple(v for k, v in sample.labels.items() if k not in ("le", "quantile"))
                        for sample in family.samples if sample.labels.get("peer") == key}
                for labels in gone:
                    with contextlib.suppress(KeyError, ValueError):
                        metric.remove(*labels)

    def _tokens_undelivered(self, session: PeerSession, why: str, code: int = ErrorCode.PEER_UNREACHABLE) -> None:
        """A fleet session is dropped, or a session's listener kept nothing of it (WELCOME
        ``resumed`` false), or the peer restarted (``code`` PEER_RESTARTED): token IDs relayed to
        it and not acknowledged will never arrive. Each request's owner engine (``send_tokens``
        made it the owner, tied to the peer's site) is told (``transfer_failed``, transfer id 0,
        direction out, ``code``), so that the request ends with an outcome; a handoff's relay is
        not (its ``handoff_done`` is the outcome). The streams are dropped then: told once."""
        for rid, stream in session.tokens.tok_out.items():
            owner = self.kv.owners.get(rid)
            if (not stream.unacked or stream.handoff or owner is None or owner.engine.closed
                    or not owner.allows(session.peer.site)):
                continue
            owner.engine.send(p.TransferFailed(request_id=rid, transfer_id=0, peer=session.key, direction="out",
                                               code=code, reason=f"token IDs not delivered: {why}"))
            self.log.info("relayed tokens not delivered", request_id=rid, peer=session.key, reason=why)
        session.tokens.drop_out()

    def _busy_sessions(self) -> set[str]:
        """The peers with anything open: transfers, unacknowledged or held tokens, a handoff, KV
        waiting for its post (a fleet session is not closed as idle then). One pass a tick."""
        busy = {s.key for s in self.peers
                if s.out or s.inn or s.tokens.held or any(st.unacked for st in s.tokens.tok_out.values())}
        busy |= {e.session.key for e in self.handoffs.live.values() if not e.settled}
        return busy | {k for k, n in self.kv.unposted_per_peer.items() if n}

    def _member_record(self) -> MemberRecord:
        assert self.wan_address is not None
        return member_record(self.config, incarnation=self.incarnation, wan_port=self.wan_address[1],
                             admin=(self.admin.address or "") if self.admin else "",
                             fingerprint=cert_fingerprint(self.pki.cert) if self.pki else "")

    def _live(self) -> Live:
        ups = [s for s in self.peers if s.is_up]
        links = tuple(LinkRec(s.key, float(s.est.bandwidth_Bps or s.goodput_Bps), float(s.est.rtt_s or 0.0))
                      for s in ups)
        return Live(transfers=self.open_transfers(), queue_bytes=sum(s.queue_bytes() for s in self.peers),
                    engines=len(self.engine_server.engines) if self.engine_server else 0, links=links)

    def session_up(self, session: PeerSession) -> None:
        self.handoffs.session_up(session)
        if self.fleet is not None:
            self.fleet.session_up(session)

    def peer_goodbye(self, session: PeerSession, reason: str) -> None:
        if self.fleet is not None:
            self.fleet.goodbye(session, reason)

    def peer_lost(self, session: PeerSession, reason: str) -> None:
        self.handoffs.peer_lost(session, reason)

    tokens_lost = _tokens_undelivered

    def request_aborted(self, session: PeerSession, msg: m.RequestAbort) -> None:
        self.kv.request_aborted(session, msg)

    def prefix_query(self, session: PeerSession, msg: m.PrefixQuery) -> int:
        return self.kv.prefix_query(session, msg)

    # ------------------------------------------------------------------ AdminSource (read by the admin pages)
    def is_ready(self) -> bool:
        return self.ready.is_set() and not self.stopping

    def peers_up(self) -> tuple[int, int]:
        return sum(s.is_up for s in self.peers), len(self.peers)

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    async def probe(self, peer: str, seconds: float = 4.0, streams: int | None = None) -> dict:
        """Measure the link to ``peer`` (site or site/node) through the real WAN path (a fleet
        member's session is opened first, within fleet.dial_wait_s)."""
        if self.fleet is not None and not self.stopping:
            await self.fleet.wait_up(peer, self.config.fleet.dial_wait_s)
        return await self.probes.probe(peer, seconds, streams)

    def audit(self) -> tuple[dict[str, int], int]:
        """Blocks held for peers, and those held past their lease (see :meth:`KvDesk.audit`)."""
        return self.kv.audit()

    async def _audit_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.timeouts.heartbeat_s)
            pinned, stranded = self.audit()
            for _ in self.inventory.expire(asyncio.get_running_loop().time()):
                self.metrics.leases_expired.labels(kind="prefix").inc()
            for s in self.peers:
                est, key = s.est, s.key
                self.metrics.link_bandwidth.labels(peer=key).set(est.bandwidth_Bps or s.goodput_Bps)
                self.metrics.link_rtt.labels(peer=key).set(est.rtt_s or 0.0)
                self.metrics.link_jitter.labels(peer=key).set(est.jitter_s)
                self.metrics.link_loss.labels(peer=key).set(est.loss)
                self.metrics.link_queue.labels(peer=key).set(s.queue_bytes())
            for kind, n in pinned.items():
                self.metrics.pinned_blocks.labels(kind=kind).set(n)
            self.metrics.stranded_blocks.set(stranded)
            if self.fleet is not None and self.membership is not None:
                self.fleet.tick()
                self.membership.set_live(self._live())
            if stranded:
                self.log.error("blocks held past their lease", stranded=stranded, pinned=pinned)

    def cpus(self) -> dict[str, str]:
        """Where the threads run now (cpulists): the event loop's (called on it) and each bulk thread's."""
        bulk = set()
        for bl in self.bulk_loops:
            if bl.native_id is not None:
                try:
                    bulk |= os.sched_getaffinity(bl.native_id)
                except OSError:  # it ended meanwhile
                    pass
        return {"main": placement.format_cpus(placement.this_thread()), "bulk": placement.format_cpus(bulk)}

    def describe(self) -> dict:
        pinned, stranded = self.audit()
        return {
            "site": self.config.site, "node": self.config.node, "incarnation": self.incarnation,
            "uptime_s": round(time.time() - self.started, 3), "stopping": self.stopping,
            "wan": f"{self.wan_address[0]}:{self.wan_address[1]}" if self.wan_address else None,
            "engine_socket": self.config.listen.engine_socket,
            "cpus": self.cpus(),
            "peers": [s.describe() for s in self.peers],
            "transfers": [t.describe() | {"direction": d} for s in self.peers
                          for d, ts in (("out", s.out), ("in", s.inn)) for t in ts.values()],
            "engines": [{"name": e.name, "pid": e.pid, "regions": len(e.regions)}
                        for e in (self.engine_server.engines.values() if self.engine_server else [])],
            "regions": len(self.regions), "posted_receives": len(self.posts),
            "unposted_waiting": self.kv.unposted_count(),
            "handoffs": self.handoffs.describe(),
            "pinned_blocks": pinned, "stranded_blocks": stranded,
            "fleet": (self.membership.describe() | self.fleet.describe()
                      if self.membership is not None and self.fleet is not None else None),
        }


def member_record(cfg: Config, *, incarnation: int, wan_port: int, admin: str, fingerprint: str) -> MemberRecord:
    """This node's fleet record: the agent's, and ``--check``'s (:func:`check_member_record`)."""
    f = cfg.fleet
    host = parse_hostport(cfg.listen.wan, "listen.wan")[0]
    wan = f.advertise or f"{host}:{wan_port}"  # the bound port (listen.wan may say 0)
    return MemberRecord(site=cfg.site, node=cfg.node, incarnation=incarnation, wan=wan, transport=f.transport,
                        fingerprint=fingerprint, versions=tuple(m.SUPPORTED_VERSIONS), capabilities=CAPABILITIES,
                        admin=admin, engines=tuple(EngineRec(role=e.role, url=e.url, admin=admin,
                                                             engine_socket=e.engine_socket or cfg.listen.engine_socket)
                                                   for e in f.engines))


def check_member_record(cfg: Config) -> None:
    """ConfigError naming ``fleet.engines`` when this node's record could be over
    :data:`.record.MAX_RECORD_BYTES` (the agent would refuse to start, exit 1): built at its
    largest, as ``--check`` knows it before anything is bound (a certificate's fingerprint, the
    largest incarnation, port 65535 for a port 0, the longest address a name may be bound as)."""
    admin = ""
    if cfg.listen.admin:
        host, port = parse_hostport(cfg.listen.admin, "listen.admin")
        try:
            ipaddress.ip_address(host)
        except ValueError:  # a name: the admin server gives the address it bound, IPv6 at most 39 characters
            host = host.ljust(39)
        admin = f"{host}:{port or 65535}"
    me = member_record(cfg, incarnation=(1 << 63) - 1, wan_port=parse_hostport(cfg.listen.wan, "listen.wan")[1]
                       or 65535, admin=admin, fingerprint="sha256:" + "0" * 64)
    try:
        record.check_size(me)
    except ValueError as exc:
        raise ConfigError("fleet.engines", str(exc)) from None
