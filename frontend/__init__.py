"""Front end: LLM and AsyncLLM, the engine-core client library, tokenizer and detokenizer, outputs."""
from frontend.async_llm import AsyncLLM
from frontend.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from frontend.core_client import AsyncEngineCoreClient, EngineCoreClient, EngineDeadError, RequestFailedError
from frontend.llm import LLM
from frontend.outputs import CompletionOutput, Logprob, RequestOutput
from ipc import RequestOutputKind, SamplingParams

__all__ = ["AsyncEngineCoreClient", "AsyncLLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence",
           "CompletionOutput", "EngineCoreClient", "EngineDeadError", "LLM", "Logprob", "RequestOutput",
           "RequestFailedError", "RequestOutputKind", "SamplingParams"]
