"""The rows of a step's input embedding that requests gave as prompt embeddings (ipc.PromptEmbeds), chunk by chunk."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workers.request_state import CachedRequestState


@dataclass
class StepEmbeds:
    """Token rows of the step and the embeddings that stand in for their embedded tokens."""

    rows: torch.Tensor
    values: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The embedded tokens `x` with the given rows in place of the placeholders'."""
        x[self.rows] = self.values
        return x


def step_embeds(states: Sequence[CachedRequestState], starts: np.ndarray, ends: np.ndarray, first_rows: np.ndarray,
                dtype: torch.dtype, device: torch.device) -> StepEmbeds | None:
    """Each request's prompt positions starts[i]..ends[i]-1 (its chunk, from row first_rows[i] of the step) that it
    gave as embeddings; None when no request of the step gave any."""
    rows, values = [], []
    for state, start, end, first in zip(states, starts, ends, first_rows):
        if state.prompt_embeds is None:
            continue
        stop = min(int(end), state.num_prompt_tokens)
        if start >= stop:
            continue
        rows.append(np.arange(first, first + stop - start))
        values.append(state.prompt_embeds[start:stop])
    if not rows:
        return None
    return StepEmbeds(torch.from_numpy(np.concatenate(rows)).to(device),
                      torch.cat(values).to(device=device, dtype=dtype))
