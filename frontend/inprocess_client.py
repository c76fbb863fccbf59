"""The engine core inside the front end's own process (`LLM(in_process=True)`): same calls, no sockets."""
from __future__ import annotations

from typing import Any

from core import EngineCore
from ipc import EngineConfig, EngineCoreOutputs, EngineCoreRequest, SchedulerStats


class InProcessEngineCoreClient:
    """For debugging and profiling in one process; each get_outputs() runs one engine step."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = EngineCore(config)
        self.info = self.engine.info

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine.validate_request(request)
        self.engine.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine.abort_requests(request_ids)

    def get_outputs(self) -> EngineCoreOutputs:
        if not self.engine.has_unfinished_requests():
            raise RuntimeError("the engine finished requests without reporting them (a bug)")
        return EngineCoreOutputs.of_step(self.engine.step())

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.engine.call_utility(method, list(args))

    def get_stats(self) -> SchedulerStats:
        return self.engine.get_stats()

    def shutdown(self) -> None:
        self.engine.shutdown()
