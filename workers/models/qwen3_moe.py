"""Qwen3-MoE: the qwen3 decoder (q/k norms) with qwen2-moe's sparse MLP, without a shared expert."""
from __future__ import annotations

from workers.models.qwen2_moe import Qwen2MoeDecoderLayer, Qwen2MoeForCausalLM
from workers.models.qwen3 import Qwen3Attention


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    layer_class = Qwen3MoeDecoderLayer
