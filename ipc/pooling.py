"""Pooling requests (embeddings, classification) and what an engine's model pools, told at the handshake."""
from __future__ import annotations

import json
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ipc.bounds import INT32_MAX

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")


class PoolingParams(msgspec.Struct, kw_only=True, frozen=True):
    """What a pooling request wants of its prompt's hidden states: an embedding (normalized unless normalize is
    False, cut to its first `dimensions` for a Matryoshka model) or a classifier's logits (task "classify")."""

    task: Literal["embed", "classify"] = "embed"
    normalize: bool | None = None  # None: the model's own choice (sentence-transformers' Normalize module)
    dimensions: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None


class PoolerConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Overrides of the pooling a model folder implies (vLLM's --pooler-config)."""

    pooling_type: Literal["LAST", "MEAN", "CLS"] | None = None
    normalize: bool | None = None


class PoolingInfo(msgspec.Struct, kw_only=True, frozen=True):
    """The engine's model as a pooling model: how it pools, how wide its embeddings are, its labels when it is a
    classifier (a cross-encoder scores a pair of texts as one input), and whether it also generates."""

    pooling_type: str
    normalize: bool
    hidden_size: int
    num_labels: int = 0  # > 0: a sequence classifier; task "classify" returns its logits
    labels: list[str] = []
    matryoshka: bool = False  # embeddings may be cut short (`dimensions`)
    generates: bool = False  # a decoder: generation requests too, unless the engine runs as runner "pooling"
    type_vocab_size: int = 0  # token type ids a request may carry (BERT's segments); 0: none


def parse_pooler_config(value: PoolerConfig | dict | str | None) -> PoolerConfig | None:
    """A PoolerConfig from itself, a dict (LLM's keyword) or JSON text (the CLI flag); ValueError names what is
    wrong."""
    if value is None or isinstance(value, PoolerConfig):
        return value
    try:
        return msgspec.convert(json.loads(value) if isinstance(value, str) else value, PoolerConfig)
    except (ValueError, msgspec.ValidationError) as error:
        raise ValueError(f"pooler_config is invalid: {error}") from None
