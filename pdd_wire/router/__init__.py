"""``pdd-wire router``: an OpenAI-compatible front over unmodified ``vllm serve`` instances
(docs/router.md). :class:`Router` serves; :mod:`.config` reads its TOML."""

from .config import RouterConfig, default_config, load, loads
from .server import Router

__all__ = ["Router", "RouterConfig", "default_config", "load", "loads"]
