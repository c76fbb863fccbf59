"""Mixture-of-experts math as the layers call it: routing in torch; the experts' grouped GEMMs in Triton on CUDA,
else the torch twin (whose few-row products take the CPU GEMV kernel)."""
from __future__ import annotations

import torch

from kernels import fused_moe_ref
from kernels.backend import use_triton
from kernels.fused_moe_ref import select_experts

__all__ = ["fused_experts", "select_experts"]


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """Same contract as fused_moe_ref.fused_experts."""
    if use_triton(x):
        from kernels import fused_moe_triton  # lazily: see kernels.backend
        return fused_moe_triton.fused_experts(x, gate_up, down, topk_weights, topk_ids, first_expert)
    return fused_moe_ref.fused_experts(x, gate_up, down, topk_weights, topk_ids, first_expert)
