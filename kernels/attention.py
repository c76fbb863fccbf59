"""Paged attention as the layers call it: Triton kernels on CUDA; on CPU the fused decode kernel once it has
built, else the torch reference."""
from __future__ import annotations

import torch

from kernels import attention_ref, cpu_decode_attention, cpu_extension
from kernels.backend import triton_serves, use_triton


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    num_decodes: int,
    scale: float,
    sliding_window: int | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    device_query_start_loc: torch.Tensor | None = None,
    device_seq_lens: torch.Tensor | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Same contract as attention_ref.paged_attention, which it equals (tests/test_cpu_decode_attention.py,
    tests/test_triton_kernels.py). device_query_start_loc / device_seq_lens: the two lists as int32 tensors on
    the query's device, when the caller copied them once for every layer (the Triton kernels read those)."""
    if use_triton(query):
        num_sms = torch.cuda.get_device_properties(query.device).multi_processor_count
        return triton_paged_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                                      num_decodes, scale, sliding_window, num_sms, device_query_start_loc,
                                      device_seq_lens, soft_cap, k_scale, v_scale)
    # ready(), not load(): while the kernel builds in the background the torch path serves
    fused = num_decodes and query.device.type == "cpu" and cpu_extension.ready() is not None
    if not fused:
        return attention_ref.paged_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                                             num_decodes, scale, sliding_window, key, value, soft_cap, k_scale, v_scale)
    out = torch.empty_like(query)
    out[:num_decodes] = cpu_decode_attention.decode_attention(
        query[:num_decodes], key_cache, value_cache, block_tables[:num_decodes],
        torch.tensor(seq_lens[:num_decodes], dtype=torch.long), scale, sliding_window, soft_cap, k_scale, v_scale)
    attention_ref.prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                                    num_decodes, scale, sliding_window, key, value, out, soft_cap, k_scale, v_scale)
    return out


def triton_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                           num_decodes: int, scale: float, sliding_window: int | None, num_sms: int,
                           device_query_start_loc: torch.Tensor | None = None,
                           device_seq_lens: torch.Tensor | None = None, soft_cap: float | None = None,
                           k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Split-K decode when few long decodes would leave the device's num_sms idle, the mixed-batch kernel for
    the other rows. The lists plan; the kernels read their device copies (made here when not given)."""
    from kernels import attention_triton, decode_split_k_triton  # lazily: see kernels.backend
    if device_query_start_loc is None:
        device_query_start_loc = torch.tensor(query_start_loc, dtype=torch.int32, device=query.device)
    if device_seq_lens is None:
        device_seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=query.device)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    splits = decode_split_k_triton.num_splits(seq_lens[:num_decodes], key_cache.shape[1], num_sms)
    first = 0  # the first sequence left to the mixed-batch kernel
    if splits > 1:
        decode_split_k_triton.decode_attention(query[:num_decodes], key_cache, value_cache, block_tables,
                                               device_seq_lens[:num_decodes], scale, sliding_window, splits,
                                               out[:num_decodes], soft_cap, k_scale=k_scale, v_scale=v_scale)
        first = num_decodes
    if first < len(seq_lens):
        start = query_start_loc[first]
        starts = device_query_start_loc[first:] - start if start else device_query_start_loc[first:]
        attention_triton.paged_attention(query[start:], key_cache, value_cache, block_tables[first:], starts,
                                         device_seq_lens[first:], scale, sliding_window, out[start:], soft_cap,
                                         k_scale=k_scale, v_scale=v_scale)
    return out


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     sliding_window: int | None, num_splits: int, soft_cap: float | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """A decode-only batch (one query token per sequence; query_start_loc is 0, 1, ..., num_seqs) whose split-K
    slices the caller fixed (see decode_splits): on CUDA no launch reads a host value, so a CUDA graph can
    capture it and replay it with new lengths. Same contract as attention_ref.decode_attention."""
    if not use_triton(query):
        return attention_ref.decode_attention(query, key_cache, value_cache, block_tables, seq_lens.tolist(), scale,
                                              sliding_window, soft_cap, k_scale, v_scale)
    from kernels import attention_triton, decode_split_k_triton  # lazily: see kernels.backend
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_splits > 1:
        return decode_split_k_triton.decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                                      sliding_window, num_splits, out, soft_cap, k_scale=k_scale,
                                                      v_scale=v_scale)
    return attention_triton.paged_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                                            scale, sliding_window, out, soft_cap, k_scale=k_scale, v_scale=v_scale)


def decode_splits(num_seqs: int, max_seq_len: int, num_kv_heads: int, device: torch.device) -> int:
    """Split-K slices for a decode batch planned before its context lengths are known (a CUDA graph, captured
    once): the choice paged_attention makes for num_seqs contexts of max_seq_len. 1 off the Triton path."""
    if not triton_serves(device):
        return 1
    from kernels import decode_split_k_triton  # lazily: see kernels.backend
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return decode_split_k_triton.num_splits([max_seq_len] * num_seqs, num_kv_heads, num_sms)
