"""What the proposers with a model of their own share: its KV cache over the target's block ids (ProposerCaches), and
a forward pass over each request's tokens from a start position that writes it at the target's slots (FeedBatch)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workers.layers.attention import Attention, AttentionMetadata
from workers.layers.sampler import Sampler
from workers.request_state import CachedRequestState
from workers.step_sampling import sampling_metadata


class ProposerCaches:
    """K and V per attention layer of `model` over the same block ids as the target's cache; the scheduler allocates
    the slots a proposer writes ahead (SpeculativeConfig.num_lookahead_slots)."""

    model: torch.nn.Module
    block_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def block_bytes(self) -> int:
        return sum(layer.kv_block_bytes(self.block_size, self.dtype) for layer in self.attention_layers)

    def bind_kv_cache(self, num_blocks: int | None) -> None:
        """Its caches for num_blocks blocks (None: release them)."""
        for layer in self.attention_layers:
            if num_blocks is None:
                layer.kv_cache = None
            else:
                layer.bind_kv_cache(num_blocks, self.block_size, self.dtype, self.device)


@dataclass
class FeedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    order: list[int]  # the feed each run of rows belongs to: single tokens first, as attention wants them
    last_rows: torch.Tensor  # each feed's last row, in the feeds' order

    @classmethod
    def of(cls, states: list[CachedRequestState], feeds: list[tuple[int, list[int]]], block_size: int,
           device: torch.device) -> FeedBatch:
        """feeds[i]: (start position, tokens) of states[i]'s request."""
        order = sorted(range(len(feeds)), key=lambda i: len(feeds[i][1]) != 1)
        lengths = np.array([len(feeds[i][1]) for i in order], dtype=np.int64)
        starts = np.array([feeds[i][0] for i in order], dtype=np.int64)
        query_start_loc = np.concatenate(([0], np.cumsum(lengths)))
        positions = np.concatenate([np.arange(start, start + n) for start, n in zip(starts, lengths)])
        table = np.zeros((len(order), max(len(states[i].block_ids) for i in order)), dtype=np.int64)
        for row, i in enumerate(order):
            table[row, :len(states[i].block_ids)] = states[i].block_ids
        rows = np.repeat(np.arange(len(order)), lengths)
        slots = table[rows, positions // block_size] * block_size + positions % block_size
        seq_lens = starts + lengths
        metadata = AttentionMetadata(
            slot_mapping=_tensor(slots, device), block_tables=_tensor(table, device),
            query_start_loc=query_start_loc.tolist(), seq_lens=seq_lens.tolist(),
            num_decodes=int((lengths == 1).sum()))
        if device.type == "cuda":
            metadata.device_query_start_loc = _tensor(query_start_loc, device).int()
            metadata.device_seq_lens = _tensor(seq_lens, device).int()
        return cls(_tensor(np.concatenate([feeds[i][1] for i in order]), device), _tensor(positions, device),
                   metadata, order, _tensor((query_start_loc[1:] - 1)[np.argsort(order)], device))


def append_drafts(sampler: Sampler, logits: torch.Tensor, states: list[CachedRequestState],
                  new_tokens: list[list[int]], active: list[int], drafts: list[list[int]],
                  probs: list[list[torch.Tensor]]) -> list[int]:
    """Each active request's next draft from its row of `logits`, processed as the target's will be (its tokens so far:
    its state's, new_tokens and its drafts), appended to drafts[i]; a sampled request's distribution to probs[i].
    Returns the drafts drawn, in `active`'s order."""
    rows = [(states[i], new_tokens[i] + drafts[i]) for i in active]
    tokens, distributions = sampler.draft(logits, sampling_metadata(rows, logits.device))
    drawn = tokens.tolist()
    for row, (i, token) in enumerate(zip(active, drawn)):
        drafts[i].append(token)
        if distributions is not None and not states[i].sampling_params.is_greedy:
            probs[i].append(distributions[row])
    return drawn


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(array, dtype=np.int64), device=device)
