"""Gemma 2: embeddings scaled by sqrt(hidden), (1 + w) RMSNorms before and after both attention and MLP,
GeGLU (tanh GELU), attention scaled by query_pre_attn_scalar with tanh soft-capped scores, sliding window on
alternate layers, and soft-capped final logits; tensor and pipeline parallel as llama."""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from kernels.cpu_layer_weights import DecoderLayerWeights
from workers.distributed import Intermediate, parallel_state
from workers.layers.attention import Attention, StepMetadata
from workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from workers.layers.norm import GemmaRMSNorm
from workers.layers.rotary import RotaryEmbedding, rope_parameters_of
from workers.layers.vocab_parallel import VocabParallelEmbedding
from workers.fast_path.fused_stage import FusedStage, describe_layer, takes_projections
from workers.models.llama import LlamaAttention, LlamaForCausalLM, build_stage_layers, head_dim_of, sliding_window_of


class Gemma2Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, rotary)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, config.query_pre_attn_scalar**-0.5,
                              sliding_window_of(config, layer_idx), soft_cap=self.soft_cap_of(config))

    @staticmethod
    def soft_cap_of(config: PretrainedConfig) -> float | None:
        """The tanh cap on the attention scores, None for none."""
        return config.attn_logit_softcapping


class Gemma2MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [(inter, 1), (inter, 1)])
        self.down_proj = RowParallelLinear(inter, config.hidden_size)
        self.activation_name = config.hidden_activation
        self.act = ACT2FN[config.hidden_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Gemma2DecoderLayer(nn.Module):
    attention_class = Gemma2Attention

    def __init__(self, config: PretrainedConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = self.attention_class(config, layer_idx, rotary)
        self.mlp = Gemma2MLP(config)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, metadata: StepMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), metadata))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    @property
    def takes_one_call(self) -> bool:
        attn = self.self_attn
        return self.mlp.activation_name == "gelu_pytorch_tanh" and takes_projections(*self.fused_products) and all(
            norm is None or norm.eps == self.input_layernorm.eps for norm in (attn.q_norm, attn.k_norm))

    @property
    def fused_products(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        return self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj

    @property
    def fused_attention(self) -> Attention:
        return self.self_attn.attn

    @functools.cached_property
    def fused_weights(self) -> DecoderLayerWeights:
        """The sandwich of (1 + w) norms, soft-capped attention (q/k head norms where given: Gemma 3) and the
        tanh-GELU GLU as the C++ layer reads them."""
        (qkv, o, gate_up, down), attn = self.fused_products, self.self_attn
        return describe_layer(input_norm=self.input_layernorm, post_norm=self.pre_feedforward_layernorm, qkv=qkv, o=o,
                              gate_up=gate_up, down=down, attention=attn.attn, rotary=attn.rotary,
                              q_norm=attn.q_norm, k_norm=attn.k_norm, attn_out_norm=self.post_attention_layernorm,
                              mlp_out_norm=self.post_feedforward_layernorm, activation="gelu_tanh_glu")


class Gemma2Model(FusedStage, nn.Module):
    """This pipeline stage's share: scaled embeddings on the first stage, its layers, the final norm on the last."""

    layer_class = Gemma2DecoderLayer

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        state = parallel_state()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) \
            if state.is_first_stage else None
        self.embed_scale = config.hidden_size**0.5
        rotary_of = self.layer_rotary(config)
        self.stage_layers, self.layers = build_stage_layers(
            config.num_hidden_layers, lambda i: self.layer_class(config, i, rotary_of(i)))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps) if state.is_last_stage else None

    def layer_rotary(self, config: PretrainedConfig) -> Callable[[int], RotaryEmbedding]:
        """Each layer's rotary table: one for all (a family with rope bases per layer type returns its own)."""
        rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_parameters_of(config))
        return lambda layer_idx: rotary

    def final_norm_module(self) -> nn.Module | None:
        return self.norm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: StepMetadata,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        """Final hidden states on the last stage, else (hidden states,) for the next stage."""
        if intermediate is None:
            x = self.embed_tokens(input_ids)
            x = x * torch.tensor(self.embed_scale).to(x.dtype)  # rounded to the weights' dtype first, as HF does
        else:
            x = intermediate[0]
        step = self.fused_step(x, positions, metadata)
        if step is not None:
            out = self.fused_forward(x, None, step)
            return out if self.norm is not None else (out[0] + out[1],)
        for i in self.stage_layers:
            x = self.layers[i](positions, x, metadata)
        return (x,) if self.norm is None else self.norm(x)


class Gemma2ForCausalLM(LlamaForCausalLM):
    num_intermediate_tensors = 1  # no separate residual stream
    takes_prompt_embeds = False  # Gemma2Model's forward embeds its tokens itself

    def __init__(self, config: PretrainedConfig) -> None:
        if config.hidden_activation not in ACT2FN:
            raise ValueError(f"hidden_activation {config.hidden_activation!r} is not supported")
        super().__init__(config)
        self.final_logit_softcapping = self.logit_cap = config.final_logit_softcapping
        self.embed_scale = config.hidden_size**0.5  # as the C++ steps scale the embedding (Gemma2Model's)

    def build_model(self, config: PretrainedConfig) -> nn.Module:
        return Gemma2Model(config)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Last stage only; float32 logits on TP rank 0 (soft-capped by tanh), None on the other TP ranks."""
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        return logits if logits is None or cap is None else torch.tanh(logits / cap) * cap

    fused_compute_logits = compute_logits
