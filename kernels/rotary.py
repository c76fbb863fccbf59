"""Rotary position embedding: the Triton kernel (in place) on CUDA, else the torch reference."""
from __future__ import annotations

import torch

from kernels import rotary_ref
from kernels.backend import use_triton


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as rotary_ref.rotary_embedding; on CUDA query and key are rotated in place and returned."""
    if use_triton(query):
        from kernels import rotary_triton  # lazily: see kernels.backend
        return rotary_triton.rotary_embedding(positions, query, key, cos, sin)
    return rotary_ref.rotary_embedding(positions, query, key, cos, sin)
