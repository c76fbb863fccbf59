"""The engine core: requests, the KV block table, the scheduler and the step loop."""
from core.engine_core import EngineCore

__all__ = ["EngineCore"]
