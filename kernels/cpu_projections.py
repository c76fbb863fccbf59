"""Which projection weights the C++ decoder layer reads (dtypes, scales, zero points) and for how many rows of a
step: the rule every family's layer and kernels.cpu_layer_weights ask."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from kernels import cpu_gemv, cpu_int4
from kernels.quantized_matmul import input_size_of


def features(weight: torch.Tensor) -> tuple[int, int]:
    """A projection's output and input features (a 4-bit weight holds two inputs a byte)."""
    return weight.shape[0], input_size_of(weight)


def scale_group(weight: torch.Tensor, scale: torch.Tensor) -> int | None:
    """0 for a scale per row, the group size for scales per group the kernel takes, None for other scales."""
    if weight.dtype == torch.uint8:
        return cpu_int4.group_of(weight, scale)
    if scale.shape == weight.shape[:1]:
        return 0
    if scale.dim() == 2 and scale.shape[0] == weight.shape[0] and cpu_gemv.takes_groups(weight, scale):
        return weight.shape[1] // scale.shape[1]
    return None


def takes_projection(weight: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None,
                     g_idx: torch.Tensor | None) -> bool:
    """Whether the one-call layer reads this projection: unquantized, symmetric int8 or fp8 e4m3 with scales per
    row or per group (GGUF's Q8_0, fp8 block checkpoints' blocks along K where they divide it), or 4-bit with scales
    and optional zero points per row or even group (GPTQ, AWQ, compressed-tensors; not act-order's permuted columns:
    the loaders drop a g_idx that is the plain k // group)."""
    if weight.dtype == torch.uint8:
        return cpu_int4.takes(weight, scale, zero, g_idx)
    return scale is None or (weight.dtype in cpu_gemv.SCALED_DTYPES and zero is None and g_idx is None
                             and scale_group(weight, scale) is not None)


def max_rows(dtype: torch.dtype, weights: Sequence[torch.Tensor] = (),
             pairs: Sequence[torch.Tensor | None] = ()) -> int:
    """The most tokens of a step whose products the layer runs in the kernels (the least of cpu_gemv's limits for
    its projection weights, if given, with their pairs copies where given); past them torch's
    GEMMs are faster, and the layer takes them between its calls (decoder_layers_with_products: in-process decode
    of the benchmark model on a 2-core AVX-512 BF16 EPYC, 10.5 ms per step at 16 requests against 12.3 with the
    kernels' products and 14.0 on the op path; 14.6 against 18.3 on the op path at 32, 25.0 against 29.1 at 64)."""
    return min((cpu_gemv.INT8_MAX_ROWS if weight.dtype == torch.uint8 else cpu_gemv.max_rows(dtype, weight, paired)
                for weight, paired in itertools.zip_longest(weights, pairs)), default=cpu_gemv.max_rows(dtype))
