"""Qwen2: the llama decoder with biases on q/k/v (tied embeddings come from the config)."""
from __future__ import annotations

from workers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    qkv_bias = True


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_class = Qwen2DecoderLayer
