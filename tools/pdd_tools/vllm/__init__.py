"""Tiny vLLM engines driven as PDD's roles, for tests/test_vllm_adapter.py and ``pdd-tools demo
--engine vllm --side-by-side``; real ``vllm serve`` instances (:mod:`pdd_tools.vllm.serve`) for
the router's tests, the benchmarks and ``pdd-tools demo --engine vllm``.

- :mod:`pdd_tools.vllm.roles`: the driving side, in the main venv: one role server process per
  engine, in the vLLM venv (``PDD_VLLM_VENV``).
- :mod:`pdd_tools.vllm.role_server`: one vLLM engine, driven by JSON lines (runs in the vLLM venv).
- :mod:`pdd_tools.vllm.driver`: P, RLD and MD stepped by hand around offline vLLM engines, with
  the handoff ops of the engine socket (runs in the vLLM venv).
- :mod:`pdd_tools.vllm.demo`: the PD and PDD flows side by side with three tiny engines.
- :mod:`pdd_tools.vllm.serve`: ``vllm serve`` processes with PddWireConnector, a stock P/D proxy.
"""
