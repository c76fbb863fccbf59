"""4-bit weights (kernels.quantized_matmul's packed storage) in the C++ kernels (kernels/csrc/int4.h): which ones they
take, the pairs copy their bf16 products read, and the product itself."""
from __future__ import annotations

import torch

from kernels import cpu_extension, cpu_gemv
from kernels.quantized_matmul import input_size_of, unpack_int4

TILE_ROWS = 32  # gemv_pairs.h's kPairTileRows


def group_of(weight: torch.Tensor, scale: torch.Tensor) -> int | None:
    """0 for a scale per row [N], the columns per group for scales [N, K / group] of an even group, None for others."""
    if scale.shape == weight.shape[:1]:
        return 0
    columns = input_size_of(weight)
    if scale.dim() == 2 and scale.shape[0] == weight.shape[0] and columns % scale.shape[1] == 0 \
            and (columns // scale.shape[1]) % 2 == 0:
        return columns // scale.shape[1]
    return None


def takes(weight: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None,
          g_idx: torch.Tensor | None = None) -> bool:
    """Whether the kernels read this 4-bit weight: contiguous uint8 [N, K / 2] with contiguous float32 scales (and zero
    points, where given) per row or per even group of columns, in the weight's column order (no act-order g_idx)."""
    return (weight.dtype == torch.uint8 and weight.dim() == 2 and weight.is_contiguous() and weight.device.type == "cpu"
            and scale is not None and scale.dtype == torch.float32 and scale.is_contiguous()
            and group_of(weight, scale) is not None and g_idx is None
            and (zero is None or (zero.dtype == torch.float32 and zero.shape == scale.shape and zero.is_contiguous())))


def check(weight: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None,
          pairs: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
    """ValueError unless takes(weight, scale, zero), and `pairs` (where given) is its pair_int4 copy for rows of
    `dtype` on a pairs_cpu() (bf16 ones)."""
    if not takes(weight, scale, zero):
        raise ValueError("a 4-bit projection must be a contiguous uint8 [N, K / 2] weight with contiguous float32 "
                         "scales (and zero points) [N] or [N, K / group], the group even")
    if pairs is not None and not (dtype == torch.bfloat16 and cpu_gemv.pairs_cpu()
                                  and fits_pairs(weight, scale, pairs)):
        raise ValueError("pairs must be pair_int4 of the weight, for bf16 rows on a CPU with AVX-512 BF16")


def _groups(weight: torch.Tensor, scale: torch.Tensor) -> int:
    return 1 if scale.dim() == 1 else scale.shape[1]


def pairs_bytes(weight: torch.Tensor, scale: torch.Tensor) -> int:
    """The size of pair_int4(weight, scale)."""
    tiles = -(-weight.shape[0] // TILE_ROWS)
    return tiles * TILE_ROWS * (weight.shape[1] + 8 * _groups(weight, scale))


def pairs_serve(weight: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None) -> bool:
    """Whether a pair_int4() copy would serve this weight's products: one the kernels take, on a pairs_cpu()."""
    return takes(weight, scale, zero) and cpu_gemv.pairs_cpu()


def fits_pairs(weight: torch.Tensor, scale: torch.Tensor, pairs: torch.Tensor) -> bool:
    return (pairs.dtype == torch.uint8 and pairs.dim() == 1 and pairs.is_contiguous() and pairs.device.type == "cpu"
            and pairs.numel() == pairs_bytes(weight, scale))


def pair_int4(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight as int4.h's bf16 products read it (into `out`, if given): uint8 [pairs_bytes], first each tile of 32
    output rows' column pairs (32 bytes each: byte 16 h + l holds in its low nibble row 16 h + l // 2's and in its
    high one row 16 h + 8 + l // 2's column 2 p + l % 2), then the tiles' scales and their zero points (8 where
    none is given), float32 [tiles, groups, 32]; rows past N zero."""
    rows, groups = weight.shape[0], _groups(weight, scale)
    tiles, pairs = -(-rows // TILE_ROWS), weight.shape[1]
    padding = tiles * TILE_ROWS - rows
    values = torch.nn.functional.pad(unpack_int4(weight), (0, 0, 0, padding))
    lanes = values.view(tiles, 2, 2, 8, pairs, 2).permute(0, 4, 1, 3, 5, 2).reshape(tiles, pairs, 32, 2)
    nibbles = lanes[..., 0] | (lanes[..., 1] << 4)

    def per_tile(table: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(table.reshape(rows, groups), (0, 0, 0, padding))
        return padded.view(tiles, TILE_ROWS, groups).transpose(1, 2).contiguous().view(torch.uint8).reshape(-1)

    zeros = torch.full_like(scale, 8.0) if zero is None else zero
    laid_out = torch.cat([nibbles.reshape(-1), per_tile(scale), per_tile(zeros)])
    return laid_out if out is None else out.copy_(laid_out)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
           bias: torch.Tensor | None = None, pairs: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, dequantize(weight, scale, zero) in x's dtype, bias) in the kernels, for x [..., K] float32 or bf16
    (bf16 with `pairs`, pair_int4's copy: from it, on a pairs_cpu())."""
    check(weight, scale, zero, pairs, x.dtype)
    out_features, in_features = weight.shape[0], input_size_of(weight)
    if x.shape[-1] != in_features or x.dtype not in (torch.float32, torch.bfloat16) or (
            bias is not None and (bias.shape != (out_features,) or bias.dtype != x.dtype)):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} and bias do not fit")
    module = cpu_extension.required()
    rows = x.reshape(-1, in_features).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    module.gemv_int4(x.dtype == torch.bfloat16, rows.data_ptr(), weight.data_ptr(), _pointer(pairs),
                     scale.data_ptr(), _pointer(zero), group_of(weight, scale), _pointer(bias), out.data_ptr(),
                     rows.shape[0], out_features, in_features)
    return out.reshape(*x.shape[:-1], out_features)


def _pointer(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()
