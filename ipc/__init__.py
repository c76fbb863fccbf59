"""Contracts between processes: every msgspec Struct that crosses a process boundary."""
from ipc.config import EngineConfig, parse_memory_size
from ipc.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from ipc.sampling_params import SamplingParams
from ipc.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

__all__ = [
    "CachedRequestData",
    "EngineConfig",
    "EngineCoreOutput",
    "EngineCoreRequest",
    "FinishReason",
    "ModelRunnerOutput",
    "NewRequestData",
    "SamplingParams",
    "SchedulerOutput",
    "parse_memory_size",
]
