"""The figures of a run (TTFT percentiles, WAN bytes, handoffs, pipelines), the table printed and
the TTFT CDF drawn (matplotlib)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdd_wire.stats import percentile

from .config import PIPELINES, DemoConfig


@dataclass
class RunResult:
    kind: str
    requests: list[dict]  # per request: arrival, pipeline, ttft_s, ok, ...
    stats: dict  # from the sites: metrics, engine figures
    wall_s: float
    failures: list[str]
    streams: dict[str, list[dict[int, int]]] = field(default_factory=dict)  # what each side emitted, per request

    def ttfts(self) -> list[float]:
        return [r["ttft_s"] for r in self.requests if r.get("ttft_s") is not None]


def summary(res: RunResult) -> dict:
    t = res.ttfts()
    stats_a = res.stats.get("A", {}).get("agents", {})
    wan = sum(stats_a.get(r, {}).get("wan_bytes", 0) for r in ("P", "RLD"))
    wan_kv = sum(stats_a.get(r, {}).get("wan_kv_bytes_tx", 0) for r in ("P", "RLD"))
    pipes = {p: sum(1 for r in res.requests if r["pipeline"] == p) for p in PIPELINES}
    handoffs: dict[str, int] = {}
    for r in res.requests:
        h = r.get("handoff")
        if h:
            key = h["reason"] if h["owner"] == "RLD" else (h["mode"] or h["reason"])
            handoffs[key] = handoffs.get(key, 0) + 1
    rld_tok = sum(r.get("rld_tokens", 0) for r in res.requests)
    md_tok = sum(r.get("md_tokens", 0) for r in res.requests)
    return {
        "requests": len(res.requests), "ok": sum(r["ok"] for r in res.requests),
        "ttft_p50_s": _r(percentile(t, 50)), "ttft_p90_s": _r(percentile(t, 90)), "ttft_p99_s": _r(percentile(t, 99)),
        "ttft_mean_s": _r(sum(t) / len(t)) if t else None, "ttft_max_s": _r(max(t)) if t else None,
        "wan_bytes": wan, "wan_kv_bytes": wan_kv, "pipelines": pipes, "handoffs": handoffs,
        "handoff_mode_choices": stats_a.get("RLD", {}).get("handoff_modes", {}),
        "tokens_emitted": {"RLD": rld_tok, "MD": md_tok},
        "engines": {**res.stats.get("A", {}).get("engines", {}), **res.stats.get("B", {}).get("engines", {})},
        "wall_s": round(res.wall_s, 1),
    }


def _r(x):
    return None if x is None else round(x, 4)


def _sample(samples: list, name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def router_summary(res: RunResult) -> dict:
    """:func:`summary` of a run through ``pdd-wire router``: pipelines, handoffs, fallbacks and
    output tokens by pool from the router's own metrics (``res.stats["router"]``, its samples),
    and what a router run adds: RLD's share of the output, WAN bytes per request, the handoff
    stall, requests whose tokens differ from a single server's."""
    out = summary(res)
    m = res.stats.get("router") or []
    out["pipelines"] = {p: int(_sample(m, "pddwire_router_pipeline_choices_total", pipeline=p)) for p in PIPELINES}
    hand: dict[str, int] = {}
    for s in m:
        if s.name == "pddwire_router_handoffs_total" and s.value:
            key = s.labels["mode"] if s.labels["outcome"] == "switched" else s.labels["outcome"]
            hand[key] = hand.get(key, 0) + int(s.value)
    out["handoffs"] = hand
    out["handoff_mode_choices"] = {f"{s.labels['mode']}/{s.labels['reason']}": int(s.value) for s in m
                                   if s.name == "pddwire_router_handoff_modes_total" and s.value}
    out["fallbacks"] = {s.labels["kind"]: int(s.value) for s in m
                        if s.name == "pddwire_router_fallbacks_total" and s.value}
    tok = {pool: int(_sample(m, "pddwire_router_output_tokens_total", pool=pool)) for pool in ("P", "RLD", "MD")}
    out["tokens_emitted"] = {"RLD": tok["RLD"], "MD": tok["MD"] + tok["P"]}
    total = sum(tok.values())
    out["rld_share"] = round(tok["RLD"] / total, 4) if total else None
    out["wan_bytes_per_request"] = round(out["wan_bytes"] / len(res.requests)) if res.requests else None
    stalls = res.stats.get("stalls_ms") or {}  # mode -> the stalls of its switches, ms
    out["handoff_stall_ms"] = {mode: {"n": len(v), "p50": _r(percentile(v, 50)), "p99": _r(percentile(v, 99))}
                               for mode, v in (("all", [x for v in stalls.values() for x in v]), *stalls.items())}
    out["mismatches"] = sum(1 for r in res.requests if "mismatch_at" in r)
    return out


def table(fig: dict, cfg: DemoConfig) -> str:
    runs = [k for k in ("pd", "pdd") if k in fig]
    head = {"pd": "plain PD (P-MD only)", "pdd": "PDD"}
    rows: list[tuple[str, ...]] = []

    def row(label, fn):
        rows.append((label, *(fn(fig[k]) for k in runs)))

    def secs(key):
        return lambda f: "-" if f[key] is None else f"{f[key]:.3f} s"

    row("TTFT p50", secs("ttft_p50_s"))
    row("TTFT p90", secs("ttft_p90_s"))
    row("TTFT p99", secs("ttft_p99_s"))
    row("TTFT mean", secs("ttft_mean_s"))
    row("WAN bytes (both ways)", lambda f: f"{f['wan_bytes'] / 1e6:,.1f} MB")
    row("  of which KV", lambda f: f"{f['wan_kv_bytes'] / 1e6:,.1f} MB")
    for p in PIPELINES:
        row(f"pipeline {p}", lambda f, p=p: str(f["pipelines"][p]))
    row("handoffs by mode", lambda f: ", ".join(f"{k} {v}" for k, v in sorted(f["handoffs"].items())) or "-")
    row("  mode chosen because", lambda f: ", ".join(f"{k.split('/')[1]} {v}" for k, v in
                                                   sorted(f["handoff_mode_choices"].items())) or "-")
    row("output tokens by RLD / MD", lambda f: f"{f['tokens_emitted']['RLD']} / {f['tokens_emitted']['MD']}")
    if all("rld_share" in fig[k] for k in runs):  # a run through pdd-wire router
        row("  RLD's share", lambda f: "-" if f["rld_share"] is None else f"{f['rld_share'] * 100:.1f}%")
        row("WAN bytes per request", lambda f: "-" if f["wan_bytes_per_request"] is None
            else f"{f['wan_bytes_per_request'] / 1e3:,.1f} KB")
        for mode in ("one-shot", "catch-up"):
            row(f"handoff stall p50 / p99, {mode}", lambda f, mode=mode: "-" if mode not in f["handoff_stall_ms"] else
                f"{f['handoff_stall_ms'][mode]['p50']:.0f} / {f['handoff_stall_ms'][mode]['p99']:.0f} ms")
        row("fallbacks", lambda f: ", ".join(f"{k} {v}" for k, v in sorted(f["fallbacks"].items())) or "-")
        row("tokens = one server's", lambda f: f"{f['requests'] - f['mismatches']}/{f['requests']}")
    row("requests ok", lambda f: f"{f['ok']}/{f['requests']}")
    row("run wall time", lambda f: f"{f['wall_s']:.1f} s")
    w0 = max(len(r[0]) for r in rows)
    ws = [max(len(head[k]), *(len(r[i + 1]) for r in rows)) for i, k in enumerate(runs)]
    lines = ["  ".join([" " * w0, *(head[k].rjust(w) for k, w in zip(runs, ws))])]
    lines += ["  ".join([r[0].ljust(w0), *(c.rjust(w) for c, w in zip(r[1:], ws))]) for r in rows]
    if "pd" in fig and "pdd" in fig and fig["pd"]["ttft_p99_s"] and fig["pdd"]["ttft_p99_s"]:
        cut = {q: 1 - fig["pdd"][f"ttft_{q}_s"] / fig["pd"][f"ttft_{q}_s"] for q in ("p50", "p90", "p99", "mean")
               if fig["pd"][f"ttft_{q}_s"]}
        lines.append("TTFT change with PDD: " + ", ".join(f"{q} {-v * 100:+.1f}%" for q, v in cut.items())
                     + "   (PDD paper: TTFT -51.5%; plain cross-DC PD p90 18.3 s, p99 29.7 s at 64K/1K)")
    return "\n".join(lines)


def plot_cdf(results: dict[str, RunResult], path: Path, link: str,
             engines: str = "simulated engines, real agents") -> None:
    try:
        import matplotlib
    except ImportError:  # the agent does not need it: pip install 'pdd-wire-tools[demo]'
        print(f"(no {path.name}: matplotlib is not installed; pip install 'pdd-wire-tools[demo]')", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    colors = {"pd": "tab:red", "pdd": "tab:blue"}
    labels = {"pd": "plain cross-DC PD (P-MD)", "pdd": "PDD (P-MD / P-RLD-MD / P-RLD)"}
    for kind, res in results.items():
        xs = sorted(res.ttfts())
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", color=colors[kind], label=labels[kind])
        for q, ls in ((90, "--"), (99, ":")):
            v = percentile(xs, q)
            ax.axvline(v, color=colors[kind], ls=ls, lw=0.8)
            ax.annotate(f"p{q} {v:.2f}s", (v, 0.05 + (0.08 if q == 99 else 0) + (0.2 if kind == "pdd" else 0)),
                        color=colors[kind], fontsize=7, rotation=90, ha="right")
    ax.set_xscale("log")
    # labels at 1, 2 and 5 of each decade, as plain seconds: a run's TTFTs often span less than a
    # decade (only "10^0" would be labelled), and 1-2-5 never overlap
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"TTFT CDF, {engines}; WAN {link}", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)  # the curves start low at the left; lower right has the tails' labels
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
