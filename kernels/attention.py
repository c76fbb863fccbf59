"""Paged attention as the layers call it: the fused CPU decode kernel where it builds, else the torch reference."""
from __future__ import annotations

import torch

from kernels import attention_ref, cpu_decode_attention


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
    """Same contract as attention_ref.paged_attention, which it equals (tests/test_cpu_decode_attention.py)."""
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
