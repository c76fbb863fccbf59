"""DeepSeek-V3: DeepSeek-V2's layers (MLA, dense first layers, shared experts) routed by sigmoid scores, experts chosen
by score plus a learned correction bias within the best groups (noaux_tc) and weighted by their unbiased score."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from workers.layers.fused_moe import FusedMoE, Routing
from workers.layers.linear import Linear
from workers.models.deepseek_v2 import DeepseekV2DecoderLayer, DeepseekV2ForCausalLM
from workers.models.llama import LlamaMLP


class DeepseekV3MoE(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        # transformers' config has neither field (its model always routes this way); DeepSeek's own configs name them.
        method = getattr(config, "topk_method", None) or "noaux_tc"
        scoring = getattr(config, "scoring_func", None) or "sigmoid"
        if (method, scoring) != ("noaux_tc", "sigmoid"):
            raise ValueError(f"DeepSeek-V3 routing {method!r} with {scoring!r} scores is not supported (supported: "
                             "'noaux_tc' with 'sigmoid')")
        routing = Routing(config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob), scoring="sigmoid",
                          num_expert_group=config.n_group, topk_group=config.topk_group,
                          routed_scaling_factor=config.routed_scaling_factor)
        self.gate = Linear(config.hidden_size, config.n_routed_experts, quantizable=False)
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts), requires_grad=False)
        self.experts = FusedMoE(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, routing)
        self.shared_experts = LlamaMLP(config, config.moe_intermediate_size * config.n_shared_experts) \
            if config.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(x.float(), self.gate.weight.float())  # DeepSeek routes in float32
        out = self.experts(x, router_logits, self.gate.e_score_correction_bias)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekV3DecoderLayer(DeepseekV2DecoderLayer):
    moe_class = DeepseekV3MoE


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    layer_class = DeepseekV3DecoderLayer
