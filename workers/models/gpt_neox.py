"""GPT-NeoX (Pythia): LayerNorm, fused per-head q/k/v, partial rotary, GELU MLP with biases, and (by default)
the parallel residual x + attn(ln1(x)) + mlp(ln2(x)); tensor parallel over heads and the MLP, pipeline
parallel over the layers."""
from __future__ import annotations

import functools

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from kernels.cpu_layer_weights import DecoderLayerWeights
from workers.distributed import Intermediate, parallel_state
from workers.layers.attention import Attention, StepMetadata
from workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from workers.layers.rotary import RotaryEmbedding, rope_parameters_of
from workers.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, tie_lm_head
from workers.fast_path.fused_stage import (PLAIN_ACTIVATIONS, FusedGreedyDecoding, FusedStage, describe_layer,
                                        norm_kind, takes_projections)
from workers.models.llama import build_stage_layers


class GPTNeoXAttention(nn.Module):
    """query_key_value holds each head's q, k and v rows together: one TP unit of 3 * head_dim rows per head."""

    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // num_heads
        bias = getattr(config, "attention_bias", True)
        self.query_key_value = ColumnParallelLinear(config.hidden_size, [(num_heads, 3 * self.head_dim)], bias=bias)
        self.num_heads = self.query_key_value.output_sizes[0] // (3 * self.head_dim)
        self.dense = RowParallelLinear(config.hidden_size, config.hidden_size, bias=bias)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, metadata: StepMetadata) -> torch.Tensor:
        qkv = self.query_key_value(x).view(-1, self.num_heads, 3 * self.head_dim)
        q, k, v = qkv.chunk(3, dim=-1)
        q, k = self.rotary(positions, q.contiguous(), k.contiguous())
        return self.dense(self.attn(q, k, v.contiguous(), metadata))


class GPTNeoXMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(config.hidden_size, [(config.intermediate_size, 1)], bias=True)
        self.dense_4h_to_h = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True)
        self.activation_name = config.hidden_act
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class GPTNeoXLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = GPTNeoXAttention(config, rotary)
        self.mlp = GPTNeoXMLP(config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, metadata: StepMetadata) -> torch.Tensor:
        attn = self.attention(positions, self.input_layernorm(x), metadata)
        if self.use_parallel_residual:
            return self.mlp(self.post_attention_layernorm(x)) + attn + x
        attn = attn + x
        return self.mlp(self.post_attention_layernorm(attn)) + attn

    @property
    def takes_one_call(self) -> bool:
        return self.mlp.activation_name in PLAIN_ACTIVATIONS and norm_kind(self.input_layernorm) == "layer" \
            and self.input_layernorm.eps == self.post_attention_layernorm.eps \
            and takes_projections(*self.fused_products)

    @property
    def fused_products(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        return (self.attention.query_key_value, self.attention.dense, self.mlp.dense_h_to_4h,
                self.mlp.dense_4h_to_h)

    @property
    def fused_attention(self) -> Attention:
        return self.attention.attn

    @functools.cached_property
    def fused_weights(self) -> DecoderLayerWeights:
        """LayerNorms, q/k/v per head, partial rotary, the plain MLP and the (parallel) residual as the C++ layer
        reads them."""
        qkv, o, up, down = self.fused_products
        return describe_layer(input_norm=self.input_layernorm, post_norm=self.post_attention_layernorm, qkv=qkv, o=o,
                              gate_up=up, down=down, attention=self.attention.attn, rotary=self.attention.rotary,
                              activation=PLAIN_ACTIVATIONS[self.mlp.activation_name],
                              parallel_residual=self.use_parallel_residual, qkv_per_head=True)


class GPTNeoXModel(FusedStage, nn.Module):
    """This pipeline stage's share: embeddings on the first stage, its layers, the final norm on the last."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        state = parallel_state()
        self.embed_in = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if state.is_first_stage else None
        head_dim = config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, rope_parameters_of(config))
        self.stage_layers, self.layers = build_stage_layers(config.num_hidden_layers,
                                                            lambda _: GPTNeoXLayer(config, rotary))
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) \
            if state.is_last_stage else None
        for param in self.parameters():
            param.requires_grad_(False)

    def final_norm_module(self) -> nn.Module | None:
        return self.final_layer_norm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: StepMetadata,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        """Final hidden states on the last stage, else (hidden states,) for the next stage."""
        x = self.embed_in(input_ids) if intermediate is None else intermediate[0]
        step = self.fused_step(x, positions, metadata)
        if step is not None:
            out = self.fused_forward(x, None, step)
            return out if self.final_layer_norm is not None else (out[0] + out[1],)
        for i in self.stage_layers:
            x = self.layers[i](positions, x, metadata)
        return (x,) if self.final_layer_norm is None else self.final_layer_norm(x)


class GPTNeoXForCausalLM(FusedGreedyDecoding, nn.Module):
    num_intermediate_tensors = 1  # no separate residual stream

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported")
        self.gpt_neox = GPTNeoXModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size) \
            if parallel_state().is_last_stage else None
        # Older checkpoints name the head embed_out; a tied head on a stage without the embeddings loads them.
        self.weight_aliases = {"embed_out.weight": "lm_head.weight"}
        self.tie_word_embeddings = config.tie_word_embeddings
        if config.tie_word_embeddings:
            self.weight_aliases |= tie_lm_head(self.lm_head, self.gpt_neox.embed_in, "gpt_neox.embed_in.weight")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: StepMetadata,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        return self.gpt_neox(input_ids, positions, metadata, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Last stage only; float32 logits on TP rank 0, None on the other TP ranks."""
        return self.lm_head.compute_logits(hidden)

    fused_compute_logits = compute_logits

    def fused_parts(self) -> tuple[FusedStage, nn.Module | None, nn.Module | None] | None:
        return self.gpt_neox, self.gpt_neox.embed_in, self.lm_head
