"""Split-K (flash-decoding) decode attention for long contexts and few requests: each program attends one
slice of a sequence's context, a reduce kernel merges the slices; caches of the model dtype or fp8 with per-tensor
scales (Triton twin of attention_ref.decode_attention)."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.attention_triton import TILE_N, attend_keys, dot_precision, padded_head_dim, rows_per_program
from kernels.kv_cache_triton import cache_scales

_MAX_SPLITS = 16
_MIN_KEYS_PER_SPLIT = 256  # below this a slice's fixed cost outweighs the parallelism it adds


def num_splits(seq_lens: list[int], num_kv_heads: int, num_sms: int) -> int:
    """Slices per sequence: enough programs to fill the device twice, when contexts are long enough."""
    programs = len(seq_lens) * num_kv_heads
    if not programs or programs >= num_sms:
        return 1
    return max(1, min(_MAX_SPLITS, max(seq_lens) // _MIN_KEYS_PER_SPLIT, math.ceil(2 * num_sms / programs)))


@triton.jit
def _split_kernel(partial_out_ptr, partial_max_ptr, partial_sum_ptr, query_ptr, key_cache_ptr, value_cache_ptr,
                  block_tables_ptr, seq_lens_ptr, scale, k_scale, v_scale, soft_cap, sliding_window, num_heads,
                  head_dim, block_size,
                  stride_qt, stride_qh, stride_bt, stride_cb, stride_ch, stride_cs,
                  QUERIES_PER_KV: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                  DIM_PADDED: tl.constexpr, SLIDING: tl.constexpr, PRECISION: tl.constexpr,
                  SOFT_CAP: tl.constexpr):
    """One program per (sequence, KV head, slice); partials are laid out [seq, head, slice, (dim)]."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * QUERIES_PER_KV + rows
    dims = tl.arange(0, DIM_PADDED)
    mask = (rows < QUERIES_PER_KV)[:, None] & (dims[None, :] < head_dim)
    q = tl.load(query_ptr + seq * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=mask, other=0.0)
    first = 0
    if SLIDING:
        first = tl.maximum(0, seq_len - sliding_window)
    keys_per_split = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), TILE_N) * TILE_N
    key_start = first + split * keys_per_split
    key_end = tl.minimum(seq_len, key_start + keys_per_split)
    acc, running_max, exp_sum = attend_keys(
        q, tl.zeros([BLOCK_M], tl.int32) + seq_len - 1, key_cache_ptr, value_cache_ptr,
        block_tables_ptr + seq * stride_bt, kv_head, key_start, key_end, block_size, sliding_window, scale, k_scale,
        v_scale, soft_cap, head_dim, stride_cb, stride_ch, stride_cs, BLOCK_M, DIM_PADDED, SLIDING, PRECISION, SOFT_CAP)
    partial = (seq * num_heads + head) * NUM_SPLITS + split
    tl.store(partial_out_ptr + partial[:, None] * DIM_PADDED + dims[None, :], acc, mask=mask)
    tl.store(partial_max_ptr + partial, running_max, mask=rows < QUERIES_PER_KV)
    tl.store(partial_sum_ptr + partial, exp_sum, mask=rows < QUERIES_PER_KV)


@triton.jit
def _reduce_kernel(out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, head_dim, stride_ot, stride_oh,
                   NUM_SPLITS: tl.constexpr, SPLITS_PADDED: tl.constexpr, DIM_PADDED: tl.constexpr):
    """One program per (sequence, query head): the slices' outputs weighted by their share of the softmax."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    splits = tl.arange(0, SPLITS_PADDED)
    dims = tl.arange(0, DIM_PADDED)
    partial = (seq * num_heads + head) * NUM_SPLITS + splits
    running_max = tl.load(partial_max_ptr + partial, mask=splits < NUM_SPLITS, other=float("-inf"))
    exp_sum = tl.load(partial_sum_ptr + partial, mask=splits < NUM_SPLITS, other=0.0)
    weight = tl.exp(running_max - tl.max(running_max, 0))  # an empty slice (max -inf) weighs 0
    acc = tl.load(partial_out_ptr + partial[:, None] * DIM_PADDED + dims[None, :],
                  mask=(splits < NUM_SPLITS)[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(exp_sum * weight, 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < head_dim)


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, sliding_window: int | None,
                     splits: int, out: torch.Tensor, soft_cap: float | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """attention_ref.decode_attention's contract (one query token per sequence), written into `out` and returned.

    seq_lens is an int32 tensor on the query's device (nothing is read from the host: a CUDA graph can capture
    this). The last dims of query, out and caches are contiguous; both caches share one layout and dtype (fp8 caches
    read as stored * k_scale and stored * v_scale).
    """
    k_scale, v_scale = cache_scales(key_cache, k_scale, v_scale)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    queries_per_kv, dim_padded = num_heads // num_kv_heads, padded_head_dim(head_dim)
    partial_out = torch.empty(num_seqs, num_heads, splits, dim_padded, dtype=torch.float32, device=query.device)
    partial_max = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=query.device)
    partial_sum = torch.empty_like(partial_max)
    _split_kernel[(num_seqs, num_kv_heads, splits)](
        partial_out, partial_max, partial_sum, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale,
        v_scale, soft_cap or 0.0, sliding_window or 0, num_heads, head_dim, key_cache.shape[2], query.stride(0),
        query.stride(1), block_tables.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        QUERIES_PER_KV=queries_per_kv, NUM_SPLITS=splits, BLOCK_M=rows_per_program(queries_per_kv)[0],
        DIM_PADDED=dim_padded, SLIDING=sliding_window is not None, PRECISION=dot_precision(query.dtype),
        SOFT_CAP=soft_cap is not None)
    _reduce_kernel[(num_seqs, num_heads)](
        out, partial_out, partial_max, partial_sum, head_dim, out.stride(0), out.stride(1),
        NUM_SPLITS=splits, SPLITS_PADDED=triton.next_power_of_2(splits), DIM_PADDED=dim_padded)
    return out
