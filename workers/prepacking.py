"""Which of a loaded model's linear weights keep a copy prepacked for torch's CPU GEMMs (kernels.cpu_prepacked).

The copy sits next to the plain weight, which the GEMV and fused decoder-layer kernels read, so it costs the
weights' bytes again: a model gets copies only while they take at most PREPACK_MEMORY_FRACTION of the memory
available at load; a larger model (a 7B one on a 24 GiB machine) keeps its memory for the KV cache instead.
"""
from __future__ import annotations

import os

from torch import nn

from kernels import cpu_prepacked

PREPACK_MEMORY_FRACTION = 0.125


def prepack_linear_weights(model: nn.Module, available_bytes: int | None = None) -> int:
    """Give each linear layer with a plain packable weight its prepacked copy (`packed_weight`) if all of them
    fit the budget; the bytes packed (0 when none was)."""
    layers = [m for m in model.modules() if getattr(m, "packed_weight", False) is None
              and getattr(m, "weight_scale", None) is None and cpu_prepacked.packable(m.weight)]
    total = sum(m.weight.nbytes for m in layers)
    if available_bytes is None:
        available_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    if not layers or total > available_bytes * PREPACK_MEMORY_FRACTION:
        return 0
    for layer in layers:
        layer.packed_weight = cpu_prepacked.prepack(layer.weight)
    return total
