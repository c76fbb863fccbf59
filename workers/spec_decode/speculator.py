"""Speculator: after a step's sampling, drafts for the requests that may speculate in the next one."""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from ipc import SpeculativeConfig
from kernels.cpu_greedy_decode import DraftModelDrafts, PromptLookupDrafts
from kernels.cpu_mtp import MtpDrafts
from workers.layers.sampler import Sampler
from workers.request_state import CachedRequestState
from workers.model_inputs import StepRows
from workers.spec_decode.draft_model import DraftModel
from workers.spec_decode.mtp import MtpProposer
from workers.spec_decode.ngram import ngram_draft

KernelDrafts = PromptLookupDrafts | DraftModelDrafts | MtpDrafts


class Proposer(Protocol):
    def propose(self, states: list[CachedRequestState], new_tokens: list[list[int]]) -> list[list[int]]:
        """Drafts after each request's tokens: its state's, then the ones just sampled."""

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        """The distributions its last drafts were drawn from; None: one-hot guesses."""

    def forget(self, req_id: str) -> None:
        """The request finished or lost its blocks."""

    def kernel_drafts(self, states: list[CachedRequestState], contexts: list[list[int]], capacity: np.ndarray
                      ) -> KernelDrafts | None:
        """What the target's greedy_decode() needs to draft for these requests itself, as propose() would
        (`contexts`: all their tokens so far; `capacity`: the positions their blocks give); None: it cannot."""

    def resume(self, states: list[CachedRequestState], drafts: KernelDrafts, lengths: np.ndarray) -> None:
        """greedy_decode() drafted for `states` with `drafts`; they are `lengths` tokens long now."""

    reads_hidden_states: bool  # observe() takes each step's final hidden states (a proposer of the target's layers)
    # A proposer that reads them also has kernel_observer(states, contexts, capacity): kernel_drafts() for steps that
    # verify no drafts, which greedy_decode() still feeds it.


class PromptLookup:
    reads_hidden_states = False

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, states: list[CachedRequestState], new_tokens: list[list[int]]) -> list[list[int]]:
        config = self.config
        return [ngram_draft(state.token_ids + tokens, config.num_speculative_tokens,
                            config.prompt_lookup_min, config.prompt_lookup_max)
                for state, tokens in zip(states, new_tokens)]

    def draft_probs(self, req_id: str) -> None:
        return None

    def forget(self, req_id: str) -> None:
        pass

    def kernel_drafts(self, states: list[CachedRequestState], contexts: list[list[int]], capacity: np.ndarray
                      ) -> PromptLookupDrafts:
        config = self.config
        return PromptLookupDrafts(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max,
                                  contexts)

    def resume(self, states: list[CachedRequestState], drafts: KernelDrafts, lengths: np.ndarray) -> None:
        pass


class Speculator:
    """Drafts for every request just sampled, unless the batch is past disable_by_batch_size; none for a request
    under a structured-output constraint (its grammar would have to follow each draft)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config, self.proposer = config, proposer

    def propose(self, requests: dict[str, CachedRequestState], sampled: dict[str, list[int]],
                only: list[str] | None = None) -> dict[str, list[int]]:
        """Drafts after each sampled request's tokens (its state's, then `sampled`'s), for those in `only` if given
        (the batch, whose size turns speculation off, is still all of `sampled`)."""
        if not self.speculates(len(sampled)):
            return {}
        req_ids = [req_id for req_id in (sampled if only is None else only)
                   if requests[req_id].sampling_params.structured_outputs is None]
        drafts = self.proposer.propose([requests[r] for r in req_ids], [sampled[r] for r in req_ids])
        return {req_id: draft for req_id, draft in zip(req_ids, drafts) if draft}

    def speculates(self, batch_size: int) -> bool:
        """Whether a step of `batch_size` requests verifies drafts (disable_by_batch_size)."""
        limit = self.config.disable_by_batch_size
        return limit is None or batch_size <= limit

    def kernel_drafts(self, states: list[CachedRequestState], contexts: list[list[int]], capacity: np.ndarray,
                      drafting: bool = True) -> KernelDrafts | None:
        """What the greedy_decode() kernel needs to draft for these requests itself (all their tokens so far in
        `contexts`, the positions their blocks give in `capacity`): prompt lookup, or the draft model's (or the MTP
        layer's) weights and caches; None where it cannot. resume() after. drafting False (a batch past the
        cut-off): what a proposer that reads hidden states needs to take the steps' all the same."""
        if drafting:
            return self.proposer.kernel_drafts(states, contexts, capacity)
        return self.proposer.kernel_observer(states, contexts, capacity)

    def resume(self, states: list[CachedRequestState], drafts: KernelDrafts, lengths: np.ndarray) -> None:
        self.proposer.resume(states, drafts, lengths)

    @property
    def reads_hidden_states(self) -> bool:
        return self.proposer.reads_hidden_states

    def observe(self, hidden: torch.Tensor, rows: StepRows, requests: dict[str, CachedRequestState],
                sampled: dict[str, list[int]]) -> None:
        """A step's final hidden states (`rows` says whose), and its sampled tokens, for a proposer that reads them."""
        self.proposer.observe(hidden, rows, requests, sampled)

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        return self.proposer.draft_probs(req_id)

    def forget(self, req_id: str) -> None:
        self.proposer.forget(req_id)


def make_speculator(config: SpeculativeConfig | None, target: str, dtype: torch.dtype, device: torch.device,
                    block_size: int, max_model_len: int, sampler: Sampler) -> Speculator | None:
    """The speculator the driver rank runs for the model folder `target` (None without speculative decoding)."""
    if config is None:
        return None
    if config.method == "draft_model":
        return Speculator(config, DraftModel(config, dtype, device, block_size, max_model_len, sampler))
    if config.method == "mtp":
        return Speculator(config, MtpProposer(config, target, dtype, device, block_size, max_model_len, sampler))
    return Speculator(config, PromptLookup(config))
