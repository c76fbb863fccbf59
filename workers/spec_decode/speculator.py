"""Speculator: after a step's sampling, drafts for the requests that may speculate in the next one."""
from __future__ import annotations

import numpy as np

from ipc import SpeculativeConfig
from workers.request_state import CachedRequestState
from workers.spec_decode.ngram import ngram_draft


class Speculator:
    """Drafts for every request just sampled, unless the batch is past disable_by_batch_size; none for a request
    under a structured-output constraint (its grammar would have to follow each draft)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, requests: dict[str, CachedRequestState], sampled: dict[str, list[int]]
                ) -> dict[str, list[int]]:
        config = self.config
        if config.disable_by_batch_size is not None and len(sampled) > config.disable_by_batch_size:
            return {}
        drafts = {}
        for req_id, new_tokens in sampled.items():
            state = requests[req_id]
            if state.sampling_params.structured_outputs is not None:
                continue
            tokens = np.array(state.token_ids + new_tokens, dtype=np.int64)
            draft = ngram_draft(tokens, config.num_speculative_tokens, config.prompt_lookup_min,
                                config.prompt_lookup_max)
            if draft:
                drafts[req_id] = draft
        return drafts


def make_speculator(config: SpeculativeConfig | None) -> Speculator | None:
    return None if config is None else Speculator(config)
