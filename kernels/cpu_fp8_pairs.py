"""fp8 e4m3 weights with scales per row or per group of columns (FP8 block checkpoints) from a pairs copy
(kernels/csrc/fp8_pairs.h): which ones it serves, the copy, and the product.

The plain fp8 kernel converts each weight row into a buffer and reads it back per input row; the pairs copy converts
a column pair of 32 output rows in registers, by the table lookup int8's pairs copy uses, and at more rows a tile
once. Same arithmetic as the plain kernel: the weights' exact values in bf16, each group's float32 sums scaled once.
"""
from __future__ import annotations

import torch

from kernels import cpu_extension, cpu_gemv
from kernels.cpu_features import cpu_flags

TILE_ROWS = 32  # gemv_pairs.h's kPairTileRows
FP8_UNIT = 256.0  # fp8.h's kFp8Unit: the table gives e4m3 values over this, which the scales multiply back


def _groups(weight: torch.Tensor, scale: torch.Tensor) -> int:
    return 1 if scale.dim() == 1 else scale.shape[1]


def takes(weight: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether the pairs kernel reads this weight: fp8 e4m3 [N, K] on the CPU, K even, with float32 scales per row
    [N] or per group of a multiple of 8 columns [N, K / group]."""
    return (weight.dtype == torch.float8_e4m3fn and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.shape[1] % 2 == 0 and scale is not None and scale.dtype == torch.float32
            and (scale.shape == weight.shape[:1] or (scale.dim() == 2 and scale.shape[0] == weight.shape[0]
                                                     and cpu_gemv.takes_groups(weight, scale))))


def pairs_serve(weight: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether a pair_fp8() copy would serve this weight's bf16 products: one the kernel takes, on a CPU with
    AVX-512 BF16 and VBMI (the lookup's vpermt2b)."""
    return takes(weight, scale) and cpu_gemv.pairs_cpu() and "avx512vbmi" in cpu_flags()


def pairs_bytes(weight: torch.Tensor, scale: torch.Tensor) -> int:
    """The size of pair_fp8(weight, scale)."""
    tiles = -(-weight.shape[0] // TILE_ROWS)
    return tiles * TILE_ROWS * (weight.shape[1] + 4 * _groups(weight, scale))


def fits_pairs(weight: torch.Tensor, scale: torch.Tensor, pairs: torch.Tensor) -> bool:
    return (pairs.dtype == torch.uint8 and pairs.dim() == 1 and pairs.is_contiguous() and pairs.device.type == "cpu"
            and pairs.numel() == pairs_bytes(weight, scale))


def pair_fp8(weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight as fp8_pairs.h reads it (into `out`, if given): uint8 [pairs_bytes], first each tile of 32 output
    rows' column pairs in an int8 pairs copy's order (kernels.cpu_gemv.pair_weight of the bytes), then the tiles'
    scales times FP8_UNIT, float32 [tiles, groups, 32]; rows past N zero."""
    rows, groups = weight.shape[0], _groups(weight, scale)
    tiles = -(-rows // TILE_ROWS)
    padding = tiles * TILE_ROWS - rows
    byte_pairs = cpu_gemv.pair_weight(weight.contiguous().view(torch.int8)).view(torch.uint8).reshape(-1)
    scales = torch.nn.functional.pad(scale.reshape(rows, groups).float() * FP8_UNIT, (0, 0, 0, padding))
    scales = scales.view(tiles, TILE_ROWS, groups).transpose(1, 2).contiguous().view(torch.uint8).reshape(-1)
    laid_out = torch.cat([byte_pairs, scales])
    return laid_out if out is None else out.copy_(laid_out)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
           pairs: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight * scale, bias) for bf16 x [..., K] from the weight's pair_fp8 copy, on a CPU it serves."""
    if not (x.dtype == torch.bfloat16 and pairs_serve(weight, scale) and fits_pairs(weight, scale, pairs)):
        raise ValueError("pairs must be pair_fp8 of an fp8 e4m3 weight and its scales, for bf16 rows on a CPU with "
                         "AVX-512 BF16 and VBMI")
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features or (bias is not None and (bias.shape != (out_features,) or bias.dtype != x.dtype)):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias do not fit")
    module = cpu_extension.required()
    rows = x.reshape(-1, in_features).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    group = in_features // _groups(weight, scale)
    module.gemv_pairs_fp8(rows.data_ptr(), pairs.data_ptr(), group, 0 if bias is None else bias.data_ptr(),
                          out.data_ptr(), rows.shape[0], out_features, in_features)
    return out.reshape(*x.shape[:-1], out_features)
