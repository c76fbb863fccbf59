"""The fast path's interface for a model family: layers that describe themselves to the C++ decoder layer
(kernels.cpu_layer_weights.DecoderLayerWeights) let their stage run its steps of decodes and short chunks there
(FusedStage), and a model whose embedding, layers and head all run there decodes several steps in one call
(FusedGreedyDecoding, kernels.cpu_greedy_decode)."""
from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from kernels import (cpu_decoder_layer, cpu_gemv, cpu_greedy_decode, cpu_layer_weights, cpu_mtp, cpu_projections,
                     cpu_row_options)
from workers.distributed import parallel_state, pipeline_kernel_group, tp_kernel_group
from workers.layers.attention import Attention, AttentionMetadata, StepMetadata
from workers.layers.norm import GemmaRMSNorm, RMSNorm
from workers.layers.rotary import RotaryEmbedding

_NORM_KINDS = ((GemmaRMSNorm, "gemma"), (RMSNorm, "rms"), (nn.LayerNorm, "layer"))
# The C++ layer's activation for an ungated MLP's HF activation name: those torch computes as one op (gelu_new and
# gelu_fast are formulas of several ops, each rounded to the dtype: not these).
PLAIN_ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def norm_kind(norm: nn.Module) -> str | None:
    """The C++ layer's kind of this norm, or None where it computes no such norm (a LayerNorm without weights)."""
    if isinstance(norm, nn.LayerNorm) and (norm.weight is None or len(norm.normalized_shape) != 1):
        return None
    return next((kind for cls, kind in _NORM_KINDS if isinstance(norm, cls)), None)


def takes_projections(*linears: nn.Module) -> bool:
    """Whether the C++ layer reads each of these linear layers' weights (kernels.cpu_projections.takes_projection)."""
    return all(cpu_projections.takes_projection(p.weight, p.weight_scale, p.weight_zero, p.weight_g_idx)
               for p in linears)


def experts_form(block: nn.Module) -> dict | None:
    """A mixture-of-experts block (its router `gate`, routed `experts` (workers.layers.fused_moe.FusedMoE) and, where
    it has one, a `shared_expert` MLP weighted by sigmoid(`shared_expert_gate`)) as DecoderLayerWeights' expert
    fields; None where the C++ layer does not compute it: sigmoid scores or group-limited routing (DeepSeek's),
    whole experts split over ranks (expert parallel), a quantized or biased router. Under tensor parallelism each
    rank's experts hold a slice of every expert's MLP, whose sums the C++ layer reduces over the group."""
    moe, router, routing = block.experts, block.gate, block.experts.routing
    if routing.scoring != "softmax" or (routing.num_expert_group or 1) > 1 or moe.splits_whole_experts or \
            router.weight_scale is not None or router.bias is not None or moe.gate_up_proj.dtype != router.weight.dtype:
        return None
    gate = getattr(block, "shared_expert_gate", None)
    if gate is not None and (gate.weight_scale is not None or gate.bias is not None):
        return None
    return {"router": router.weight, "experts_gate_up": moe.gate_up_proj.data, "experts_down": moe.down_proj.data,
            "experts_gate_up_pairs": moe.gate_up_pairs, "experts_down_pairs": moe.down_pairs,
            "top_k": routing.top_k, "renormalize": routing.renormalize,
            "routed_scaling": routing.routed_scaling_factor, "shared_gate": None if gate is None else gate.weight}


def describe_layer(*, input_norm: nn.Module, post_norm: nn.Module, qkv: nn.Module, o: nn.Module,
                   gate_up: nn.Module | None, down: nn.Module | None, attention: Attention,
                   rotary: RotaryEmbedding | None,
                   attn_out_norm: nn.Module | None = None, mlp_out_norm: nn.Module | None = None,
                   q_norm: nn.Module | None = None, k_norm: nn.Module | None = None, scale: float | None = None,
                   **form) -> cpu_layer_weights.DecoderLayerWeights:
    """A layer's modules as the C++ layer reads them: its norms (all of input_norm's kind and eps), linear layers
    (weights, biases, int8 scales, paired copies), attention (heads, scale unless given, window, soft cap) and rotary
    table; `form`: the rest of DecoderLayerWeights' fields that differ from llama's (experts_form()'s among them).
    gate_up and down: the dense MLP's (a mixture of experts' shared expert), or None."""
    def weight(module: nn.Module | None) -> torch.Tensor | None:
        return None if module is None else module.weight

    def projection(name: str, linear: nn.Module | None) -> dict:
        if linear is None:
            return {name: None}
        lora = linear.lora
        return {name: linear.weight, f"{name}_bias": linear.bias, f"{name}_scale": linear.weight_scale,
                f"{name}_zero": linear.weight_zero, f"{name}_pairs": linear.pairs_weight,
                f"{name}_lora": None if lora is None else cpu_layer_weights.AdapterSlots(lora.a, lora.b_t, lora.used,
                                                                                         lora.part_offsets)}

    return cpu_layer_weights.DecoderLayerWeights(
        input_norm=input_norm.weight, post_norm=post_norm.weight, input_norm_bias=getattr(input_norm, "bias", None),
        post_norm_bias=getattr(post_norm, "bias", None), attn_out_norm=weight(attn_out_norm),
        mlp_out_norm=weight(mlp_out_norm), q_norm=weight(q_norm), k_norm=weight(k_norm),
        **projection("qkv", qkv), **projection("o", o), **projection("gate_up", gate_up), **projection("down", down),
        cos=None if rotary is None else rotary.cos.float().contiguous(),
        sin=None if rotary is None else rotary.sin.float().contiguous(), eps=input_norm.eps,
        scale=attention.scale if scale is None else scale, num_heads=attention.num_heads,
        num_kv_heads=attention.num_kv_heads, head_dim=attention.head_dim, sliding_window=attention.sliding_window,
        soft_cap=attention.soft_cap or 0.0, norm_kind=norm_kind(input_norm), **form)


class FusedStage:
    """A pipeline stage (an nn.Module with stage_layers and layers) whose steps of decodes and short chunks run in
    the C++ layer when every layer of it describes itself: takes_one_call, fused_weights (describe_layer()),
    fused_products (its qkv, o, gate_up and down linear layers) and fused_attention (its Attention, whose bound KV
    cache the kernel writes). The family gives its final norm (final_norm_module(), None off the last stage)."""

    lora_context = None  # set by workers.lora when adapters are enabled: which tokens run with which adapter
    # The C++ layer's arguments, made for the caches bound when it first ran (kernels.cpu_decoder_layer).
    _prepared_layers: cpu_decoder_layer.PreparedLayers | None = None

    def final_norm_module(self) -> nn.Module | None:
        raise NotImplementedError

    @functools.cached_property
    def one_call_layers(self) -> bool:
        """Whether the C++ layer serves this stage's steps of decodes and short chunks: every layer takes it."""
        return bool(self.stage_layers) and all(self.layers[i].takes_one_call for i in self.stage_layers)

    def fused_step(self, x: torch.Tensor, positions: torch.Tensor, metadata: StepMetadata
                   ) -> cpu_decoder_layer.DecodeStep | None:
        """The step's inputs for the C++ layer when it takes this step (kernels.cpu_decoder_layer.decode_step)."""
        if not (self.one_call_layers and isinstance(metadata, AttentionMetadata)):
            return None
        # Under tensor parallelism the C++ layer sums the row-parallel products over the group's shared memory
        # itself; over gloo the products are the model's own linear layers, which all-reduce their partial sums, and
        # the C++ layer computes everything between them.
        rows = self.product_rows if self.reduces_in_kernels else 0
        return cpu_decoder_layer.decode_step(x, positions, metadata.slot_mapping, metadata.block_tables,
                                             metadata.query_start_loc, rows)

    def fused_forward(self, x: torch.Tensor, residual: torch.Tensor | None, step: cpu_decoder_layer.DecodeStep,
                      sums: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The stage's layers on a step fused_step() gave: the final norm's output on the last stage (with `sums`:
        and the sum it normed, the last layer's output), else (out, residual), whose sum is the last layer's output.
        In one C++ call, or with torch's products between C++ calls past the kernels' rows; the same results as the
        op path."""
        prepared = self.prepared_layers(x.dtype, prepare=True)
        if step.kernel_products:
            x, residual = cpu_decoder_layer.decoder_layers(prepared, x, residual, step, self._adapter_slots(len(x)),
                                                           self.kernel_group())
        else:
            products = [self.layers[i].fused_products for i in self.stage_layers]
            x, residual = cpu_decoder_layer.decoder_layers_with_products(prepared, products, x, residual, step)
        return (x, residual) if prepared.final_norm is None or sums else x

    def forget_fused_layers(self) -> None:
        """Its layers changed what the C++ layer reads (an adapter's slots were made for a projection): describe
        and prepare them again at the next step."""
        self._prepared_layers = None
        for i in self.stage_layers:
            self.layers[i].__dict__.pop("fused_weights", None)
        self.__dict__.pop("product_rows", None)

    @property
    def reduces_in_kernels(self) -> bool:
        """Whether the C++ calls compute this rank's share of the stage whole: one rank, or a TP group whose sums they
        take themselves."""
        return parallel_state().tp_size == 1 or self.kernel_group() is not None

    def kernel_group(self) -> cpu_decoder_layer.ShmGroup | None:
        """The TP group the C++ layers reduce over (None at one rank, or over gloo: no shared memory)."""
        return tp_kernel_group() if self.one_call_layers else None

    def _adapter_slots(self, tokens: int) -> torch.Tensor | None:
        """Each token's adapter slot this step (-1: none), None when no token has one."""
        groups = [] if self.lora_context is None else self.lora_context.token_groups
        if not groups:
            return None
        slots = torch.full((tokens,), -1, dtype=torch.int64)
        for slot, rows in groups:
            slots[rows] = slot
        return slots

    def prepared_layers(self, dtype: torch.dtype, prepare: bool = False) -> cpu_decoder_layer.PreparedLayers | None:
        """The stage as the kernel takes it for the bound caches and dtype; made anew if `prepare`, else None when
        the last one made is not for them."""
        caches = [attention.kv_cache for attention in self._stage_attention]
        prepared = self._prepared_layers
        if prepared is not None and prepared.serves(caches, dtype):
            return prepared
        if not prepare:
            return None
        if any(cache is None for cache in caches):
            raise RuntimeError("the KV cache was not bound to an attention layer")
        norm = self.final_norm_module()
        weights = [self.layers[i].fused_weights for i in self.stage_layers]
        self._prepared_layers = cpu_decoder_layer.PreparedLayers(
            weights, caches, dtype, None if norm is None else norm.weight, 0.0 if norm is None else norm.eps,
            getattr(norm, "bias", None), [(a.k_scale, a.v_scale) for a in self._stage_attention])
        return self._prepared_layers

    @functools.cached_property
    def _stage_attention(self) -> list[Attention]:
        """This stage's attention layers, whose kv_cache each step reads (a plain list: no module lookups)."""
        return [self.layers[i].fused_attention for i in self.stage_layers]

    @functools.cached_property
    def product_rows(self) -> int:
        """The most tokens of a step whose products the C++ layer runs: the least this stage's projection weights
        allow (kernels.cpu_projections.max_rows: int8 and small bf16 weights take more)."""
        return min(self.layers[i].fused_weights.max_rows() for i in self.stage_layers)


class FusedGreedyDecoding:
    """A causal LM whose multi-step calls may take their later steps in one C++ call: the family gives its stage,
    embedding and LM head (fused_parts()), and declares the compute_logits() the kernel computes
    (fused_compute_logits: a subclass that changes the logits otherwise falls back to Python steps), with the
    embedding scale and logits' soft cap it applies (0: none)."""

    embed_scale = 0.0
    logit_cap = 0.0
    fused_compute_logits = None

    def fused_parts(self) -> tuple[FusedStage, nn.Module | None, nn.Module | None]:
        raise NotImplementedError

    def fused_positions(self) -> tuple[torch.Tensor, int] | None:
        """A table of learned positions added to the embedding (and the row of position 0), or None."""
        return None

    def greedy_decode(self, tokens: np.ndarray, positions: np.ndarray, table: np.ndarray, limits: np.ndarray,
                      stops: list[set[int]], steps: int,
                      drafts: cpu_greedy_decode.PromptLookupDrafts | cpu_greedy_decode.DraftModelDrafts
                      | cpu_mtp.MtpDrafts | None = None,
                      sampled: cpu_row_options.SampledRows | None = None,
                      penalized: cpu_row_options.PenalizedRows | None = None, logprobs: np.ndarray | None = None,
                      adapters: np.ndarray | None = None,
                      masks: cpu_row_options.GrammarMasks | None = None) -> cpu_greedy_decode.GreedyRun | None:
        """A multi-step call's later steps in one C++ call (kernels.cpu_greedy_decode.greedy_decode: same tokens
        as forward(), compute_logits() and the argmax or the sampler step by step, logits masked by grammars,
        biased and penalized as the sampler does, drafts verified as the Python steps verify them, the sampler's
        logprobs, adapters' deltas in the layers); None where that does not compute
        what they do, and the caller steps in Python, or more rows than the kernels' products take."""
        model = self.greedy_model()
        if model is None or len(tokens) > model.max_rows:
            return None
        return cpu_greedy_decode.greedy_decode(model, tokens, positions, table, limits, stops, steps, drafts, sampled,
                                               penalized, logprobs, adapters, masks)

    def greedy_model(self) -> cpu_greedy_decode.GreedyModel | None:
        """The model (this pipeline stage of it) as greedy_decode() takes it; None for changed logits, tensor
        parallelism where the C++ layers do not reduce over the group themselves, pipeline stages whose ranks do not
        all share this host's memory, an adapter's own LM head or embeddings (modules_to_save), a quantized table or
        head, or layers not in C++ or not prepared for the bound caches (a one-call step prepares them)."""
        parts = self.fused_parts()
        if parts is None or type(self).compute_logits is not type(self).fused_compute_logits:
            return None
        stage, embedding, head = parts
        state, world = parallel_state(), pipeline_kernel_group()
        tables = [table for table in (embedding, head) if table is not None]
        if not (isinstance(stage, FusedStage) and stage.reduces_in_kernels and stage.one_call_layers
                and (state.pp_size == 1 or world is not None)
                and (embedding is not None) == state.is_first_stage and (head is not None) == state.is_last_stage
                and all(table.lora is None and table.weight_scale is None for table in tables)
                and len({table.weight.dtype for table in tables}) <= 1):
            return None
        # A stage with neither table reads the dtype its layers were last prepared for.
        dtype = tables[0].weight.dtype if tables else getattr(stage._prepared_layers, "dtype", None)
        prepared = None if dtype is None else stage.prepared_layers(dtype)
        if prepared is None:
            return None
        positions, rows = self.fused_positions(), stage.product_rows
        if head is not None:
            rows = min(rows, cpu_gemv.max_rows(dtype, head.weight, head.pairs_weight))
        return cpu_greedy_decode.GreedyModel(
            prepared, None if embedding is None else embedding.weight, None if head is None else head.weight,
            0 if head is None else head.vocab_size, rows, None if head is None else head.pairs_weight,
            float(torch.tensor(self.embed_scale).to(dtype)) if self.embed_scale else 0.0,
            float(self.logit_cap or 0.0), *(positions or (None, 0)), stage.kernel_group(),
            tables[0].start if tables else 0,
            None if world is None else cpu_greedy_decode.PipelinePlace(world, state.pp_rank, state.pp_size,
                                                                       state.tp_size))
