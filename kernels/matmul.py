"""y = x W^T + b on the fastest path for its device, dtype and row count (GEMV, or a GEMM in matmul_dtype), for
plain weights and for quantized ones (kernels.quantized_matmul describes their storage)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_gemv
from kernels.cpu_features import matmul_dtype
from kernels.quantized_matmul import QUANTIZED_DTYPES, quantized_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None, weight_zero: torch.Tensor | None = None,
           weight_g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear in `matmul_dtype`: bf16 weights stay bf16 in memory but multiply as float32 on CPUs that
    would emulate bf16 GEMMs (about 3x faster end to end, same result as a native bf16 GEMM). A few rows on the
    CPU (decode at small batch) go to the GEMV kernel, which streams the weight once.

    A quantized weight (int8, packed 4-bit, fp8) comes with its scales and optional zero points and act-order
    g_idx. Symmetric int8 read by few rows stays int8 (the GEMV kernel); the rest is dequantized a tile of rows at
    a time into the GEMM's dtype."""
    if weight.dtype in QUANTIZED_DTYPES:
        return _quantized_linear(x, weight, bias, weight_scale, weight_zero, weight_g_idx)
    if cpu_gemv.serves(x, weight, bias):
        return cpu_gemv.gemv(x, weight, bias)
    compute = matmul_dtype(weight.dtype, weight.device)
    if compute == weight.dtype:
        return F.linear(x, weight, bias)
    out = F.linear(x.to(compute), weight.to(compute), bias.to(compute) if bias is not None else None)
    return out.to(weight.dtype)


def _quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None,
                      zero: torch.Tensor | None, g_idx: torch.Tensor | None) -> torch.Tensor:
    if scale is None:
        raise ValueError(f"a {weight.dtype} weight needs its weight_scale")
    if weight.dtype == torch.int8 and zero is None and g_idx is None and cpu_gemv.serves(x, weight, bias) \
            and (scale.dim() == 1 or cpu_gemv.takes_groups(weight, scale)):
        return cpu_gemv.gemv_int8(x, weight, scale, bias)
    return quantized_linear(x, weight, scale, zero, g_idx, bias)
