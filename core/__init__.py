"""The engine core: requests, the KV block table, the scheduler and the step loop."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from core.engine_core import EngineCore

__all__ = ["EngineCore"]


def __getattr__(name: str) -> Any:
    # Lazy (PEP 562): a front end that only starts an engine (core.engine_spawn) must not load torch and workers.
    if name == "EngineCore":
        return importlib.import_module("core.engine_core").EngineCore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
