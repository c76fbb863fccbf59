"""What one forward pass of the model runner takes: its tokens, positions and attention metadata, the rows it samples
and the prompt-logprob and pooling work on its hidden states."""
from __future__ import annotations

from dataclasses import dataclass, field

import itertools

import numpy as np
import torch

from ipc import PromptLogprobs
from workers.layers.attention import StepMetadata
from workers.layers.logprobs import gather_logprobs
from workers.prompt_embeds import StepEmbeds
from workers.request_state import CachedRequestState
from workers.step_sampling import SampleGroup


# Each request's rows of a step: (request id, its first row, that row's position, its number of rows).
StepRows = list[tuple[str, int, int, int]]


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: StepMetadata
    # Rows to sample: the last token of each request whose scheduled tokens reach its end, and the drafts before it
    logits_indices: torch.Tensor
    sample_groups: list[SampleGroup]
    prompt_logprob_jobs: list[PromptLogprobJob]
    lora_row_slots: list[int] | None = None  # the adapter slot of each row of logits_indices (workers.lora)
    pooling_jobs: list[PoolingJob] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # the step's final hidden states where a forward pass ahead computed them
    prompt_embeds: StepEmbeds | None = None  # rows given as embeddings (first pipeline stage only)
    rows: StepRows | None = None  # where a proposer reads the step's hidden states (MTP)


@dataclass
class PoolingJob:
    """A pooling request's rows in this step: `count` rows from `first_row`, its prompt positions from `start`."""

    state: CachedRequestState
    first_row: int
    count: int
    start: int
    is_last: bool


@dataclass
class PromptLogprobJob:
    """The rows of one request's prompt chunk whose next token is a prompt token (whose logprob is wanted)."""

    req_id: str
    rows: np.ndarray
    next_token_ids: list[int]
    num_top: int
    lora_slot: int = -1


def sampled_rows(ends: np.ndarray, drafts: list[list[int]]) -> np.ndarray:
    """The token rows to sample: each request's last one, or, verifying k drafts, its last k + 1."""
    if not any(drafts):
        return ends - 1
    num_rows = np.array([len(d) + 1 for d in drafts], dtype=np.int64)
    first_of_group = np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
    return np.repeat(ends - num_rows, num_rows) + np.arange(num_rows.sum()) - first_of_group


def rows_of(groups: list[SampleGroup], failed: dict[str, str]) -> list[int]:
    """The logits rows of the groups whose request did not fail."""
    starts = itertools.accumulate((group.num_rows for group in groups), initial=0)
    return [row for group, start in zip(groups, starts) if group.state.req_id not in failed
            for row in range(start, start + group.num_rows)]


def prompt_logprobs_of(logits: torch.Tensor, job: PromptLogprobJob) -> PromptLogprobs:
    logprobs = torch.log_softmax(logits, dim=-1)
    next_token_ids = torch.tensor(job.next_token_ids, device=logits.device)
    return PromptLogprobs(*gather_logprobs(logprobs, next_token_ids, job.num_top))


def prompt_logprob_job(state: CachedRequestState, start: int, end: int, first_row: int, lora_slot: int
                        ) -> PromptLogprobJob | None:
    """Positions start..end-1 of this step; each one before the prompt's last predicts a prompt token. Once a
    token was sampled they were all reported (a preempted request recomputes its prompt without them)."""
    num_top = state.sampling_params.prompt_logprobs
    last = min(end, state.num_prompt_tokens - 1)
    if num_top is None or state.num_output_tokens or last <= start:
        return None
    return PromptLogprobJob(state.req_id, np.arange(first_row, first_row + last - start),
                            state.token_ids[start + 1:last + 1], num_top, lora_slot)
