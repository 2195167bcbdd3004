"""PDD's per-request choices as small pure functions: which pipeline, and which handoff mode.

Sans-IO and stateless: every input is an argument, every output a frozen value that carries a
stable ``reason`` label (for a metric label or a log field) and the figure it was decided on.
The rules restate ``../shared/PDD.md`` (items 4-6); ``proto/handoff.md`` specifies the handoff.

Pipelines (:func:`choose_pipeline`):

========== ===================================================================================
P-MD       prefill in A, decode on MD in B. For requests whose missing KV (input tokens that
           MD's prefix cache lacks) crosses the WAN within the TTFT budget: no masking needed.
P-RLD-MD   prefill in A, relay decode (RLD) in A streams the first tokens while the KV crosses,
           then hands the output to MD (``pdd_wire.desk.handoff_protocol``). For requests whose KV would
           take longer than the budget.
P-RLD      finish on RLD, nothing crosses the WAN. **Refused**, except for the
           anomalous-traffic filter: very long input and short expected output. Sending
           ordinary requests to P-RLD lets MD's prefix cache fall behind P's, more requests
           then miss, more load falls back on RLD, and RLD collapses (PDD.md item 5).
========== ===================================================================================

Handoff modes (:func:`choose_handoff_mode`), for a P-RLD-MD request at the moment MD reports
that it holds the KV: ``one-shot`` (RLD stops at once, MD stalls once) when RLD is busy or
the gap is small, ``catch-up`` (RLD keeps generating while MD absorbs batches) when RLD has
headroom.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

Pipeline = Literal["P-MD", "P-RLD-MD", "P-RLD"]
HandoffMode = Literal["one-shot", "catch-up"]

_cfg = dict(frozen=True, forbid_unknown_fields=True, kw_only=True)


def _check(cond: bool, key: str, why: str) -> None:
    if not cond:
        raise ValueError(f"{key}: {why}")


# ----------------------------------------------------------------------------- pipeline choice
class PipelineConfig(msgspec.Struct, **_cfg):
    """Thresholds of the pipeline choice. Decoded from TOML/JSON like ``pdd_wire.config``:
    unknown keys and wrong types are errors; out-of-range values raise ``ValueError``
    (a ``msgspec.ValidationError`` when decoding)."""

    ttft_budget_s: float = 0.2
    """How long the KV crossing may take before RLD should mask it. A request whose predicted
    WAN time is at most this goes P-MD; above it, P-RLD-MD."""

    anomaly_filter: bool = True
    """The anomalous-traffic filter, the only way to P-RLD. ``False``: never P-RLD."""

    anomaly_min_input_tokens: int = 32768
    """The filter takes requests with at least this many input tokens ..."""

    anomaly_max_output_tokens: int = 500
    """... and fewer than this many expected output tokens (PDD: under about 500)."""

    def __post_init__(self) -> None:
        _check(self.ttft_budget_s >= 0 and math.isfinite(self.ttft_budget_s), "ttft_budget_s",
               "must be a finite number >= 0")
        _check(self.anomaly_min_input_tokens >= 1, "anomaly_min_input_tokens", "must be >= 1")
        _check(self.anomaly_max_output_tokens >= 1, "anomaly_max_output_tokens", "must be >= 1")


class RequestFigures(msgspec.Struct, **_cfg):
    """What the router knows about one request."""

    input_tokens: int
    """Prompt length."""
    prefix_hit_tokens: int
    """Leading prompt tokens whose KV MD already holds (its prefix cache); at most ``input_tokens``."""
    expected_output_tokens: int
    """The router's estimate of the output length (e.g. ``max_tokens`` or a predictor)."""

    def __post_init__(self) -> None:
        _check(self.input_tokens >= 0, "input_tokens", "must be >= 0")
        _check(0 <= self.prefix_hit_tokens <= self.input_tokens, "prefix_hit_tokens",
               f"must be in 0..input_tokens ({self.input_tokens}), got {self.prefix_hit_tokens}")
        _check(self.expected_output_tokens >= 0, "expected_output_tokens", "must be >= 0")


class LinkFigures(msgspec.Struct, **_cfg):
    """Live figures of the WAN path from site A to MD's site (from the agents' link probes)."""

    bandwidth_Bps: float
    """Estimated goodput available to this request's KV, bytes per second; 0 = unknown/down."""
    queue_bytes: int = 0
    """KV bytes already queued ahead of this request on the path."""
    rtt_s: float = 0.0
    """Round-trip time of the control connection."""

    def __post_init__(self) -> None:
        _check(self.bandwidth_Bps >= 0 and not math.isnan(self.bandwidth_Bps), "bandwidth_Bps", "must be >= 0")
        _check(self.queue_bytes >= 0, "queue_bytes", "must be >= 0")
        _check(self.rtt_s >= 0 and math.isfinite(self.rtt_s), "rtt_s", "must be a finite number >= 0")


DEFAULT_PIPELINE = PipelineConfig()


class Decision(msgspec.Struct, frozen=True):
    """The pipeline for one request.

    ``reason`` is one of a small fixed set of labels (safe as a metric label):
    ``anomalous_long_input_short_output`` (P-RLD), ``wan_within_budget`` (P-MD),
    ``wan_over_budget`` (P-RLD-MD). ``predicted_wan_s`` is the predicted time for the request's
    missing KV to cross (``inf`` without a bandwidth estimate; 0.0 for P-RLD, which sends
    nothing). ``detail`` repeats the figures for a log line.
    """

    pipeline: Pipeline
    reason: str
    predicted_wan_s: float
    detail: str = ""


def missing_kv_bytes(req: RequestFigures, kv_bytes_per_token: int) -> int:
    """Bytes of KV that must cross the WAN: the prompt tokens MD's prefix cache lacks."""
    return (req.input_tokens - req.prefix_hit_tokens) * kv_bytes_per_token


def predict_wan_s(missing_bytes: int, link: LinkFigures) -> float:
    """``missing / bandwidth + queue / bandwidth + RTT``: the KV waits behind the queue, then
    streams at the estimated bandwidth, and the transfer's begin/done exchange costs one RTT."""
    if link.bandwidth_Bps <= 0:
        return math.inf
    return (missing_bytes + link.queue_bytes) / link.bandwidth_Bps + link.rtt_s


def choose_pipeline(req: RequestFigures, link: LinkFigures, kv_bytes_per_token: int,
                    cfg: PipelineConfig | None = None) -> Decision:
    """Choose P-MD, P-RLD-MD or (only through the anomalous-traffic filter) P-RLD.

    Rules, in order:

    1. filter on, ``input_tokens >= anomaly_min_input_tokens`` and
       ``expected_output_tokens < anomaly_max_output_tokens``: **P-RLD** (whatever the hit rate).
    2. predicted WAN time ``<= ttft_budget_s``: **P-MD**.
    3. otherwise: **P-RLD-MD** (a missing bandwidth estimate predicts ``inf``: RLD masks).
    """
    cfg = cfg if cfg is not None else DEFAULT_PIPELINE
    if kv_bytes_per_token < 0:
        raise ValueError(f"kv_bytes_per_token: must be >= 0, got {kv_bytes_per_token}")
    if (cfg.anomaly_filter and req.input_tokens >= cfg.anomaly_min_input_tokens
            and req.expected_output_tokens < cfg.anomaly_max_output_tokens):
        return Decision("P-RLD", "anomalous_long_input_short_output", 0.0,
                        f"input {req.input_tokens} >= {cfg.anomaly_min_input_tokens} tokens and expected "
                        f"output {req.expected_output_tokens} < {cfg.anomaly_max_output_tokens}: finish on RLD")
    missing = missing_kv_bytes(req, kv_bytes_per_token)
    wan_s = predict_wan_s(missing, link)
    figures = (f"missing {req.input_tokens - req.prefix_hit_tokens} tokens = {missing} B, queue "
               f"{link.queue_bytes} B at {link.bandwidth_Bps:.4g} B/s + RTT {link.rtt_s * 1e3:.3g} ms: "
               f"{wan_s * 1e3:.4g} ms vs budget {cfg.ttft_budget_s * 1e3:.4g} ms")
    if wan_s <= cfg.ttft_budget_s:
        return Decision("P-MD", "wan_within_budget", wan_s, figures)
    return Decision("P-RLD-MD", "wan_over_budget", wan_s, figures)


# ----------------------------------------------------------------------------- handoff mode
class HandoffPolicy(msgspec.Struct, **_cfg):
    """How RLD hands a P-RLD-MD request's output to MD (used by :func:`choose_handoff_mode`
    and by ``pdd_wire.desk.handoff_protocol.RldHandoff``)."""

    busy_load: float = 0.8
    """RLD load (0 = idle, 1 = every decode slot in use; may exceed 1) at or above which the
    handoff is one-shot: RLD leaves as early as possible."""

    catchup_gap_tokens: int = 64
    """Catch-up only pays when MD is more than this many tokens behind RLD; a catch-up handoff
    commits once MD is at most this many tokens behind (one small, imperceptible extend)."""

    max_catchup_rounds: int = 16
    """A catch-up that has not converged after this many MD progress reports commits anyway
    (MD then stalls once, as in one-shot): catch-up never keeps RLD busy without bound."""

    def __post_init__(self) -> None:
        _check(self.busy_load >= 0 and not math.isnan(self.busy_load), "busy_load", "must be >= 0")
        _check(self.catchup_gap_tokens >= 0, "catchup_gap_tokens", "must be >= 0")
        _check(self.max_catchup_rounds >= 1, "max_catchup_rounds", "must be >= 1")


DEFAULT_POLICY = HandoffPolicy()


class ModeDecision(msgspec.Struct, frozen=True):
    """The handoff mode for one request. ``reason``: ``gap_small`` (one-shot: catch-up would be a
    single round anyway), ``rld_busy`` (one-shot), ``rld_headroom`` (catch-up)."""

    mode: HandoffMode
    reason: str
    detail: str = ""


def choose_handoff_mode(rld_load: float, gap_tokens: int, policy: HandoffPolicy | None = None) -> ModeDecision:
    """One-shot or catch-up, from RLD's live load and how far MD is behind.

    ``rld_load``: RLD's load now (fraction of its decode capacity in use, the larger of batch
    slots and KV memory is a good figure). ``gap_tokens``: tokens RLD has generated that MD has
    not absorbed yet.

    1. ``gap_tokens <= catchup_gap_tokens``: one-shot (``gap_small``).
    2. ``rld_load >= busy_load``: one-shot (``rld_busy``).
    3. otherwise catch-up (``rld_headroom``).
    """
    policy = policy if policy is not None else DEFAULT_POLICY
    if gap_tokens < 0:
        raise ValueError(f"gap_tokens: must be >= 0, got {gap_tokens}")
    if math.isnan(rld_load) or rld_load < 0:
        raise ValueError(f"rld_load: must be >= 0, got {rld_load}")
    if gap_tokens <= policy.catchup_gap_tokens:
        return ModeDecision("one-shot", "gap_small",
                            f"gap {gap_tokens} <= {policy.catchup_gap_tokens} tokens")
    if rld_load >= policy.busy_load:
        return ModeDecision("one-shot", "rld_busy", f"RLD load {rld_load:.3g} >= {policy.busy_load:.3g}")
    return ModeDecision("catch-up", "rld_headroom",
                        f"RLD load {rld_load:.3g} < {policy.busy_load:.3g}, gap {gap_tokens} tokens")
