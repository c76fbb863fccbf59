"""Engine-core request and output messages exchanged between the front end and the engine core."""
from __future__ import annotations

import enum
from typing import Any

import msgspec

from ipc.sampling_params import SamplingParams
from ipc.scheduler_output import PromptLogprobs


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class EngineCoreRequest(msgspec.Struct, kw_only=True, tag="add"):
    """A tokenized request: the engine core only ever sees token ids."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    # Requests with different salts never share prefix-cache blocks (tenant isolation).
    cache_salt: str | None = None


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
    prompt_logprobs: PromptLogprobs | None = None  # the whole prompt's, on the request's first output


class AbortRequests(msgspec.Struct, tag="abort"):
    """Stop these requests and free their blocks (a stop string, a disconnect, a cancelled task)."""

    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility"):
    """Call an engine-core method by name (stats, reset prefix cache, profiler, health); answered by call_id."""

    call_id: int
    method: str
    args: list[Any] = []


# Everything a client may send to the engine core; the tag field tells them apart on the wire.
EngineCoreInput = EngineCoreRequest | AbortRequests | UtilityCall


class UtilityResult(msgspec.Struct, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None


class SchedulerStats(msgspec.Struct, kw_only=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_preemptions: int
    num_aborted_requests: int = 0  # since start: aborted by a client (stop string, disconnect, cancel)
    peak_kv_cache_usage: float = 0.0
    kv_utilization_at_peak: float = 1.0  # tokens held / slots allocated, at the step of peak usage
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class EngineInfo(msgspec.Struct, kw_only=True):
    """What an engine core tells a client at the handshake: its model, limits and KV capacity."""

    model: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    scheduling_policy: str

    def validate_request(self, request: EngineCoreRequest) -> None:
        """Raise ValueError naming what is wrong with a request this engine would refuse."""
        prompt, limit = request.prompt_token_ids, self.max_model_len
        if not prompt:
            raise ValueError(f"request {request.request_id}: the prompt is empty")
        if len(prompt) >= limit:
            raise ValueError(f"request {request.request_id}: the prompt has {len(prompt)} tokens, but "
                             f"max_model_len is {limit} (prompt tokens must be fewer, to leave room to generate)")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"request {request.request_id}: prompt token id {bad} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        params = request.sampling_params
        special = {"stop/eos": [*(params.stop_token_ids or []), *([request.eos_token_id]
                                                                if request.eos_token_id is not None else [])],
                   "logit_bias": list(params.logit_bias or ()),
                   "bad_words": [t for word in params.bad_words_token_ids or [] for t in word]}
        for name, token_ids in special.items():
            bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"request {request.request_id}: {name} token id {bad} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        if params.n != 1:
            raise ValueError(f"request {request.request_id}: an engine request samples once (n=1, got "
                             f"{params.n}); the front end sends n > 1 as n requests")
        if request.priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(f"request {request.request_id}: priority={request.priority} needs "
                             "scheduling_policy='priority' (the engine runs first-come first-served)")


class EngineStartup(msgspec.Struct, omit_defaults=True):
    """The one line an engine-core process writes to its parent when start-up ends: ready, or why not."""

    info: EngineInfo | None = None
    error: str | None = None
    error_type: str = "RuntimeError"


class RequestError(msgspec.Struct, omit_defaults=True):
    """A request the engine could not take: it ends here, with this message. kind "invalid" (bad input,
    malformed frame) or "overloaded" (the waiting queue is full: retry later)."""

    request_id: str
    message: str
    kind: str = "invalid"


class EngineDead(msgspec.Struct):
    """Sent to every client when the engine core fails and is about to exit."""

    reason: str


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    """One message from the engine core to one client: its requests' new tokens and any replies."""

    outputs: list[EngineCoreOutput] = []
    errors: list[RequestError] = []
    utility_result: UtilityResult | None = None
    engine_dead: EngineDead | None = None
    timestamp: float = 0.0
