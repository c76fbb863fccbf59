"""Which of a loaded model's linear weights keep copies laid out for the CPU's products: paired for the GEMV
kernel's bf16 (and int8) products of up to 64 rows (kernels.cpu_gemv.pair_weight; 4-bit weights' for the C++ layer:
kernels.cpu_int4.pair_int4; fp8 ones': kernels.cpu_fp8_pairs.pair_fp8), prepacked for torch's CPU GEMMs past them
(kernels.cpu_prepacked).

A copy sits next to the plain weight, which the other paths read, so each kind costs the weights' bytes again: a
model gets copies only while all of them take at most PREPACK_MEMORY_FRACTION of the memory available at load,
paired ones first (they serve every decode step of up to 64 requests); a larger model (a 7B one on a 24 GiB
machine) keeps its memory for the KV cache instead.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from kernels import cpu_fp8_pairs, cpu_gemv, cpu_int4, cpu_prepacked
from workers.cpu_allocator import available_memory, huge_page_views

PREPACK_MEMORY_FRACTION = 0.125
BYTE_COPIES = (torch.uint8, torch.float8_e4m3fn)  # weights whose pairs copy is bytes and scales together (uint8)


def prepack_linear_weights(model: nn.Module, available_bytes: int | None = None) -> int:
    """Give each linear layer with a plain bf16 weight, an int8 one with a scale per row or a 4-bit one the kernels
    take, its paired copy (`pairs_weight`), and each mixture of experts' stacked bf16 weights theirs
    (workers.layers.fused_moe.FusedMoE's `gate_up_pairs`, `down_pairs`), where the CPU has the kernel's instruction,
    then each linear layer its prepacked copy (`packed_weight`), each kind only if all copies fit the budget; the
    bytes copied (0 when none was). Made once: nothing changes a weight after loading (a weight changed in place
    would leave its copies, and the C++ layers' pointers to them, stale)."""
    plain = [m for m in model.modules() if getattr(m, "packed_weight", False) is None
             and getattr(m, "weight_scale", None) is None]
    # int8 copies serve bf16 rows only: a bf16 model's (its norms' dtype, say).
    bf16 = any(p.dtype == torch.bfloat16 for p in model.parameters())
    int8 = [(m, "pairs_weight", m.weight) for m in model.modules() if bf16 and getattr(m, "quantizable", False)
            and getattr(m, "weight_zero", True) is None and getattr(m, "weight_g_idx", True) is None
            and m.weight_scale is not None and cpu_gemv.pairs_serve(m.weight, m.weight_scale)]
    int4 = [(m, "pairs_weight", m.weight) for m in model.modules() if bf16 and getattr(m, "quantizable", False)
            and getattr(m, "weight_g_idx", True) is None and m.weight.dtype == torch.uint8
            and cpu_int4.pairs_serve(m.weight, m.weight_scale, m.weight_zero)]
    fp8 = [(m, "pairs_weight", m.weight) for m in model.modules() if bf16 and getattr(m, "quantizable", False)
           and getattr(m, "weight_zero", True) is None and getattr(m, "weight_g_idx", True) is None
           and m.weight.dtype == torch.float8_e4m3fn and cpu_fp8_pairs.pairs_serve(m.weight, m.weight_scale)]
    stacks = [(m, f"{name}_pairs", getattr(m, f"{name}_proj")) for m in model.modules()
              for name in ("gate_up", "down") if getattr(m, f"{name}_pairs", False) is None]
    if available_bytes is None:
        available_bytes = available_memory()
    budget, copied = available_bytes * PREPACK_MEMORY_FRACTION, 0
    for targets, takes, nbytes, copy in (
            ([(m, "pairs_weight", m.weight) for m in plain] + stacks + int8 + int4 + fp8,
             lambda w: w.dtype in BYTE_COPIES or w.dtype == torch.int8 or cpu_gemv.pairs_serve(_matrix(w)),
             _pairs_bytes,
             _paired),
            ([(m, "packed_weight", m.weight) for m in plain], cpu_prepacked.packable, lambda m, w: w.nbytes,
             _prepacked)):
        targets = [(owner, attribute, weight) for owner, attribute, weight in targets if takes(weight)]
        total = sum(nbytes(owner, weight) for owner, _, weight in targets)
        if not targets or copied + total > budget:
            continue
        for (owner, attribute, _), weight_copy in zip(targets, copy(targets), strict=True):
            setattr(owner, attribute, weight_copy)
        copied += total
    return copied


def _matrix(weight: torch.Tensor) -> torch.Tensor:
    """A weight matrix, or a stack's first."""
    return weight[(0,) * (weight.dim() - 2)]


def _pairs_shape(weight: torch.Tensor) -> tuple[int, ...]:
    """A weight matrix's pair_weight shape, or a stack's: each matrix's, stacked."""
    return (*weight.shape[:-2], *cpu_gemv.pairs_shape(_matrix(weight)))


def _pairs_bytes(owner: nn.Module, weight: torch.Tensor) -> int:
    if weight.dtype == torch.uint8:
        return cpu_int4.pairs_bytes(weight, owner.weight_scale)
    if weight.dtype == torch.float8_e4m3fn:
        return cpu_fp8_pairs.pairs_bytes(weight, owner.weight_scale)
    return math.prod(_pairs_shape(weight)) * weight.element_size()


def _paired(targets: Sequence[tuple[nn.Module, str, torch.Tensor]]) -> list[torch.Tensor]:
    """The weights' pairs copies (a stack's matrices each paired in turn) in one arena on huge pages: batch-1 decode
    streams them, as it streams the weights (workers.cpu_allocator)."""
    homes = huge_page_views([((_pairs_bytes(m, w),), torch.uint8) if w.dtype in BYTE_COPIES
                             else (_pairs_shape(w), w.dtype) for m, _, w in targets])
    for (owner, _, weight), home in zip(targets, homes):
        if weight.dtype == torch.uint8:
            cpu_int4.pair_int4(weight, owner.weight_scale, owner.weight_zero, out=home)
            continue
        if weight.dtype == torch.float8_e4m3fn:
            cpu_fp8_pairs.pair_fp8(weight, owner.weight_scale, out=home)
            continue
        for matrix, out in zip(weight.reshape(-1, *weight.shape[-2:]), home.view(-1, *home.shape[-4:])):
            cpu_gemv.pair_weight(matrix, out=out)
    return homes


def _prepacked(targets: Sequence[tuple[nn.Module, str, torch.Tensor]]) -> list[torch.Tensor]:
    return [cpu_prepacked.prepack(w) for _, _, w in targets]
