"""Llama decoder (also the base of qwen2 and mistral): RMSNorm, rotary, GQA attention, SwiGLU MLP."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from workers.layers.activation import silu_and_mul
from workers.layers.attention import Attention, AttentionMetadata
from workers.layers.linear import Linear, MergedLinear
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config: PretrainedConfig, layer_idx: int) -> int | None:
    """Per-layer window: `layer_types` when the config has them (qwen2), else one window for all (mistral)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


def rope_parameters_of(config: PretrainedConfig) -> dict:
    """transformers 5 keeps rope settings in `rope_parameters`; older configs use rope_theta/rope_scaling."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    return {"rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}


class LlamaAttention(nn.Module):
    qkv_bias = False

    def __init__(self, config: PretrainedConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        bias = self.qkv_bias or getattr(config, "attention_bias", False)
        self.qkv_proj = MergedLinear(config.hidden_size, self.split_sizes, bias=bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=getattr(config, "attention_bias", False))
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                              sliding_window_of(config, layer_idx))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, metadata))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter])
        self.down_proj = Linear(inter, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_class = LlamaAttention

    def __init__(self, config: PretrainedConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, layer_idx, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_class: type[LlamaDecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_parameters_of(config))
        self.layers = nn.ModuleList(layer_class(config, i, rotary) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, metadata)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Checkpoint names match HF's; q/k/v and gate/up load into merged projections."""

    layer_class = LlamaDecoderLayer
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.model = LlamaModel(config, self.layer_class)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
