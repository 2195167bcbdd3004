"""The per-step metadata the scheduler-side connector hands its worker, and the bookkeeping both
sides keep per request (:mod:`pdd_wire.adapters.vllm_connector`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


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
class WorkerState(KVConnectorWorkerMetadata):
    """Worker -> scheduler, with a step's output: each worker's agent connection, as
    ``{worker pid: (why it is down, or None; the link's generation)}``. Sent when it changes,
    and every step while it is down."""

    states: dict[int, tuple[str | None, int]] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, WorkerState):
            self.states.update(other.states)
        return self


@dataclasses.dataclass
class Producer:
    rid: str
    to: list[str]
    deadline_s: float
    prompt_len: int
    stock: bool  # asked with do_remote_decode: answer with vLLM's P/D params
    lease_s: float
    hashes: list[int] | None = None
    sent: bool = False
    error: str | None = None  # why nothing was sent
    started: float = 0.0  # wall time the send (and its lease) started
    owns_name: bool = False  # holds ``rid`` among the names in flight (a refused duplicate does not)


@dataclasses.dataclass
class Consumer:
    rid: str
    from_site: str | None
    num_tokens: int
    lease_end: float | None  # wall time the sender's lease ends; None: the post waits the agent's post_ttl_s
    lease_s: float | None = None  # the sender's whole lease: a receive never waits longer (plus the slack)
    local_hit: int = 0
    posted: bool = False
    loaded: bool = False  # the load is done (or there was nothing to wait for)


@dataclasses.dataclass
class PendingLoad:
    req_id: str | None
    blocks: list[int]  # vLLM block ids the agent writes into (errors are reported on these)
    slot: Any = None  # staging (KV on a CUDA device): where the agent writes, copied in on arrival
    all_blocks: list[int] = dataclasses.field(default_factory=list)
    first: int = 0


@dataclasses.dataclass
class PendingSend:
    req_id: str
    rid: str
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
    agent_losses: int = 0  # agent connections that ended (an agent restart: one)

