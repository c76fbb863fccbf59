"""Attention over the paged KV cache: write this step's K/V, then attend; plus the per-step metadata."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels import decode_attention, kv_quant, paged_attention, write_kv_cache
from workers.cpu_allocator import huge_page_zeros


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
    """Multi-head / grouped-query attention; `kv_cache` is bound by the model runner before use. With `shared_kv`
    keys and values are one tensor (MLA's latent cache): one cache entry per token and KV head, bound as both."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, shared_kv: bool = False, soft_cap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap  # scores capped at ±soft_cap by tanh (Gemma 2)
        self.kv_entries = 1 if shared_kv else 2
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # An fp8 cache's per-tensor scales (kernels.kv_quant): the checkpoint's where it has them (model_loader).
        self.k_scale, self.v_scale = 1.0, 1.0

    def kv_block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """One block's bytes of K and V stored as `dtype` (the cache's: one byte an element for fp8)."""
        self._check_cache_dtype(dtype)
        element_bytes = torch.empty((), dtype=dtype).element_size()
        return self.kv_entries * block_size * self.num_kv_heads * self.head_dim * element_bytes

    def bind_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
                      ) -> torch.Tensor:
        """Allocate this layer's cache, [kv_entries, num_blocks, kv_heads, block_size, head_dim], and bind it."""
        self._check_cache_dtype(dtype)
        # Zeroed: never-written slots are masked out, but garbage there could hold NaN, and 0 * NaN = NaN.
        shape = (self.kv_entries, num_blocks, self.num_kv_heads, block_size, self.head_dim)
        if device.type == "cpu":  # on huge pages (workers.cpu_allocator), written now so that no step page-faults
            cache = huge_page_zeros(shape, dtype).zero_()
        else:
            cache = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_cache = (cache[0], cache[-1])
        return cache

    def _check_cache_dtype(self, dtype: torch.dtype) -> None:
        if kv_quant.is_fp8(dtype) and self.kv_entries == 1:
            raise ValueError(kv_quant.MLA_REFUSAL)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                metadata: StepMetadata) -> torch.Tensor:
        """query: [tokens, heads, dim]; key/value: [tokens, kv_heads, dim] → [tokens, heads * dim]."""
        self.write_kv(key, value, metadata)
        return self.attend(query, metadata, key, value)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, metadata: StepMetadata) -> None:
        """This step's keys and values into their cache slots."""
        if self.kv_cache is None:
            raise RuntimeError("the KV cache was not bound to this attention layer")
        write_kv_cache(key, value, *self.kv_cache, metadata.slot_mapping, self.k_scale, self.v_scale)

    def attend(self, query: torch.Tensor, metadata: StepMetadata, key: torch.Tensor | None = None,
               value: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over the cache, this step's K/V already written → [tokens, heads * dim]. key/value: this
        step's, which a prefill without a cached prefix attends over directly."""
        key_cache, value_cache = self.kv_cache
        if isinstance(metadata, DecodeMetadata):
            out = decode_attention(query, key_cache, value_cache, metadata.block_tables, metadata.query_start_loc,
                                   metadata.seq_lens, self.scale, self.sliding_window, metadata.num_splits,
                                   self.soft_cap, self.k_scale, self.v_scale)
        else:
            out = paged_attention(query, key_cache, value_cache, metadata.block_tables, metadata.query_start_loc,
                                  metadata.seq_lens, metadata.num_decodes, self.scale, self.sliding_window, key,
                                  value, metadata.device_query_start_loc, metadata.device_seq_lens, self.soft_cap,
                                  self.k_scale, self.v_scale)
        return out.flatten(1)
