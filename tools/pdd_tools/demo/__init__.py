"""The demo: PDD against plain cross-datacenter PD, end to end, on one machine.

``scripts/demo`` (``pdd-tools demo``) starts three agents, one per node as PDD has them: prefill
P (node a1) and relay decode RLD (node a2) in datacenter A, main decode MD (node b1) in
datacenter B, and the simulated engines of :mod:`pdd_tools.sim` on them. It replays one
trace shaped like PDD's traffic (:mod:`pdd_tools.trace`) twice:

* **pd**: plain cross-DC PD. Every request is P-MD: P prefills and ships the KV MD lacks
  across the WAN; MD emits the first token once the KV is in.
* **pdd**: PDD. For each request a router asks P's agent ``choose_pipeline`` (live link
  figures): P-MD when the missing KV crosses within the TTFT budget; P-RLD-MD otherwise (one
  ``send_kv`` to RLD and MD at once, RLD decodes and emits while the KV crosses the WAN, then
  hands the output over, one-shot or catch-up by its load); P-RLD for the anomalous requests
  (ultra-long input, ultra-short output: finished on RLD, nothing crosses).

It prints a table (TTFT p50/p90/p99 of both runs, WAN bytes, handoffs by mode, pipelines
chosen), and writes under ``--out`` (``demo-out/``) ``figures.json``, ``ttft_cdf.png``, one
JSON line per request of each run (``pd/requests.jsonl``, ``pdd/requests.jsonl``) and every
process's log. TTFT is the time from a request's arrival to the first token emitted to the user:
the ``emit`` of position 0 (RLD's, in a handoff), or the decoder's own first token.

**Two datacenters.** As root, sites A and B are network namespaces joined by a veth pair
(:class:`pdd_tools.netns.TwoSites`, a tbf at ``--link-mbit`` on both ends); site A's agents and
engines run in namespace A, site B's in B. WAN latency comes from one
:mod:`pdd_tools.shaper` relay in namespace A in front of MD's agent (half of ``--rtt-ms`` each
way, with jitter): the agents of A dial B (the lower site/node dials), so their peer address for
b1 is the shaper's. Without root it falls back to loopback, with the shaper also doing the
rate (per connection, so the KV goes over one bulk connection there). Everything is stopped and
the namespaces removed on exit, whatever happens (Ctrl-C, SIGTERM, errors).

Each site's engines run in a process of their own (``python -m pdd_tools.demo --site-engines
SPEC``), driven over its stdin/stdout by this process, which plays the router and the user.

**``--engine vllm``**: the same two runs through ``pdd-wire router`` over three real ``vllm
serve`` instances of the tiny model, on the same agents, namespaces and shaper, the trace scaled
to the model (:mod:`~pdd_tools.demo.tiny`); this process is the users, and every output is
compared with a single server's greedy answer (:mod:`~pdd_tools.demo.vllm_runner`,
:mod:`~pdd_tools.demo.vllm_stack`). ``--engine vllm --side-by-side``: three prompts' tokens side
by side instead (:mod:`pdd_tools.vllm.demo`).

Modules: :mod:`~pdd_tools.demo.config` (options, scaled constants), :mod:`~pdd_tools.demo.layout`
(where the processes live, the agents' configs, the processes), :mod:`~pdd_tools.demo.runner`
(one run, both runs), :mod:`~pdd_tools.demo.site` (a site's engines process),
:mod:`~pdd_tools.demo.report` (figures, table, CDF); with vLLM :mod:`~pdd_tools.demo.tiny` (the
scale), :mod:`~pdd_tools.demo.vllm_stack` (agents, shapers, servers, the router),
:mod:`~pdd_tools.demo.vllm_runner` (the runs).
"""
from .config import DemoConfig, add_demo_args, config_from_args
from .report import RunResult
from .runner import run, run_demo

__all__ = ["DemoConfig", "RunResult", "add_demo_args", "config_from_args", "run", "run_demo"]
