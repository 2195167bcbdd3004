"""The tools around pdd-wire, shipped apart from it (distribution ``pdd-wire-tools``).

They depend on the product (:mod:`pdd_wire`), never the reverse:

- :mod:`pdd_tools.cli`: ``pdd-tools demo`` and ``pdd-tools bench`` (``scripts/demo``, ``scripts/bench``).
- :mod:`pdd_tools.demo`: PDD against plain cross-datacenter PD over an emulated WAN.
- :mod:`pdd_tools.bench`, :mod:`~pdd_tools.bench_compress`, :mod:`~pdd_tools.bench_ucx`,
  :mod:`~pdd_tools.benchpipe` (the bare pipe and iperf3 baselines), :mod:`~pdd_tools.wakeprobe`
  (a reference for the token path's floor: processes that only wake one another),
  :mod:`~pdd_tools.bench_register`, :mod:`~pdd_tools.bench_vllm`: benchmarks and their baselines.
- :mod:`pdd_tools.sim`: simulated engines (prefill, relay decode, main decode) on the engine socket.
- :mod:`pdd_tools.trace`: a request trace shaped like PDD's traffic.
- :mod:`pdd_tools.harness`: agents as subprocesses, on loopback or in network namespaces.
- :mod:`pdd_tools.netns`: two emulated sites (network namespaces, a tbf-shaped veth); needs root.
- :mod:`pdd_tools.shaper`: the user-space TCP relay: WAN delay, jitter and rate, and the faults
  the tests inject.
- :mod:`pdd_tools.vllm`: tiny vLLM engines driven by hand as P, RLD and MD, for the vLLM test
  and ``scripts/demo --engine vllm``.
"""
