"""pdd-wire: the per-node transport daemon for cross-datacenter PD-disaggregated LLM serving."""

from .engine.client import EngineClient, RegionHandle
from .errors import ErrorCode, PddWireError
from .memory import SharedMemory

__version__ = "0.1.0"
__all__ = ["EngineClient", "RegionHandle", "SharedMemory", "ErrorCode", "PddWireError", "__version__"]
