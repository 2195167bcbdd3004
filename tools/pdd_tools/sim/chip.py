"""The cost model of the simulated engines that serve many requests at once: a
:class:`ChipProfile` per chip (:data:`GPU_A`, :data:`GPU_B`) and the KV size per token."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ChipProfile:
    """How fast one simulated chip prefills and decodes.

    * prefill (and extend) is compute bound: ``prefill_overhead_s + tokens / prefill_tokens_per_s``;
    * a decode step of ``B`` sequences is memory bound: ``step_base_s + B * step_per_seq_s`` (the
      weights are read once per step, each sequence's KV once); an extend of ``n`` relayed tokens
      is mixed into a step and adds ``n / prefill_tokens_per_s``;
    * ``max_batch`` sequences decode at once; the load an engine reports is
      ``(running + waiting) / max_batch``.
    """

    name: str
    prefill_tokens_per_s: float
    step_base_s: float
    step_per_seq_s: float
    max_batch: int
    prefill_overhead_s: float = 0.005

    def __post_init__(self) -> None:
        for key in ("prefill_tokens_per_s", "step_base_s"):
            v = getattr(self, key)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{key} must be > 0, got {v}")
        if not (self.step_per_seq_s >= 0 and self.prefill_overhead_s >= 0):
            raise ValueError("step_per_seq_s and prefill_overhead_s must be >= 0")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")

    def prefill_s(self, tokens: int) -> float:
        """Time to prefill ``tokens`` prompt tokens (the ones not in the prefix cache)."""
        return self.prefill_overhead_s + max(0, tokens) / self.prefill_tokens_per_s

    def extend_s(self, tokens: int) -> float:
        """What an extend of ``tokens`` relayed tokens adds to the decode step it rides in."""
        return max(0, tokens) / self.prefill_tokens_per_s

    def step_s(self, batch: int, extend_tokens: int = 0) -> float:
        """One decode step of ``batch`` sequences carrying extends of ``extend_tokens`` tokens."""
        if batch <= 0 and extend_tokens <= 0:
            return 0.0
        return self.step_base_s + self.step_per_seq_s * max(0, batch) + self.extend_s(extend_tokens)

    def decode_tokens_per_s(self, batch: int) -> float:
        """Output tokens per second of the whole chip at batch size ``batch``."""
        return batch / self.step_s(batch) if batch > 0 else 0.0


# Scaled like the demo's trace and link (pdd_tools.trace): illustrative, not measured. GPU-A runs
# prefill (P) and relay decode (RLD, a small pool); GPU-B, main decode (MD), has half the
# compute but reads memory faster per sequence and holds a bigger batch.
GPU_A = ChipProfile("GPU-A", prefill_tokens_per_s=40_000, step_base_s=0.025, step_per_seq_s=0.0005,
                    max_batch=16, prefill_overhead_s=0.010)
GPU_B = ChipProfile("GPU-B", prefill_tokens_per_s=20_000, step_base_s=0.020, step_per_seq_s=0.00025,
                    max_batch=128, prefill_overhead_s=0.005)

# KV per token: PDD's 1T-class model has 10-80 KB (about 50 KB typical) on a 10-100 Gbps line;
# the demo's link is about 100x narrower and its prompts 3-4x shorter, so 4 KiB per token keeps
# a long prompt's KV crossing in seconds, as PDD's 1-20 s. A block holds BLOCK_TOKENS tokens.
KV_BYTES_PER_TOKEN = 4096
BLOCK_TOKENS = 16
