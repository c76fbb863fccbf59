"""Which product each of a loaded model's linear weights uses for one-row steps on CUDA (batch-1 decode):
cuBLAS or the Triton GEMV, chosen per weight shape by timing both on the model's own weights (kernels.gemv_choice)."""
from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn

from kernels import gemv_choice
from kernels.backend import triton_serves

logger = logging.getLogger(__name__)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def choose_gemvs(model: nn.Module) -> list[gemv_choice.GemvChoice]:
    """Set `gemv_config` on each linear layer with a plain CUDA weight (None: cuBLAS); what the timing found, one
    entry per group of weights of one shape, dtype and bias presence (none with the mode "off" or "always", nor
    off CUDA)."""
    mode = gemv_choice.mode()
    layers = [m for m in model.modules() if getattr(m, "gemv_config", False) is None
              and getattr(m, "weight_scale", None) is None and m.weight.dim() == 2 and m.weight.dtype in _DTYPES
              and m.weight.stride(1) == 1 and triton_serves(m.weight.device)]
    if mode == "off" or not layers:
        return []
    if mode == "always":
        for layer in layers:
            layer.gemv_config = gemv_choice.CONFIGS[0]
        return []
    groups: dict[tuple, list[nn.Module]] = defaultdict(list)
    for layer in layers:
        bias = getattr(layer, "bias", None)
        groups[(tuple(layer.weight.shape), layer.weight.dtype, bias is not None)].append(layer)
    choices = []
    for group in groups.values():
        choice = gemv_choice.choose([(m.weight, getattr(m, "bias", None)) for m in group])
        for layer in group:
            layer.gemv_config = choice.config
        triton = "none ran" if choice.triton_us is None else f"{choice.triton_us:.1f} us"
        logger.info("one-row products of %s %s weights (%d): cuBLAS %.1f us, Triton GEMV %s: %s", choice.shape,
                    choice.dtype, choice.weights, choice.cublas_us, triton, choice.config or "cuBLAS")
        choices.append(choice)
    return choices
