"""Paged attention over a mixed batch of decode tokens and prefill chunks (torch reference)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole context in the paged cache.

    query: [num_tokens, num_heads, head_dim], sequences laid out back to back; the first `num_decodes`
    sequences have exactly one query token. block_tables: [num_seqs, max_blocks] block ids.
    seq_lens[i]: context length of sequence i including its new tokens (whose K/V are already written).
    sliding_window: a query at position p sees keys at positions p - sliding_window < j <= p.
    Returns [num_tokens, num_heads, head_dim].
    """
    out = torch.empty_like(query)
    if num_decodes:
        out[:num_decodes] = _decode(query[:num_decodes], key_cache, value_cache, block_tables[:num_decodes],
                                    seq_lens[:num_decodes], scale, sliding_window)
    for i in range(num_decodes, len(seq_lens)):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        out[start:end] = _prefill(query[start:end], key_cache, value_cache, block_tables[i], seq_lens[i],
                                  scale, sliding_window)
    return out


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """[num_seqs, max_blocks] block ids → [num_seqs, num_kv_heads, max_len, head_dim] contexts."""
    block_size = cache.shape[1]
    num_blocks = -(-max_len // block_size)
    blocks = cache[block_tables[:, :num_blocks]]  # [seqs, blocks, block_size, kv_heads, dim]
    flat = blocks.flatten(1, 2)[:, :max_len]
    return flat.transpose(1, 2)


def _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window) -> torch.Tensor:
    """One query token per sequence: batch every sequence, padded to the longest context."""
    max_len = max(seq_lens)
    key = _gather(key_cache, block_tables, max_len)
    value = _gather(value_cache, block_tables, max_len)
    lens = torch.tensor(seq_lens, device=query.device).unsqueeze(1)
    positions = torch.arange(max_len, device=query.device).unsqueeze(0)
    mask = positions < lens
    if sliding_window is not None:
        mask &= positions > lens - 1 - sliding_window
    q = query.unsqueeze(2)  # [seqs, heads, 1, dim]
    out = F.scaled_dot_product_attention(q, key.to(q.dtype), value.to(q.dtype), attn_mask=mask[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)


def _prefill(query, key_cache, value_cache, block_table, seq_len, scale, sliding_window) -> torch.Tensor:
    """A chunk of new tokens at the end of a context of seq_len tokens (cached prefix + chunk)."""
    num_new = query.shape[0]
    key = _gather(key_cache, block_table.unsqueeze(0), seq_len)
    value = _gather(value_cache, block_table.unsqueeze(0), seq_len)
    q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, new, dim]
    q_pos = torch.arange(seq_len - num_new, seq_len, device=query.device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    out = F.scaled_dot_product_attention(q, key.to(q.dtype), value.to(q.dtype), attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)
