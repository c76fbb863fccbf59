"""Linear layers whose parameters know how to load their checkpoint tensors (`weight_loader`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import matmul_dtype


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

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        _copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several linears over the same input stacked on the output dimension (q/k/v, gate/up): one matmul."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            raise ValueError("a merged linear loads one shard at a time; the checkpoint name had no shard")
        offset = sum(self.output_sizes[:shard_id])
        _copy_checked(param.data.narrow(0, offset, self.output_sizes[shard_id]), loaded)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear in `matmul_dtype`: bf16 weights stay bf16 in memory but multiply as float32 on CPUs that
    would emulate bf16 GEMMs (about 3x faster end to end, same result as a native bf16 GEMM)."""
    compute = matmul_dtype(weight.dtype, weight.device)
    if compute == weight.dtype:
        return F.linear(x, weight, bias)
    out = F.linear(x.to(compute), weight.to(compute), bias.to(compute) if bias is not None else None)
    return out.to(weight.dtype)


def _copy_checked(target: torch.Tensor, loaded: torch.Tensor) -> None:
    if target.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter "
                         f"of shape {tuple(target.shape)}")
    target.copy_(loaded)
