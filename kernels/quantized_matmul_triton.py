"""y = x W^T + b with W quantized (kernels.quantized_matmul's storage: int8, packed 4-bit or fp8; scales per row
or group; optional zero points and act-order g_idx), dequantized tile by tile in registers: the Triton twin of
quantized_matmul.quantized_linear, for CUDA."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quantized_matmul import input_size_of

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _quantized_matmul_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, g_idx_ptr, bias_ptr, out_ptr, M, N, K, groups,
                             group_size, stride_x, stride_w, stride_out,
                             INT4: tl.constexpr, SCALE_PER_ROW: tl.constexpr,
                             HAS_ZERO: tl.constexpr, HAS_G_IDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[rows, cols] for one BLOCK_M x BLOCK_N tile; W's [BLOCK_K, BLOCK_N] tiles dequantized as loaded."""
    block_m, block_n = tl.program_id(0), tl.program_id(1)
    rows = (block_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (block_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=(rows[:, None] < M) & k_ok[None, :],
                    other=0.0)
        w_mask = (cols[None, :] < N) & k_ok[:, None]
        if INT4:
            packed = tl.load(w_ptr + cols[None, :] * stride_w + (k // 2)[:, None], mask=w_mask, other=0)
            q = ((packed.to(tl.int32) >> ((k % 2) * 4)[:, None]) & 0xF).to(tl.float32)
        else:
            q = tl.load(w_ptr + cols[None, :] * stride_w + k[:, None], mask=w_mask, other=0).to(tl.float32)
        if SCALE_PER_ROW:
            scale = tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
            if HAS_ZERO:
                q -= tl.load(zero_ptr + cols, mask=cols < N, other=0.0)[None, :]
            elif INT4:
                q -= 8.0
        else:
            if HAS_G_IDX:
                group = tl.load(g_idx_ptr + k, mask=k_ok, other=0).to(tl.int64)
            else:
                group = (k // group_size).to(tl.int64)
            offsets = cols[None, :] * groups + group[:, None]
            scale = tl.load(scale_ptr + offsets, mask=w_mask, other=0.0)
            if HAS_ZERO:
                q -= tl.load(zero_ptr + offsets, mask=w_mask, other=0.0)
            elif INT4:
                q -= 8.0
        acc += tl.dot(x.to(tl.float32), q * scale, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                     g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as kernels.quantized_matmul.quantized_linear."""
    k = input_size_of(weight)
    n = weight.shape[0]
    rows = x.reshape(-1, k).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out.reshape(*x.shape[:-1], n)
    weight, scale = weight.contiguous(), scale.contiguous()
    per_row = scale.dim() == 1
    groups = 1 if per_row else scale.shape[1]
    placeholder = scale  # never read: the flags say which pointers are real
    grid = (triton.cdiv(rows.shape[0], BLOCK_M), triton.cdiv(n, BLOCK_N))
    _quantized_matmul_kernel[grid](
        rows, weight, scale, placeholder if zero is None else zero.contiguous(),
        placeholder if g_idx is None else g_idx.contiguous(), placeholder if bias is None else bias.contiguous(),
        out, rows.shape[0], n, k, groups, max(1, k // groups), rows.stride(0), weight.stride(0), out.stride(0),
        INT4=weight.dtype == torch.uint8, SCALE_PER_ROW=per_row,
        HAS_ZERO=zero is not None, HAS_G_IDX=g_idx is not None, HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out.reshape(*x.shape[:-1], n)
