"""Paged attention as the layers call it: Triton kernels on CUDA; on CPU the fused decode kernel where it
builds, else the torch reference."""
from __future__ import annotations

import torch

from kernels import attention_ref, cpu_decode_attention
from kernels.backend import use_triton


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
) -> torch.Tensor:
    """Same contract as attention_ref.paged_attention, which it equals (tests/test_cpu_decode_attention.py,
    tests/test_triton_kernels.py)."""
    if use_triton(query):
        num_sms = torch.cuda.get_device_properties(query.device).multi_processor_count
        return triton_paged_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                                      num_decodes, scale, sliding_window, num_sms)
    fused = num_decodes and query.device.type == "cpu" and cpu_decode_attention.load() is not None
    if not fused:
        return attention_ref.paged_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                                             num_decodes, scale, sliding_window, key, value)
    out = torch.empty_like(query)
    out[:num_decodes] = cpu_decode_attention.decode_attention(
        query[:num_decodes], key_cache, value_cache, block_tables[:num_decodes],
        torch.tensor(seq_lens[:num_decodes], dtype=torch.long), scale, sliding_window)
    attention_ref.prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                                    num_decodes, scale, sliding_window, key, value, out)
    return out


def triton_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                           num_decodes: int, scale: float, sliding_window: int | None, num_sms: int) -> torch.Tensor:
    """Split-K decode when few long decodes would leave the device's num_sms idle, the mixed-batch kernel for
    the other rows."""
    from kernels import attention_triton, decode_split_k_triton  # lazily: see kernels.backend
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    splits = decode_split_k_triton.num_splits(seq_lens[:num_decodes], key_cache.shape[1], num_sms)
    first = 0  # the first sequence left to the mixed-batch kernel
    if splits > 1:
        decode_split_k_triton.decode_attention(query[:num_decodes], key_cache, value_cache, block_tables,
                                               seq_lens[:num_decodes], scale, sliding_window, splits,
                                               out[:num_decodes])
        first = num_decodes
    if first < len(seq_lens):
        start = query_start_loc[first]
        attention_triton.paged_attention(query[start:], key_cache, value_cache, block_tables[first:],
                                         [loc - start for loc in query_start_loc[first:]], seq_lens[first:], scale,
                                         sliding_window, out[start:])
    return out
