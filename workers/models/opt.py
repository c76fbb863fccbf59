"""OPT decoder: learned positions (offset 2), LayerNorm, ReLU MLP, pre- or post-norm, tied LM head; tensor
parallel over heads and the MLP, pipeline parallel over the decoder layers."""
from __future__ import annotations

import functools

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from kernels.cpu_layer_weights import DecoderLayerWeights
from workers.distributed import Intermediate, parallel_state
from workers.layers.attention import Attention, StepMetadata
from workers.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from workers.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, tie_lm_head
from workers.fast_path.fused_stage import (PLAIN_ACTIVATIONS, FusedGreedyDecoding, FusedStage, describe_layer,
                                        norm_kind, takes_projections)
from workers.models.llama import build_stage_layers

# OPT's learned position table reserves its first two rows (a fairseq padding convention).
_POSITION_OFFSET = 2


class OPTAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // num_heads
        self.scaling = self.head_dim**-0.5
        self.qkv_proj = ColumnParallelLinear(hidden, [(num_heads, self.head_dim)] * 3, bias=config.enable_bias)
        self.num_heads = self.qkv_proj.output_sizes[0] // self.head_dim
        self.out_proj = RowParallelLinear(hidden, hidden, bias=config.enable_bias)
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
        self.fc1 = ColumnParallelLinear(hidden, [(config.ffn_dim, 1)], bias=config.enable_bias)
        self.fc2 = RowParallelLinear(config.ffn_dim, hidden, bias=config.enable_bias)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.activation_name = config.activation_function
        self.activation = ACT2FN[config.activation_function]

    def forward(self, x: torch.Tensor, metadata: StepMetadata) -> torch.Tensor:
        x = self._sublayer(x, self.self_attn_layer_norm, lambda h: self.self_attn(h, metadata))
        return self._sublayer(x, self.final_layer_norm, lambda h: self.fc2(self.activation(self.fc1(h))))

    def _sublayer(self, x: torch.Tensor, norm: nn.LayerNorm, body) -> torch.Tensor:
        if self.pre_norm:
            return x + body(norm(x))
        return norm(x + body(x))

    @property
    def takes_one_call(self) -> bool:
        """Pre-norm layers (post-norm OPT-350m's take the op path) with LayerNorm weights."""
        norms = self.self_attn_layer_norm, self.final_layer_norm
        return self.pre_norm and self.activation_name in PLAIN_ACTIVATIONS \
            and all(norm_kind(norm) == "layer" and norm.eps == norms[0].eps for norm in norms) \
            and takes_projections(*self.fused_products)

    @property
    def fused_products(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        return self.self_attn.qkv_proj, self.self_attn.out_proj, self.fc1, self.fc2

    @property
    def fused_attention(self) -> Attention:
        return self.self_attn.attn

    @functools.cached_property
    def fused_weights(self) -> DecoderLayerWeights:
        """LayerNorms, no rotary (positions are learned), q scaled before its scores, the plain MLP."""
        qkv, o, up, down = self.fused_products
        return describe_layer(input_norm=self.self_attn_layer_norm, post_norm=self.final_layer_norm, qkv=qkv, o=o,
                              gate_up=up, down=down, attention=self.self_attn.attn, rotary=None,
                              scale=self.self_attn.scaling, scale_q_first=True,
                              activation=PLAIN_ACTIVATIONS[self.activation_name])


class OPTDecoder(FusedStage, nn.Module):
    """This pipeline stage's share: embeddings (and project_in) on the first stage, its layers, the final norm
    (and project_out) on the last stage."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        state = parallel_state()
        hidden, proj_dim = config.hidden_size, config.word_embed_proj_dim
        self.is_last_stage = state.is_last_stage
        self.projected = proj_dim != hidden  # project_in and project_out, which the C++ steps do not compute
        self.embed_tokens = self.embed_positions = self.project_in = None
        if state.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, proj_dim)
            self.embed_positions = nn.Embedding(config.max_position_embeddings + _POSITION_OFFSET, hidden)
            self.project_in = Linear(proj_dim, hidden) if proj_dim != hidden else None
        self.stage_layers, self.layers = build_stage_layers(config.num_hidden_layers,
                                                            lambda _: OPTDecoderLayer(config))
        self.final_layer_norm = self.project_out = None
        if state.is_last_stage:
            keep_final_norm = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
            affine = config.layer_norm_elementwise_affine
            self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine) if keep_final_norm else None
            self.project_out = Linear(hidden, proj_dim) if proj_dim != hidden else None
        for param in self.parameters():
            param.requires_grad_(False)

    def final_norm_module(self) -> nn.Module | None:
        return self.final_layer_norm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: StepMetadata,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        """Final hidden states on the last stage, else (hidden states,) for the next stage."""
        x = self._embed(input_ids, positions) if intermediate is None else intermediate[0]
        step = self.fused_step(x, positions, metadata)
        if step is not None:
            out = self.fused_forward(x, None, step)
            x = out[0] + out[1] if isinstance(out, tuple) else out  # the final norm's output, or the stage's
            if not self.is_last_stage:
                return (x,)
            return x if self.project_out is None else self.project_out(x)
        for i in self.stage_layers:
            x = self.layers[i](x, metadata)
        if not self.is_last_stage:
            return (x,)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        return x if self.project_out is None else self.project_out(x)

    def _embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        return x + self.embed_positions(positions + _POSITION_OFFSET)


class OPTModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(FusedGreedyDecoding, nn.Module):
    num_intermediate_tensors = 1  # no separate residual stream
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.model = OPTModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.word_embed_proj_dim) \
            if parallel_state().is_last_stage else None
        # Checkpoint names loaded into another parameter: a tied head on a stage without the embeddings.
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", True)
        self.weight_aliases = tie_lm_head(self.lm_head, self.model.decoder.embed_tokens,
                                          "model.decoder.embed_tokens.weight") if self.tie_word_embeddings else {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: StepMetadata,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        return self.model.decoder(input_ids, positions, metadata, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Last stage only; float32 logits on TP rank 0, None on the other TP ranks."""
        return self.lm_head.compute_logits(hidden)

    fused_compute_logits = compute_logits

    def fused_parts(self) -> tuple[FusedStage, nn.Module | None, nn.Module | None] | None:
        """The decoder, its embedding and head; None where it projects in and out (the C++ steps do not)."""
        decoder = self.model.decoder
        return None if decoder.projected else (decoder, decoder.embed_tokens, self.lm_head)

    def fused_positions(self) -> tuple[torch.Tensor, int] | None:
        positions = self.model.decoder.embed_positions  # the first stage's
        return None if positions is None else (positions.weight, _POSITION_OFFSET)
