"""What a worker keeps about each request across steps (the scheduler sends only diffs)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ipc import LoRARequest, NewRequestData, PoolingParams, SamplingParams, SchedulerOutput
from ipc.multimodal import ImageInput
from ipc.sampling_params import stop_tokens


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + every sampled token the scheduler has reported back
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = field(default=None, repr=False)
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None  # a pooling request: its prompt is pooled, never sampled from
    prompt_embeds: torch.Tensor | None = None  # its prompt's rows of the input embedding, given in place of its ids
    mm_inputs: list[ImageInput] | None = None  # its images, whose features replace their placeholders' embeddings

    @classmethod
    def from_new(cls, data: NewRequestData) -> CachedRequestState:
        params = data.sampling_params
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        return cls(data.req_id, list(data.prompt_token_ids), len(data.prompt_token_ids), params,
                   data.eos_token_id, list(data.block_ids), data.num_computed_tokens, generator, data.lora_request,
                   data.pooling_params, None if data.prompt_embeds is None else data.prompt_embeds.tensor(),
                   data.mm_inputs)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def first_seen_token(self) -> int:
        """Where the tokens that penalties and bad words read begin: after an embeddings prompt's placeholder ids,
        which are not its content."""
        return 0 if self.prompt_embeds is None else self.num_prompt_tokens

    def stop_token_ids(self) -> set[int]:
        """The tokens that end it once min_tokens outputs exist (ipc.sampling_params.stop_tokens)."""
        return stop_tokens(self.sampling_params, self.eos_token_id)

    def banned_token_ids(self, after: list[int] = ()) -> list[int]:
        """Stop tokens until min_tokens outputs exist, and the last token of any bad word that the tokens so far
        would complete (a one-token bad word always; transformers' NoBadWordsLogitsProcessor rule). `after`: tokens
        taken as sampled after its own (a multi-step call's so far, the drafts before the one a row verifies)."""
        params = self.sampling_params
        banned = []
        num_output_tokens = self.num_output_tokens + len(after)
        if num_output_tokens < params.min_tokens and params.structured_outputs is None:  # the grammar ends it
            banned += sorted(self.stop_token_ids())
        for word in params.bad_words_token_ids or ():
            prefix = word[:-1]
            tail = self.token_ids[max(self.first_seen_token, len(self.token_ids) - len(prefix)):]
            if not prefix or [*tail, *after][-len(prefix):] == prefix:
                banned.append(word[-1])
        return banned


def update_states(requests: dict[str, CachedRequestState], so: SchedulerOutput) -> tuple[list[str], list[str]]:
    """A step's diffs applied: finished requests dropped, new ones added, cached ones given their new tokens and
    blocks. Returns (finished, resumed from preemption): requests whose state kept elsewhere is stale."""
    for req_id in so.finished_req_ids:
        requests.pop(req_id, None)
    for new in so.scheduled_new_reqs:
        requests[new.req_id] = CachedRequestState.from_new(new)
    resumed = []
    for cached in so.scheduled_cached_reqs:
        state = requests[cached.req_id]
        state.token_ids.extend(cached.new_token_ids)
        if cached.resumed_from_preemption:
            state.block_ids = list(cached.new_block_ids)
            resumed.append(cached.req_id)
        else:
            state.block_ids.extend(cached.new_block_ids)
        state.num_computed_tokens = cached.num_computed_tokens
    return list(so.finished_req_ids), resumed
