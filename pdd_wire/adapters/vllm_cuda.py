"""KV on a CUDA device: staging through pinned host memory the agent can read and write.

UNTESTED ON A GPU (none was available when this was written; ``scripts/gpu-check`` is the check
to run). The byte path is exercised on CPU tensors by ``scripts/gpu-check --device cpu``.

The agent moves bytes between registered host memory and the network; it cannot read device
memory. :class:`Staging` is one memfd (a :class:`~pdd_wire.memory.SharedMemory`) registered with
the agent and, for a CUDA device, page-locked with ``cudaHostRegister`` so that copies to and from
it are real DMA. A transfer takes a run of staging blocks (``[layers][blocks]``: each layer's
blocks contiguous, so one copy per layer), and its extents list them in the byte stream's order
(block by block, each block's layers), the order :class:`PddWireConnector` uses on the CPU path:

- send: :meth:`Staging.stage_out` copies each layer's blocks device -> staging on the staging
  CUDA stream (``layer()`` per layer, e.g. from ``save_kv_layer`` as the forward computes them, so
  copying overlaps the forward), :meth:`Staging.ready` waits for the copies; the agent then
  reads the staging blocks;
- receive: the agent writes the staging blocks; :meth:`Staging.stage_in` copies them staging ->
  device layer by layer on the stream and waits, before vLLM is told the KV is there.

The CPU path (vLLM's KV cache in host memory, registered zero-copy) does not use this module.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..memory import SharedMemory


@dataclasses.dataclass
class Slot:
    """A run of staging blocks: ``layers`` runs of ``n`` blocks each, from ``first``."""

    first: int
    n: int
    layers: int


class Staging:
    """``capacity`` staging blocks of ``block_bytes`` each, for KV caches on ``device``."""

    def __init__(self, capacity: int, block_bytes: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.block_bytes, self.capacity = block_bytes, capacity
        self.mem = SharedMemory(capacity * block_bytes, name="pdd-wire-kv-staging")
        self.host = torch.frombuffer(self.mem.buf, dtype=torch.uint8).view(capacity, block_bytes)
        self.cuda = self.device.type == "cuda"
        self.stream = None
        if self.cuda:
            rc = torch.cuda.cudart().cudaHostRegister(self.host.data_ptr(), capacity * block_bytes, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of {capacity * block_bytes} bytes failed: {rc}")
            self.stream = torch.cuda.Stream(device=self.device)
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (first, count) runs, sorted

    # ---------------------------------------------------------------- slots
    def take(self, n_blocks: int, layers: int) -> Slot | None:
        """A run of ``n_blocks * layers`` staging blocks, or None when there is no room (the
        caller then does not send, or the request recomputes)."""
        need = n_blocks * layers
        for i, (first, count) in enumerate(self._free):
            if count >= need:
                self._free[i] = (first + need, count - need)
                if self._free[i][1] == 0:
                    del self._free[i]
                return Slot(first, n_blocks, layers)
        return None

    def give(self, slot: Slot) -> None:
        runs = sorted(self._free + [(slot.first, slot.n * slot.layers)])
        merged: list[tuple[int, int]] = []
        for first, count in runs:
            if merged and merged[-1][0] + merged[-1][1] == first:
                merged[-1] = (merged[-1][0], merged[-1][1] + count)
            else:
                merged.append((first, count))
        self._free = merged

    def extents(self, region: int, slot: Slot, skip: int = 0) -> list[tuple[int, int, int]]:
        """The slot's blocks in the byte stream's order (block by block, each block's layers)."""
        return [(region, slot.first + layer * slot.n + i, 1)
                for i in range(skip, slot.n) for layer in range(slot.layers)]

    def view(self, slot: Slot, layer: int) -> torch.Tensor:
        return self.host[slot.first + layer * slot.n: slot.first + (layer + 1) * slot.n]

    # ---------------------------------------------------------------- copies
    @staticmethod
    def _flat(t: torch.Tensor) -> torch.Tensor:
        """A KV cache layer as ``[num_blocks, block_bytes]`` bytes (blocks must be contiguous)."""
        return t.view(t.shape[0], -1).view(torch.uint8)

    def layer(self, slot: Slot, layer: int, kv: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Device -> staging: ``kv[block_ids]`` into the slot's ``layer`` run (asynchronous)."""
        src = self._flat(kv)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the forward wrote it
            with torch.cuda.stream(self.stream):
                self.view(slot, layer).copy_(src.index_select(0, block_ids), non_blocking=True)
        else:
            self.view(slot, layer).copy_(src.index_select(0, block_ids))

    def stage_out(self, slot: Slot, kv_layers: list[torch.Tensor], block_ids: list[int]) -> None:
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for i, kv in enumerate(kv_layers):
            self.layer(slot, i, kv, ids)

    def ready(self) -> None:
        """Every copy issued so far is done (the agent may read the staging blocks)."""
        if self.cuda:
            self.stream.synchronize()

    def stage_in(self, slot: Slot, kv_layers: list[torch.Tensor], block_ids: list[int], skip: int = 0) -> None:
        """Staging -> device: the slot's blocks from ``skip`` on into ``kv[block_ids[skip:]]``;
        returns when the copies are done."""
        if skip >= len(block_ids):
            return
        ids = torch.tensor(block_ids[skip:], dtype=torch.long, device=self.device)
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            for i, kv in enumerate(kv_layers):
                src = self.view(slot, i)[skip:]
                self._flat(kv).index_copy_(0, ids, src.to(self.device, non_blocking=self.cuda))
        self.ready()

    def close(self) -> None:
        if self.cuda:
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
        del self.host
        with contextlib.suppress(BufferError):  # a tensor still viewing it keeps the mapping
            self.mem.close()
