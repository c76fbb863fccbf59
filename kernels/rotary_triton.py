"""Rotary position embedding applied in place to query and key (Triton twin of rotary_ref)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rounded_product(x, y):
    """x * y rounded to x's dtype as torch rounds it, returned in float32 for the next operation."""
    return (x.to(tl.float32) * y).to(x.dtype).to(tl.float32)


@triton.jit
def _rotate(x_ptr, stride_t, stride_h, num_heads, token, cos, sin, half,
            HEADS_PADDED: tl.constexpr, HALF_PADDED: tl.constexpr):
    """Rotate every head of one token: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), rounded as the twin."""
    heads = tl.arange(0, HEADS_PADDED)[:, None]
    dims = tl.arange(0, HALF_PADDED)[None, :]
    mask = (heads < num_heads) & (dims < half)
    first = x_ptr + token * stride_t + heads * stride_h + dims
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    cos, sin = cos.to(x1.dtype).to(tl.float32), sin.to(x1.dtype).to(tl.float32)  # the twin casts the table first
    out1 = _rounded_product(x1, cos) - _rounded_product(x2, sin)
    out2 = _rounded_product(x2, cos) + _rounded_product(x1, sin)
    tl.store(first, out1.to(x1.dtype), mask=mask)
    tl.store(first + half, out2.to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(positions_ptr, query_ptr, key_ptr, cos_ptr, sin_ptr, num_heads, num_kv_heads, half,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_table,
                   HEADS_PADDED: tl.constexpr, KV_HEADS_PADDED: tl.constexpr, HALF_PADDED: tl.constexpr):
    """One program per token: its query and key heads share one row of the cos/sin table."""
    token = tl.program_id(0).to(tl.int64)
    row = tl.load(positions_ptr + token).to(tl.int64) * stride_table
    dims = tl.arange(0, HALF_PADDED)[None, :]
    cos = tl.load(cos_ptr + row + dims, mask=dims < half, other=0.0)
    sin = tl.load(sin_ptr + row + dims, mask=dims < half, other=0.0)
    _rotate(query_ptr, stride_qt, stride_qh, num_heads, token, cos, sin, half, HEADS_PADDED, HALF_PADDED)
    _rotate(key_ptr, stride_kt, stride_kh, num_kv_heads, token, cos, sin, half, KV_HEADS_PADDED, HALF_PADDED)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as rotary_ref.rotary_embedding, but rotates query and key in place and returns them.

    Their last dim and the tables' rows must be contiguous.
    """
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, query, key, cos, sin, num_heads, key.shape[1], head_dim // 2,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos.stride(0),
            HEADS_PADDED=triton.next_power_of_2(num_heads), KV_HEADS_PADDED=triton.next_power_of_2(key.shape[1]),
            HALF_PADDED=triton.next_power_of_2(head_dim // 2))
    return query, key
