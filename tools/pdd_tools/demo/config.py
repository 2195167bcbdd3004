"""The demo's options (:class:`DemoConfig`, ``pdd-tools demo`` arguments) and the constants of its
scaled-down PDD setup."""

from __future__ import annotations

import argparse
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


def add_demo_args(d: argparse.ArgumentParser) -> None:
    """The ``demo`` subcommand's options (``pdd_tools.cli``)."""
    c = DemoConfig()
    d.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                   help="sim: simulated engines (default); vllm: three tiny vLLM engines (pdd_tools.vllm)")
    d.add_argument("--out", default=c.out,
                   help="where figures.json, ttft_cdf.png and the logs go (default %(default)s)")
    d.add_argument("--requests", type=int, default=c.requests, help="requests in the trace (default %(default)s)")
    d.add_argument("--rate", type=float, default=c.rate, help="mean arrival rate, requests/s (default %(default)s)")
    d.add_argument("--seed", type=int, default=c.seed, help="trace seed (default %(default)s)")
    d.add_argument("--link-mbit", type=float, default=c.link_mbit, help="WAN rate, Mbit/s (default %(default)s)")
    d.add_argument("--rtt-ms", type=float, default=c.rtt_ms, help="WAN round trip, ms (default %(default)s)")
    d.add_argument("--jitter-ms", type=float, default=c.jitter_ms, help="WAN jitter each way, ms (default %(default)s)")
    d.add_argument("--kv-bytes-per-token", type=int, default=c.kv_bytes_per_token,
                   help="simulated KV size per token (default %(default)s)")
    d.add_argument("--where", choices=("auto", "netns", "loopback"), default="auto",
                   help="netns: two network namespaces (root); loopback: one namespace; auto: netns when root")
    d.add_argument("--runs", default="pd,pdd", help="which runs, comma-separated (default %(default)s)")


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    runs = tuple(r.strip() for r in args.runs.split(",") if r.strip())
    bad = [r for r in runs if r not in ("pd", "pdd")]
    if bad or not runs:
        raise SystemExit(f"pdd-tools demo: --runs takes pd and/or pdd, not {args.runs!r}")
    for key in ("requests", "rate", "link_mbit", "kv_bytes_per_token"):
        if not getattr(args, key) > 0:
            raise SystemExit(f"pdd-tools demo: --{key.replace('_', '-')} must be > 0")
    if args.rtt_ms < 0 or args.jitter_ms < 0:
        raise SystemExit("pdd-tools demo: --rtt-ms and --jitter-ms must be >= 0")
    return DemoConfig(engine=args.engine, out=args.out, requests=args.requests, rate=args.rate, seed=args.seed,
                      link_mbit=args.link_mbit, rtt_ms=args.rtt_ms, jitter_ms=args.jitter_ms,
                      kv_bytes_per_token=args.kv_bytes_per_token, where=args.where, runs=runs)
