"""Request bodies of the pooling routes: /v1/embeddings (OpenAI's), /score, /rerank and /classify (vLLM's)."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from frontend.api.protocol import Rule, _Strict
from ipc.bounds import INT32_MAX

TokenIds = list[Annotated[int, Field(ge=0, le=INT32_MAX)]]
# truncate_prompt_tokens: keep each input's first k tokens (-1: the model's limit); without it a longer input is a 400.
Truncation = Annotated[int, Field(ge=-1, le=INT32_MAX)] | None
_POOLING = {"add_special_tokens": Rule("inputs always get the tokenizer's special tokens", lambda v, b: v in (None, True)),
            "priority": Rule("the engine runs first-come first-served", lambda v, b: v in (None, 0))}


class EmbeddingRequest(_Strict):
    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    user: str | None = None
    truncate_prompt_tokens: Truncation = None
    normalize: bool | None = None  # vLLM's extra field: None is the model's own choice
    refused_fields = _POOLING


class ScoreRequest(_Strict):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Truncation = None
    refused_fields = _POOLING


class RerankRequest(_Strict):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None  # 0 or None: every document
    return_documents: bool = True
    truncate_prompt_tokens: Truncation = None
    refused_fields = _POOLING


class ClassificationRequest(_Strict):
    model: str | None = None
    input: str | list[str]
    truncate_prompt_tokens: Truncation = None
    refused_fields = _POOLING
