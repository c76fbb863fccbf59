"""The checks of a C++ layer's optional parts (kernels.cpu_layer_weights.DecoderLayerWeights): its mixture of experts
and its adapter slots."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels import cpu_deepseek_weights, cpu_gemv

if TYPE_CHECKING:
    from kernels.cpu_layer_weights import DecoderLayerWeights


def check_experts(weights: DecoderLayerWeights, dtype: torch.dtype, hidden: int) -> None:
    """A mixture of experts of the hidden states' dtype with a SwiGLU per expert; a dense MLP only as its
    shared expert; or neither (a dense MLP)."""
    if weights.router is None:
        if weights.gate_up is None or weights.shared_gate is not None:
            raise ValueError("a layer without experts needs its dense MLP and no shared expert gate")
        return
    experts = weights.router.shape[0]
    tensors = (weights.router, weights.experts_gate_up, weights.experts_down)
    if not all(t is not None and t.dtype == dtype and t.is_contiguous() for t in tensors) or \
            weights.router.shape != (experts, hidden) or weights.experts_gate_up.dim() != 3 or \
            weights.experts_down.shape != (experts, hidden, weights.experts_gate_up.shape[1] // 2) or \
            weights.experts_gate_up.shape != (experts, 2 * weights.experts_down.shape[2], hidden):
        raise ValueError("experts need a router [experts, hidden], gate_up [experts, 2 inter, hidden] and down "
                         "[experts, hidden, inter] of the hidden states' dtype")
    if not 0 < weights.top_k <= experts or weights.activation != "silu_glu":
        raise ValueError("experts take top_k of 1 up to their count, each a SwiGLU MLP")
    grouped, gate = weights.grouped_router is not None, weights.shared_gate
    if (gate is not None and weights.gate_up is None) or (grouped and gate is not None) or (
            not grouped and (gate is None) != (weights.gate_up is None)) or (
            gate is not None and not (gate.dtype == dtype and gate.shape == (1, hidden) and gate.is_contiguous())):
        raise ValueError("a shared expert needs its MLP and its gate [1, hidden] of the hidden states' dtype "
                         "(DeepSeek's routing: no gate)")
    if grouped:
        cpu_deepseek_weights.check_grouped_routing(weights, experts, hidden)
    for name in ("experts_gate_up", "experts_down"):
        stacked, pairs = getattr(weights, name), getattr(weights, f"{name}_pairs")
        if pairs is not None and not (stacked.dtype == torch.bfloat16 and cpu_gemv.pairs_serve(stacked[0])
                                      and pairs.shape[:1] == stacked.shape[:1]
                                      and cpu_gemv.fits_pairs(stacked[0], pairs[0]) and pairs.is_contiguous()):
            raise ValueError(f"{name}_pairs must be kernels.cpu_gemv.pair_weight of each bf16 expert's weight, "
                             "stacked, on a CPU with AVX-512 BF16")

def check_loras(weights: DecoderLayerWeights) -> None:
    """Adapter slots that fit their projections, all of one compute dtype (float32 or bf16)."""
    dtypes = set()
    for (weight, _), slots in zip(weights.projections(), weights.loras()):
        if slots is None:
            continue
        a, b, used = slots.a, slots.bt, slots.used
        if not (a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0] == used.shape[0]
                and b.shape[1] == a.shape[1] and b.shape[2] == weight.shape[0] and a.shape[2] == weight.shape[1]
                and a.dtype == b.dtype
                and a.dtype in (torch.float32, torch.bfloat16) and used.dtype == torch.bool
                and a.is_contiguous() and b.is_contiguous() and used.is_contiguous()):
            raise ValueError("a projection's adapter slots must be a [slots, width, K], bt [slots, width, N] of "
                             "float32 or bf16 and used [slots] bool")
        offsets = slots.offsets
        if offsets is not None and not (
                offsets.dtype == torch.int64 and offsets.dim() == 1 and offsets.is_contiguous()
                and 1 < offsets.numel() and a.shape[1] % (offsets.numel() - 1) == 0 and int(offsets[0]) == 0
                and int(offsets[-1]) == weight.shape[0] and bool((offsets[1:] >= offsets[:-1]).all())):
            raise ValueError("a projection's adapter part offsets must be contiguous int64 [parts + 1], rising from 0 "
                             "to its output rows, with the slots' width a multiple of the parts")
        dtypes.add(a.dtype)
    if len(dtypes) > 1:
        raise ValueError("a layer's adapter slots share one compute dtype")
