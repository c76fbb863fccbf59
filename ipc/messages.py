"""Engine-core request and output messages exchanged between the front end and the engine core."""
from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from ipc.bounds import (MAX_ID_LENGTH, MAX_PROMPT_TOKENS, Count, Fraction, Int64, RequestId, Seconds, TokenId,
                        check_fields)
from ipc.kv_transfer import KVTransferParams
from ipc.lora import LoRARequest
from ipc.multimodal import MAX_IMAGES_PER_PROMPT, ImageInput, ImageTiling
from ipc.pooling import PoolingInfo, PoolingParams
from ipc.prompt_embeds import PromptEmbeds
from ipc.request_rules import validate_request
from ipc.sampling_params import SamplingParams
from ipc.scheduler_output import PromptLogprobs


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # the request ends with a RequestError: "failed" (the engine, on it alone) or "invalid" (its input)


class EngineCoreRequest(msgspec.Struct, kw_only=True, tag="add"):
    """A tokenized request: the engine core only ever sees token ids."""

    request_id: RequestId
    prompt_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_TOKENS)]
    sampling_params: SamplingParams
    eos_token_id: TokenId | None = None
    arrival_time: Seconds = 0.0
    priority: Int64 = 0
    # Requests with different salts never share prefix-cache blocks (tenant isolation).
    cache_salt: Annotated[str, Meta(max_length=MAX_ID_LENGTH)] | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    # A pooling request: its prompt is computed (never sampled from) and pooled; sampling_params are unused.
    pooling_params: PoolingParams | None = None
    token_type_ids: Annotated[list[Count], Meta(max_length=MAX_PROMPT_TOKENS)] | None = None  # BERT's segments
    # The prompt as embeddings: prompt_token_ids are then placeholders (one per row), never read as content.
    prompt_embeds: PromptEmbeds | None = None
    # Its images, in prompt order: each one's features replace the embeddings of its placeholder tokens.
    mm_inputs: Annotated[list[ImageInput], Meta(max_length=MAX_IMAGES_PER_PROMPT)] | None = None
    # Disaggregated prefill (a kv_transfer_config group; other engines ignore both): produce_kv asks the prefill
    # engine to hand the prompt's KV blocks over (its final output carries where they are); kv_transfer_params tells
    # the decode engine where to load them from.
    produce_kv: bool = False
    kv_transfer_params: KVTransferParams | None = None

    def __post_init__(self) -> None:
        check_fields(self, "EngineCoreRequest.")


class EngineCoreOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """New tokens of one request from one step; `finish_reason` set on its last output."""

    request_id: str
    new_token_ids: list[TokenId]
    finish_reason: FinishReason | None = None
    stop_reason: TokenId | str | None = None
    # Per new token: [sampled token, top-N ...] ids, their logprobs and the sampled token's rank.
    new_logprob_token_ids: list[list[TokenId]] | None = None
    new_logprobs: list[list[float]] | None = None
    new_sampled_ranks: list[Count] | None = None
    num_cached_tokens: Count = 0
    prompt_logprobs: PromptLogprobs | None = None  # the whole prompt's, on the request's first output
    error: str | None = None  # why, when finish_reason is ERROR
    error_kind: str = "failed"  # the RequestError kind it ends with: "invalid" when its input was at fault
    error_param: str | None = None  # the request field at fault, for an "invalid" one
    pooled: bytes | None = None  # a pooling request's result, float32 little-endian, on its final output
    kv_transfer_params: KVTransferParams | None = None  # a produce_kv request's final output: where its KV went


class AbortRequests(msgspec.Struct, tag="abort"):
    """Stop these requests and free their blocks (a stop string, a disconnect, a cancelled task)."""

    request_ids: list[RequestId]


class UtilityCall(msgspec.Struct, tag="utility"):
    """Call an engine-core method by name (stats, reset prefix cache, profiler, health); answered by call_id."""

    call_id: Count
    method: Annotated[str, Meta(max_length=64)]
    args: Annotated[list[Any], Meta(max_length=8)] = []


class SubscribeHeartbeats(msgspec.Struct, tag="heartbeats"):
    """Send this client a Heartbeat twice a second from now on (a client that never reads, such as an idle LLM,
    does not subscribe, so none pile up in its queue)."""


CLIENT_ALIVE_INTERVAL_S = 0.2
CLIENT_SILENCE_S = 1.0


class ClientAlive(msgspec.Struct, tag="alive"):
    """This client is alive. A client that sends one keeps sending them, every CLIENT_ALIVE_INTERVAL_S; after
    CLIENT_SILENCE_S without one the engine takes it as gone (killed, or its host lost) and aborts its requests.
    A client that never sends one is never taken as gone."""


# Everything a client may send to the engine core; the tag field tells them apart on the wire.
EngineCoreInput = EngineCoreRequest | AbortRequests | UtilityCall | SubscribeHeartbeats | ClientAlive


class UtilityResult(msgspec.Struct, omit_defaults=True):
    call_id: Count
    result: Any = None
    error: str | None = None


class SpecDecodingStats(msgspec.Struct, kw_only=True):
    """Speculative decoding since start. A draft is the run of tokens one request verified in one step; position i
    counts the drafts that had an i-th token (drafted) and those whose first i+1 tokens were all accepted."""

    num_drafts: Count = 0
    num_draft_tokens: Count = 0
    num_accepted_tokens: Count = 0
    drafted_per_position: list[Count] = []
    accepted_per_position: list[Count] = []

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens verified."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens each verification step emitted: the accepted drafts plus the one the target always adds."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        grow = num_drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_drafted):
            self.drafted_per_position[position] += 1
            self.accepted_per_position[position] += position < num_accepted


class SchedulerStats(msgspec.Struct, kw_only=True):
    num_running: Count
    num_waiting: Count
    kv_cache_usage: Fraction
    num_free_blocks: Count
    num_preemptions: Count
    num_aborted_requests: Count = 0  # since start: aborted by a client (stop string, disconnect, cancel)
    peak_kv_cache_usage: Fraction = 0.0
    # Tokens held / slots allocated, at the step of peak usage: above 1 when requests share prefix-cached blocks.
    kv_utilization_at_peak: Annotated[float, Meta(ge=0.0)] = 1.0
    peak_num_running: Count = 0  # the most requests running in one step since start
    prefix_cache_queries: Count = 0
    prefix_cache_hits: Count = 0
    prefix_cache_host_hits: Count = 0  # of those, found in the host-memory tier (kv_offload_bytes) and loaded from it
    spec_decoding: SpecDecodingStats | None = None  # when speculative decoding is configured
    # Data parallel + expert parallel: steps this engine ran a dummy batch in, keeping pace with the others'
    num_dummy_steps: Count = 0
    # Disaggregated prefill since start: KV blocks a prefill engine wrote to the shared region, blocks a decode
    # engine loaded from it, and the requests whose transfer failed a check there (they computed their prompt).
    kv_transfer_blocks_sent: Count = 0
    kv_transfer_blocks_received: Count = 0
    kv_transfer_recomputes: Count = 0


class EngineInfo(msgspec.Struct, kw_only=True):
    """What an engine core tells a client at the handshake: its model, limits and KV capacity."""

    model: str
    max_model_len: Count
    vocab_size: Count
    num_kv_blocks: Count
    block_size: Count
    weight_bytes: Count = 0  # the model's parameters over all ranks, as held (quantized weights at their size)
    scheduling_policy: str
    privileged_utilities: list[str] = []  # those of the profiler and cache reset this engine allows
    max_logprobs: Count = 20
    runner: str = "generate"  # or "pooling": generation requests are refused
    pooling: PoolingInfo | None = None  # None: the model cannot pool
    hidden_size: Count = 0  # the width of the model's input embedding: of a prompt_embeds row
    enable_prompt_embeds: bool = False  # whether requests may give their prompt as embeddings
    # A vision-language model's image placeholder token (None: it takes no images) and the features (placeholders) of
    # every image, or 0 where each image's count follows from its size by image_tiling's rule.
    image_token_id: TokenId | None = None
    image_feature_count: Count = 0
    image_tiling: ImageTiling | None = None
    kv_role: str | None = None  # its kv_transfer_config's role (kv_producer, kv_consumer), None without one

    def validate_request(self, request: EngineCoreRequest) -> None:
        """Raise InvalidRequestError naming what is wrong with a request this engine would refuse."""
        validate_request(self, request)


class EngineStartup(msgspec.Struct, omit_defaults=True):
    """The one line an engine-core process writes to its parent when start-up ends: ready, or why not."""

    info: EngineInfo | None = None
    error: str | None = None
    error_type: str = "RuntimeError"


class RequestError(msgspec.Struct, omit_defaults=True):
    """A request the engine could not take or could not finish: it ends here, with this message. kind "invalid"
    (bad input, malformed frame), "overloaded" (the waiting queue is full: retry later) or "failed" (an error
    while preparing or sampling this request alone; the engine serves on)."""

    request_id: str
    message: str
    kind: str = "invalid"
    param: str | None = None  # the request field at fault, where one is


class EngineDead(msgspec.Struct):
    """Sent to every client when the engine core fails and is about to exit."""

    reason: str


class Heartbeat(msgspec.Struct):
    """Sent to every client twice a second from a thread of its own, so a long step cannot delay it."""

    loop_age: Seconds  # since the engine's loop last made progress (it stands still during a step)
    # What the loop last published (before the step it may be in): data-parallel front ends balance by them.
    num_waiting: Count = 0
    num_running: Count = 0
    num_yours: Count = 0  # of the requests the engine holds (compiling a grammar too), this client's


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    """One message from the engine core to one client: its requests' new tokens and any replies."""

    outputs: list[EngineCoreOutput] = []
    errors: list[RequestError] = []
    utility_result: UtilityResult | None = None
    engine_dead: EngineDead | None = None
    heartbeat: Heartbeat | None = None
    timestamp: float = 0.0

    @classmethod
    def of_step(cls, outputs: list[EngineCoreOutput], timestamp: float = 0.0) -> EngineCoreOutputs:
        """A step's outputs as a client receives them: a request that failed ends with its error."""
        failed = [o for o in outputs if o.finish_reason == FinishReason.ERROR]
        if not failed:
            return cls(outputs=outputs, timestamp=timestamp)
        errors = [RequestError(request_id=o.request_id, message=o.error or "failed", kind=o.error_kind,
                               param=o.error_param) for o in failed]
        return cls(outputs=[o for o in outputs if o.finish_reason != FinishReason.ERROR], errors=errors,
                   timestamp=timestamp)
