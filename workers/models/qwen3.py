"""Qwen3: the llama decoder with an RMSNorm over each query and key head before rotary (no q/k/v biases)."""
from __future__ import annotations

import torch
from transformers import PretrainedConfig

from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding
from workers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, rotary)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project_qkv(x)
        return self.q_norm(q), self.k_norm(k), v


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3DecoderLayer
