"""bf16 weights prepacked into oneDNN's GEMM layout, for torch's CPU GEMMs on rows too many for the GEMV kernel.

F.linear on a plain bf16 weight reorders it into the GEMM's blocked layout on every call: at prefill's thousands of
rows that is noise, but a decode step of 16-96 rows streams each weight from memory and pays the reorder on top.
Prepacked once, the same products are bit-identical and, in the throughput benchmark's decode steps (the
benchmark model, 2-core AVX-512 BF16 EPYC), 1.3-1.6x faster (9-31 rows 81 -> 127 GFLOP/s, 32-63 rows 150 -> 205,
64-95 rows 209 -> 263); prefill's chunks are unchanged (379 -> 387).
"""
from __future__ import annotations

import torch

from kernels.cpu_features import matmul_dtype


def packable(weight: torch.Tensor) -> bool:
    """A bf16 matrix on a CPU whose GEMMs run in bf16 (not converted to float32 per call), torch built with oneDNN."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and matmul_dtype(weight.dtype, weight.device) == torch.bfloat16 and torch.backends.mkldnn.is_available())


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] in oneDNN's layout for any row count (an opaque tensor: only linear() reads it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] in bf16, from the weight's prepack(); bit-identical to it."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
