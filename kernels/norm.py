"""RMSNorm with an optional fused residual add: the Triton kernel on CUDA, else the torch reference."""
from __future__ import annotations

import torch

from kernels import norm_ref
from kernels.backend import use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as norm_ref.rms_norm."""
    if use_triton(x):
        from kernels import norm_triton  # lazily: see kernels.backend
        return norm_triton.rms_norm(x, weight, eps, residual)
    return norm_ref.rms_norm(x, weight, eps, residual)
