"""Front end: LLM, tokenizer and detokenizer, outputs (and later AsyncLLM and the OpenAI gateway)."""
from frontend.llm import LLM
from frontend.outputs import CompletionOutput, Logprob, RequestOutput
from ipc import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
