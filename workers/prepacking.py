"""Which of a loaded model's linear weights keep copies laid out for the CPU's products: paired for the GEMV
kernel's bf16 products of up to 64 rows (kernels.cpu_gemv.pair_weight), prepacked for torch's CPU GEMMs past them
(kernels.cpu_prepacked).

A copy sits next to the plain weight, which the other paths read, so each kind costs the weights' bytes again: a
model gets copies only while all of them take at most PREPACK_MEMORY_FRACTION of the memory available at load,
paired ones first (they serve every decode step of up to 64 requests); a larger model (a 7B one on a 24 GiB
machine) keeps its memory for the KV cache instead.
"""
from __future__ import annotations

import os

from torch import nn

from kernels import cpu_gemv, cpu_prepacked

PREPACK_MEMORY_FRACTION = 0.125


def prepack_linear_weights(model: nn.Module, available_bytes: int | None = None) -> int:
    """Give each linear layer with a plain bf16 weight its paired copy (`pairs_weight`) where the CPU has the
    kernel's instruction, then its prepacked copy (`packed_weight`), each kind only if all copies fit the budget;
    the bytes copied (0 when none was)."""
    plain = [m for m in model.modules() if getattr(m, "packed_weight", False) is None
             and getattr(m, "weight_scale", None) is None]
    if available_bytes is None:
        available_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    budget, copied = available_bytes * PREPACK_MEMORY_FRACTION, 0
    for attribute, takes, copy in (("pairs_weight", cpu_gemv.pairs_serve, cpu_gemv.pair_weight),
                                   ("packed_weight", cpu_prepacked.packable, cpu_prepacked.prepack)):
        layers = [m for m in plain if takes(m.weight)]
        total = sum(m.weight.nbytes for m in layers)
        if not layers or copied + total > budget:
            continue
        for layer in layers:
            setattr(layer, attribute, copy(layer.weight))
        copied += total
    return copied
