"""Executors drive the workers: the in-process one (tp = pp = 1) calls a single Worker directly; the Ray one
(workers/ray_executor.py) drives tp × pp ranks."""
from __future__ import annotations

from typing import Protocol

from ipc import EngineConfig, ModelRunnerOutput, SchedulerOutput
from workers.worker import Worker


class Executor(Protocol):
    def determine_num_kv_blocks(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def check_health(self) -> None:
        """Nothing here can fail apart from this process itself."""

    def shutdown(self) -> None:
        """Nothing to release in-process; the Ray executor tears down its actors here."""
