"""Pooling inputs (texts, token ids, text pairs for a cross-encoder) as engine requests: tokenized in one batched
call of the fast tokenizer, truncated when truncate_prompt_tokens asks, validated against the engine's limits."""
from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from ipc import EngineCoreRequest, EngineInfo, PoolingParams, SamplingParams

PoolingInput = str | dict | list[int]
# Pooling requests are never sampled from; the engine-core request carries sampling params all the same.
_UNUSED_SAMPLING = SamplingParams(max_tokens=1)


def input_token_ids(tokenizer: PreTrainedTokenizerBase, info: EngineInfo, inputs: Sequence[PoolingInput],
                    truncate_prompt_tokens: int | None, pairs: Sequence[str] | None = None
                    ) -> tuple[list[list[int]], list[list[int]] | None]:
    """Each input's token ids (and, for text pairs, their token type ids). Texts are tokenized together, with the
    tokenizer's special tokens; truncate_prompt_tokens k keeps the first k tokens (-1: the model's limit), the
    special ones included; without it an input over max_model_len is refused by validation."""
    limit = truncation_limit(info, truncate_prompt_tokens)
    ids: list[list[int] | None] = [_token_ids(item) for item in inputs]
    texts = [_text(item) if item_ids is None else None for item, item_ids in zip(inputs, ids)]
    if pairs is not None:
        if any(text is None for text in texts) or not all(isinstance(text, str) for text in pairs):
            raise ValueError("a cross-encoder scores pairs of texts, not token ids")
        encoded = tokenizer(texts, list(pairs), truncation="longest_first" if limit else False, max_length=limit)
        types = encoded.get("token_type_ids")
        # The tokenizer leaves an input whole when the limit cannot hold its special tokens: cut it here.
        return _cut(encoded["input_ids"], limit), _cut(types, limit) if types is not None else None
    to_encode = [i for i, item in enumerate(ids) if item is None]
    if to_encode:
        encoded = tokenizer([texts[i] for i in to_encode], truncation=bool(limit), max_length=limit)["input_ids"]
        for i, item in zip(to_encode, encoded):
            ids[i] = item
    return _cut(ids, limit), None


def _cut(rows: list[list[int]], limit: int | None) -> list[list[int]]:
    return [row[:limit] for row in rows] if limit else rows


def truncation_limit(info: EngineInfo, truncate_prompt_tokens: int | None) -> int | None:
    if truncate_prompt_tokens is None:
        return None
    if isinstance(truncate_prompt_tokens, bool) or not isinstance(truncate_prompt_tokens, int) \
            or truncate_prompt_tokens == 0 or truncate_prompt_tokens < -1:
        raise ValueError(f"truncate_prompt_tokens must be -1 (the model's limit) or a positive int, got "
                         f"{truncate_prompt_tokens!r}")
    return info.max_model_len if truncate_prompt_tokens == -1 else min(truncate_prompt_tokens, info.max_model_len)


def pooling_request(info: EngineInfo, request_id: str, token_ids: list[int], params: PoolingParams,
                    token_type_ids: list[int] | None = None) -> EngineCoreRequest:
    """The validated engine-core request (InvalidRequestError, a ValueError, naming what is wrong)."""
    request = EngineCoreRequest(request_id=request_id, prompt_token_ids=token_ids, sampling_params=_UNUSED_SAMPLING,
                                pooling_params=params, token_type_ids=token_type_ids)
    info.validate_request(request)
    return request


def as_inputs(value: PoolingInput | Sequence[PoolingInput]) -> list[PoolingInput]:
    """One input (a text, a prompt dict, or a list of token ids) or a list of them, as a list of inputs."""
    if isinstance(value, (str, dict)) or (isinstance(value, list) and value and all(isinstance(t, int) for t in value)):
        return [value]
    return list(value)


def _text(item: PoolingInput) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and isinstance(item.get("prompt"), str):
        return item["prompt"]
    raise ValueError(f"an input must be a str, {{'prompt': str}}, {{'prompt_token_ids': [...]}} or a list of "
                     f"token ids, got {type(item).__name__}")


def _token_ids(item: PoolingInput) -> list[int] | None:
    ids = item.get("prompt_token_ids") if isinstance(item, dict) else item if isinstance(item, list) else None
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("prompt_token_ids must be a list of ints")
    return ids


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> tuple[list[str], list[str]]:
    """The pairs to score: one text_1 against each text_2, or two lists of one length pair by pair."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds) or not firsts:
        raise ValueError(f"score takes one text_1 and any number of text_2, or as many of each; got "
                         f"{len(firsts)} and {len(seconds)}")
    return firsts, seconds
