"""Paged attention over a mixed batch of decode tokens and prefill chunks (torch reference)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Decode sequences are batched in groups whose shortest context is at least this fraction of the longest,
# so padding to the group's longest context wastes little memory traffic (decode attention is memory-bound),
# and of at most this many padded context tokens, so each gathered group stays small enough for malloc
# to reuse heap memory instead of mapping (and page-faulting) fresh pages every step.
_GROUP_LENGTH_RATIO = 0.8
_GROUP_MAX_TOKENS = 4096


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
    sequences have exactly one query token. Caches: [num_blocks, num_kv_heads, block_size, head_dim].
    block_tables: [num_seqs, max_blocks] block ids. seq_lens[i]: context length of sequence i including its
    new tokens (whose K/V are already written). sliding_window: a query at position p sees keys at
    positions p - sliding_window < j <= p. Returns [num_tokens, num_heads, head_dim].
    """
    out = torch.empty_like(query)
    for rows in _decode_groups(seq_lens[:num_decodes]):
        index = torch.tensor(rows, device=query.device)
        out[index] = _decode(query[index], key_cache, value_cache, block_tables[index],
                             [seq_lens[r] for r in rows], scale, sliding_window)
    for i in range(num_decodes, len(seq_lens)):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        out[start:end] = _prefill(query[start:end], key_cache, value_cache, block_tables[i], seq_lens[i],
                                  scale, sliding_window)
    return out


def _decode_groups(seq_lens: list[int]) -> list[list[int]]:
    """Decode rows grouped by similar context length, longest first."""
    groups: list[list[int]] = []
    longest = 0
    for row in sorted(range(len(seq_lens)), key=lambda r: -seq_lens[r]):
        full = groups and (len(groups[-1]) + 1) * longest > _GROUP_MAX_TOKENS
        if not groups or full or seq_lens[row] < longest * _GROUP_LENGTH_RATIO:
            groups.append([])
            longest = seq_lens[row]
        groups[-1].append(row)
    return groups


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """[num_seqs, max_blocks] block ids → [num_seqs, blocks, num_kv_heads, block_size, head_dim].

    Whole blocks are contiguous in the cache, so index_select along dim 0 copies large runs.
    """
    num_blocks = -(-max_len // cache.shape[2])
    ids = block_tables[:, :num_blocks].reshape(-1)
    return cache.index_select(0, ids).view(block_tables.shape[0], num_blocks, *cache.shape[1:])


def _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window) -> torch.Tensor:
    """One query token per sequence: the group in batched products over whole blocks, no re-layout copies.

    Query heads are grouped by their KV head (as HF's repeat_kv orders them), so GQA needs no repeated K/V.
    """
    num_seqs, num_heads, head_dim = query.shape
    max_len = max(seq_lens)
    key = _gather_blocks(key_cache, block_tables, max_len)  # [seqs, blocks, kv_heads, block_size, dim]
    value = _gather_blocks(value_cache, block_tables, max_len)
    _, num_blocks, kv_heads, block_size, _ = key.shape
    group = num_heads // kv_heads
    grouped = query.view(num_seqs, 1, kv_heads, group, head_dim).to(key.dtype)
    scores = torch.matmul(grouped, key.transpose(-1, -2))  # [seqs, blocks, kv_heads, group, block_size]
    scores = scores.permute(0, 2, 3, 1, 4).reshape(num_seqs, kv_heads, group, -1).float() * scale
    scores.masked_fill_(_decode_mask(seq_lens, num_blocks * block_size, sliding_window, query.device),
                        float("-inf"))
    probs = scores.softmax(dim=-1).to(value.dtype).view(num_seqs, kv_heads, group, num_blocks, block_size)
    out = torch.matmul(probs.permute(0, 3, 1, 2, 4), value).sum(dim=1, dtype=torch.float32)
    return out.view(num_seqs, num_heads, head_dim).to(query.dtype)


def _decode_mask(seq_lens: list[int], padded_len: int, sliding_window: int | None,
                 device: torch.device) -> torch.Tensor:
    """[seqs, 1, 1, padded_len]: True where a key is beyond the context or outside the window."""
    lens = torch.tensor(seq_lens, device=device).unsqueeze(1)
    positions = torch.arange(padded_len, device=device).unsqueeze(0)
    masked = positions >= lens
    if sliding_window is not None:
        masked |= positions <= lens - 1 - sliding_window
    return masked[:, None, None, :]


def _prefill(query, key_cache, value_cache, block_table, seq_len, scale, sliding_window) -> torch.Tensor:
    """A chunk of new tokens at the end of a context of seq_len tokens (cached prefix + chunk)."""
    num_new = query.shape[0]
    key, value = (_context(cache, block_table, seq_len).to(query.dtype) for cache in (key_cache, value_cache))
    q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, new, dim]
    q_pos = torch.arange(seq_len - num_new, seq_len, device=query.device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first seq_len keys or values as [1, kv_heads, seq_len, head_dim]."""
    blocks = _gather_blocks(cache, block_table.unsqueeze(0), seq_len)[0]  # [blocks, kv_heads, block_size, dim]
    kv_heads, head_dim = blocks.shape[1], blocks.shape[3]
    return blocks.transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :seq_len].unsqueeze(0)
