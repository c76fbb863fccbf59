"""y = x W^T + b on the fastest path for its device, dtype and row count (GEMV, or a GEMM in matmul_dtype), for
plain weights and for int8 weights with a scale per output row (weight-only quantization)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_gemv
from kernels.cpu_features import matmul_dtype


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear in `matmul_dtype`: bf16 weights stay bf16 in memory but multiply as float32 on CPUs that
    would emulate bf16 GEMMs (about 3x faster end to end, same result as a native bf16 GEMM). A few rows on the
    CPU (decode at small batch) go to the GEMV kernel, which streams the weight once.

    An int8 weight comes with `weight_scale` (float32, one per output row): W = weight * weight_scale[:, None].
    Few rows read it as int8 (the GEMV kernel); more rows dequantize it once per call into the GEMM's dtype."""
    if weight.dtype == torch.int8:
        return _int8_linear(x, weight, weight_scale, bias)
    if cpu_gemv.serves(x, weight, bias):
        return cpu_gemv.gemv(x, weight, bias)
    compute = matmul_dtype(weight.dtype, weight.device)
    if compute == weight.dtype:
        return F.linear(x, weight, bias)
    out = F.linear(x.to(compute), weight.to(compute), bias.to(compute) if bias is not None else None)
    return out.to(weight.dtype)


def _int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
                 ) -> torch.Tensor:
    if scale is None:
        raise ValueError("an int8 weight needs its weight_scale")
    if cpu_gemv.serves(x, weight, bias):
        return cpu_gemv.gemv_int8(x, weight, scale, bias)
    compute = matmul_dtype(x.dtype, x.device)
    dequantized = weight.to(compute) * scale.to(compute).unsqueeze(1)
    out = F.linear(x.to(compute), dequantized, bias.to(compute) if bias is not None else None)
    return out.to(x.dtype)
