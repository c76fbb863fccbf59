"""DeepSeek-V2: multi-head latent attention (workers.layers.mla), the first `first_k_dense_replace` layers dense,
the rest a mixture of routed experts (softmax, greedy or group-limited top-k, scaled) plus always-on shared
experts."""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from kernels import cpu_layer_weights
from workers.layers.fused_moe import FusedMoE, Routing
from workers.layers.linear import Linear
from workers.layers.mla import MLAAttention
from workers.fast_path.fused_stage import describe_layer, takes_projections
from workers.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, head_dim_of

_TOPK_METHODS = ("greedy", "group_limited_greedy")


class DeepseekV2MoE(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.topk_method not in _TOPK_METHODS:
            raise ValueError(f"topk_method {config.topk_method!r} is not supported (supported: {_TOPK_METHODS})")
        grouped = config.topk_method == "group_limited_greedy"
        routing = Routing(config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob),
                          num_expert_group=config.n_group if grouped else None,
                          topk_group=config.topk_group if grouped else None,
                          routed_scaling_factor=config.routed_scaling_factor)
        self.gate = Linear(config.hidden_size, config.n_routed_experts, quantizable=False)
        self.experts = FusedMoE(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, routing)
        self.shared_experts = LlamaMLP(config, config.moe_intermediate_size * config.n_shared_experts) \
            if config.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(x.float(), self.gate.weight.float())  # DeepSeek routes in float32
        out = self.experts(x, router_logits)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    """The C++ layer takes it in MLA form (kernels/csrc/mla.h), its mixture of experts with DeepSeek's routing
    (kernels/csrc/grouped_routing.h) and ungated shared experts."""

    attention_class = MLAAttention
    moe_class: type[nn.Module] = DeepseekV2MoE

    def build_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        sparse = (config.n_routed_experts and layer_idx >= config.first_k_dense_replace
                  and layer_idx % (getattr(config, "moe_layer_freq", 1) or 1) == 0)
        return self.moe_class(config) if sparse else LlamaMLP(config)

    @property
    def takes_one_call(self) -> bool:
        attn, dense = self.self_attn, self._dense_mlp
        return attn.takes_one_call() and \
            takes_projections(attn.q_projection, attn.o_proj) and (
                dense is None or takes_projections(dense.gate_up_proj, dense.down_proj)) and (
                self._experts is None or _experts_form(self.mlp) is not None)

    @property
    def fused_products(self) -> tuple[Callable, nn.Module, nn.Module, nn.Module | None]:
        if self._experts is not None:
            return self.self_attn.fused_qkv, self.self_attn.o_proj, self.mlp, None
        return self.self_attn.fused_qkv, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj

    @property
    def _dense_mlp(self) -> nn.Module | None:
        return self.mlp.shared_experts if self._experts is not None else self.mlp

    @functools.cached_property
    def fused_weights(self) -> cpu_layer_weights.DecoderLayerWeights:
        attn, dense = self.self_attn, self._dense_mlp
        experts = {} if self._experts is None else _experts_form(self.mlp)
        return describe_layer(input_norm=self.input_layernorm, post_norm=self.post_attention_layernorm,
                              qkv=attn.q_projection, o=attn.o_proj,
                              gate_up=None if dense is None else dense.gate_up_proj,
                              down=None if dense is None else dense.down_proj, attention=attn.attn,
                              rotary=attn.rotary, **attn.fused_form(), **experts)


def _experts_form(block: nn.Module) -> dict | None:
    """DeepSeek's mixture of experts as DecoderLayerWeights' expert fields (its router also as the float32 copy
    it routes by); None where the C++ layer does not compute it: whole experts split over ranks (expert parallel), a
    quantized router."""
    moe, router, routing = block.experts, block.gate, block.experts.routing
    if moe.splits_whole_experts or router.weight_scale is not None or router.bias is not None or \
            moe.gate_up_proj.dtype != router.weight.dtype:
        return None
    bias = getattr(router, "e_score_correction_bias", None)
    return {"router": router.weight, "experts_gate_up": moe.gate_up_proj.data, "experts_down": moe.down_proj.data,
            "experts_gate_up_pairs": moe.gate_up_pairs, "experts_down_pairs": moe.down_pairs,
            "top_k": routing.top_k, "renormalize": routing.renormalize, "routed_scaling": routing.routed_scaling_factor,
            "grouped_router": router.weight.float().contiguous(),
            "correction_bias": None if bias is None else bias.float().contiguous(),
            "expert_groups": routing.num_expert_group or 0, "topk_groups": routing.topk_group or 0,
            "sigmoid_scores": routing.scoring == "sigmoid"}


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """The rotary table covers qk_rope_head_dim (the config's head_dim); norm_topk_prob is honoured as DeepSeek's
    own code does (HF transformers' port ignores it; the released V2 configs set it False)."""

    layer_class = DeepseekV2DecoderLayer
    expert_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}

    def __init__(self, config: PretrainedConfig) -> None:
        if head_dim_of(config) != config.qk_rope_head_dim:  # HF's config sets them equal; an edited one may not
            raise ValueError(f"DeepSeek's head_dim ({head_dim_of(config)}) must equal qk_rope_head_dim "
                             f"({config.qk_rope_head_dim}): it is the width of the rotary table")
        super().__init__(config)
