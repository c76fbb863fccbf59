"""Llama decoder (also the base of qwen2 and mistral): RMSNorm, rotary, GQA attention, SwiGLU MLP."""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from kernels import cpu_layer_weights, silu_and_mul
from workers.distributed import Intermediate, parallel_state
from workers.layers.attention import Attention, StepMetadata
from workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding, rope_parameters_of
from workers.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, tie_lm_head
from workers.fast_path.fused_stage import (FusedGreedyDecoding, FusedStage, describe_layer, experts_form,
                                        takes_projections)
from workers.prompt_embeds import StepEmbeds

# What a pipeline stage hands the next: (hidden states, residual).


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config: PretrainedConfig, layer_idx: int) -> int | None:
    """Per-layer window: `layer_types` when the config has them (qwen2), else one window for all (mistral)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """The layers pipeline stage pp_rank runs: an even split, earlier stages taking the remainder."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


def build_stage_layers(num_layers: int, build: Callable[[int], nn.Module]) -> tuple[range, nn.ModuleList]:
    """This pipeline stage's layer indices and all layers: its own built, the others placeholders, so
    parameter names keep their checkpoint indices."""
    state = parallel_state()
    layers = stage_layers(num_layers, state.pp_rank, state.pp_size)
    return layers, nn.ModuleList(build(i) if i in layers else nn.Identity() for i in range(num_layers))


class LlamaAttention(nn.Module):
    qkv_bias = False

    def __init__(self, config: PretrainedConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        # A family's RMSNorm of each q and k head before rotary (Qwen3's), which the C++ layer takes as data.
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim_of(config)
        bias = self.qkv_bias or getattr(config, "attention_bias", False) or getattr(config, "qkv_bias", False)
        heads = [(num_heads, self.head_dim), (num_kv_heads, self.head_dim), (num_kv_heads, self.head_dim)]
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, heads, bias=bias)
        self.split_sizes = self.qkv_proj.output_sizes
        self.num_heads, self.num_kv_heads = (size // self.head_dim for size in self.split_sizes[:2])
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size,
                                        bias=getattr(config, "attention_bias", False))
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                              sliding_window_of(config, layer_idx))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, metadata: StepMetadata) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, metadata))

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x → q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim], before rotary."""
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [(inter, 1), (inter, 1)])
        self.down_proj = RowParallelLinear(inter, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_class = LlamaAttention

    def __init__(self, config: PretrainedConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, layer_idx, rotary)
        self.mlp = self.build_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                metadata: StepMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def build_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config)

    @property
    def takes_one_call(self) -> bool:
        attn = self.self_attn
        if any(norm is not None and norm.eps != self.input_layernorm.eps for norm in (attn.q_norm, attn.k_norm)):
            return False
        if self._experts is None:
            return takes_projections(*self.fused_products)
        dense = self._dense_mlp
        return experts_form(self.mlp) is not None and takes_projections(attn.qkv_proj, attn.o_proj) and (
            dense is None or takes_projections(dense.gate_up_proj, dense.down_proj))

    @property
    def fused_products(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module | None]:
        """qkv, o, gate_up and down; of a mixture of experts, the whole MLP and None."""
        if self._experts is not None:
            return self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp, None
        return self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj

    @property
    def _experts(self) -> nn.Module | None:
        """The MLP if it is a mixture of experts (it has routed `experts`), else None."""
        return self.mlp if hasattr(self.mlp, "experts") else None

    @property
    def _dense_mlp(self) -> nn.Module | None:
        """The dense MLP: the layer's, or its mixture of experts' shared expert (None without one)."""
        return getattr(self.mlp, "shared_expert", None) if self._experts is not None else self.mlp

    @property
    def fused_attention(self) -> Attention:
        return self.self_attn.attn

    @functools.cached_property
    def fused_weights(self) -> cpu_layer_weights.DecoderLayerWeights:
        """This layer's parameters as the one-call layer reads them (kernels.cpu_decoder_layer)."""
        attn, dense = self.self_attn, self._dense_mlp
        experts = {} if self._experts is None else experts_form(self._experts)
        return describe_layer(input_norm=self.input_layernorm, post_norm=self.post_attention_layernorm,
                              qkv=attn.qkv_proj, o=attn.o_proj, gate_up=None if dense is None else dense.gate_up_proj,
                              down=None if dense is None else dense.down_proj, attention=attn.attn,
                              rotary=attn.rotary, q_norm=attn.q_norm, k_norm=attn.k_norm, **experts)


class LlamaModel(FusedStage, nn.Module):
    """This pipeline stage's share: embeddings on the first stage, its layers (others are placeholders, so
    parameter names keep their checkpoint indices), the final norm on the last stage."""

    def __init__(self, config: PretrainedConfig, layer_class: type[LlamaDecoderLayer]) -> None:
        super().__init__()
        state = parallel_state()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) \
            if state.is_first_stage else None
        rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_parameters_of(config))
        self.stage_layers, self.layers = build_stage_layers(config.num_hidden_layers,
                                                            lambda i: layer_class(config, i, rotary))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if state.is_last_stage else None

    def final_norm_module(self) -> nn.Module | None:
        return self.norm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: StepMetadata,
                intermediate: Intermediate | None = None, prompt_embeds: StepEmbeds | None = None
                ) -> torch.Tensor | Intermediate:
        """Final hidden states on the last stage, else (hidden, residual) for the next stage; rows given as
        prompt_embeds (first stage) replace their placeholder tokens' embeddings."""
        x, residual = (self.embed_tokens(input_ids), None) if intermediate is None else intermediate
        if prompt_embeds is not None:
            x = prompt_embeds.apply(x)
        step = self.fused_step(x, positions, metadata)
        if step is not None:
            return self.fused_forward(x, residual, step)
        for i in self.stage_layers:
            x, residual = self.layers[i](positions, x, residual, metadata)
        if self.norm is None:
            return x, residual
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(FusedGreedyDecoding, nn.Module):
    """Checkpoint names match HF's; q/k/v and gate/up load into merged projections."""

    layer_class = LlamaDecoderLayer
    num_intermediate_tensors = 2  # hidden states and residual
    takes_prompt_embeds = True  # its model's forward takes prompt_embeds (a family with its own model says)
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.model = self.build_model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size) \
            if parallel_state().is_last_stage else None
        # Checkpoint names loaded into another parameter: a tied head on a stage without the embeddings.
        self.tie_word_embeddings = config.tie_word_embeddings
        self.weight_aliases = tie_lm_head(self.lm_head, self.model.embed_tokens, "model.embed_tokens.weight") \
            if config.tie_word_embeddings else {}

    def build_model(self, config: PretrainedConfig) -> nn.Module:
        """Embeddings, this stage's layers and the final norm (a family with other layers returns its own)."""
        return LlamaModel(config, self.layer_class)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: StepMetadata,
                intermediate: Intermediate | None = None, prompt_embeds: StepEmbeds | None = None
                ) -> torch.Tensor | Intermediate:
        if prompt_embeds is None:  # a family's own model (Gemma2's) takes none
            return self.model(input_ids, positions, metadata, intermediate)
        return self.model(input_ids, positions, metadata, intermediate, prompt_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Last stage only; float32 logits on TP rank 0, None on the other TP ranks."""
        return self.lm_head.compute_logits(hidden)

    fused_compute_logits = compute_logits

    def fused_parts(self) -> tuple[FusedStage, nn.Module | None, nn.Module | None] | None:
        return self.model, self.model.embed_tokens, self.lm_head
