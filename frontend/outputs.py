"""User-facing results: RequestOutput and CompletionOutput with vLLM's field names."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


def merge_delta(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One delta output covering both (when a stream's consumer fell behind by a step)."""
    merged = []
    for old, new in zip(older.outputs, newer.outputs):
        logprobs = old.logprobs + new.logprobs if old.logprobs is not None and new.logprobs is not None else None
        merged.append(CompletionOutput(new.index, old.text + new.text, old.token_ids + new.token_ids,
                                       new.cumulative_logprob, logprobs, new.finish_reason, new.stop_reason))
    return RequestOutput(newer.request_id, newer.prompt, newer.prompt_token_ids, merged, newer.finished,
                         newer.num_cached_tokens, older.prompt_logprobs or newer.prompt_logprobs)


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]  # softmax over the labels (sigmoid of the one logit of a one-label model)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ScoringOutput:
    score: float  # cosine similarity (bi-encoder) or the cross-encoder's sigmoid-activated logit


@dataclass(slots=True)
class PoolingRequestOutput:
    """One input's result from LLM.embed / classify / score (vLLM's EmbeddingRequestOutput and kin)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ClassificationOutput | ScoringOutput
    finished: bool = True
