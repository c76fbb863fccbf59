"""Linear layers on CPU in the C++ kernels (kernels/csrc/gemv.h, gemm.h): weights streamed once at few rows,
register-tiled GEMMs at many.

At batch-1 decode every weight is read once per token and little else is done, so the step is as fast as the
weights stream. torch's F.linear at one row streams distinct bf16 weights at about half the memory bandwidth, and
on CPUs without bf16 instructions the weights were first converted to float32 (three passes over memory); the
GEMV widens bf16 in registers and splits the output rows over the threads. From 12 rows on, gemm.h's packed
outer-product tiles take over and run near the FMA peak, still widening bf16 weights in registers rather than
converting them per call. Where the CPU has AVX-512 BF16, bf16 products are its dot-product instruction's instead
(gemv_bf16.h), and from a weight's pair_weight() copy, where the model keeps one, gemv_pairs.h's (any rows up to
PAIRS_MAX_ROWS). Same arithmetic as the float32 path: float32 products and sums, one rounding to the output dtype.
int8 and fp8 e4m3 weights with scales per row or per group of columns are read as stored (gemv_quantized); an int8
weight with a scale per row and its int8 pair_weight() copy by gemv_pairs.h, converted to bf16 in registers.
"""
from __future__ import annotations

import sys

import torch

from kernels import cpu_extension
from kernels.cpu_features import cpu_flags, cpu_has_native_bf16


# int8 and fp8 weights: the alternative past the kernel dequantizes the whole weight per call, so the kernel wins
# longer.
# benchmarks/cpu_gemv.py (2-core AVX2, 33 matrices): at 64 rows 65 ms against 89-134 ms dequantizing, at 256 rows
# 237-252 ms against 186-218 ms; torch._weight_int8pack_mm measured alongside was never clearly faster.
INT8_MAX_ROWS = 64

# The weight dtypes the kernels read with float32 scales per row or group (gemv_quantized).
SCALED_DTYPES = (torch.int8, torch.float8_e4m3fn)


# float32 weights: torch's float32 GEMM catches up past this many rows (measured below).
FLOAT32_MAX_ROWS = 256

# bf16 weights on CPUs with AVX-512 BF16 (gemv_bf16.h's dot products): torch's bf16 GEMMs catch up past this.
NATIVE_BF16_MAX_ROWS = 8

# ... and for a small weight, which gemv_bf16.h multiplies in blocks of 16 sums at every row count (under
# SMALL_WEIGHT_BYTES, or rows of at most SHORT_ROW columns: its kSmallWeightBytes and kShortRow). 2-core AVX-512
# BF16 EPYC, against F.linear, the demo model's 17 matrices (192 columns): 0.47x the time at 8 rows, 0.46x at 16,
# 0.87x at 32, 0.92x at 64, 1.37x at 128; the draft model's 9 (64 columns): 0.58x at 8, 0.72x at 16, 0.95x at 32,
# 1.43x at 64.
SMALL_BF16_MAX_ROWS = 32
SMALL_WEIGHT_BYTES, SHORT_ROW = 1 << 19, 256

# bf16 weights with a pair_weight() copy (AVX-512 BF16 only): gemv_pairs.h up to this many rows. python
# benchmarks/cpu_gemv.py --pairs (2-core AVX-512 BF16 EPYC, one run, ms per pass over the benchmark model's 33
# matrices): at 1 / 4 / 8 / 16 / 32 rows 1.23 / 1.34 / 1.77 / 2.91 / 4.96 against gemv_bf16.h's 1.19 / 2.05 / 3.71 /
# 4.87 / 7.35 and the oneDNN-prepacked GEMM's 1.93 / 1.86 / 2.39 / 3.23 / 5.12; at 64 and 96 rows 9.06 and 13.21
# against 9.18 and 13.17; from 128 rows the prepacked GEMM is faster (17.37 against 16.89, at 2048 280.6 against
# 266.1; the demo model's 17 matrices: 1.88 against 1.84 at 128, 28.4 against 25.0 at 2048).
PAIRS_MAX_ROWS = 64


def max_rows(dtype: torch.dtype, weight: torch.Tensor | None = None, pairs: torch.Tensor | None = None) -> int:
    """The most rows of `dtype` the kernels take (for `weight`, if given: an int8 or fp8 one takes INT8_MAX_ROWS, a
    small bf16 one SMALL_BF16_MAX_ROWS where the CPU has bf16 instructions, a bf16 one with its `pairs` copy
    PAIRS_MAX_ROWS), each measured against torch's path on the benchmark model's 33 matrices (python
    benchmarks/cpu_gemv.py, best of 7).

    2-core AVX2 CPU without bf16 instructions (torch's path: F.linear in float32, bf16 weights converted per call):
    bf16 1.9-3.3x faster at 1-64 rows, 1.5x at 128-256, 1.0-1.2x at 512-2048; float32 2.1-3.1x at 1-32 rows,
    1.3-1.6x at 64-128, 1.07x at 256, 0.93-1.0x at 512-2048, hence FLOAT32_MAX_ROWS.
    2-core AVX-512 BF16 CPU (AMD EPYC, torch's bf16 GEMMs use the bf16 instructions): bf16 3.5x at 1 row, 3.1x at 2,
    2.4x at 4, 1.5x at 8, 0.95x at 12, 0.86x at 16, hence NATIVE_BF16_MAX_ROWS; float32 1.4-2.9x at 1-64 rows,
    1.1-1.2x at 128-512, 0.94x at 1024. With AVX-512 but no bf16 instructions the kernels keep to 4 bf16 and 64
    float32 rows, where a step is surely memory-bound (unmeasured: no such CPU here)."""
    if weight is not None and weight.dtype in SCALED_DTYPES:
        return INT8_MAX_ROWS
    if pairs is not None and dtype == torch.bfloat16:
        return PAIRS_MAX_ROWS
    if cpu_has_native_bf16():
        if dtype != torch.bfloat16:
            return FLOAT32_MAX_ROWS
        small = weight is not None and (weight.numel() * 2 < SMALL_WEIGHT_BYTES or weight.shape[-1] <= SHORT_ROW)
        return SMALL_BF16_MAX_ROWS if small else NATIVE_BF16_MAX_ROWS
    if "avx512f" in cpu_flags():
        return 4 if dtype == torch.bfloat16 else 64
    return sys.maxsize if dtype == torch.bfloat16 else FLOAT32_MAX_ROWS


def pairs_cpu() -> bool:
    """Whether this CPU runs gemv_pairs.h: AVX-512 BF16 and BW, what it is compiled for under -march=native (AMX
    alone does not do)."""
    return {"avx512_bf16", "avx512bw"} <= cpu_flags()


def pairs_serve(weight: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
    """Whether a pair_weight() copy of this weight would serve its products: a bf16 CPU matrix, or an int8 one with
    its `scale` per row, on a pairs_cpu()."""
    kind = weight.dtype == torch.bfloat16 if scale is None else (weight.dtype == torch.int8 and scale.dim() == 1)
    return weight.device.type == "cpu" and kind and weight.dim() == 2 and pairs_cpu()


def pairs_shape(weight: torch.Tensor) -> tuple[int, int, int, int]:
    """pair_weight(weight)'s shape: [ceil(N / 32), ceil(K / 2), 32, 2] for a weight [N, K]."""
    rows, columns = weight.shape
    return (rows + 31) // 32, (columns + 1) // 2, 32, 2


def pair_weight(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The bf16 (or int8) weight [N, K] as gemv_pairs.h reads it (into `out`, if given): [ceil(N / 32), ceil(K / 2),
    32, 2], tile t's element [p, r, e] = weight[32 t + r, 2 p + e], zero past N and K (one column pair of 32 output
    rows per 128 bytes; int8: per 64 bytes, in INT8_PAIR_ORDER)."""
    rows, columns = weight.shape
    tiles, pairs, _, _ = pairs_shape(weight)
    padded = torch.nn.functional.pad(weight, (0, columns % 2, 0, -rows % 32))
    laid_out = padded.view(tiles, 32, pairs, 2).transpose(1, 2)
    if weight.dtype == torch.int8:
        laid_out = laid_out.reshape(tiles, pairs, 64)[..., INT8_PAIR_ORDER].view(tiles, pairs, 32, 2)
    return laid_out.contiguous() if out is None else out.copy_(laid_out)


def _int8_pair_order() -> torch.Tensor:
    """Where each of an int8 column pair's 64 bytes comes from: vpunpcklbw and vpunpckhbw (gemv_pairs.h) turn bytes
    0-7, 16-23, 32-39, 48-55 into rows 0-15's bf16 pairs and the others into rows 16-31's."""
    order = torch.empty(64, dtype=torch.long)
    for entry in range(64):
        order[16 * (entry % 32 // 8) + 8 * (entry // 32) + entry % 8] = entry
    return order


INT8_PAIR_ORDER = _int8_pair_order()


def fits_pairs(weight: torch.Tensor, pairs: torch.Tensor) -> bool:
    """Whether `pairs` has pair_weight(weight)'s layout (shape, dtype, contiguous)."""
    return (pairs.dtype == weight.dtype and pairs.is_contiguous() and pairs.device.type == "cpu"
            and pairs.shape == pairs_shape(weight))


def serves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pairs: torch.Tensor | None = None
           ) -> bool:
    """Whether gemv() (or gemv_quantized() for an int8 or fp8 weight) takes this product: on the CPU, up to max_rows
    rows (for this weight, and its `pairs` copy where given), float32 or bfloat16 activations, weight and bias,
    kernel built."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and (weight.dtype == x.dtype or weight.dtype in SCALED_DTYPES)
            and x.numel() <= max_rows(x.dtype, weight, pairs) * weight.shape[-1]
            and weight.dim() == 2 and weight.is_contiguous()
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
            and not torch.is_grad_enabled() and cpu_extension.ready() is not None)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         pairs: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] with few rows; weight [N, K] contiguous, all one dtype. bf16 with
    `pairs` (pair_weight(weight), kept by the model): from that copy, each output summed over the column pairs in
    order whatever the rows beside it."""
    if pairs is not None and x.dtype == torch.bfloat16:
        if not (fits_pairs(weight, pairs) and pairs_serve(weight)):
            raise ValueError("pairs must be pair_weight(weight) of a bf16 weight, on a CPU with AVX-512 BF16")
        return _run(x, weight, None, bias, pairs)
    return _run(x, weight, None, bias)


def gemv_quantized(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                   pairs: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight * scale, bias) for an int8 or fp8 e4m3 weight [N, K] with a float32 scale per row [N] or
    per group of columns [N, K / group] (group a multiple of 8), the weight read as stored: half of bf16's bytes.
    Each row's (or group's) sum is scaled once, in float32 (from 12 rows on, a grouped weight is dequantized a tile
    at a time instead). bf16 rows with `pairs` (pair_weight(weight) of an int8 weight with a scale per row): from
    that copy, as gemv() reads a bf16 one."""
    _check_scaled(weight, scale)
    if pairs is not None and x.dtype == torch.bfloat16:
        if not (fits_pairs(weight, pairs) and pairs_serve(weight, scale)):
            raise ValueError("pairs must be pair_weight(weight) of an int8 weight with a scale per row, on a CPU with "
                             "AVX-512 BF16")
        return _run(x, weight, scale.contiguous(), bias, pairs)
    return _run(x, weight, scale.contiguous(), bias)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
               g_idx: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """kernels.quantized_matmul.dequantize in the C++ kernels, for the weights gemv_quantized takes (no zero points
    or g_idx), into float32 or bf16: the tiles of quantized_linear's GEMMs past the kernel's rows."""
    if zero is not None or g_idx is not None or dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"zero, g_idx, dtype: the kernel dequantizes symmetric scales into float32 or bf16, not "
                         f"zero points, g_idx or {dtype}")
    _check_scaled(weight, scale)
    module = cpu_extension.required()
    weight, scale = weight.contiguous(), scale.contiguous()
    out = torch.empty(weight.shape, dtype=dtype)
    module.dequantize_scaled(dtype == torch.bfloat16, weight.dtype == torch.float8_e4m3fn, weight.data_ptr(),
                             scale.data_ptr(), _group(weight, scale), out.data_ptr(), *weight.shape)
    return out


def _check_scaled(weight: torch.Tensor, scale: torch.Tensor) -> None:
    if weight.dtype not in SCALED_DTYPES or weight.dim() != 2:
        raise ValueError(f"weight: the kernels take a 2-D int8 or float8_e4m3fn weight, not {weight.dtype}")
    if scale.dtype != torch.float32 or scale.shape[:1] != weight.shape[:1] or scale.dim() not in (1, 2) \
            or (scale.dim() == 2 and not takes_groups(weight, scale)):
        raise ValueError("scale: the kernels take a float32 scale [N] or [N, K / group] for a weight [N, K], the "
                         "group a multiple of 8")


def _group(weight: torch.Tensor, scale: torch.Tensor) -> int:
    """The columns sharing a scale: 0 for a scale per row."""
    return weight.shape[1] // scale.shape[1] if scale.dim() == 2 else 0


def takes_groups(weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether the kernel takes these per-group scales: equal groups of a multiple of 8 columns."""
    groups = scale.shape[1]
    return weight.shape[1] % groups == 0 and (weight.shape[1] // groups) % 8 == 0


def _run(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
         pairs: torch.Tensor | None = None) -> torch.Tensor:
    module = cpu_extension.required()
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features or (bias is not None and bias.shape != (out_features,)):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias do not fit")
    rows = x.reshape(-1, in_features).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    bf16, bias_ptr = x.dtype == torch.bfloat16, 0 if bias is None else bias.data_ptr()
    if pairs is not None and scale is not None:
        module.gemv_pairs_int8(rows.data_ptr(), pairs.data_ptr(), scale.data_ptr(), bias_ptr, out.data_ptr(),
                               rows.shape[0], out_features, in_features)
    elif pairs is not None:
        module.gemv_pairs(rows.data_ptr(), pairs.data_ptr(), bias_ptr, out.data_ptr(), rows.shape[0], out_features,
                          in_features)
    elif scale is None:
        module.gemv(bf16, rows.data_ptr(), weight.data_ptr(), bias_ptr, out.data_ptr(), rows.shape[0], out_features,
                    in_features)
    else:
        module.gemv_scaled(bf16, weight.dtype == torch.float8_e4m3fn, rows.data_ptr(), weight.data_ptr(),
                           scale.data_ptr(), _group(weight, scale), bias_ptr, out.data_ptr(), rows.shape[0],
                           out_features, in_features)
    return out.reshape(*x.shape[:-1], out_features)
