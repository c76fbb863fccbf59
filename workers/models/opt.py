"""OPT decoder: learned positions (offset 2), LayerNorm, ReLU MLP, pre- or post-norm, tied LM head."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from workers.layers.attention import Attention, StepMetadata
from workers.layers.linear import Linear, MergedLinear

# OPT's learned position table reserves its first two rows (a fairseq padding convention).
_POSITION_OFFSET = 2


class OPTAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, self.num_heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.scaling = self.head_dim**-0.5
        self.qkv_proj = MergedLinear(hidden, [hidden] * 3, bias=config.enable_bias)
        self.out_proj = Linear(hidden, hidden, bias=config.enable_bias)
        # HF scales the query before the product (scale 1.0 inside attention); matching it keeps floats equal.
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, scale=1.0)

    def forward(self, x: torch.Tensor, metadata: StepMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        shape = (-1, self.num_heads, self.head_dim)
        out = self.attn((q * self.scaling).view(shape), k.view(shape), v.view(shape), metadata)
        return self.out_proj(out)


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, affine = config.hidden_size, config.layer_norm_elementwise_affine
        self.pre_norm = config.do_layer_norm_before
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.fc1 = Linear(hidden, config.ffn_dim, bias=config.enable_bias)
        self.fc2 = Linear(config.ffn_dim, hidden, bias=config.enable_bias)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.activation = ACT2FN[config.activation_function]

    def forward(self, x: torch.Tensor, metadata: StepMetadata) -> torch.Tensor:
        x = self._sublayer(x, self.self_attn_layer_norm, lambda h: self.self_attn(h, metadata))
        return self._sublayer(x, self.final_layer_norm, lambda h: self.fc2(self.activation(self.fc1(h))))

    def _sublayer(self, x: torch.Tensor, norm: nn.LayerNorm, body) -> torch.Tensor:
        if self.pre_norm:
            return x + body(norm(x))
        return norm(x + body(x))


class OPTDecoder(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, proj_dim = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, proj_dim)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + _POSITION_OFFSET, hidden)
        self.project_in = Linear(proj_dim, hidden) if proj_dim != hidden else None
        self.project_out = Linear(hidden, proj_dim) if proj_dim != hidden else None
        keep_final_norm = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        affine = config.layer_norm_elementwise_affine
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine) if keep_final_norm else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config) for _ in range(config.num_hidden_layers))
        for param in self.parameters():
            param.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: StepMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + _POSITION_OFFSET)
        for layer in self.layers:
            x = layer(x, metadata)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        return x if self.project_out is None else self.project_out(x)


class OPTModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(nn.Module):
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.model = OPTModel(config)
        self.lm_head = Linear(config.word_embed_proj_dim, config.vocab_size)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: StepMetadata) -> torch.Tensor:
        return self.model.decoder(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
