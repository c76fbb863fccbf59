"""The rows of a step's input embedding given in place of embedded tokens: prompt embeddings (ipc.PromptEmbeds) and
images' features (ipc.ImageInput, through the encoder cache), chunk by chunk."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workers.encoder_cache import EncoderCache
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
                dtype: torch.dtype, device: torch.device, encoder_cache: EncoderCache | None = None
                ) -> StepEmbeds | None:
    """Each request's prompt positions starts[i]..ends[i]-1 (its chunk, from row first_rows[i] of the step) that it
    gave as embeddings or that are an image's placeholders (with an encoder cache: on the stage that embeds); None when
    the step has none. An image whose placeholders the chunk covers in part is encoded whole (once: the cache keeps
    its features for the chunks after)."""
    rows, values, image_parts = [], [], []
    for state, start, end, first in zip(states, starts, ends, first_rows):
        stop = min(int(end), state.num_prompt_tokens)
        if start >= stop:
            continue
        if state.prompt_embeds is not None:
            rows.append(np.arange(first, first + stop - start))
            values.append(state.prompt_embeds[start:stop])
        for image in (state.mm_inputs or ()) if encoder_cache is not None else ():
            low, high = max(int(start), image.offset), min(stop, image.end)
            if low < high:
                image_parts.append((image, low - image.offset, high - image.offset, first + low - start))
    if image_parts:
        features = encoder_cache.features([image for image, *_ in image_parts])
        for image, low, high, row in image_parts:
            rows.append(np.arange(row, row + high - low))
            values.append(features[image.hash][low:high])
    if not rows:
        return None
    return StepEmbeds(torch.from_numpy(np.concatenate(rows)).to(device),
                      torch.cat([value.to(device=device, dtype=dtype) for value in values]))
