"""y = x W^T + b on the fastest path for its device, dtype and row count (GEMV, or a GEMM in matmul_dtype), for
plain weights and for quantized ones (kernels.quantized_matmul describes their storage)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_extension, cpu_fp8_pairs, cpu_gemv, cpu_prepacked
from kernels.backend import use_triton
from kernels.cpu_features import matmul_dtype
from kernels.gemv_choice import GemvConfig
from kernels.quantized_matmul import QUANTIZED_DTYPES, quantized_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None, weight_zero: torch.Tensor | None = None,
           weight_g_idx: torch.Tensor | None = None, packed: torch.Tensor | None = None,
           pairs: torch.Tensor | None = None, gemv: GemvConfig | None = None) -> torch.Tensor:
    """F.linear in `matmul_dtype`: bf16 weights stay bf16 in memory but multiply as float32 on CPUs that
    would emulate bf16 GEMMs (about 3x faster end to end, same result as a native bf16 GEMM). A few rows on the
    CPU (decode at small batch) go to the GEMV kernel, which streams the weight once.

    A quantized weight (int8, packed 4-bit, fp8) comes with its scales and optional zero points and act-order
    g_idx. Symmetric int8 and fp8 read by few rows stay as stored (the GEMV kernel); the rest is dequantized a tile
    of rows at a time into the GEMM's dtype (by the C++ kernels where they take the weight).

    `pairs`, the weight's kernels.cpu_gemv.pair_weight copy where the model keeps one, serves bf16 products of up to
    cpu_gemv.PAIRS_MAX_ROWS rows (an int8 weight's, with a scale per row, and an fp8 one's, kernels.cpu_fp8_pairs'
    pair_fp8 copy: its bf16 rows up to INT8_MAX_ROWS);
    `packed`, its kernels.cpu_prepacked copy, the GEMMs the GEMV kernel does not take.

    `gemv`, the Triton GEMV's launch shape that start-up timing chose for this weight on CUDA (workers.gemv_tuning),
    serves products of one row (batch-1 decode) in place of cuBLAS (or, for an int8 weight with a scale per row, of
    the quantized kernel)."""
    if gemv is not None and x.numel() == x.shape[-1] and weight_zero is None and weight_g_idx is None:
        from kernels import gemv_triton  # lazily: see kernels.backend

        return gemv_triton.gemv(x, weight, bias, gemv, weight_scale)
    if weight.dtype in QUANTIZED_DTYPES:
        return _quantized_linear(x, weight, bias, weight_scale, weight_zero, weight_g_idx, pairs)
    if cpu_gemv.serves(x, weight, bias, pairs):
        return cpu_gemv.gemv(x, weight, bias, pairs)
    if packed is not None and x.dtype == torch.bfloat16:
        return cpu_prepacked.linear(x, packed, bias)
    compute = matmul_dtype(weight.dtype, weight.device)
    if compute == weight.dtype:
        return F.linear(x, weight, bias)
    out = F.linear(x.to(compute), weight.to(compute), bias.to(compute) if bias is not None else None)
    return out.to(weight.dtype)


def _quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None,
                      zero: torch.Tensor | None, g_idx: torch.Tensor | None, pairs: torch.Tensor | None = None
                      ) -> torch.Tensor:
    if scale is None:
        raise ValueError(f"a {weight.dtype} weight needs its weight_scale")
    if weight.dtype in cpu_gemv.SCALED_DTYPES and zero is None and g_idx is None and x.device.type == "cpu" \
            and (scale.dim() == 1 or cpu_gemv.takes_groups(weight, scale)) and cpu_extension.ready() is not None:
        if cpu_gemv.serves(x, weight, bias):
            if weight.dtype == torch.float8_e4m3fn and pairs is not None and x.dtype == torch.bfloat16:
                return cpu_fp8_pairs.linear(x, weight, scale, bias, pairs)
            return cpu_gemv.gemv_quantized(x, weight, scale, bias, pairs)
        return quantized_linear(x, weight, scale, None, None, bias, dequantizer=cpu_gemv.dequantize)
    if weight.dtype == torch.float8_e4m3fn and fp8_tensor_cores(x, weight, scale, zero, g_idx):
        return _fp8_scaled_mm(x, weight, scale, bias)
    if weight.dtype != torch.float8_e4m3fn and use_triton(x):  # other fp8 cases dequantize tiles in torch
        from kernels import quantized_matmul_triton

        return quantized_matmul_triton.quantized_linear(x, weight, scale, zero, g_idx, bias)
    return quantized_linear(x, weight, scale, zero, g_idx, bias)


def fp8_tensor_cores(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                     g_idx: torch.Tensor | None) -> bool:
    """Whether torch._scaled_mm takes this fp8 product: a CUDA GPU with fp8 tensor cores (compute capability 8.9,
    Hopper and later), one scale per weight row, 16-aligned features, a 16-bit activation dtype."""
    return (x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9) and scale.dim() == 1
            and zero is None and g_idx is None and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0
            and x.dtype in (torch.bfloat16, torch.float16))


def _fp8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    """W8A8 fp8: each token's activations scaled into fp8 e4m3 by its own largest value (dynamic, per token),
    multiplied on the fp8 tensor cores, both scales applied to the float32 sums."""
    rows = x.reshape(-1, x.shape[-1])
    x_scale = (rows.abs().amax(dim=1, keepdim=True).float() / 448.0).clamp_(min=1e-12)
    x_fp8 = (rows.float() / x_scale).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    # bf16 out: the only output type cuBLAS takes with row-wise scales on some GPUs and versions (sm89; sm90 before
    # cuBLAS 12.9); float16 activations get theirs converted.
    out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1).float(),
                           out_dtype=torch.bfloat16).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])
