"""Write new keys and values into the paged KV cache at their slots (Triton twin of kv_cache_ref)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
                     num_kv_heads, head_dim, block_size,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_ch, stride_cs,
                     HEADS_PADDED: tl.constexpr, DIM_PADDED: tl.constexpr):
    """One program per token: all its heads, at cache slot slot_mapping[token]."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padded token
        return
    heads = tl.arange(0, HEADS_PADDED)[:, None]
    dims = tl.arange(0, DIM_PADDED)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    cache_offsets = (slot // block_size) * stride_cb + heads * stride_ch + (slot % block_size) * stride_cs + dims
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(key_cache_ptr + cache_offsets, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Same contract as kv_cache_ref.write_kv_cache; the last dims of key, value and caches are contiguous."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if not num_tokens:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, num_kv_heads, head_dim, key_cache.shape[2],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads), DIM_PADDED=triton.next_power_of_2(head_dim))
