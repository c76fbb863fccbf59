"""OpenAI request and response bodies (pydantic, strict types: "5" is not an int here)."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from frontend.api.bounds import Mirrored, mirror
from ipc.sampling_params import LogitBias, SamplingParams

SP = Mirrored(SamplingParams)  # a SamplingParams field's type and bounds, for the field of the same meaning


class _Strict(BaseModel):
    # Unknown fields are ignored, as OpenAI does; known ones must have the right JSON type.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    """Fields both endpoints share; top_k, min_p, min_tokens, ignore_eos... are vLLM's extra fields."""

    model: str
    n: SP["n"] = 1
    temperature: SP["temperature"] | None = None
    top_p: SP["top_p"] | None = None
    seed: SP["seed"] = None
    stop: SP["stop"] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: SP["presence_penalty"] = 0.0
    frequency_penalty: SP["frequency_penalty"] = 0.0
    user: str | None = None
    top_k: SP["top_k"] | None = None
    min_p: SP["min_p"] | None = None
    repetition_penalty: SP["repetition_penalty"] | None = None
    min_tokens: SP["min_tokens"] = 0
    ignore_eos: bool = False
    stop_token_ids: SP["stop_token_ids"] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, mirror(LogitBias)] | None = None  # token id (as a JSON key) → bias
    bad_words: SP["bad_words"] = None
    cache_salt: str | None = None  # requests with different salts never share cached KV blocks


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: SP["max_tokens"] = 16
    echo: bool = False
    logprobs: SP["logprobs"] = None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: SP["max_tokens"] = None
    max_completion_tokens: SP["max_tokens"] = None
    chat_template: str | None = None  # refused when given: templates run code-like Jinja on the server
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: SP["logprobs"] = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: dict | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: dict | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
