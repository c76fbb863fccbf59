"""Front end: LLM and AsyncLLM, the engine-core client library, tokenizer and detokenizer, outputs."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from frontend.async_llm import AsyncLLM
    from frontend.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from frontend.async_core_client import AsyncEngineCoreClient
    from frontend.core_client import EngineCoreClient, EngineDeadError, RequestFailedError
    from frontend.llm import LLM
    from frontend.outputs import CompletionOutput, Logprob, RequestOutput
    from ipc import LoRARequest, RequestOutputKind, SamplingParams, StructuredOutputsParams

# Loaded on first use (PEP 562), so that a program embedding only the client library loads neither
# transformers nor the LLM machinery.
_HOMES = {
    "AsyncEngineCoreClient": "frontend.async_core_client", "AsyncLLM": "frontend.async_llm",
    "BeamSearchOutput": "frontend.beam_search", "BeamSearchParams": "frontend.beam_search",
    "BeamSearchSequence": "frontend.beam_search", "CompletionOutput": "frontend.outputs",
    "EngineCoreClient": "frontend.core_client", "EngineDeadError": "frontend.core_client", "LLM": "frontend.llm",
    "Logprob": "frontend.outputs", "RequestOutput": "frontend.outputs", "RequestFailedError": "frontend.core_client",
    "RequestOutputKind": "ipc", "SamplingParams": "ipc", "StructuredOutputsParams": "ipc", "LoRARequest": "ipc",
}

__all__ = ["AsyncEngineCoreClient", "AsyncLLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence",
           "CompletionOutput", "EngineCoreClient", "EngineDeadError", "LLM", "Logprob", "LoRARequest", "RequestOutput",
           "RequestFailedError", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
