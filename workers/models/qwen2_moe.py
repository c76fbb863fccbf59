"""Qwen2-MoE: the qwen2 decoder whose MLP (on the sparse layers) is a mixture of experts plus a shared expert
scaled by its own sigmoid gate; the other layers keep a dense MLP."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from workers.layers.fused_moe import FusedMoE, Routing
from workers.layers.linear import Linear
from workers.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """Qwen-MoE's rule: every `decoder_sparse_step`-th layer is sparse unless listed in `mlp_only_layers`."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (config.num_experts > 0 and (layer_idx + 1) % step == 0
            and layer_idx not in (getattr(config, "mlp_only_layers", None) or []))


class QwenMoE(nn.Module):
    """Router (`gate`), routed experts and, when the config has one, a shared expert every token passes through,
    weighted by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.gate = Linear(config.hidden_size, config.num_experts, quantizable=False)
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                Routing(config.num_experts_per_tok, renormalize=config.norm_topk_prob))
        shared_size = getattr(config, "shared_expert_intermediate_size", 0)
        self.shared_expert = LlamaMLP(config, shared_size) if shared_size else None
        self.shared_expert_gate = Linear(config.hidden_size, 1, quantizable=False) if shared_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return QwenMoE(config) if is_sparse_layer(config, layer_idx) else LlamaMLP(config)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """q/k/v biases come from the config's `qkv_bias`."""

    layer_class = Qwen2MoeDecoderLayer
    expert_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
