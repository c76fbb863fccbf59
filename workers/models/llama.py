"""Llama decoder (also the base of qwen2 and mistral): RMSNorm, rotary, GQA attention, SwiGLU MLP."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig

from kernels import cpu_decoder_layer, cpu_gemv, silu_and_mul
from workers.distributed import Intermediate, parallel_state
from workers.layers.attention import Attention, AttentionMetadata, StepMetadata
from workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding, rope_parameters_of
from workers.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, tie_lm_head

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
    # Whether the C++ one-call layer (kernels.cpu_decoder_layer) computes what forward() does; a subclass that
    # changes the attention or the MLP says False.
    one_call_capable = True

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
        if not self.one_call_capable or attn.rotary.rotary_dim != attn.head_dim or any(
                norm is not None and norm.eps != self.input_layernorm.eps for norm in (attn.q_norm, attn.k_norm)):
            return False
        projections = (self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)
        return all(cpu_decoder_layer.takes_projection(p.weight, p.weight_scale, p.weight_zero, p.weight_g_idx)
                   for p in projections)

    @functools.cached_property
    def fused_weights(self) -> cpu_decoder_layer.DecoderLayerWeights:
        """This layer's parameters as the one-call layer reads them (kernels.cpu_decoder_layer)."""
        attn, mlp = self.self_attn, self.mlp
        return cpu_decoder_layer.DecoderLayerWeights(
            self.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight,
            attn.o_proj.bias, self.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight,
            attn.rotary.cos.float().contiguous(), attn.rotary.sin.float().contiguous(), self.input_layernorm.eps,
            attn.attn.scale, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.attn.sliding_window,
            attn.qkv_proj.weight_scale, attn.o_proj.weight_scale, mlp.gate_up_proj.weight_scale,
            mlp.down_proj.weight_scale, attn.qkv_proj.pairs_weight, attn.o_proj.pairs_weight,
            mlp.gate_up_proj.pairs_weight, mlp.down_proj.pairs_weight,
            None if attn.q_norm is None else attn.q_norm.weight, None if attn.k_norm is None else attn.k_norm.weight)


class LlamaModel(nn.Module):
    """This pipeline stage's share: embeddings on the first stage, its layers (others are placeholders, so
    parameter names keep their checkpoint indices), the final norm on the last stage."""

    lora_context = None  # set by workers.lora when adapters are enabled: which tokens run with which adapter

    def __init__(self, config: PretrainedConfig, layer_class: type[LlamaDecoderLayer]) -> None:
        super().__init__()
        state = parallel_state()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) \
            if state.is_first_stage else None
        rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_parameters_of(config))
        self.stage_layers, self.layers = build_stage_layers(config.num_hidden_layers,
                                                            lambda i: layer_class(config, i, rotary))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if state.is_last_stage else None
        # The C++ layer's arguments, made for the caches bound when it first ran (kernels.cpu_decoder_layer).
        self._prepared_layers: cpu_decoder_layer.PreparedLayers | None = None

    @functools.cached_property
    def one_call_layers(self) -> bool:
        """Whether the C++ layer serves this stage's steps of decodes and short chunks: tp 1 only (it has no
        all-reduce between attention and MLP), and every layer takes it."""
        return parallel_state().tp_size == 1 and bool(self.stage_layers) and \
            all(self.layers[i].takes_one_call for i in self.stage_layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: StepMetadata,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        """Final hidden states on the last stage, else (hidden, residual) for the next stage."""
        x, residual = (self.embed_tokens(input_ids), None) if intermediate is None else intermediate
        step = self._one_call_step(x, positions, metadata)
        if step is not None:
            return self._one_call_forward(x, residual, step)
        for i in self.stage_layers:
            x, residual = self.layers[i](positions, x, residual, metadata)
        if self.norm is None:
            return x, residual
        x, _ = self.norm(x, residual)
        return x

    def _one_call_forward(self, x: torch.Tensor, residual: torch.Tensor | None, step: cpu_decoder_layer.DecodeStep
                          ) -> torch.Tensor | Intermediate:
        """forward() of a step of decodes or short chunks: the stage's layers, and the final norm on the last stage,
        in one C++ call, or with torch's products between C++ calls past the kernels' rows (kernels.cpu_decoder_layer);
        same results."""
        caches = [attention.kv_cache for attention in self._stage_attention]
        prepared = self._prepared_layers
        if prepared is None or not prepared.serves(caches, x.dtype):
            if any(cache is None for cache in caches):
                raise RuntimeError("the KV cache was not bound to an attention layer")
            layers = [self.layers[i] for i in self.stage_layers]
            norm, eps = (None, 0.0) if self.norm is None else (self.norm.weight, self.norm.eps)
            prepared = self._prepared_layers = cpu_decoder_layer.PreparedLayers(
                [layer.fused_weights for layer in layers], caches, x.dtype, norm, eps)
        if step.kernel_products:
            x, residual = cpu_decoder_layer.decoder_layers(prepared, x, residual, step)
        else:
            products = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
                        for layer in (self.layers[i] for i in self.stage_layers)]
            x, residual = cpu_decoder_layer.decoder_layers_with_products(prepared, products, x, residual, step)
        return (x, residual) if self.norm is None else x

    @functools.cached_property
    def _stage_attention(self) -> list[nn.Module]:
        """This stage's attention layers, whose kv_cache each step reads (a plain list: no module lookups)."""
        return [self.layers[i].self_attn.attn for i in self.stage_layers]

    def _one_call_step(self, x: torch.Tensor, positions: torch.Tensor, metadata: StepMetadata
                       ) -> cpu_decoder_layer.DecodeStep | None:
        if not (self.one_call_layers and isinstance(metadata, AttentionMetadata)) or (
                self.lora_context is not None and self.lora_context.token_groups):  # adapters need the op path
            return None
        return cpu_decoder_layer.decode_step(x, positions, metadata.slot_mapping, metadata.block_tables,
                                             metadata.query_start_loc, self.product_rows)

    @functools.cached_property
    def product_rows(self) -> int:
        """The most tokens of a step whose products the C++ layer runs: the least this stage's projection weights
        allow (kernels.cpu_decoder_layer.max_rows: int8 and small bf16 weights take more)."""
        return min(self.layers[i].fused_weights.max_rows() for i in self.stage_layers)


class LlamaForCausalLM(nn.Module):
    """Checkpoint names match HF's; q/k/v and gate/up load into merged projections."""

    layer_class = LlamaDecoderLayer
    num_intermediate_tensors = 2  # hidden states and residual
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
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        return self.model(input_ids, positions, metadata, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Last stage only; float32 logits on TP rank 0, None on the other TP ranks."""
        return self.lm_head.compute_logits(hidden)

    def greedy_decode(self, tokens: np.ndarray, positions: np.ndarray, table: np.ndarray, limits: np.ndarray,
                      stops: list[set[int]], steps: int,
                      drafts: cpu_decoder_layer.PromptLookupDrafts | cpu_decoder_layer.DraftModelDrafts | None = None,
                      sampled: cpu_decoder_layer.SampledRows | None = None) -> cpu_decoder_layer.GreedyRun | None:
        """A multi-step call's later steps in one C++ call (kernels.cpu_decoder_layer.greedy_decode: same tokens as
        forward(), compute_logits() and the argmax or the sampler step by step, drafts verified as the Python steps
        verify them); None where that does not compute what they do, and the caller steps in Python (greedy_parts),
        or more rows than the kernels' products take."""
        parts = self.greedy_parts()
        if parts is None or len(tokens) > parts.max_rows:
            return None
        return cpu_decoder_layer.greedy_decode(parts.prepared, parts.embedding, parts.head, parts.vocab_size, tokens,
                                               positions, table, limits, stops, steps, drafts, parts.max_rows,
                                               sampled, parts.head_pairs)

    def greedy_parts(self) -> GreedyParts | None:
        """The model as greedy_decode() takes it; None for another family's model, embedding or logits, pipeline
        stages, adapters, a quantized table or head, or layers not in C++ or not prepared for the bound caches (a
        one-call step prepares them)."""
        model, head = self.model, self.lm_head
        if not (type(self).compute_logits is LlamaForCausalLM.compute_logits and type(model) is LlamaModel
                and model.embed_tokens is not None and head is not None and model.one_call_layers
                and model.lora_context is None and model.embed_tokens.lora is None and head.lora is None
                and model.embed_tokens.weight_scale is None and head.weight_scale is None):
            return None
        prepared, embedding = model._prepared_layers, model.embed_tokens.weight
        caches = [attention.kv_cache for attention in model._stage_attention]
        if prepared is None or not prepared.serves(caches, embedding.dtype) or head.weight.dtype != embedding.dtype:
            return None
        return GreedyParts(prepared, embedding, head.weight, head.vocab_size,
                           min(model.product_rows, cpu_gemv.max_rows(embedding.dtype, head.weight, head.pairs_weight)),
                           head.pairs_weight)


@dataclasses.dataclass(frozen=True)
class GreedyParts:
    """A llama model as kernels.cpu_decoder_layer.greedy_decode() takes it; max_rows: the most token rows of a step
    its kernels' products take; head_pairs: the head's kernels.cpu_gemv.pair_weight copy, where kept."""

    prepared: cpu_decoder_layer.PreparedLayers
    embedding: torch.Tensor
    head: torch.Tensor
    vocab_size: int
    max_rows: int
    head_pairs: torch.Tensor | None = None
