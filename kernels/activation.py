"""SiLU-gated activation: the Triton kernel on CUDA, else the torch reference."""
from __future__ import annotations

import torch

from kernels import activation_ref
from kernels.backend import use_triton


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as activation_ref.silu_and_mul."""
    if use_triton(x):
        from kernels import activation_triton  # lazily: see kernels.backend
        return activation_triton.silu_and_mul(x)
    return activation_ref.silu_and_mul(x)
