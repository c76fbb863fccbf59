"""The checks of DeepSeek's forms of the C++ layer (kernels.cpu_layer_weights.DecoderLayerWeights): multi-head latent
attention and grouped routing."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels import cpu_gemv

if TYPE_CHECKING:
    from kernels.cpu_layer_weights import DecoderLayerWeights


def check_mla(weights: DecoderLayerWeights, dtype: torch.dtype, hidden: int) -> tuple[int, int]:
    """MLA's tensors of the hidden states' dtype that fit one another → the q projection's (rows, inputs)."""
    lora = 0 if weights.mla_kv_norm is None else weights.mla_kv_norm.shape[0]
    rope, heads = weights.head_dim - lora, weights.num_heads
    tensors = [weights.mla_kv_a, weights.mla_kv_norm, weights.mla_w_uk_t, weights.mla_w_uv]
    q_lora = 0 if weights.mla_q_a is None else weights.mla_q_a.shape[0]
    if weights.mla_q_a is not None:
        tensors += [weights.mla_q_a, weights.mla_q_a_norm]
    if not (all(t is not None and t.dtype == dtype and t.is_contiguous() for t in tensors) and lora > 0
            and rope > 0 and rope % 2 == 0 and weights.num_kv_heads == 1
            and weights.mla_kv_a.shape == (lora + rope, hidden)
            and weights.mla_w_uk_t.dim() == 3 and weights.mla_w_uk_t.shape[:2] == (heads, lora)
            and weights.mla_w_uv.dim() == 3 and weights.mla_w_uv.shape[0] == heads and weights.mla_w_uv.shape[2] == lora
            and (weights.mla_q_a is None or (weights.mla_q_a.shape == (q_lora, hidden)
                                          and weights.mla_q_a_norm.shape == (q_lora,)))
            and weights.cos is not None and weights.cos.shape[1] == rope and weights.mla_eps > 0):
        raise ValueError("MLA needs kv_a [lora + rope, hidden], kv_norm [lora], w_uk_t [heads, lora, nope], w_uv "
                         "[heads, v, lora] (and q_a [q_lora, hidden] with q_a_norm [q_lora]) of the hidden states' "
                         "dtype, one KV head of lora + rope, a rotary table of rope and mla_eps")
    for name in ("mla_w_uk_t", "mla_w_uv"):
        stacked, pairs = getattr(weights, name), getattr(weights, f"{name}_pairs")
        if pairs is not None and not (dtype == torch.bfloat16 and cpu_gemv.pairs_serve(stacked[0])
                                      and pairs.shape[:1] == stacked.shape[:1] and pairs.is_contiguous()
                                      and cpu_gemv.fits_pairs(stacked[0], pairs[0])):
            raise ValueError(f"{name}_pairs must be kernels.cpu_gemv.pair_weight of each head's bf16 {name}, "
                             "stacked, on a CPU with AVX-512 BF16")
    return heads * (weights.mla_w_uk_t.shape[2] + rope), q_lora or hidden


def check_grouped_routing(weights: DecoderLayerWeights, experts: int, hidden: int) -> None:
    """DeepSeek's routing: a float32 router [experts, hidden], a float32 bias [experts] or none, groups that
    divide the experts, top_k of the competing groups' experts."""
    groups = max(weights.expert_groups, 1)
    bias = weights.correction_bias
    if not (weights.grouped_router.dtype == torch.float32 and weights.grouped_router.shape == (experts, hidden)
            and weights.grouped_router.is_contiguous() and experts % groups == 0
            and 0 < (weights.topk_groups if groups > 1 else 1) <= groups
            and weights.top_k <= (experts // groups) * (weights.topk_groups if groups > 1 else 1)
            and (bias is None or (bias.dtype == torch.float32 and bias.shape == (experts,)
                                  and bias.is_contiguous()))):
        raise ValueError("grouped routing needs a float32 router [experts, hidden], a float32 correction_bias "
                         "[experts] or none, expert_groups that divide the experts and top_k within topk_groups")
