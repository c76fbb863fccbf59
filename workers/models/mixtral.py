"""Mixtral: the llama decoder whose MLP is a sparse mixture of SwiGLU experts (softmax top-k, renormalised)."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from workers.layers.fused_moe import FusedMoE, Routing
from workers.layers.linear import Linear
from workers.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class MixtralMoE(nn.Module):
    """Router (`gate`, replicated on every rank) and experts."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        self.gate = Linear(config.hidden_size, config.num_local_experts, quantizable=False)
        self.experts = FusedMoE(config.num_local_experts, config.hidden_size, config.intermediate_size,
                                Routing(config.num_experts_per_tok, renormalize=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class MixtralDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return MixtralMoE(config)


class MixtralForCausalLM(LlamaForCausalLM):
    layer_class = MixtralDecoderLayer
    renamed_modules = {"block_sparse_moe": "mlp"}
    expert_modules = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0)}
