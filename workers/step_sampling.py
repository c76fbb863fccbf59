"""A step's sampling on the driver rank: each sampled request's logits rows (one, or one per draft token plus one
when it verifies drafts) → its new tokens and logprobs; a request whose sampling fails fails alone."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ipc import GrammarBitmask, ModelRunnerOutput
from kernels.cpu_row_options import PenalizedRows
from workers.layers.sampler import GrammarRows, Penalties, Sampler, SamplerOutput, SamplingMetadata
from workers.request_state import CachedRequestState

logger = logging.getLogger("pagedserve.step_sampling")


@dataclass(frozen=True)
class SampleGroup:
    """One request's consecutive logits rows: row i verifies drafts[i]; the last row gives the token after them.
    draft_probs: [len(drafts), vocab], the distributions a draft model drew them from (None: one-hot guesses).
    earlier: its tokens after state.token_ids that the rows follow (a multi-step call's tokens so far)."""

    state: CachedRequestState
    drafts: list[int]
    draft_probs: torch.Tensor | None = None
    earlier: list[int] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return len(self.drafts) + 1


class StepSampler:
    def __init__(self, sampler: Sampler, device: torch.device) -> None:
        self.sampler, self.device = sampler, device

    def sample(self, logits: torch.Tensor, groups: list[SampleGroup], bitmask: GrammarBitmask | None,
               before_sync: Callable[[torch.Tensor], torch.Tensor] | None = None) -> ModelRunnerOutput:
        """Sample the batch; if that fails, sample each request alone, so that only the one at fault fails (the
        sampler leaves its inputs untouched when it raises). before_sync: see Sampler.__call__ (batch only)."""
        try:
            return self._sample_batch(logits, groups, bitmask, before_sync)
        except Exception:
            logger.exception("sampling %d requests together failed; sampling each alone", len(groups))
        outputs, first = [], 0
        for group in groups:
            failed: dict[str, str] = {}
            with fails_alone(group.state.req_id, failed):
                outputs.append(self._sample_batch(logits[first:first + group.num_rows], [group], bitmask))
            outputs.append(ModelRunnerOutput(sampled_token_ids={}, failed=failed))
            first += group.num_rows
        return _merged(outputs)

    def _sample_batch(self, logits: torch.Tensor, groups: list[SampleGroup], bitmask: GrammarBitmask | None,
                      before_sync: Callable[[torch.Tensor], torch.Tensor] | None = None) -> ModelRunnerOutput:
        meta = self._sampling_metadata(groups)
        if bitmask is not None:  # a constrained request verifies no drafts: it has one row
            meta.grammar = _grammar_rows(bitmask, [g.state.req_id for g in groups for _ in range(g.num_rows)],
                                         self.device)
        return _grouped_output(self.sampler(logits, meta, before_sync), groups)

    def _sampling_metadata(self, groups: list[SampleGroup]) -> SamplingMetadata:
        """One row per logits row; a row verifying draft i sees drafts 0..i-1 as already sampled (min_tokens, bad
        words, penalties), so its distribution is the one sampling without speculation would use there."""
        meta = sampling_metadata([(g.state, g.earlier + g.drafts[:i]) for g in groups for i in range(g.num_rows)],
                                 self.device)
        drafts = [draft for g in groups for draft in (*g.drafts, -1)]
        if len(drafts) > len(groups):
            meta.draft_token_ids = _to_device(drafts, self.device)
        vocab = next((g.draft_probs.shape[1] for g in groups if g.draft_probs is not None), None)
        if vocab is not None:
            meta.draft_probs = torch.cat([_draft_rows(g, vocab, self.device) for g in groups])
        return meta


def _draft_rows(group: SampleGroup, vocab: int, device: torch.device) -> torch.Tensor:
    """The group's draft distributions, and zeros for the row after them (all zeros for a greedy request)."""
    if group.draft_probs is None:
        return torch.zeros(group.num_rows, vocab, device=device)
    return torch.cat([group.draft_probs[:len(group.drafts)], torch.zeros(1, vocab, device=device)])


def sampling_metadata(rows: list[tuple[CachedRequestState, list[int]]], device: torch.device) -> SamplingMetadata:
    """One row per (request, tokens taken as sampled after its own): its options, bans and penalties there."""
    params = [state.sampling_params for state, _ in rows]
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    return SamplingMetadata(
        temperature=_to_device([0.0 if p.is_greedy else p.temperature for p in params], device),
        top_k=_to_device(top_k, device) if any(k > 0 for k in top_k) else None,
        top_p=_to_device(top_p, device) if any(p < 1.0 for p in top_p) else None,
        min_p=_to_device(min_p, device) if any(p > 0.0 for p in min_p) else None,
        every_row_greedy=all(p.is_greedy for p in params), any_row_greedy=any(p.is_greedy for p in params),
        generators={row: state.generator for row, (state, _) in enumerate(rows) if state.generator is not None},
        banned_token_ids={row: ids for row, (state, before) in enumerate(rows)
                          if (ids := state.banned_token_ids(before))},
        num_logprobs={row: p.logprobs for row, p in enumerate(params) if p.logprobs is not None},
        penalties=_penalties(rows, device),
        logit_bias={row: p.logit_bias for row, p in enumerate(params) if p.logit_bias} or None)


def _to_device(values: list, device: torch.device) -> torch.Tensor:
    """A tensor of `values` on `device`, its copy queued behind the step's work: torch.tensor(values, device=...)
    would first wait for the GPU to finish everything queued (the forward pass), which keeps the host from
    launching the next step's forward pass ahead (workers/decode_ahead.py)."""
    return torch.tensor(values).to(device, non_blocking=True)


def _grouped_output(out: SamplerOutput, groups: list[SampleGroup]) -> ModelRunnerOutput:
    """Per request: its accepted drafts (those before the first rejected one) and the token of the row after them."""
    output = ModelRunnerOutput(sampled_token_ids={})
    first = 0
    for group in groups:
        num_accepted = 0
        if out.accepted is not None:
            while num_accepted < len(group.drafts) and out.accepted[first + num_accepted]:
                num_accepted += 1
        rows = range(first, first + num_accepted + 1)
        req_id = group.state.req_id
        output.sampled_token_ids[req_id] = [out.token_ids[row] for row in rows]
        if first in out.logprobs:
            entries = [out.logprobs[row] for row in rows]
            output.logprob_token_ids[req_id] = [ids for ids, _, _ in entries]
            output.logprobs[req_id] = [values for _, values, _ in entries]
            output.sampled_ranks[req_id] = [rank for _, _, rank in entries]
        first += group.num_rows
    return output


def _grammar_rows(bitmask: GrammarBitmask, req_ids: list[str], device: torch.device) -> GrammarRows | None:
    """The bitmask rows of the requests in this batch, by their row in it."""
    index = {req_id: i for i, req_id in enumerate(bitmask.req_ids)}
    rows = [row for row, req_id in enumerate(req_ids) if req_id in index]
    if not rows:
        return None
    packed = torch.frombuffer(bytearray(bitmask.packed), dtype=torch.int32).view(-1, bitmask.words_per_row)
    return GrammarRows(rows, packed[[index[req_ids[row]] for row in rows]].to(device))


def penalized_rows(states: list[CachedRequestState], earlier: list[list[int]]) -> PenalizedRows:
    """The requests' logit bias, penalties and bad words as a multi-step call's C++ steps apply them, over the same
    tokens as _penalties() and banned_token_ids(): each one's tokens and the call's `earlier` ones (the kernel counts
    those it takes after)."""
    params = [state.sampling_params for state in states]
    contexts = [(state, [*state.token_ids, *before]) for state, before in zip(states, earlier)]
    return PenalizedRows([p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                         [p.repetition_penalty for p in params], [p.logit_bias or {} for p in params],
                         [tokens[state.num_prompt_tokens:] for state, tokens in contexts],
                         [tokens[state.first_seen_token:state.num_prompt_tokens] for state, tokens in contexts],
                         [p.bad_words_token_ids or [] for p in params])


def _penalties(rows: list[tuple[CachedRequestState, list[int]]], device: torch.device) -> Penalties | None:
    penalized = [row for row, (state, _) in enumerate(rows) if state.sampling_params.has_penalties]
    if not penalized:
        return None
    params = [rows[row][0].sampling_params for row in penalized]
    contexts = [(state, [*state.token_ids, *before] if before else state.token_ids)
                for state, before in (rows[row] for row in penalized)]
    return Penalties(rows=penalized, presence=_to_device([p.presence_penalty for p in params], device),
                     frequency=_to_device([p.frequency_penalty for p in params], device),
                     repetition=_to_device([p.repetition_penalty for p in params], device),
                     output_token_ids=[tokens[state.num_prompt_tokens:] for state, tokens in contexts],
                     seen_token_ids=[tokens[state.first_seen_token:] if state.first_seen_token else tokens
                                     for state, tokens in contexts])


@contextlib.contextmanager
def fails_alone(req_id: str, failed: dict[str, str]) -> Iterator[None]:
    """Record an exception in the block as this request's failure instead of letting it end the step."""
    try:
        yield
    except Exception as error:
        logger.exception("request %s failed", req_id)
        failed[req_id] = f"{type(error).__name__}: {error}"


def _merged(outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    merged = ModelRunnerOutput(sampled_token_ids={})
    for output in outputs:
        for name in ("sampled_token_ids", "logprob_token_ids", "logprobs", "sampled_ranks", "failed"):
            getattr(merged, name).update(getattr(output, name))
    return merged
