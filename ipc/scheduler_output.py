"""SchedulerOutput (the per-step diff the scheduler sends every worker) and ModelRunnerOutput (the reply)."""
from __future__ import annotations

from typing import Any

import msgspec

from ipc.bounds import Count, TokenId
from ipc.kv_transfer import KVTransferCall
from ipc.lora import LoRARequest
from ipc.multimodal import ImageInput
from ipc.pooling import PoolingParams
from ipc.prompt_embeds import PromptEmbeds
from ipc.sampling_params import SamplingParams
from ipc.structured_outputs import GrammarBitmask


class NewRequestData(msgspec.Struct, kw_only=True):
    """A request a worker has not seen before: everything it must keep for it."""

    req_id: str
    prompt_token_ids: list[TokenId]
    sampling_params: SamplingParams
    eos_token_id: TokenId | None
    block_ids: list[Count]
    num_computed_tokens: Count
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None
    token_type_ids: list[Count] | None = None
    prompt_embeds: PromptEmbeds | None = None  # the prompt's rows of the input embedding, given
    mm_inputs: list[ImageInput] | None = None  # its images and their placeholders, in prompt order


class CachedRequestData(msgspec.Struct, kw_only=True):
    """A request the worker already holds: what changed since its last step."""

    req_id: str
    # Tokens sampled since this request was last scheduled (all ranks learn them from the scheduler).
    new_token_ids: list[TokenId]
    new_block_ids: list[Count]
    num_computed_tokens: Count
    # After preemption the request restarts from token 0 in fresh blocks: new_block_ids replace the old.
    resumed_from_preemption: bool = False


class SchedulerOutput(msgspec.Struct, kw_only=True):
    """One step: which requests compute how many tokens, and the block-table changes."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, Count]
    total_num_scheduled_tokens: Count
    finished_req_ids: list[str]
    grammar_bitmask: GrammarBitmask | None = None  # the allowed tokens of constrained requests sampled this step
    # Draft tokens to verify, by request: they follow its last token in this step's input (counted in
    # num_scheduled_tokens), and its output is the accepted ones plus one more.
    scheduled_spec_decode_tokens: dict[str, list[TokenId]] = {}
    # A decode-only step after which the scheduler expects to decode the same requests again (or those of them that
    # do not finish): nothing waiting could join, and none reaches its length limit with this step's token. The
    # worker may then start the next step's forward pass before this one's tokens reach the engine.
    decode_ahead: bool = False
    # Decode steps to run in this call (core/multi_step.py): after this step, num_steps - 1 more for the same requests,
    # each fed the token sampled in the one before; every scheduled token is a request's only one, and its slots for the
    # tokens in between are allocated. The output holds num_steps tokens per request (fewer where all of the requests
    # stopped early).
    num_steps: Count = 1
    # The prefix cache's host tier (core/kv_offload.py), applied before this step's forward pass, stores first:
    # (device block, host slot) for the hashed blocks this step's allocations evicted, then (host slot, device block)
    # for the fresh blocks its prefix hits in the tier fill.
    kv_stores: list[tuple[Count, Count]] = []
    kv_loads: list[tuple[Count, Count]] = []
    # Disaggregated prefill on Ray ranks: a step of no tokens that carries one call of the ranks' connector half.
    kv_transfer_call: KVTransferCall | None = None


class PromptLogprobs(msgspec.Struct):
    """Per prompt position from the second on: [prompt token, top-k ...] ids, their logprobs, the prompt token's
    rank. A prompt computed in chunks gets one of these per chunk, concatenated in order."""

    token_ids: list[list[TokenId]]
    logprobs: list[list[float]]
    ranks: list[Count]

    def extend(self, other: PromptLogprobs) -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.ranks += other.ranks


class ModelRunnerOutput(msgspec.Struct, kw_only=True):
    """Sampled tokens for the requests whose scheduled tokens reached their end: one each, or, for a request that
    verified drafts, the accepted drafts and one more."""

    sampled_token_ids: dict[str, list[TokenId]]
    # Only for requests that asked for logprobs, per sampled token: [sampled, top-N ...] ids and logprobs, and the
    # sampled token's rank.
    logprob_token_ids: dict[str, list[list[TokenId]]] = {}
    logprobs: dict[str, list[list[float]]] = {}
    sampled_ranks: dict[str, list[Count]] = {}
    # Drafts proposed for each request's next step (speculative decoding), and each verification this step ran
    # for it: (drafts, accepted).
    draft_token_ids: dict[str, list[TokenId]] = {}
    verified: dict[str, list[tuple[Count, Count]]] = {}
    prompt_logprobs: dict[str, PromptLogprobs] = {}  # this step's chunk, for requests that asked
    # Requests this step could not prepare or sample (why, by request id): they end with an error; the rest of
    # the batch is unaffected.
    failed: dict[str, str] = {}
    # Pooling requests whose prompt this step completed: their pooled vector (float32 little-endian).
    pooled: dict[str, bytes] = {}
    kv_transfer_result: Any = None  # the answer to SchedulerOutput.kv_transfer_call
