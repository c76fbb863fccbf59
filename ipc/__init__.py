"""Contracts between processes: every msgspec Struct that crosses a process boundary."""
from ipc.config import EngineConfig, parse_memory_size
from ipc.lora import LoRARequest
from ipc.pooling import PoolerConfig, PoolingInfo, PoolingParams
from ipc.prompt_embeds import PromptEmbeds
from ipc.messages import (
    CLIENT_ALIVE_INTERVAL_S,
    CLIENT_SILENCE_S,
    AbortRequests,
    ClientAlive,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineInfo,
    EngineStartup,
    FinishReason,
    Heartbeat,
    RequestError,
    SchedulerStats,
    SpecDecodingStats,
    SubscribeHeartbeats,
    UtilityCall,
    UtilityResult,
)
from ipc.sampling_params import RequestOutputKind, SamplingParams
from ipc.serialization import Decoder, Encoder
from ipc.speculative import SpeculativeConfig
from ipc.structured_outputs import GrammarBitmask, ReasoningSection, StructuredOutputsParams
from ipc.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SchedulerOutput,
)

__all__ = [
    "AbortRequests",
    "CLIENT_ALIVE_INTERVAL_S",
    "CLIENT_SILENCE_S",
    "ClientAlive",
    "CachedRequestData",
    "Decoder",
    "Encoder",
    "GrammarBitmask",
    "LoRARequest",
    "PoolerConfig",
    "PoolingInfo",
    "PoolingParams",
    "EngineCoreInput",
    "EngineCoreOutputs",
    "EngineDead",
    "EngineInfo",
    "EngineStartup",
    "RequestError",
    "SchedulerStats",
    "SpecDecodingStats",
    "SpeculativeConfig",
    "SubscribeHeartbeats",
    "UtilityCall",
    "UtilityResult",
    "EngineConfig",
    "EngineCoreOutput",
    "EngineCoreRequest",
    "FinishReason",
    "Heartbeat",
    "ModelRunnerOutput",
    "NewRequestData",
    "PromptEmbeds",
    "PromptLogprobs",
    "ReasoningSection",
    "RequestOutputKind",
    "SamplingParams",
    "SchedulerOutput",
    "StructuredOutputsParams",
    "parse_memory_size",
]
