"""Engine adapters: glue between an inference engine and its pdd-wire agent.

Each adapter talks to the agent only through the engine socket (:class:`pdd_wire.EngineClient`).
Importing this package imports no engine; the modules do:

- :mod:`pdd_wire.adapters.vllm_connector`: a vLLM ``KVConnectorBase_V1`` (needs ``vllm``;
  docs/vllm.md), with its worker side in ``vllm_worker``, its per-step metadata in ``vllm_meta``,
  the checks of its config and per-request params in ``vllm_params`` (no vLLM needed) and the
  staging for a KV cache on a CUDA device in ``vllm_cuda`` (untested on a GPU).
- :mod:`pdd_wire.adapters.loop_thread`: a private asyncio loop on a thread, so that
  synchronous engine code can call the asyncio ``EngineClient``.
- :mod:`pdd_wire.adapters.agent_link`: an engine connection that comes back after the agent
  restarts (memory registered again).

PDD's roles (prefill, relay decode, main decode) driven by hand around offline vLLM engines,
with the handoff ops of the engine socket, are a tool, not product: ``pdd_tools.vllm.driver``
in ``tools/``.
"""
