"""Attention over the paged KV cache: write this step's K/V, then attend; plus the per-step metadata."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels import decode_attention, paged_attention, write_kv_cache


@dataclass
class AttentionMetadata:
    """Where each token of the flat batch goes and what it sees; decode sequences come first."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    query_start_loc: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # [num_seqs] context length after this step
    num_decodes: int  # sequences with a single new token, placed first
    # On CUDA: the two lists as int32 device tensors, copied once per step for every layer's kernels.
    device_query_start_loc: torch.Tensor | None = None
    device_seq_lens: torch.Tensor | None = None


@dataclass
class DecodeMetadata:
    """A decode-only batch as a CUDA graph captures it: shapes fixed by the batch size, every value a device
    tensor that the next replay reads anew, nothing on the host. Padding rows have slot -1 (no KV write) and
    seq_len 1 over block 0 (a valid read whose output is never used)."""

    slot_mapping: torch.Tensor  # [batch]
    block_tables: torch.Tensor  # [batch, ceil(max_model_len / block_size)]
    query_start_loc: torch.Tensor  # [batch + 1] int32: 0, 1, ..., batch
    seq_lens: torch.Tensor  # [batch] int32
    num_splits: int  # split-K slices, fixed for the captured size


StepMetadata = AttentionMetadata | DecodeMetadata


class Attention(nn.Module):
    """Multi-head / grouped-query attention; `kv_cache` is bound by the model runner before use."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                metadata: StepMetadata) -> torch.Tensor:
        """query: [tokens, heads, dim]; key/value: [tokens, kv_heads, dim] → [tokens, heads * dim]."""
        if self.kv_cache is None:
            raise RuntimeError("the KV cache was not bound to this attention layer")
        key_cache, value_cache = self.kv_cache
        write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        if isinstance(metadata, DecodeMetadata):
            out = decode_attention(query, key_cache, value_cache, metadata.block_tables, metadata.query_start_loc,
                                   metadata.seq_lens, self.scale, self.sliding_window, metadata.num_splits)
        else:
            out = paged_attention(query, key_cache, value_cache, metadata.block_tables, metadata.query_start_loc,
                                  metadata.seq_lens, metadata.num_decodes, self.scale, self.sliding_window, key,
                                  value, metadata.device_query_start_loc, metadata.device_seq_lens)
        return out.flatten(1)
