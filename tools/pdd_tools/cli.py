"""``pdd-tools``: the demo and the benchmarks. Exit status: 0 ok, 1 runtime failure, 2 bad usage.

``pdd-tools demo`` (``scripts/demo``) and ``pdd-tools bench`` (``scripts/bench``); the operator's
own tool, ``pdd-wire`` (config, status, probe), is the product's (:mod:`pdd_wire.cli`).
"""

from __future__ import annotations

import argparse
import sys

from pdd_wire.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdd-tools", description="pdd-wire's demo and benchmarks")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="PDD against plain cross-DC PD: a trace replayed over two emulated datacenters")
    from .demo import add_demo_args

    add_demo_args(d)
    b = sub.add_parser("bench", help="benchmarks (see scripts/bench)")
    b.add_argument("--json", action="store_true")
    b.add_argument("--quick", action="store_true", help="fewer repetitions")
    b.add_argument("--only", default="", help="comma-separated figure groups: goodput, ucx, probe, compress, "
                   "register, vllm, router, latency, prefix, handoff, wan (probe and compress need root: network "
                   "namespaces, wan uses them as root; vllm and router the vLLM venv of scripts/vllm-env)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "demo":
            from .demo import run_demo

            return run_demo(args)
        from .bench import run_bench

        return run_bench(args)
    except ConfigError as exc:
        print(f"pdd-tools: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"pdd-tools: {exc}", file=sys.stderr)
        return 1
