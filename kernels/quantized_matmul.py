"""y = x W^T + b for quantized weights (int8, packed 4-bit, fp8 with scales per row or per group, optional zero
points and act-order), dequantized a tile of output rows at a time: never the whole weight at once.

A quantized weight is stored as
- `weight`: int8 [N, K]; uint8 [N, K / 2] holding two unsigned 4-bit values per byte (column 2j in the low
  nibble, 2j + 1 in the high one); or float8_e4m3fn [N, K];
- `scale`: float32 [N] (one per output row) or [N, G] (G groups along K);
- `zero`: None or float32 like `scale`, the zero point in quantized units; absent, 4-bit values are centred at 8
  (signed int4 stored as unsigned) and the others at 0;
- `g_idx`: None or int32 [K], the group of each input column (GPTQ's act-order); absent, column k is in group
  k // (K / G).
Real weight = (q - zero) * scale, of that column's group.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.cpu_features import matmul_dtype

QUANTIZED_DTYPES = (torch.int8, torch.uint8, torch.float8_e4m3fn)
# Rows dequantized per tile: 4M elements (16 MiB in float32) keeps the temporary small next to any weight.
TILE_ELEMENTS = 1 << 22


def input_size_of(weight: torch.Tensor) -> int:
    """K, the input features of a stored weight (packed 4-bit holds two per byte)."""
    return weight.shape[1] * 2 if weight.dtype == torch.uint8 else weight.shape[1]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] → uint8 [N, K], values 0..15."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Values 0..15 [N, K] (K even) → uint8 [N, K / 2], the inverse of unpack_int4."""
    if values.shape[-1] % 2:
        raise ValueError("4-bit packing needs an even number of input features")
    pairs = values.to(torch.uint8).reshape(values.shape[0], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
               g_idx: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The real weight [N, K] in `dtype` (the torch twin of every quantized product here)."""
    q = (unpack_int4(weight) if weight.dtype == torch.uint8 else weight).float()
    if zero is None and weight.dtype == torch.uint8:
        q -= 8.0
    if scale.dim() == 1:
        w = (q if zero is None else q - zero.unsqueeze(1)) * scale.unsqueeze(1)
        return w.to(dtype)
    if g_idx is not None:
        columns = g_idx.long()
        w = (q if zero is None else q - zero[:, columns]) * scale[:, columns]
        return w.to(dtype)
    rows, groups = scale.shape
    grouped = q.view(rows, groups, -1)
    if zero is not None:
        grouped = grouped - zero.unsqueeze(-1)
    return (grouped * scale.unsqueeze(-1)).reshape(rows, -1).to(dtype)


def check_quantized(weight: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None,
                    g_idx: torch.Tensor | None) -> None:
    """ValueError when the tensors do not describe one quantized weight (shapes, dtypes, groups)."""
    if weight.dtype not in QUANTIZED_DTYPES or weight.dim() != 2:
        raise ValueError(f"a quantized weight is 2-D int8, uint8 (4-bit) or float8_e4m3fn, not {weight.dtype}")
    if scale is None or scale.dtype != torch.float32 or scale.dim() not in (1, 2) or scale.shape[0] != weight.shape[0]:
        raise ValueError(f"a quantized weight [{weight.shape[0]}, ...] needs a float32 scale [N] or [N, G]")
    if zero is not None and zero.shape != scale.shape:
        raise ValueError(f"zero points {tuple(zero.shape)} do not match the scales {tuple(scale.shape)}")
    k = input_size_of(weight)
    if g_idx is not None:
        if scale.dim() != 2 or g_idx.shape != (k,) or (g_idx.numel() and int(g_idx.max()) >= scale.shape[1]):
            raise ValueError(f"g_idx must give each of the {k} input columns one of the {scale.shape[-1]} groups")
    elif scale.dim() == 2 and k % scale.shape[1]:
        raise ValueError(f"{k} input features do not split into {scale.shape[1]} equal groups")


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                     g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     dequantizer: Callable[..., torch.Tensor] = dequantize) -> torch.Tensor:
    """F.linear(x, dequantize(...), bias) in the GEMM dtype of x, a tile of output rows at a time (dequantized by
    `dequantizer`, dequantize's signature: the C++ kernels' kernels.cpu_gemv.dequantize where they take the weight)."""
    compute = matmul_dtype(x.dtype, x.device)
    rows = x.reshape(-1, x.shape[-1]).to(compute)
    out_features = weight.shape[0]
    tile = max(1, TILE_ELEMENTS // max(1, input_size_of(weight)))
    out = torch.empty(rows.shape[0], out_features, dtype=compute, device=x.device)
    for start in range(0, out_features, tile):
        end = min(start + tile, out_features)
        w = dequantizer(weight[start:end], scale[start:end], None if zero is None else zero[start:end], g_idx,
                        compute)
        out[:, start:end] = rows @ w.t()
    if bias is not None:
        out += bias.to(compute)
    return out.to(x.dtype).reshape(*x.shape[:-1], out_features)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                     g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product with the whole weight dequantized in float32: what tests compare every path against."""
    return F.linear(x.float(), dequantize(weight, scale, zero, g_idx), None if bias is None else bias.float())
