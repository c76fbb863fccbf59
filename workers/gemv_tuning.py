"""Which product each of a loaded model's linear weights uses for one-row steps on CUDA (batch-1 decode): the general
one (cuBLAS; the quantized kernel for int8) or the Triton GEMV, chosen per weight shape by timing both on the
model's own weights (kernels.gemv_choice)."""
from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn

from kernels import gemv_choice
from kernels.backend import triton_serves

logger = logging.getLogger(__name__)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def streamable(layer: nn.Module) -> bool:
    """A linear layer whose weight the GEMV reads as stored: plain, or int8 with one float32 scale per row."""
    weight, scale = layer.weight, getattr(layer, "weight_scale", None)
    if scale is None:
        plain = weight.dtype in _DTYPES
    else:
        plain = weight.dtype == torch.int8 and scale.dim() == 1 and scale.dtype == torch.float32 \
            and getattr(layer, "weight_zero", None) is None and getattr(layer, "weight_g_idx", None) is None
    return plain and weight.dim() == 2 and weight.stride(1) == 1


def choose_gemvs(model: nn.Module, dtype: torch.dtype) -> list[gemv_choice.GemvChoice]:
    """Set `gemv_config` on each linear layer with a streamable CUDA weight (None: the general product), for
    activations of `dtype`; what the timing found, one entry per group of weights of one shape, dtype and bias
    presence (none with the mode "off" or "always", nor off CUDA)."""
    mode = gemv_choice.mode()
    layers = [m for m in model.modules() if getattr(m, "gemv_config", False) is None and streamable(m)
              and triton_serves(m.weight.device)]
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
        choice = gemv_choice.choose([(m.weight, getattr(m, "bias", None), getattr(m, "weight_scale", None))
                                    for m in group], dtype)
        for layer in group:
            layer.gemv_config = choice.config
        triton = "none ran" if choice.triton_us is None else f"{choice.triton_us:.1f} us"
        logger.info("one-row products of %s %s weights (%d): general %.1f us, Triton GEMV %s: %s", choice.shape,
                    choice.dtype, choice.weights, choice.general_us, triton, choice.config or "general")
        choices.append(choice)
    return choices
