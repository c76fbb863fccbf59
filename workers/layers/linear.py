"""Linear layers whose parameters load their own checkpoint tensors (`weight_loader`), whole or a TP shard."""
from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_gemv, matmul_dtype
from workers.distributed import parallel_state, shard_range, tp_all_reduce


class Linear(nn.Module):
    """y = x W^T + b, with W loaded whole from one checkpoint tensor."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Sliceable, shard_id: int | None = None) -> None:
        _copy_checked(param.data, loaded[:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


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
        self.weight = nn.Parameter(torch.empty(sum(self.output_sizes), input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.output_sizes)), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Sliceable, shard_id: int | None = None) -> None:
        if shard_id is None and len(self.ranges) > 1:
            raise ValueError("a merged linear loads one shard at a time; the checkpoint name had no shard")
        shard = shard_id or 0
        start, end = self.ranges[shard]
        _copy_checked(param.data.narrow(0, sum(self.output_sizes[:shard]), end - start), loaded[start:end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """The input dimension split over the TP ranks (it takes a column-parallel output); partial products are
    summed with an all-reduce, and the bias, held whole by every rank, is added once after it."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        state = parallel_state()
        input_range = shard_range(input_size, state.tp_rank, state.tp_size)
        super().__init__(input_range[1] - input_range[0], output_size, bias)
        self.tp_size, self.input_range = state.tp_size, input_range

    def weight_loader(self, param: nn.Parameter, loaded: Sliceable, shard_id: int | None = None) -> None:
        start, end = self.input_range
        _copy_checked(param.data, loaded[:] if param is self.bias else loaded[:, start:end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return linear(x, self.weight, self.bias)
        out = tp_all_reduce(linear(x, self.weight, None))
        return out if self.bias is None else out + self.bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear in `matmul_dtype`: bf16 weights stay bf16 in memory but multiply as float32 on CPUs that
    would emulate bf16 GEMMs (about 3x faster end to end, same result as a native bf16 GEMM). A few rows on the
    CPU (decode at small batch) go to the GEMV kernel, which streams the weight once."""
    if cpu_gemv.serves(x, weight, bias):
        return cpu_gemv.gemv(x, weight, bias)
    compute = matmul_dtype(weight.dtype, weight.device)
    if compute == weight.dtype:
        return F.linear(x, weight, bias)
    out = F.linear(x.to(compute), weight.to(compute), bias.to(compute) if bias is not None else None)
    return out.to(weight.dtype)


class Sliceable(Protocol):
    """A checkpoint tensor: a torch.Tensor, or a safetensors slice that reads only the bytes indexed."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


def _copy_checked(target: torch.Tensor, loaded: torch.Tensor) -> None:
    if target.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter "
                         f"of shape {tuple(target.shape)}")
    target.copy_(loaded)
