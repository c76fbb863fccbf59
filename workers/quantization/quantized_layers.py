"""Quantized checkpoint weights into the linear layers: storage allocated in the checkpoint's scheme on the first
part, each part sharded as the layer shards a plain weight (output rows for column-parallel parts, input columns
for row-parallel ones, in units of packed values and of groups)."""
from __future__ import annotations

import torch
from torch import nn

from kernels.quantized_matmul import input_size_of
from workers.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from workers.quantization.formats import QuantizedTensors


def holds_quantized(layer: nn.Module) -> bool:
    """Whether the layer computes with quantized storage (else a quantized checkpoint weight is dequantized into
    it at load: routers, experts, embeddings)."""
    return isinstance(layer, (Linear, ColumnParallelLinear)) and layer.quantizable


def load_quantized(layer: Linear | ColumnParallelLinear, part: QuantizedTensors, shard_id: int | None) -> None:
    """Copy one checkpoint module's quantized weight into the layer's share (`shard_id`: its place in a merged
    projection, None when whole)."""
    if layer.weight_scale is None:
        _allocate(layer, part)
    _check_same_scheme(layer, part)
    row_parallel = isinstance(layer, RowParallelLinear)
    act_order = part.g_idx is not None
    group = input_size_of(part.weight) // part.scale.shape[1] if part.scale.dim() == 2 and not act_order else None
    pieces = [(layer.weight, _Columns(part.weight, 2 if part.weight.dtype == torch.uint8 else 1)),
              (layer.weight_scale, _columns_of_scales(part.scale, group)),
              (layer.weight_zero, None if part.zero is None else _columns_of_scales(part.zero, group))]
    for target, loaded in pieces:
        if loaded is not None:
            layer.weight_loader(target, loaded if row_parallel else loaded.tensor, shard_id)
    if act_order:
        _load_g_idx(layer, part.g_idx)


def _allocate(layer: Linear | ColumnParallelLinear, part: QuantizedTensors) -> None:
    rows, columns = layer.weight.shape
    device = layer.weight.device
    weight_columns = columns // 2 if part.weight.dtype == torch.uint8 else columns
    scale_shape: tuple[int, ...] = (rows,)
    if part.scale.dim() == 2:
        groups = part.scale.shape[1]
        if part.g_idx is None:
            group = input_size_of(part.weight) // groups
            if columns % group or (part.weight.dtype == torch.uint8 and columns % 2):
                raise ValueError(f"this rank's {columns} input features do not hold whole quantization groups of "
                                 f"{group}: choose a tensor-parallel size that splits the groups evenly")
            groups = columns // group
        scale_shape = (rows, groups)
    weight = nn.Parameter(torch.empty(rows, weight_columns, dtype=part.weight.dtype, device=device),
                          requires_grad=False)
    weight.weight_loader = layer.weight_loader
    layer.weight = weight
    layer.weight_scale = torch.empty(scale_shape, dtype=torch.float32, device=device)
    if part.zero is not None:
        layer.weight_zero = torch.empty(scale_shape, dtype=torch.float32, device=device)
    if part.g_idx is not None:
        layer.weight_g_idx = torch.empty(columns, dtype=torch.int32, device=device)
        layer.g_idx_loaded = None


def _check_same_scheme(layer: Linear | ColumnParallelLinear, part: QuantizedTensors) -> None:
    """The parts of a merged projection (q, k, v) must share one scheme: the layer multiplies them as one."""
    same = (layer.weight.dtype == part.weight.dtype and layer.weight_scale.dim() == part.scale.dim()
            and (layer.weight_zero is None) == (part.zero is None)
            and (layer.weight_g_idx is None) == (part.g_idx is None)
            and (part.g_idx is not None or part.scale.dim() == 1
                 or input_size_of(layer.weight) // layer.weight_scale.shape[1]
                 == input_size_of(part.weight) // part.scale.shape[1]))
    if not same:
        raise ValueError("the parts of a merged projection are quantized differently (dtype, groups, zero points or "
                         "act-order); they must share one scheme")


def _load_g_idx(layer: Linear | ColumnParallelLinear, g_idx: torch.Tensor) -> None:
    if isinstance(layer, RowParallelLinear):
        start, end = layer.input_range
        layer.weight_g_idx.copy_(g_idx[start:end])
        return
    if layer.g_idx_loaded is not None and not torch.equal(layer.g_idx_loaded, g_idx):
        raise ValueError("the parts of a merged projection have different act-order g_idx; they share one input")
    layer.g_idx_loaded = g_idx
    layer.weight_g_idx.copy_(g_idx)


class _Columns:
    """A canonical tensor indexed as the row-parallel loader indexes a plain weight ([:, start:end] in input
    features), its columns being `unit` features each (2 for packed 4-bit, the group size for scales); whole when
    unit is None (scales per row, act-order's scales indexed through g_idx)."""

    def __init__(self, tensor: torch.Tensor, unit: int | None) -> None:
        self.tensor, self.unit = tensor, unit

    def __getitem__(self, index: object) -> torch.Tensor:
        if self.unit is None or not isinstance(index, tuple):
            return self.tensor
        columns = index[1]
        if columns.start % self.unit or columns.stop % self.unit:
            raise ValueError(f"a tensor-parallel shard boundary ({columns.start}, {columns.stop}) splits a "
                             f"quantization unit of {self.unit} input features")
        return self.tensor[:, columns.start // self.unit:columns.stop // self.unit]


def _columns_of_scales(scale: torch.Tensor, group: int | None) -> _Columns:
    return _Columns(scale, group if scale.dim() == 2 else None)
