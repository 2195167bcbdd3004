"""The demo's options (:class:`DemoConfig`, ``pdd-tools demo`` arguments) and the constants of its
scaled-down PDD setup."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

MiB = 1 << 20
PIPELINES = ("P-MD", "P-RLD-MD", "P-RLD")
NODES = {"P": ("A", "a1"), "RLD": ("A", "a2"), "MD": ("B", "b1")}
RLD_PEER, MD_PEER = "A/a2", "B/b1"
# The agents' anomalous-traffic filter, scaled like the trace (PDD: input >= 32K, output < 500).
ANOMALY_MIN_INPUT, ANOMALY_MAX_OUTPUT = 16384, 80
# Catch-up handoff threshold, scaled like the answers (PDD: 64 tokens of 1K; here of ~200).
CATCHUP_GAP = 16
PUBLISHED = {"pd_ttft_p50_s": 6.7, "pd_ttft_p90_s": 18.3, "pd_ttft_p99_s": 29.7, "pdd_ttft_reduction": 0.515,
             "source": "PDD (Infinigence, 2026): unoptimised cross-DC PD, 64K total length, 1K output"}


@dataclass
class DemoConfig:
    engine: str = "sim"
    out: str = "demo-out"
    requests: int = 240
    rate: float = 6.0  # requests per second
    seed: int = 1
    link_mbit: float = 400.0
    rtt_ms: float = 30.0
    jitter_ms: float = 2.0
    kv_bytes_per_token: int = 4096
    where: str = "auto"  # auto | netns | loopback
    runs: tuple[str, ...] = ("pd", "pdd")
    prefix: str = "pddw"  # namespace names (tests use their own)
    trace_overrides: dict = field(default_factory=dict)  # TraceConfig fields, for small test runs
    pool_mib: dict = field(default_factory=lambda: {"P": 512, "RLD": 384, "MD": 512})
    timeout_s: float | None = None  # per run, after the last arrival; None: 120 s
    quiet: bool = False
    ttft_budget_s: float = 0.2  # --engine vllm: the agents' policy.pipeline.ttft_budget_s
    side_by_side: bool = False  # --engine vllm: three prompts' tokens side by side instead of the trace


def vllm_defaults() -> dict:
    """The options' defaults with ``--engine vllm`` (the tiny model's scale, pdd_tools.demo.tiny)."""
    from . import tiny

    return {"requests": tiny.REQUESTS, "rate": tiny.RATE, "link_mbit": tiny.LINK_MBIT, "rtt_ms": tiny.RTT_MS,
            "ttft_budget_s": tiny.TTFT_BUDGET_S, "prefix": "pddv"}


DESCRIPTION = """\
PDD against plain cross-datacenter PD over two emulated datacenters: a trace shaped like PDD's
traffic (multi-turn conversations, a skewed prefix-hit distribution, a few long-input
short-output requests) replayed twice, as plain PD (every request P-MD) and as PDD (each
request's pipeline chosen by the agents: P-MD, P-RLD-MD with a handoff, P-RLD for the anomalous
ones), over a WAN shaped by tbf and a delay relay (two network namespaces as root, loopback
otherwise). Prints TTFT p50/p90/p99/mean, pipelines, handoffs, WAN bytes; writes figures.json,
ttft_cdf.png and per-request rows under --out.

--engine sim (default): three real agents with simulated engines (about 100 s).
--engine vllm: three real `vllm serve` instances of the tiny model (P and RLD in site A, MD in
site B, PddWireConnector on real agents) with `pdd-wire router` in front, the trace scaled to
the tiny model (context 512, KV 1 KiB per token: the link is slowed to match); every output is
checked against a single server's greedy answer (about 3 minutes; under --out/vllm/).
--engine vllm --side-by-side: instead, three prompts' tokens from one vLLM, plain PD and PDD
side by side, the handoff driven by the agents (one-shot and catch-up) on offline engines.
"""


def add_demo_args(d: argparse.ArgumentParser) -> None:
    """The ``demo`` subcommand's options (``pdd_tools.cli``). Options left out take the engine's
    defaults (the simulated demo's, or :func:`vllm_defaults`)."""
    c, v = DemoConfig(), vllm_defaults()
    d.description = DESCRIPTION
    d.formatter_class = argparse.RawDescriptionHelpFormatter
    d.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                   help="sim: simulated engines (default); vllm: three tiny vllm serve and pdd-wire router")
    d.add_argument("--out", default=c.out,
                   help="where figures.json, ttft_cdf.png and the logs go (default %(default)s)")
    d.add_argument("--requests", type=int, help=f"requests in the trace (default {c.requests}; vllm {v['requests']})")
    d.add_argument("--rate", type=float, help=f"mean arrival rate, requests/s (default {c.rate:g}; vllm {v['rate']:g})")
    d.add_argument("--seed", type=int, default=c.seed, help="trace seed (default %(default)s)")
    d.add_argument("--link-mbit", type=float,
                   help=f"WAN rate, Mbit/s (default {c.link_mbit:g}; vllm {v['link_mbit']:g})")
    d.add_argument("--rtt-ms", type=float, help=f"WAN round trip, ms (default {c.rtt_ms:g}; vllm {v['rtt_ms']:g})")
    d.add_argument("--jitter-ms", type=float, default=c.jitter_ms, help="WAN jitter each way, ms (default %(default)s)")
    d.add_argument("--kv-bytes-per-token", type=int, default=c.kv_bytes_per_token,
                   help="simulated KV size per token (default %(default)s; vllm: the tiny model's, 1024)")
    d.add_argument("--ttft-budget-ms", type=float,
                   help=f"vllm: the agents' TTFT budget, P-MD when the KV crosses within it (default "
                        f"{v['ttft_budget_s'] * 1e3:g})")
    d.add_argument("--side-by-side", action="store_true",
                   help="vllm: three prompts' tokens side by side (one vLLM, PD, PDD) instead of the trace")
    d.add_argument("--where", choices=("auto", "netns", "loopback"), default="auto",
                   help="netns: two network namespaces (root); loopback: one namespace; auto: netns when root")
    d.add_argument("--runs", default="pd,pdd", help="which runs, comma-separated (default %(default)s)")


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    runs = tuple(r.strip() for r in args.runs.split(",") if r.strip())
    bad = [r for r in runs if r not in ("pd", "pdd")]
    if bad or not runs:
        raise SystemExit(f"pdd-tools demo: --runs takes pd and/or pdd, not {args.runs!r}")
    vllm = args.engine == "vllm"
    if args.side_by_side and not vllm:
        raise SystemExit("pdd-tools demo: --side-by-side goes with --engine vllm")
    base = dataclasses.asdict(DemoConfig()) | (vllm_defaults() if vllm else {})
    if args.ttft_budget_ms is not None:
        if not vllm:
            raise SystemExit("pdd-tools demo: --ttft-budget-ms goes with --engine vllm (the sim's agents use 200 ms)")
        args.ttft_budget_s = args.ttft_budget_ms / 1e3
    given = {k: getattr(args, k) for k in ("requests", "rate", "link_mbit", "rtt_ms", "ttft_budget_s")
             if getattr(args, k, None) is not None}
    opts = {k: base[k] for k in ("requests", "rate", "link_mbit", "rtt_ms", "ttft_budget_s", "prefix")} | given
    for key in ("requests", "rate", "link_mbit"):
        if not opts[key] > 0:
            raise SystemExit(f"pdd-tools demo: --{key.replace('_', '-')} must be > 0")
    if not args.kv_bytes_per_token > 0:
        raise SystemExit("pdd-tools demo: --kv-bytes-per-token must be > 0")
    if opts["rtt_ms"] < 0 or args.jitter_ms < 0 or opts["ttft_budget_s"] < 0:
        raise SystemExit("pdd-tools demo: --rtt-ms, --jitter-ms and --ttft-budget-ms must be >= 0")
    return DemoConfig(engine=args.engine, out=args.out, seed=args.seed, jitter_ms=args.jitter_ms,
                      kv_bytes_per_token=args.kv_bytes_per_token, where=args.where, runs=runs,
                      side_by_side=args.side_by_side, **opts)
