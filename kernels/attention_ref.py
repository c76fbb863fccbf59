"""Paged attention over a mixed batch of decode tokens and prefill chunks (torch reference)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_extension, cpu_gemv, kv_quant
from kernels.cpu_features import matmul_dtype

if torch.cuda.is_available():  # its module imports torch._dynamo, a large share of an engine's start: see prefill_chunk
    from torch.nn.attention.bias import causal_lower_right

# Decode rows are attended in groups whose shortest context is at least this fraction of the longest, so
# padding to the group's longest context wastes little memory traffic (decode attention is memory-bound),
# and of at most this many padded context tokens, so a group's gathered K/V stays cache-sized.
_GROUP_LENGTH_RATIO = 0.7
_GROUP_MAX_TOKENS = 6144


@dataclass
class DecodeGroup:
    """Consecutive decode rows [start, end) attended together, padded to their longest context."""

    start: int
    end: int
    block_ids: torch.Tensor  # [rows * num_blocks]: each row's first num_blocks block ids, flattened
    seq_lens: torch.Tensor  # [rows, 1]


def plan_decode_groups(seq_lens: list[int], block_tables: torch.Tensor, block_size: int) -> list[DecodeGroup]:
    """Split the decode rows (the first len(seq_lens) rows) into groups of consecutive rows.

    Rows sorted by descending context length group best; any order is correct.
    """
    bounds: list[list[int]] = []  # [start, end, longest, shortest]
    for row, length in enumerate(seq_lens):
        if bounds:
            start, _, longest, shortest = bounds[-1]
            longest, shortest = max(longest, length), min(shortest, length)
            if shortest >= longest * _GROUP_LENGTH_RATIO and (row + 1 - start) * longest <= _GROUP_MAX_TOKENS:
                bounds[-1] = [start, row + 1, longest, shortest]
                continue
        bounds.append([row, row + 1, length, length])
    lens = torch.tensor(seq_lens, dtype=torch.long, device=block_tables.device).unsqueeze(1)
    return [DecodeGroup(start, end, block_tables[start:end, :-(-longest // block_size)].reshape(-1), lens[start:end])
            for start, end, longest, _ in bounds]


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
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole context in the paged cache.

    query: [num_tokens, num_heads, head_dim], sequences laid out back to back; the first `num_decodes`
    sequences have exactly one query token. Caches: [num_blocks, num_kv_heads, block_size, head_dim].
    block_tables: [num_seqs, max_blocks] block ids. seq_lens[i]: context length of sequence i including its
    new tokens (whose K/V are already written). sliding_window: a query at position p sees keys at
    positions p - sliding_window < j <= p. key/value: this step's new K/V ([num_tokens, num_kv_heads,
    head_dim], already written to the cache), which a prefill without cached prefix attends over directly.
    soft_cap: each scaled score s becomes soft_cap * tanh(s / soft_cap) before masking (Gemma 2).
    k_scale/v_scale: an fp8 cache's scales (kernels.kv_quant): its values are read as stored * scale, and fresh K/V
    as the cache holds them. Returns [num_tokens, num_heads, head_dim].
    """
    out = torch.empty_like(query)
    if num_decodes:
        out[:num_decodes] = decode_attention(query[:num_decodes], key_cache, value_cache, block_tables,
                                             seq_lens[:num_decodes], scale, sliding_window, soft_cap, k_scale, v_scale)
    prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, num_decodes, scale,
                      sliding_window, key, value, out, soft_cap, k_scale, v_scale)
    return out


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: list[int], scale: float,
                     sliding_window: int | None, soft_cap: float | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """The decode rows (one query token each, the first len(seq_lens) rows of block_tables), in groups."""
    out = torch.empty_like(query)
    for group in plan_decode_groups(seq_lens, block_tables, key_cache.shape[2]):
        out[group.start:group.end] = _decode(query[group.start:group.end], key_cache, value_cache, group, scale,
                                             sliding_window, soft_cap, k_scale, v_scale)
    return out


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int], num_decodes: int,
                      scale: float, sliding_window: int | None, key: torch.Tensor | None,
                      value: torch.Tensor | None, out: torch.Tensor, soft_cap: float | None = None,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """The prefill chunks (sequences num_decodes onward), written into their rows of `out`."""
    if key is not None and kv_quant.is_fp8(key_cache.dtype):  # what the cache holds, as every other reader sees
        key, value = kv_quant.stored_as(key, k_scale, key_cache.dtype), kv_quant.stored_as(value, v_scale,
                                                                                          value_cache.dtype)
    for i in range(num_decodes, len(seq_lens)):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if end - start == seq_lens[i] and key is not None:  # no cached prefix: attend over the fresh K/V
            context = (key[start:end].transpose(0, 1).unsqueeze(0), value[start:end].transpose(0, 1).unsqueeze(0))
        else:
            context = (read(context_of(key_cache, block_tables[i], seq_lens[i]), k_scale, query.dtype),
                       read(context_of(value_cache, block_tables[i], seq_lens[i]), v_scale, query.dtype))
        out[start:end] = prefill_chunk(query[start:end], *context, scale, sliding_window, soft_cap)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Flat block ids → [num_seqs, blocks, num_kv_heads, block_size, head_dim].

    Whole blocks are contiguous in the cache, so index_select along dim 0 copies large runs.
    """
    return cache.index_select(0, block_ids).view(num_seqs, -1, *cache.shape[1:])


def read(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache contents as values of `dtype`: an fp8 cache's dequantized (kernels.kv_quant), any other's converted.
    An e4m3 context on the CPU goes through the C++ kernels where they are built: the same values in one pass over
    the bytes, where torch's float32 round trip took a prefill chunk's share of a long context's run."""
    if stored.dtype == torch.float8_e4m3fn and stored.device.type == "cpu" and stored.numel() \
            and dtype in (torch.float32, torch.bfloat16) and cpu_extension.ready() is not None:
        rows = stored.reshape(-1, stored.shape[-1])
        return cpu_gemv.dequantize(rows, torch.full((rows.shape[0],), scale), dtype=dtype).view(stored.shape)
    return kv_quant.dequantize(stored, scale, dtype) if kv_quant.is_fp8(stored.dtype) else stored.to(dtype)


def _decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, group: DecodeGroup,
            scale: float, sliding_window: int | None, soft_cap: float | None, k_scale: float,
            v_scale: float) -> torch.Tensor:
    """One query token per sequence: the group in batched products over whole blocks, no re-layout copies.

    Query heads are grouped by their KV head (as HF's repeat_kv orders them), so GQA needs no repeated K/V.
    """
    num_seqs, num_heads, head_dim = query.shape
    compute = matmul_dtype(query.dtype, key_cache.device)
    # [seqs, blocks, kv_heads, bs, dim]
    key = read(_gather_blocks(key_cache, group.block_ids, num_seqs), k_scale, compute)
    _, num_blocks, kv_heads, block_size, _ = key.shape
    per_kv = num_heads // kv_heads
    grouped = query.view(num_seqs, 1, kv_heads, per_kv, head_dim).to(compute)
    scores = torch.matmul(grouped, key.transpose(-1, -2))  # [seqs, blocks, kv_heads, per_kv, block_size]
    scores = _capped(scores.permute(0, 2, 3, 1, 4).reshape(num_seqs, kv_heads, per_kv, -1).float() * scale, soft_cap)
    scores.masked_fill_(_decode_mask(group.seq_lens, num_blocks * block_size, sliding_window), float("-inf"))
    del key  # V is gathered only now, into the memory K just left (still in cache)
    value = read(_gather_blocks(value_cache, group.block_ids, num_seqs), v_scale, compute)
    probs = scores.softmax(dim=-1).to(compute).view(num_seqs, kv_heads, per_kv, num_blocks, block_size)
    out = torch.matmul(probs.permute(0, 3, 1, 2, 4), value).sum(dim=1, dtype=torch.float32)
    return out.view(num_seqs, num_heads, head_dim).to(query.dtype)


def _decode_mask(seq_lens: torch.Tensor, padded_len: int, sliding_window: int | None) -> torch.Tensor:
    """[seqs, 1, 1, padded_len]: True where a key is beyond the context or outside the window."""
    positions = torch.arange(padded_len, device=seq_lens.device).unsqueeze(0)
    masked = positions >= seq_lens
    if sliding_window is not None:
        masked |= positions <= seq_lens - 1 - sliding_window
    return masked[:, None, None, :]


def prefill_chunk(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                  sliding_window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
    """Causal attention of a chunk of new tokens at the end of its context: query [new, heads, dim]; key
    [1, kv_heads, context_len, dim]; value [1, kv_heads, context_len, value_dim] → [new, heads, value_dim]."""
    num_new, seq_len = query.shape[0], key.shape[2]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, new, dim]
    key, value = key.to(q.dtype), value.to(q.dtype)
    if soft_cap is None and sliding_window is None and (num_new == seq_len or query.is_cuda):
        # The causal mask as SDPA's own (the chunk's rows end at the context's end): its kernels skip the blocks
        # above the diagonal that a materialized mask makes them compute, half the work of a whole prompt. A chunk
        # after earlier context needs the mask aligned to the lower right, which only CUDA's kernels take as a bias
        # (on the CPU torch materializes it), so only where CUDA is is its module imported (at start, not at a
        # request's first such chunk).
        if num_new == seq_len:
            out = F.scaled_dot_product_attention(q, key, value, is_causal=True, scale=scale, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, key, value, attn_mask=causal_lower_right(num_new, seq_len),
                                                 scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    q_pos = torch.arange(seq_len - num_new, seq_len, device=query.device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    if soft_cap is None:
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
    else:  # SDPA has no soft cap: the products written out, as HF's eager attention computes them
        per_kv = q.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(per_kv, dim=1), value.repeat_interleave(per_kv, dim=1)
        scores = _capped(torch.matmul(q, key.transpose(-1, -2)) * scale, soft_cap).masked_fill(~mask, float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), value)
    return out[0].transpose(0, 1)


def _capped(scores: torch.Tensor, soft_cap: float | None) -> torch.Tensor:
    return scores if soft_cap is None else torch.tanh(scores / soft_cap) * soft_cap


def context_of(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first seq_len keys or values as [1, kv_heads, seq_len, head_dim]."""
    blocks = _gather_blocks(cache, block_table[:-(-seq_len // cache.shape[2])], 1)[0]
    kv_heads, head_dim = blocks.shape[1], blocks.shape[3]
    return blocks.transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :seq_len].unsqueeze(0)
