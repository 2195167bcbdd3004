"""pdd-wire: the per-node transport daemon for cross-datacenter PD-disaggregated LLM serving."""

from ._version import __version__
from .engine.client import EngineClient, RegionHandle
from .errors import ErrorCode, PddWireError
from .memory import SharedMemory

__all__ = ["EngineClient", "RegionHandle", "SharedMemory", "ErrorCode", "PddWireError", "__version__"]
