"""Paged attention over a mixed batch of decode tokens and prefill chunks, over caches of the model dtype or fp8
with per-tensor scales (Triton twin of attention_ref)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_cache_triton import cache_scales

TILE_N = tl.constexpr(32)  # keys per inner-loop step; a tile may span several cache blocks, so any block size works


@triton.jit
def attend_keys(q, q_pos, key_cache_ptr, value_cache_ptr, block_table_ptr, kv_head, key_start, key_end,
                block_size, sliding_window, scale, k_scale, v_scale, soft_cap, head_dim,
                stride_cb, stride_ch, stride_cs,
                BLOCK_M: tl.constexpr, DIM_PADDED: tl.constexpr, SLIDING: tl.constexpr, PRECISION: tl.constexpr,
                SOFT_CAP: tl.constexpr):
    """Online softmax of q [BLOCK_M, DIM_PADDED] (query positions q_pos) over keys at [key_start, key_end);
    with SOFT_CAP each score s is first soft_cap * tanh(s / soft_cap). The cache holds keys / k_scale and
    values / v_scale (both 1 but for an fp8 cache): the scales multiply the products, not every loaded element,
    and an fp8 element converts to the query's dtype exactly.

    Returns the unnormalized output [BLOCK_M, DIM_PADDED], the running max and the sum of exponentials.
    """
    dims = tl.arange(0, DIM_PADDED)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    exp_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PADDED], tl.float32)
    for tile_start in range(key_start, key_end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        in_range = pos < key_end
        block = tl.load(block_table_ptr + pos // block_size, mask=in_range, other=0).to(tl.int64)
        offsets = (block[:, None] * stride_cb + kv_head * stride_ch + (pos % block_size)[:, None] * stride_cs
                   + dims[None, :])
        kv_mask = in_range[:, None] & (dims[None, :] < head_dim)
        key = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(key), input_precision=PRECISION) * (scale * k_scale)
        if SOFT_CAP:
            scores = soft_cap * (2 * tl.sigmoid(2 * scores / soft_cap) - 1)  # tanh
        visible = in_range[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING:
            visible &= pos[None, :] > q_pos[:, None] - sliding_window
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row that has seen no visible key yet
        probs = tl.exp(scores - shift[:, None])
        rescale = tl.exp(running_max - shift)
        exp_sum = exp_sum * rescale + tl.sum(probs, 1)
        value = tl.load(value_cache_ptr + offsets, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * rescale[:, None] + tl.dot(probs.to(q.dtype), value, input_precision=PRECISION)
        running_max = new_max
    return acc * v_scale, running_max, exp_sum


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence of query tile `tile`, where sequence i owns tiles from query_start_loc[i] // BLOCK_Q + i."""
    low = 0
    high = num_seqs
    while low < high:
        mid = (low + high) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            low = mid + 1
        else:
            high = mid
    return low - 1


@triton.jit
def _paged_attention_kernel(out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
                            query_start_loc_ptr, num_seqs, scale, k_scale, v_scale, soft_cap, sliding_window,
                            head_dim, block_size,
                            stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_ch, stride_cs,
                            QUERIES_PER_KV: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                            DIM_PADDED: tl.constexpr, SLIDING: tl.constexpr, PRECISION: tl.constexpr,
                            SOFT_CAP: tl.constexpr):
    """One program per (query tile of BLOCK_Q tokens of one sequence, KV head): rows are (token, query head)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_token = (tile - q_start // BLOCK_Q - seq) * BLOCK_Q
    if first_token >= q_len:  # the grid is an upper bound on the number of tiles
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    token = first_token + rows // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    dims = tl.arange(0, DIM_PADDED)
    mask = ((rows < BLOCK_Q * QUERIES_PER_KV) & (token < q_len))[:, None] & (dims[None, :] < head_dim)
    q = tl.load(query_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=mask, other=0.0)
    q_pos = seq_len - q_len + tl.minimum(token, q_len - 1)  # padding rows act as the last token: no 0/0
    key_end = seq_len - q_len + tl.minimum(first_token + BLOCK_Q, q_len)
    key_start = 0
    if SLIDING:
        key_start = tl.maximum(0, seq_len - q_len + first_token - sliding_window + 1)
    acc, _, exp_sum = attend_keys(q, q_pos, key_cache_ptr, value_cache_ptr, block_tables_ptr + seq * stride_bt,
                                  kv_head, key_start, key_end, block_size, sliding_window, scale, k_scale, v_scale,
                                  soft_cap, head_dim,
                                  stride_cb, stride_ch, stride_cs, BLOCK_M, DIM_PADDED, SLIDING, PRECISION, SOFT_CAP)
    out = acc / exp_sum[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def rows_per_program(queries_per_kv: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): rows of a program (≥ 16, tl.dot's minimum) and the query tokens they cover."""
    block_m = max(16, triton.next_power_of_2(queries_per_kv))
    return block_m, block_m // queries_per_kv


def padded_head_dim(head_dim: int) -> int:
    """The head dim as tl.dot takes it: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(head_dim))


def dot_precision(dtype: torch.dtype) -> str:
    """float32 products in full precision (tf32 would break equality with the torch twin)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    sliding_window: int | None, out: torch.Tensor, soft_cap: float | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """attention_ref.paged_attention's contract, written into `out` and returned; every key is read from the cache.

    query_start_loc and seq_lens are int32 tensors on the query's device: the launch reads nothing from the host
    but shapes, so a CUDA graph can capture it. Decode rows need not come first. The last dims of query, out and
    caches are contiguous; both caches share one layout and dtype (fp8 caches read as stored * k_scale and
    stored * v_scale).
    """
    k_scale, v_scale = cache_scales(key_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, num_kv_heads = len(seq_lens), key_cache.shape[1]
    block_m, block_q = rows_per_program(num_heads // num_kv_heads)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, num_seqs, scale, k_scale, v_scale,
        soft_cap or 0.0, sliding_window or 0, head_dim, key_cache.shape[2], query.stride(0), query.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2),
        QUERIES_PER_KV=num_heads // num_kv_heads, BLOCK_Q=block_q, BLOCK_M=block_m,
        DIM_PADDED=padded_head_dim(head_dim), SLIDING=sliding_window is not None,
        PRECISION=dot_precision(query.dtype), SOFT_CAP=soft_cap is not None)
    return out
