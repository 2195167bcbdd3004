"""Simulated engines: no model, a deterministic token stream, real agents, real bytes.

:func:`~.model.token_at` plays the model: every engine that decodes request ``r`` produces the
same token at position ``i`` (as greedy decoding of one model does), so a test can check the
stream a user would see (:func:`~.model.check_stream`).

One request at a time, for the handoff tests and ``pdd-tools bench`` (group ``handoff``), in
:mod:`.handoff`: :class:`RldSim` decodes from position 0 and hands the output over;
:class:`MdSim` absorbs relayed tokens with simulated extend steps and takes over. Both emit only
what their agent's ``emit`` events allow, and record it: ``emitted`` maps position to token.
Timing: a decode step takes ``step_s``; an extend of ``n`` tokens takes
``extend_s + n * extend_per_token_s``.

Many requests at once, for replaying a trace (``pdd_tools.demo``):

* :class:`ChipProfile` (:mod:`.chip`), the cost model: prefill at ``prefill_tokens_per_s``
  (compute bound), a decode step of a batch of ``B`` sequences in
  ``step_base_s + B * step_per_seq_s`` (memory bound: the weights once, each sequence's KV),
  extends mixed into the step at the prefill rate. :data:`GPU_A` (prefill and relay decode)
  and :data:`GPU_B` (main decode) differ.
* :class:`KvPool` (:mod:`.kvpool`): an engine's KV memory, one
  :class:`~pdd_wire.memory.SharedMemory` region registered with its agent, handed out in blocks
  of ``block_tokens * kv_bytes_per_token`` bytes; every block carries a stamp (request, index)
  that the receiver checks.
* :class:`PrefillSim` (:mod:`.prefill`): prefills one request after another, writes the KV into
  its pool and ships it with ``send_kv`` (one destination, or two at once: the dual path to RLD
  and MD).
* :class:`DecodeSim` (:mod:`.decode`): a continuous-batching decoder serving many requests, as
  RLD (site A) or MD (site B): posts each request's receive, admits it once the KV is in (its
  position 0 is the prefill's token and is emitted then), steps the batch, reports its load
  with ``set_load``, and for handed-off requests drives the handoff (``handoff_rld`` /
  ``handoff_md``, extends mixed into its steps, ``handoff_tokens``), emitting only what
  ``emit`` events allow. Both run on :class:`EventLoopEngine` (:mod:`.engine`): one task
  reading the engine's events.

Prefix reuse: the trace says how much of each prompt MD's prefix cache holds, and the
simulated prefill ships only the missing suffix's blocks. That stands in for the decode-side
prefix inventory (:mod:`pdd_wire.desk.inventory`, ``send_kv(block_hashes=...)``), with which the agents
work the suffix out themselves; the demo does not use it, since MD would have to keep every
conversation's prefix resident.
"""

from __future__ import annotations

from .chip import BLOCK_TOKENS, GPU_A, GPU_B, KV_BYTES_PER_TOKEN, ChipProfile
from .decode import DecodeSim, Seq
from .engine import EventLoopEngine
from .handoff import HANDOFF_EVENTS, MdSim, RldSim
from .kvpool import KvPool
from .model import check_stream, token_at
from .prefill import PrefillJob, PrefillSim

__all__ = ["BLOCK_TOKENS", "GPU_A", "GPU_B", "HANDOFF_EVENTS", "KV_BYTES_PER_TOKEN", "ChipProfile", "DecodeSim",
           "EventLoopEngine", "KvPool", "MdSim", "PrefillJob", "PrefillSim", "RldSim", "Seq", "check_stream",
           "token_at"]
