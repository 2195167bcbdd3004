"""The engine side of pdd-wire: the engine-socket protocol and :class:`EngineClient`.

An engine adapter (a vLLM KV connector, a simulated engine, ...) depends on this package
only; it never imports the agent.
"""

from .client import EngineClient, RegionHandle

__all__ = ["EngineClient", "RegionHandle"]
