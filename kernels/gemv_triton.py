"""y = x W^T (+ b) for one row of x: a weight-streaming GEMV (Triton twin of F.linear), each program a tile of
output rows over the whole input dimension, for batch-1 decode where the product reads every weight byte once.
An int8 weight with one scale per output row (kernels.quantized_matmul's storage) is streamed as stored, each row's
sum scaled once: the quantized Triton kernel's W8A16 arithmetic (fp8 weights keep torch._scaled_mm's W8A8, whose
activations are quantized: another result)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gemv_choice import GemvConfig


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, n, k, stride_wn,
                 HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Products accumulate element-wise in float32 and are summed across the input tile once, at the end."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptr + start + cols, eviction_policy="evict_last")
        else:
            x = tl.load(x_ptr + start + cols, mask=start + cols < k, other=0.0, eviction_policy="evict_last")
        if EVEN_N and EVEN_K:
            w = tl.load(w_ptrs + start, eviction_policy="evict_first")
        else:
            mask = (rows < n)[:, None] & (start + cols < k)[None, :]
            w = tl.load(w_ptrs + start, mask=mask, other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_SCALE:
        y *= tl.load(scale_ptr + rows, mask=rows < n, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=rows < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < n)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig,
         scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for an x of one row (any leading shape whose product is 1); the weight's rows
    contiguous, of x's dtype, or int8 with `scale` float32 [N] (the real weight q * scale[:, None]).
    Rounds the float32 sums to x's dtype once, as cuBLAS does."""
    n, k = weight.shape
    scaled = weight.dtype == torch.int8 and scale is not None and scale.shape == (n,) \
        and scale.dtype == torch.float32 and scale.stride(0) == 1
    if (x.numel() != k or weight.stride(1) != 1 or not (scaled or x.dtype == weight.dtype and scale is None)
            or bias is not None and (bias.dtype != x.dtype or bias.stride(0) != 1)):
        raise ValueError(f"gemv takes one row of {k} features, a row-major weight of its dtype (or int8 with a "
                         f"float32 scale per row) and a contiguous bias of its dtype: got x {tuple(x.shape)} {x.dtype}, "
                         f"weight strides {weight.stride()} {weight.dtype}, scale "
                         f"{None if scale is None else (tuple(scale.shape), scale.dtype)}, "
                         f"bias {None if bias is None else (bias.stride(), bias.dtype)}")
    row = x.reshape(k).contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        row, weight, scale, bias, out, n, k, weight.stride(0), HAS_SCALE=scale is not None, HAS_BIAS=bias is not None,
        EVEN_N=n % config.block_n == 0, EVEN_K=k % config.block_k == 0, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages)
    return out
