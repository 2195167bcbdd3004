"""The agent's answers to engine requests: one ``case`` per message of :mod:`pdd_wire.engine.protocol`.

The engine socket (:mod:`pdd_wire.engine_server`) decodes each request into its typed message
and awaits :meth:`EngineRequests.handle`; what it returns is the reply's ``result``, what it
raises (an :class:`EngineRequestError`) the reply's error. Memory registration lives here; KV
posts and sends go to the KV desk, handoffs to the handoff desk.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import policy
from .config import Config
from .desk.admission import Gate, check_request_id, check_site, check_token_ids
from .desk.handoff import HandoffDesk
from .desk.kv import KvDesk
from .engine import protocol as p
from .errors import EngineRequestError, ErrorCode
from .memory import HOST_FD, HostRegion, register_async
from .metrics import Metrics
from .session.tokens import MAX_UNACKED_TOKENS

if TYPE_CHECKING:
    from .engine_server import EngineConn, EngineServer
    from .peers import Peers


class EngineRequests:
    """Serves every engine's requests. ``engines`` is the socket they come from (for counts and
    broadcasts); ``describe`` is the agent's ``/v1/status``."""

    def __init__(self, config: Config, metrics: Metrics, peers: "Peers", gate: Gate, kv: KvDesk,
                 handoffs: HandoffDesk, describe: Callable[[], dict], log) -> None:
        self.config = config
        self.metrics = metrics
        self.peers = peers
        self.gate = gate
        self.kv = kv
        self.handoffs = handoffs
        self.describe = describe
        self.log = log
        self.engines: EngineServer | None = None  # set once the socket exists
        self.regions: dict[int, HostRegion] = {}
        self._region_ids = itertools.count(1)
        self.work_cpus: frozenset[int] = frozenset()  # where page-in threads run (the agent's cpus.bulk)

    #: The requests answered without waiting for anything (:meth:`handle_now`): the engine
    #: socket answers them as soon as it reads them, when none of the engine's requests is ahead.
    NOW: frozenset[type] = frozenset({
        p.Hello, p.PostRecv, p.SendKv, p.SendTokens, p.ExpectTokens, p.Status, p.Estimate, p.KvStored,
        p.KvEvict, p.PrefixRelease, p.SetLoad, p.HandoffRld, p.HandoffMd, p.HandoffTokens,
        p.HandoffExtended, p.HandoffFail})

    async def handle(self, ec: "EngineConn", msg: p.Msg, fd: int | None) -> dict | None:
        match msg:
            case p.Register():
                return await self._register(ec, msg, fd)
            case p.Deregister():
                await self._deregister(ec, msg.region)
                return None
            case p.Abort():
                return {"cancelled": await self.kv.abort(ec, msg.request_id, msg.reason)}
            case p.ChoosePipeline():
                return await self._choose_pipeline(msg)
        if type(msg) in self.NOW:
            return self.handle_now(ec, msg)
        raise EngineRequestError(f"unknown request {type(msg).__name__}", ErrorCode.BAD_REQUEST)

    def handle_now(self, ec: "EngineConn", msg: p.Msg) -> dict | None:
        """A request of :attr:`NOW`, answered without awaiting."""
        match msg:
            case p.Hello():
                ec.name = f"{msg.engine}#{ec.number}"
                ec.log = ec.log.bind(engine=ec.name)
                self._count_engines()
                return {"site": self.config.site, "node": self.config.node, "protocol": p.ENGINE_PROTOCOL_VERSION,
                        "peers": sorted(self.peers.by_key), "chunk_bytes": self.config.transfer.chunk_bytes}
            case p.PostRecv():
                self.kv.post(ec, msg)
                return None
            case p.SendKv():
                return self.kv.send_kv(ec, msg)
            case p.SendTokens():
                return self._send_tokens(ec, msg)
            case p.ExpectTokens():
                check_request_id(msg.request_id)
                check_site("from_site", msg.from_site)
                self.kv.check_mine(ec, msg.request_id, "expect_tokens")  # no taking over a live engine's request
                sites = None if msg.from_site is None else frozenset({msg.from_site})
                return {"delivered": self.kv.own(msg.request_id, ec, sites, widen=False)}
            case p.Status():
                return self.describe()
            case p.Estimate():
                return self._estimate(msg)
            case p.KvStored():
                return self.kv.kv_stored(ec, msg)
            case p.KvEvict():
                return self.kv.kv_evict(ec, msg)
            case p.PrefixRelease():
                check_request_id(msg.request_id)
                self.kv.check_mine(ec, msg.request_id, "prefix_release")
                return {"released": self.kv.prefix_release(msg.request_id)}
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

    async def engine_gone(self, ec: "EngineConn") -> None:
        """Cancel the engine's transfers (peers are told), drop its posts, release its memory."""
        await self.kv.engine_gone(ec)
        for rid in list(ec.regions):
            self._drop_region(ec, rid)
        self._count_engines()

    def close(self) -> None:
        for r in list(self.regions.values()):
            r.close()
        self.regions.clear()

    def _count_engines(self) -> None:
        self.metrics.engines.set(len(self.engines.engines) if self.engines is not None else 0)

    # ------------------------------------------------------------------ memory
    async def _register(self, ec: "EngineConn", msg: p.Register, fd: int | None) -> dict:
        try:
            self.gate.check()
            if fd is None:
                raise EngineRequestError("register needs one file descriptor", ErrorCode.BAD_REQUEST)
            if msg.kind != HOST_FD:
                raise EngineRequestError(f"memory kind {msg.kind!r} not supported here (known: {HOST_FD!r})",
                                         ErrorCode.BAD_REQUEST)
            if msg.block_bytes <= 0 or msg.size < msg.block_bytes:
                raise EngineRequestError(f"size {msg.size} and block_bytes {msg.block_bytes} do not make a block",
                                         ErrorCode.BAD_REQUEST)
            if len(ec.regions) >= self.config.limits.max_regions:
                raise EngineRequestError("limits.max_regions reached for this engine", ErrorCode.LIMIT_EXCEEDED)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        rid = next(self._region_ids)
        region = await register_async(HostRegion(rid, fd, msg.size, msg.block_bytes, owner=ec),  # closes fd
                                      lambda: ec.closed or self.gate.closed,  # paged in off the loop
                                      cpus=self.work_cpus)
        ec.regions[rid] = region
        self.regions[rid] = region
        self.metrics.regions.set(len(self.regions))
        self.metrics.region_bytes.inc(msg.size)
        ec.log.info("region registered", region=rid, size=msg.size, block_bytes=msg.block_bytes)
        return {"region": rid, "blocks": region.n_blocks}

    async def _deregister(self, ec: "EngineConn", rid: int) -> None:
        region = ec.regions.get(rid)
        if region is None:
            raise EngineRequestError(f"region {rid} is not registered by this engine", ErrorCode.UNKNOWN_REGION)
        for s in self.peers:
            for t in [t for t in list(s.out.values()) + list(s.inn.values()) if id(region) in t.blocks.regions]:
                await s.cancel_request(t.request_id, ErrorCode.TRANSFER_CANCELLED, "region deregistered", ec)
        self.kv.drop_posts_in(region)
        self._drop_region(ec, rid)

    def _drop_region(self, ec: "EngineConn", rid: int) -> None:
        region = ec.regions.pop(rid)
        self.regions.pop(rid, None)
        self.metrics.region_bytes.dec(region.size)
        self.metrics.regions.set(len(self.regions))
        region.close()

    # ------------------------------------------------------------------ tokens and estimates
    def _send_tokens(self, ec: "EngineConn", msg: p.SendTokens) -> dict:
        self.gate.check()
        check_request_id(msg.request_id)
        if len(msg.tokens) > MAX_UNACKED_TOKENS:  # refused anyway: before a check of each one
            raise EngineRequestError(f"over {MAX_UNACKED_TOKENS} tokens in one send_tokens (the per-request "
                                     "limit of unacknowledged tokens)", ErrorCode.LIMIT_EXCEEDED)
        check_token_ids(msg.tokens)
        if self.handoffs.owns_relay(msg.request_id):
            raise EngineRequestError(f"request {msg.request_id!r} is in a handoff: report its tokens with "
                                     f"handoff_tokens", ErrorCode.BAD_REQUEST)
        session = self.peers.session_for(msg.to)
        seq = session.send_tokens(msg.request_id, msg.tokens)
        self.kv.own(msg.request_id, ec, frozenset({session.peer.site}))  # tokens back come from there
        return {"seq": seq}

    def _estimate(self, msg: p.Estimate) -> dict:
        if msg.bytes < 0:
            raise EngineRequestError(f"bytes must be >= 0, got {msg.bytes}", ErrorCode.BAD_REQUEST)
        s = self.peers.session_for(msg.to)
        # The bandwidth `seconds` was computed from: the link's live estimate (delivery rates of
        # acknowledged KV and of probes), or before its first sample the goodput of finished
        # transfers (bandwidth_source says which; 0 and None: neither yet).
        live = s.est.bandwidth_Bps
        source = "link_estimate" if live else "goodput" if s.goodput_Bps else None
        return ({"peer": s.key, "up": s.is_up, "seconds": s.predict(msg.bytes)} | s.est.describe(s.queue_bytes())
                | {"bandwidth_Bps": round(live or s.goodput_Bps), "bandwidth_source": source})

    async def _choose_pipeline(self, msg: p.ChoosePipeline) -> dict:
        # Checked always, as every request naming one does: with block_hashes it goes to the
        # peer in PREFIX_QUERY, and the choice is kept under it (expect_wan) for the request's KV.
        check_request_id(msg.request_id)
        session = self.peers.session_for(msg.to)
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
            self.kv.expect_wan(msg.request_id, session.key, d.predicted_wan_s)
        self.log.info("pipeline chosen", request_id=msg.request_id, pipeline=d.pipeline, reason=d.reason,
                      predicted_wan_s=d.predicted_wan_s, detail=d.detail)
        return {"pipeline": d.pipeline, "reason": d.reason, "predicted_wan_s": d.predicted_wan_s,
                "prefix_hit_tokens": hit, "prefix_source": source,
                "detail": d.detail, "link": {"bandwidth_Bps": link.bandwidth_Bps, "queue_bytes": link.queue_bytes,
                                             "rtt_s": link.rtt_s, "peer": session.key}}
