"""The KV desk: where a posted receive meets the KV_BEGIN that fills it, and where a ``send_kv`` fans out to its
destinations.

A **post** (``post_recv``) lends the agent an engine's blocks for one request until a transfer claims them or
``ttl_s`` runs out. A peer's KV_BEGIN is *matched* to the post of its request (:meth:`KvDesk.incoming_begin`);
one that comes first waits, unposted, up to ``transfer.unposted_wait_s`` for the engine to post. A post is
*offered* (KV_OFFER) to the peers that may fill it, so that their transfer moves without waiting for KV_ACCEPT;
the offer is withdrawn when the post goes. ``send_kv`` starts one transfer per destination, all reading the same
pages, all or none. Aborts (from an engine here or from a peer) end what the desk holds for the request: posts,
unposted waits, transfers, the handoff.

Isolation (``proto/transfer.md`` §14): each request is tied to the engine that owns it here (posted it, sent its
KV or tokens, or ``expect_tokens``) and to the peer sites it deals with; tokens and REQUEST_ABORTs from any
other site never reach an engine, and tokens nobody owns are held briefly for their owner per peer
(``session/tokens.py``), then dropped and counted. Unposted waits are kept per peer, each peer within its own
``transfer.max_transfers``, and keyed by (peer, request id): a peer announcing a request id first cannot get
another's KV_BEGIN refused. Between engines: one cannot ``expect_tokens``, ``abort`` or ``prefix_release`` a
request another live engine holds here (:meth:`KvDesk.check_mine`), and each engine has its own share of posted
receives.

The audit counts the blocks held for peers and those held past their lease (*stranded*), which every path that
ends a lease keeps at zero.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import TYPE_CHECKING

from ..config import Config
from ..engine import protocol as p
from ..errors import EngineRequestError, ErrorCode, check_duration
from ..log import limited
from ..metrics import Metrics
from ..wire import messages as m
from .admission import Gate, check_request_id, check_site
from .given_up import GivenUp
from .handoff import HandoffDesk
from .inventory import Inventory, Lease
from .posts import Owner, Post, Unposted, blockmap

if TYPE_CHECKING:
    from ..engine_server import EngineConn
    from ..peers import Peers
    from ..session import PeerSession
    from ..transfer import InTransfer, OutTransfer


class KvDesk:
    def __init__(self, config: Config, metrics: Metrics, peers: "Peers", gate: Gate, handoffs: HandoffDesk,
                 inventory: Inventory, log) -> None:
        self.config = config
        self.metrics = metrics
        self.peers = peers
        self.gate = gate
        self.handoffs = handoffs
        self.inventory = inventory
        self.log = log
        self.posts: dict[str, Post] = {}
        self.posts_per_engine: collections.Counter[EngineConn] = collections.Counter()
        # KV_BEGINs waiting for their post: request id -> peer ("site/node") -> the wait.
        self.unposted: dict[str, dict[str, Unposted]] = {}
        self.unposted_per_peer: collections.Counter[str] = collections.Counter()
        # Requests whose sender gave up before their receive was posted, per site: a post for one
        # fails at once instead of waiting out its ttl.
        self.gave_up = GivenUp(config.transfer.max_transfers * 4, config.transfer.post_ttl_s)
        # The engine that last posted or sent for a request, and the sites tied to it: it gets the
        # request's tokens and aborts, from those sites only.
        self.owners: collections.OrderedDict[str, Owner] = collections.OrderedDict()
        # (request, peer) -> the WAN seconds its pipeline choice predicted, checked on KV_SENT.
        self.predictions: collections.OrderedDict[tuple[str, str], float] = collections.OrderedDict()
        self.aborting: set[tuple[str, str]] = set()  # (peer, request): a REQUEST_ABORT's cancel running

    # ------------------------------------------------------------------ posts and matching
    def post(self, ec: "EngineConn", msg: p.PostRecv) -> None:
        self.gate.check()
        check_request_id(msg.request_id)
        check_site("from_site", msg.from_site)
        if msg.request_id in self.posts:
            raise EngineRequestError(f"request {msg.request_id!r} already has a posted receive",
                                     ErrorCode.DUPLICATE_TRANSFER)
        if self.posts_per_engine[ec] >= self.config.transfer.max_transfers * 4:
            # Each engine's own share: one engine's posts never keep another's out.
            raise EngineRequestError("too many posted receives for this engine (4 x transfer.max_transfers)",
                                     ErrorCode.LIMIT_EXCEEDED)
        ttl = check_duration("ttl_s", self.config.transfer.post_ttl_s if msg.ttl_s is None else msg.ttl_s)
        if msg.max_skip_blocks is not None and msg.max_skip_blocks < 0:
            raise EngineRequestError(f"max_skip_blocks must be >= 0, got {msg.max_skip_blocks}", ErrorCode.BAD_REQUEST)
        now, sites = asyncio.get_running_loop().time(), [msg.from_site] if msg.from_site else list(self.peers.by_site)
        if (gone := self.gave_up.take(msg.request_id, sites, now)) is not None:
            raise EngineRequestError(gone[1], ErrorCode(gone[0]))
        post = self._add_post(Post(msg.request_id, ec, blockmap(ec, msg.blocks), msg.from_site, ttl,
                                   msg.max_skip_blocks))
        self.own(msg.request_id, ec, None if msg.from_site is None else frozenset({msg.from_site}))
        # The post's from_site picks which peer's waiting KV_BEGIN it takes (the oldest of those).
        waits = [w for w in self.unposted.get(msg.request_id, {}).values()
                 if msg.from_site in (None, w.session.peer.site)]
        if waits:
            waiting = min(waits, key=lambda w: w.since)
            self._unwait(msg.request_id, waiting.session.key)
            self._match(waiting.session, waiting.tid, waiting.begin, post, late=True)
        elif self.config.transfer.offers:
            self._offer(post)

    def _offer(self, post: Post) -> None:
        """Offer the post to the peers that may fill it (its from_site's, or every peer)."""
        site = post.from_site
        sessions = self.peers.by_site.get(site, []) if site is not None else list(self.peers)
        post.offered = [s for s in sessions if s.receiver.offer(post.request_id, post.blocks, post.expires)]

    def incoming_begin(self, session: "PeerSession", tid: int, begin: m.KvBegin) -> None:
        """A peer announced KV for a request: match it to its post, or let it wait for one."""
        self.gave_up.forget(session.peer.site, begin.request_id)  # sent (again): a post may match
        post = self.posts.get(begin.request_id)
        if post is not None:
            self._match(session, tid, begin, post)
            return
        waiting = self.unposted.get(begin.request_id, {}).get(session.key)
        if waiting is not None:
            if waiting.tid == tid:
                return  # the same KV_BEGIN again (resent after a reconnect): still waiting
            session.reject_in(tid, begin, ErrorCode.DUPLICATE_TRANSFER,
                              f"another transfer for request {begin.request_id!r} from {session.key} is already "
                              f"waiting")
            return
        if self.gate.closed:  # stopping: no engine posts any more (post_recv is refused SHUTTING_DOWN)
            session.reject_in(tid, begin, ErrorCode.SHUTTING_DOWN, "receiver is shutting down")
            return
        if self.unposted_per_peer[session.key] >= self.config.transfer.max_transfers:
            session.reject_in(tid, begin, ErrorCode.TOO_MANY_TRANSFERS,
                              f"{session.key} has transfer.max_transfers KV_BEGINs waiting unposted")
            return
        wait = self._unposted_wait(begin)
        timer = asyncio.get_running_loop().call_later(wait, self._unposted_expired, begin.request_id, session.key)
        self.unposted.setdefault(begin.request_id, {})[session.key] = Unposted(session, tid, begin, timer)
        self.unposted_per_peer[session.key] += 1

    def _unwait(self, request_id: str, peer: str) -> Unposted | None:
        """Take the unposted wait of ``peer`` for ``request_id`` off the table (timer stopped)."""
        waits = self.unposted.get(request_id)
        waiting = waits.pop(peer, None) if waits is not None else None
        if waiting is None:
            return None
        if not waits:
            del self.unposted[request_id]
        waiting.timer.cancel()
        self.unposted_per_peer[peer] -= 1
        if not self.unposted_per_peer[peer]:
            del self.unposted_per_peer[peer]
        return waiting

    def unposted_count(self) -> int:
        return sum(self.unposted_per_peer.values())

    def incoming_cancelled(self, session: "PeerSession", tid: int, msg: m.KvCancel) -> None:
        waiting = self.unposted.get(msg.request_id, {}).get(session.key)
        if waiting is not None and waiting.tid == tid:
            self._unwait(msg.request_id, session.key)
            self._gave_up(session.peer.site, msg.request_id, ErrorCode.TRANSFER_CANCELLED,
                          f"the sender cancelled its KV before this receive was posted: {msg.message}")

    def _unposted_wait(self, begin: m.KvBegin) -> float:
        """How long an unposted KV_BEGIN waits: the sender's lease (post_wait_ms) up to
        transfer.post_ttl_s, else transfer.unposted_wait_s."""
        t = self.config.transfer
        return min(begin.post_wait_ms / 1000, t.post_ttl_s) if begin.post_wait_ms > 0 else t.unposted_wait_s

    def _unposted_expired(self, request_id: str, peer: str) -> None:
        waiting = self._unwait(request_id, peer)
        if waiting is not None:
            reason = f"no receive posted for request {request_id!r} within {self._unposted_wait(waiting.begin):g}s"
            self._gave_up(waiting.session.peer.site, request_id, ErrorCode.NOT_POSTED,
                          f"the sender's KV waited for this receive and was dropped ({reason})")
            waiting.session.reject_in(waiting.tid, waiting.begin, ErrorCode.NOT_POSTED, reason)

    def _gave_up(self, site: str, request_id: str, code: int, reason: str) -> None:
        self.gave_up.add(site, request_id, code, reason, asyncio.get_running_loop().time())

    def _match(self, session: "PeerSession", tid: int, begin: m.KvBegin, post: Post, *, late: bool = False) -> None:
        if post.from_site is not None and post.from_site != session.peer.site:
            session.reject_in(tid, begin, ErrorCode.NOT_POSTED,
                              f"request {begin.request_id!r} was posted for site {post.from_site!r} only")
            return
        dest = post.blocks
        skip = begin.skip_blocks
        if skip:
            lease = self.inventory.get((session.key, begin.request_id))  # this peer's own lease
            if post.max_skip is not None and skip > post.max_skip:
                # The receiving engine counts fewer of them as its own (post_recv.max_skip_blocks).
                session.reject_in(tid, begin, ErrorCode.PREFIX_LOST,
                                  f"{skip} prefix blocks matched for {begin.request_id!r}, but its receive allows "
                                  f"at most {post.max_skip}")
                self._unlease(session, begin.request_id)
                return
            held = 0 if lease is None or lease.broken else len(lease.hashes)  # (a broken lease holds nothing)
            if held < skip or skip >= post.blocks.n_blocks:  # the sender sends every block instead; the post stays
                why = f"only {held} are leased to {session.key}" if held < skip else "at least one block is sent"
                session.reject_in(tid, begin, ErrorCode.PREFIX_LOST, f"{skip} prefix blocks skipped of the "
                                  f"{post.blocks.n_blocks} posted for {begin.request_id!r}: {why}")
                self._unlease(session, begin.request_id)
                return
            dest = post.blocks.after_blocks(skip)
        else:
            self._unlease(session, begin.request_id)  # sent whole: a lease its query took pins blocks for nothing
        self.drop_post(begin.request_id, settled=session)
        t = session.accept_in(tid, begin, post.engine, dest, late=late)
        if t is not None:
            t.reused_blocks = skip
            t.post = post
            if skip:  # the matched blocks stay leased while the suffix is on its way
                t.lease = lease
                self.inventory.extend((session.key, begin.request_id), t.deadline + 1.0)

    def _add_post(self, post: Post) -> Post:
        """Hold ``post`` for its engine until a transfer claims it or its ttl runs out."""
        loop = asyncio.get_running_loop()
        post.expires = loop.time() + post.ttl
        post.timer = loop.call_at(post.expires, self._post_expired, post.request_id, post)
        self.posts[post.request_id] = post
        self.posts_per_engine[post.engine] += 1
        return post

    def drop_post(self, request_id: str, *, settled: "PeerSession | None" = None) -> Post | None:
        """The post goes; its offers are withdrawn (``settled``: a peer that dropped its copy
        itself: its transfer took the post, or its REQUEST_ABORT ended it)."""
        post = self.posts.pop(request_id, None)
        if post is not None:
            for s in post.offered:
                s.receiver.withdraw(request_id, tell=s is not settled)
            if post.timer is not None:
                post.timer.cancel()
            self.posts_per_engine[post.engine] -= 1
            if not self.posts_per_engine[post.engine]:
                del self.posts_per_engine[post.engine]
        return post

    def drop_posts_in(self, region: object) -> None:
        """The region goes away: no post may keep pointing into it."""
        for rid, post in list(self.posts.items()):
            if id(region) in post.blocks.regions:
                self.drop_post(rid)

    def _post_expired(self, request_id: str, post: Post) -> None:
        """The post's lease ran out with no transfer: hand the blocks back to the engine."""
        if self.posts.get(request_id) is not post:
            return
        self.drop_post(request_id)
        self.metrics.leases_expired.labels(kind="post").inc()
        reason = "no transfer claimed the posted receive before its ttl_s (transfer.post_ttl_s)"
        self.log.warning("posted receive expired", request_id=request_id, engine=post.engine.name)
        post.engine.send(p.TransferFailed(request_id=request_id, transfer_id=0, peer="", direction="in",
                                          code=int(ErrorCode.TRANSFER_TIMEOUT), reason=reason))
        self.handoffs.kv_failed(request_id, "post_expired")

    def holders(self, request_id: str) -> set["EngineConn"]:
        """The live engines holding ``request_id`` here: its owner, its post's engine, its
        handoff's, and those of its transfers."""
        held: set[EngineConn] = set()
        if (o := self.owners.get(request_id)) is not None:
            held.add(o.engine)
        if (post := self.posts.get(request_id)) is not None:
            held.add(post.engine)
        if (h := self.handoffs.live.get(request_id)) is not None:
            held.add(h.engine)
        for s in self.peers:
            held |= {t.engine for ts in s.transfers_of(request_id) for t in ts}
        return {e for e in held if not e.closed}

    def check_mine(self, ec: "EngineConn", request_id: str, what: str) -> None:
        """Refuse ``what`` (BAD_REQUEST) on a request another live engine holds here and ``ec``
        does not (proto/engine.md): engines are isolated from each other's requests."""
        held = self.holders(request_id)
        if held and ec not in held:
            raise EngineRequestError(f"request {request_id!r} belongs to another engine here: {what} refused",
                                     ErrorCode.BAD_REQUEST)

    def own(self, request_id: str, ec: "EngineConn", sites: frozenset[str] | None, *, widen: bool = True) -> int:
        """``ec`` owns ``request_id``, tied to ``sites`` (None: any). The same engine's ties add
        up; ``widen`` false: None keeps the ties it has (``expect_tokens`` without a site). Tokens
        held for the request from those sites are delivered now; returns how many frames."""
        o = self.owners.get(request_id)
        if o is not None and o.engine is ec:
            if sites is None:
                o.sites = None if widen else o.sites
            elif o.sites is not None:
                o.sites = o.sites | sites
        else:
            o = self.owners[request_id] = Owner(ec, sites)
        self.owners.move_to_end(request_id)
        while len(self.owners) > self.config.transfer.max_transfers * 16:
            self.owners.popitem(last=False)
        n = 0
        for s in self.peers:
            if o.allows(s.peer.site):
                for msg in s.tokens.claim(request_id):
                    ec.send(p.TokensReceived(request_id=request_id, peer=s.key, seq=msg.seq, tokens=msg.tokens))
                    n += 1
        return n

    # ------------------------------------------------------------------ sending: fan-out
    def send_kv(self, ec: "EngineConn", msg: p.SendKv) -> dict:
        self.gate.check()
        if not msg.to:
            raise EngineRequestError("send_kv needs at least one destination in 'to'", ErrorCode.BAD_REQUEST)
        sessions = [self.peers.session_for(d) for d in msg.to]
        if len({s.key for s in sessions}) != len(sessions):
            raise EngineRequestError("the same peer is named twice in 'to'", ErrorCode.BAD_REQUEST)
        blocks = blockmap(ec, msg.blocks)  # validated once, read by every destination
        if msg.block_hashes is not None and len(msg.block_hashes) != blocks.n_blocks:
            raise EngineRequestError(f"{len(msg.block_hashes)} block_hashes for {blocks.n_blocks} blocks",
                                     ErrorCode.BAD_REQUEST)
        check_request_id(msg.request_id)
        deadline = check_duration("deadline_s", msg.deadline_s if msg.deadline_s is not None
                                  else self.config.transfer.default_deadline_s)
        lease = 0.0 if msg.lease_s is None else check_duration("lease_s", msg.lease_s)
        for s in sessions:
            if len(s.out) >= self.config.transfer.max_transfers:
                raise EngineRequestError(f"{len(s.out)} transfers open to {s.key} (limit transfer.max_transfers)",
                                         ErrorCode.TOO_MANY_TRANSFERS)
        self.own(msg.request_id, ec, frozenset(s.peer.site for s in sessions))
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

    def expect_wan(self, request_id: str, peer: str, seconds: float) -> None:
        """The pipeline choice predicted ``seconds`` of WAN for this request's KV to ``peer``."""
        self.predictions[(request_id, peer)] = seconds
        while len(self.predictions) > self.config.transfer.max_transfers * 4:
            self.predictions.popitem(last=False)

    # ------------------------------------------------------------------ outcomes (from the sessions)
    def kv_received(self, t: "InTransfer", *, handoff: bool = True) -> None:
        """The KV landed; ``handoff``: the request may be in a handoff (not a probe)."""
        skip = t.reused_blocks
        reused = []
        if skip:
            # The blocks of the lease this transfer was matched with (its own peer's); every path
            # that ends that lease early breaks the transfer first (prefix_broken), so this holds.
            if t.lease is None or not self.inventory.current(t.lease):
                self.log.error("matched prefix lease gone at the end of its transfer", request_id=t.request_id,
                               transfer_id=t.tid, peer=t.peer_key)
                t.reused_blocks = 0  # no re-post: the sender is done; the engine must not take these blocks
                self.transfer_failed(t, "in", ErrorCode.PREFIX_LOST, "the matched prefix lease was lost",
                                     handoff=handoff)
                return
            reused = self.inventory.places(t.lease)
            t.lease.delivered = True  # the engine holds these blocks now, until its prefix_release
        t.engine.send(p.KvReceived(request_id=t.request_id, transfer_id=t.engine_tid, peer=t.peer_key, bytes=t.total,
                                   seconds=round(time.monotonic() - t.started, 6), reused_blocks=skip,
                                   reused=reused))
        if handoff:
            self.handoffs.kv_received(t.request_id)

    def kv_sent(self, t: "OutTransfer") -> None:
        self._prediction_checked(t)
        t.engine.send(p.KvSent(request_id=t.request_id, transfer_id=t.engine_tid, peer=t.peer_key, bytes=t.total,
                               seconds=round(time.monotonic() - t.started, 6)))

    def _prediction_checked(self, t: "OutTransfer") -> None:
        """The pipeline choice predicted this request's WAN time: record how it came out."""
        predicted = self.predictions.pop((t.request_id, t.peer_key), None)
        if predicted is None:
            return
        real = time.monotonic() - t.started
        self.metrics.wan_prediction.observe(real / predicted if predicted > 0 else float("inf"))
        self.log.info("WAN time against its prediction", request_id=t.request_id, peer=t.peer_key,
                      predicted_s=round(predicted, 4), real_s=round(real, 4))

    def transfer_failed(self, t, direction: str, code: int, message: str, *, handoff: bool = True) -> None:
        if direction == "in" and code == ErrorCode.PREFIX_LOST and t.reused_blocks:
            # Our matched prefix broke mid-transfer: the sender starts over with every block;
            # post the whole receive again for it. The engine sees only the outcome of that.
            post = t.post
            if not self.gate.closed and not post.engine.closed and t.request_id not in self.posts:
                self._add_post(Post(t.request_id, post.engine, post.blocks, post.from_site, post.ttl, post.max_skip))
                return
        limited(self, self.log.warning, "transfer failed", every_s=1.0, peer=t.peer_key, direction=direction,  # a
                detail={"code": ErrorCode(code).name, "request_id": t.request_id, "transfer_id": t.tid,  # peer's to
                        "engine_transfer_id": t.engine_tid, "reason": message[:200]})  # repeat, its code too
        t.engine.send(p.TransferFailed(request_id=t.request_id, transfer_id=t.engine_tid, peer=t.peer_key,
                                       direction=direction, code=int(code), reason=message))
        if direction == "in" and handoff:
            self.handoffs.kv_failed(t.request_id, "kv_cancelled")

    def tokens_received(self, session: "PeerSession", msg: m.Tokens) -> None:
        """Relayed tokens outside a handoff: to the request's owner if the peer's site is tied to
        it; held for an owner to come (bounded, per peer) if there is none; else dropped."""
        owner = self.owners.get(msg.request_id)
        if owner is None or owner.engine.closed:
            session.tokens.hold(msg)
        elif owner.allows(session.peer.site):
            owner.engine.send(p.TokensReceived(request_id=msg.request_id, peer=session.key, seq=msg.seq,
                                               tokens=msg.tokens))
        else:
            session.tokens.dropped(len(msg.tokens), "foreign_site", msg.request_id)

    # ------------------------------------------------------------------ prefix inventory
    def prefix_query(self, session: "PeerSession", msg: m.PrefixQuery) -> int:
        """A sender asks how many leading blocks of a chain this node holds: lease them."""
        if len(msg.hashes) > m.MAX_PREFIX_HASHES or msg.lease_ms <= 0 or len(set(msg.hashes)) != len(msg.hashes):
            return 0  # (a chain never repeats a hash: such a query asks about no prefix)
        ttl = min(msg.lease_ms / 1000, self.config.transfer.prefix_lease_s * 4)
        k, dropped = self.inventory.lease(session.key, msg.request_id, msg.hashes,
                                          asyncio.get_running_loop().time(), ttl)
        # Its replaced lease and its oldest (over its share) are gone: a transfer on one starts over whole.
        self.prefix_broken(dropped, "the matched prefix lease was replaced or dropped (over the peer's share)",
                           released=True)
        return k

    def _unlease(self, session: "PeerSession", request_id: str) -> None:
        """End the lease the peer's query took, if no transfer relies on it and no engine holds it."""
        lease = self.inventory.get((session.key, request_id))
        if lease is not None and not lease.delivered and not any(t.lease is lease for t in session.inn.values()):
            self.inventory.release(lease.key)

    def prefix_release(self, request_id: str) -> bool:
        """The engine has used the request's reused blocks: end the request's leases (every
        peer's). A transfer still relying on one of them starts over with every block."""
        leases = [lease for lease in self.inventory.for_request(request_id)
                  if self.inventory.release(lease.key) is not None]
        self.prefix_broken(leases, "the matched prefix lease was released by the engine", released=True)
        return bool(leases)

    def kv_stored(self, ec: "EngineConn", msg: p.KvStored) -> dict:
        bm = blockmap(ec, msg.blocks)
        if len(msg.hashes) != bm.n_blocks:
            raise EngineRequestError(f"{len(msg.hashes)} hashes for {bm.n_blocks} blocks", ErrorCode.BAD_REQUEST)
        places = [(e.region, e.block + i) for e in bm.extents for i in range(e.count)]
        self.prefix_broken(self.inventory.stored(ec, msg.hashes, places))
        self.metrics.inventory_blocks.set(len(self.inventory.blocks))
        return {"held": len(self.inventory.blocks)}

    def kv_evict(self, ec: "EngineConn", msg: p.KvEvict) -> dict:
        mine = [h for h in msg.hashes if (b := self.inventory.blocks.get(h)) is not None and b.owner is ec]
        evicted, kept, broken = self.inventory.evict(mine, force=msg.force)
        self.prefix_broken(broken)
        self.metrics.inventory_blocks.set(len(self.inventory.blocks))
        return {"evicted": evicted, "kept": kept}

    def prefix_broken(self, leases: list[Lease], reason: str = "matched prefix blocks were evicted", *,
                      released: bool = False) -> None:
        """Leases ended early: the transfers matched with them (that very lease, so only its own
        peer's) start over with every block. ``released``: the leases are already off the
        inventory and count as broken only where a transfer relied on them."""
        for lease in leases:
            if not released and self.inventory.get(lease.key) is lease:
                self.inventory.release(lease.key)
            lease.broken = True
            s = self.peers.get(lease.peer)
            relying = [t for t in s.inn.values() if t.lease is lease] if s is not None else []
            if relying or not released:
                self.metrics.prefix_leases_broken.inc()
            for t in relying:
                s.fail_incoming(t, ErrorCode.PREFIX_LOST, reason, notify_peer=True)

    # ------------------------------------------------------------------ aborts and departures
    async def abort(self, ec: "EngineConn", request_id: str, reason: str) -> int:
        """The engine aborted the request: end it here and at every peer. Refused for a request
        another live engine holds here and this one does not."""
        check_request_id(request_id)
        self.check_mine(ec, request_id, "abort")
        self.metrics.request_aborts.labels(direction="tx").inc()
        spare = ec not in self.holders(request_id) and not any(s.tokens.knows(request_id) for s in self.peers)
        n = self.handoffs.abort(ec, request_id, reason)  # its HANDOFF_ABORT goes before REQUEST_ABORT
        for s in self.peers:
            s.send_abort(request_id, reason, spare)
        for peer in list(self.unposted.get(request_id, {})):  # before any wait: a peer's KV_CANCEL for one
            waiting = self._unwait(request_id, peer)  # (its answer to the abort) must find it gone, not given up
            waiting.session.reject_in(waiting.tid, waiting.begin, ErrorCode.TRANSFER_CANCELLED, reason)
        for s in self.peers:
            n += await s.cancel_request(request_id, ErrorCode.TRANSFER_CANCELLED, reason, ec)
        post = self.posts.get(request_id)
        if post is not None and post.engine is ec:
            self.drop_post(request_id)
            n += 1
        if (owner := self.owners.get(request_id)) is not None and owner.engine is ec:
            del self.owners[request_id]  # tokens still on their way reach it no more (held, then dropped)
        return n

    def request_aborted(self, session: "PeerSession", msg: m.RequestAbort) -> None:
        """A peer's engine aborted the request: end what we hold for it on that site's behalf
        and tell our engines (proto/transfer.md §10)."""
        rid, reason = msg.request_id, msg.reason or "aborted by the peer"
        self.metrics.request_aborts.labels(direction="rx").inc()
        told: set[EngineConn] = set()
        # The engines of its transfers here: told once those have ended.
        later: set[EngineConn] = {t.engine for ts in session.transfers_of(rid) for t in ts}
        if copy := (key := (session.key, rid)) in self.aborting:
            later = set()  # a copy while the first one's cancel runs (up to 1 s): that one tells them
        if later:
            self.aborting.add(key)

            async def cancel() -> None:
                # A receive's bulk writes stop only once its cancel is done (transfer_failed first): an engine
                # told "aborted" before could reuse blocks still written. Cancelled: the takeover ends it.
                try:
                    # KV_CANCEL too: the peer ignores those it cancelled, ends one begun after the abort (a reused id).
                    await session.cancel_request(rid, ErrorCode.TRANSFER_CANCELLED,
                                                 f"aborted at {session.key}: {reason}", notify_peer=True)
                except Exception:
                    self.log.exception("cancelling an aborted request's transfers failed", request_id=rid)
                    if any(session.transfers_of(rid)):
                        return  # still moving: not "aborted" yet
                self._tell_aborted(later, rid, reason, session)
            session.spawn(cancel(), "abort").add_done_callback(lambda _: self.aborting.discard(key))
        post = self.posts.get(rid)
        if post is not None and post.from_site in (None, session.peer.site):
            self.drop_post(rid, settled=session)
            told.add(post.engine)
        if self._unwait(rid, session.key) is not None:  # its KV waited unposted: a later post fails at once
            self._gave_up(session.peer.site, rid, ErrorCode.TRANSFER_CANCELLED, f"aborted at {session.key}: {reason}")
        ec = self.handoffs.request_aborted(session, rid, reason)
        if ec is not None:
            told.add(ec)
        owner = self.owners.get(rid)
        if owner is not None and owner.allows(session.peer.site):
            del self.owners[rid]
            told.add(owner.engine)
        elif not told and not later and not copy:
            limited(session, self.log.info, "REQUEST_ABORT from a site not tied to its request; ignored (logged "
                    "once per 30 s per peer)", peer=session.key, detail={"request_id": rid})
        self._tell_aborted(told - later, rid, reason, session)
        if told or later:
            self.log.info("request aborted by a peer", request_id=rid, peer=session.key, reason=reason,
                          engines=len(told | later))

    @staticmethod
    def _tell_aborted(engines: set["EngineConn"], rid: str, reason: str, session: "PeerSession") -> None:
        for e in engines:
            if not e.closed:
                e.send(p.RequestAborted(request_id=rid, reason=reason, origin=session.key))

    async def engine_gone(self, ec: "EngineConn") -> None:
        """Cancel the engine's transfers (peers are told) and drop its posts and prefix blocks."""
        self.handoffs.engine_gone(ec)
        for s in self.peers:
            try:  # one session's failure must not leave the others' transfers writing into its memory
                await s.engine_gone(ec)
            except Exception:
                self.log.exception("ending an engine's transfers failed", engine=ec.name, peer=s.key)
        for rid, post in list(self.posts.items()):
            if post.engine is ec:
                self.drop_post(rid)
        for rid in [r for r, o in self.owners.items() if o.engine is ec]:
            del self.owners[rid]
        self.prefix_broken(self.inventory.forget_owner(ec))
        self.metrics.inventory_blocks.set(len(self.inventory.blocks))

    def shutdown(self) -> None:
        """Shutdown begins: KV_BEGINs waiting for a post get none now (nor, the gate closed, start
        waiting); their senders hear it (KV_REJECT SHUTTING_DOWN) at once, not at their lease's end."""
        for request_id, waits in list(self.unposted.items()):
            for peer in list(waits):
                waiting = self._unwait(request_id, peer)
                if waiting is not None:
                    waiting.session.reject_in(waiting.tid, waiting.begin, ErrorCode.SHUTTING_DOWN,
                                              "receiver is shutting down")

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
            if _engine_dead(post.engine, mono, slack) or now > post.expires + slack:
                stranded += n
        for s in self.peers:
            gone = s.down_since is not None and mono - s.down_since > lease
            for kind, ts in (("send", s.out), ("recv", s.inn)):
                for t in ts.values():
                    n = t.blocks.n_blocks
                    pinned[kind] += n
                    if _engine_dead(t.engine, mono, slack) or gone:
                        stranded += n
        return pinned, stranded


def _engine_dead(ec: "EngineConn", mono: float, slack: float) -> bool:
    return ec.closed and mono - ec.closed_at > slack
