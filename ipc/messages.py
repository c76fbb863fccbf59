"""Engine-core request and output messages exchanged between the front end and the engine core."""
from __future__ import annotations

import enum

import msgspec

from ipc.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class EngineCoreRequest(msgspec.Struct, kw_only=True):
    """A tokenized request: the engine core only ever sees token ids."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0


class EngineCoreOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """New tokens of one request from one step; `finish_reason` set on its last output."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Per new token: [sampled token, top-N ...] ids, their logprobs and the sampled token's rank.
    new_logprob_token_ids: list[list[int]] | None = None
    new_logprobs: list[list[float]] | None = None
    new_sampled_ranks: list[int] | None = None
    num_cached_tokens: int = 0
