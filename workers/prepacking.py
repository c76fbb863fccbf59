"""Which of a loaded model's linear weights keep copies laid out for the CPU's products: paired for the GEMV
kernel's bf16 products of up to 64 rows (kernels.cpu_gemv.pair_weight), prepacked for torch's CPU GEMMs past them
(kernels.cpu_prepacked).

A copy sits next to the plain weight, which the other paths read, so each kind costs the weights' bytes again: a
model gets copies only while all of them take at most PREPACK_MEMORY_FRACTION of the memory available at load,
paired ones first (they serve every decode step of up to 64 requests); a larger model (a 7B one on a 24 GiB
machine) keeps its memory for the KV cache instead.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
from torch import nn

from kernels import cpu_gemv, cpu_prepacked
from workers.cpu_allocator import huge_page_views

PREPACK_MEMORY_FRACTION = 0.125


def prepack_linear_weights(model: nn.Module, available_bytes: int | None = None) -> int:
    """Give each linear layer with a plain bf16 weight its paired copy (`pairs_weight`) where the CPU has the
    kernel's instruction, then its prepacked copy (`packed_weight`), each kind only if all copies fit the budget;
    the bytes copied (0 when none was). Made once: nothing changes a weight after loading (a weight changed in place
    would leave its copies, and the C++ layers' pointers to them, stale)."""
    plain = [m for m in model.modules() if getattr(m, "packed_weight", False) is None
             and getattr(m, "weight_scale", None) is None]
    if available_bytes is None:
        available_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    budget, copied = available_bytes * PREPACK_MEMORY_FRACTION, 0
    for attribute, takes, nbytes, copy in (
            ("pairs_weight", cpu_gemv.pairs_serve, lambda w: math.prod(cpu_gemv.pairs_shape(w)) * 2, _paired),
            ("packed_weight", cpu_prepacked.packable, lambda w: w.nbytes, _prepacked)):
        layers = [m for m in plain if takes(m.weight)]
        total = sum(nbytes(m.weight) for m in layers)
        if not layers or copied + total > budget:
            continue
        for layer, weight_copy in zip(layers, copy([m.weight for m in layers]), strict=True):
            setattr(layer, attribute, weight_copy)
        copied += total
    return copied


def _paired(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The weights' pairs copies in one arena on huge pages: batch-1 decode streams them, as it streams the weights
    (workers.cpu_allocator)."""
    homes = huge_page_views([(cpu_gemv.pairs_shape(w), torch.bfloat16) for w in weights])
    return [cpu_gemv.pair_weight(w, out=home) for w, home in zip(weights, homes)]


def _prepacked(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [cpu_prepacked.prepack(w) for w in weights]
