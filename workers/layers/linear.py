"""Linear layers whose parameters load their own checkpoint tensors (`weight_loader`), whole or a TP shard."""
from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from kernels.matmul import linear
from kernels.quantized_matmul import dequantize
from workers.distributed import parallel_state, shard_range, tp_all_reduce


class Linear(nn.Module):
    """y = x W^T + b, with W loaded whole from one checkpoint tensor. Weight quantization (workers/quantization)
    may replace W by a quantized one and set `weight_scale` (and `weight_zero`, `weight_g_idx`: see
    kernels.quantized_matmul), unless the layer is not `quantizable` (a router)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quantizable: bool = True) -> None:
        super().__init__()
        self.quantizable = quantizable
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        add_quantization_slots(self)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Sliceable, shard_id: int | None = None) -> None:
        copy_checked(param.data, loaded[:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = quantizable_linear(self, x, self.bias)
        return out if self.lora is None else self.lora.add_delta(x, out)


class ColumnParallelLinear(nn.Module):
    """Linears over the same input stacked on the output dimension, each split over the TP ranks: shard i is
    `units` blocks of `unit_size` rows (heads of head_dim, or single rows). Outputs stay split; no communication.
    Fewer units than ranks (KV heads) are replicated: each rank holds the unit its share of the others uses."""

    def __init__(self, input_size: int, shards: list[tuple[int, int]], bias: bool = False) -> None:
        super().__init__()
        state = parallel_state()
        unit_ranges = [shard_range(units, state.tp_rank, state.tp_size) for units, _ in shards]
        self.ranges = [(start * unit, end * unit) for (start, end), (_, unit) in zip(unit_ranges, shards)]
        self.output_sizes = [end - start for start, end in self.ranges]
        self.full_sizes = [units * unit for units, unit in shards]
        self.quantizable = True
        self.weight = nn.Parameter(torch.empty(sum(self.output_sizes), input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        add_quantization_slots(self)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.output_sizes)), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Sliceable, shard_id: int | None = None) -> None:
        """One shard's checkpoint tensor, or (shard_id None) every shard fused in one tensor, as Phi-3 stores
        qkv_proj and gate_up_proj: each shard's rows then sit at its offset in the fused tensor."""
        if shard_id is None and len(self.ranges) > 1 and _rows_of(loaded) != sum(self.full_sizes):
            raise ValueError(f"fused checkpoint tensor has {_rows_of(loaded)} rows; its parts "
                             f"{self.full_sizes} need {sum(self.full_sizes)}")
        for shard in range(len(self.ranges)) if shard_id is None else [shard_id]:
            offset = sum(self.full_sizes[:shard]) if shard_id is None else 0
            start, end = self.ranges[shard]
            copy_checked(param.data.narrow(0, sum(self.output_sizes[:shard]), end - start),
                          loaded[offset + start:offset + end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = quantizable_linear(self, x, self.bias)
        return out if self.lora is None else self.lora.add_delta(x, out)


class RowParallelLinear(Linear):
    """The input dimension split over the TP ranks (it takes a column-parallel output); partial products are
    summed with an all-reduce, and the bias, held whole by every rank, is added once after it."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        state = parallel_state()
        input_range = shard_range(input_size, state.tp_rank, state.tp_size)
        super().__init__(input_range[1] - input_range[0], output_size, bias)
        self.tp_size, self.input_range, self.full_input_size = state.tp_size, input_range, input_size

    def weight_loader(self, param: nn.Parameter, loaded: Sliceable, shard_id: int | None = None) -> None:
        start, end = self.input_range
        copy_checked(param.data, loaded[:] if param is self.bias else loaded[:, start:end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        partial = quantizable_linear(self, x, None)
        if self.lora is not None:  # this rank's share of the delta: summed with the products
            partial = self.lora.add_delta(x, partial)
        out = tp_all_reduce(partial)
        return out if self.bias is None else out + self.bias


class Sliceable(Protocol):
    """A checkpoint tensor: a torch.Tensor, or a safetensors slice that reads only the bytes indexed."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


def add_quantization_slots(layer: nn.Module) -> None:
    """The tensors a quantized weight comes with, None while the weight is not quantized; the layer's LoRA
    adapter slots (workers.lora), None until an adapter targets it; its weight's copies for the CPU's products
    (workers.prepacking: paired for the GEMV kernel, prepacked for torch's GEMMs), None unless the model keeps
    them; and the Triton GEMV's launch shape for its one-row
    products on CUDA (workers.gemv_tuning), None: cuBLAS."""
    for name in ("weight_scale", "weight_zero", "weight_g_idx"):
        layer.register_buffer(name, None, persistent=False)
    layer.lora = None
    layer.packed_weight = None
    layer.pairs_weight = None
    layer.gemv_config = None


def quantizable_linear(layer: Linear | ColumnParallelLinear, x: torch.Tensor, bias: torch.Tensor | None
                       ) -> torch.Tensor:
    return linear(x, layer.weight, bias, layer.weight_scale, layer.weight_zero, layer.weight_g_idx, layer.packed_weight,
                  layer.pairs_weight, layer.gemv_config)


def dequantized_weight(layer: Linear | ColumnParallelLinear) -> torch.Tensor:
    """The layer's weight for code that reads it directly: as loaded, or (quantized) dequantized to float32."""
    if layer.weight_scale is None:
        return layer.weight
    return dequantize(layer.weight, layer.weight_scale, layer.weight_zero, layer.weight_g_idx)


def _rows_of(loaded: Sliceable) -> int:
    return loaded.shape[0] if isinstance(loaded, torch.Tensor) else loaded.get_shape()[0]


def copy_checked(target: torch.Tensor, loaded: torch.Tensor) -> None:
    if target.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter "
                         f"of shape {tuple(target.shape)}")
    target.copy_(loaded)
