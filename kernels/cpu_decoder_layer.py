"""A stage's decoder layers, of every family they describe, for a step of decodes or short chunks in C++
(kernels/csrc/decoder_layer.h).

At batch-1 decode the weights stream in ~3 ms per token on this project's benchmark model, while the ~50 tensor
ops per layer that norm, rotate, cache, attend and gate cost several more in dispatch alone. The kernel runs the
layer's ops in order with the same roundings to the model dtype (its twin is the model's own op-by-op path,
tests/test_cpu_decoder_layer.py), with the GEMV kernel's products. Past the rows those products pay at, torch's GEMMs
run them and the kernel does the rest between them, four calls per layer (kernels/cpu_greedy_decode.py runs whole
steps of the model on top of these layers).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch

from kernels import cpu_extension
from kernels.cpu_decode_attention import cache_kind
from kernels.cpu_layer_weights import DecoderLayerWeights, pointer
from kernels.cpu_projections import max_rows


# A step with a prompt chunk of more than LONG_RUN_ROWS tokens that reaches position LONG_RUN_CONTEXT goes to the op
# path: SDPA's GEMMs attend to such a run faster than the kernel's rows, whose scores grow with rows x context
# (bf16, 8 heads over 4 KV heads of 64, 2-core AVX-512 BF16 EPYC: a whole prompt of 1024 tokens 15.9 ms against
# 17.4, 1536 37 against 55; 256 rows at 2048 the same), while shorter ones are faster in the kernel (400 tokens
# 1.7 against 3.2 ms, 768 7.7 against 9.4; float32 1.9 against 3.0 and 5.5 against 8.6) and the layer's other ops
# with it (a throughput run whose prompts are 16-400 tokens: 0.90x the time with them in the kernel). Measured on a
# Zen 4 against SDPA with a materialized mask; SDPA now takes the causal mask as its lower-right bias and skips the
# blocks above the diagonal (2x at 2048 tokens), and the kernel attends a long run in pieces whose scores fit half
# an L2: on a Zen 5 the kernel is then about 2x faster at every length measured (bf16: 1024 tokens 4.4 against 9.5
# ms, 2048 15.6 against 30), but against SDPA it stood ~2.3x worse on the Zen 4 this was tuned on, where the two would
# now be about even at 768-1024. Not re-tuned without a Zen 4 to measure on.
LONG_RUN_ROWS, LONG_RUN_CONTEXT = 16, 768


@dataclass(frozen=True)
class DecodeStep:
    """What every layer of one step reads, one row per token: int64 tensors."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor  # the block table of each token's sequence
    seq_lens: torch.Tensor  # position + 1: the slots each token attends to
    # Few enough tokens for the kernels' products (max_rows): decoder_layers(); else decoder_layers_with_products().
    kernel_products: bool


def decode_step(x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                query_start_loc: list[int], max_product_rows: int | None = None) -> DecodeStep | None:
    """The step's inputs for the C++ layer when it takes this step, else None: on the CPU, float32 or bfloat16, at
    inference, kernel built, and no sequence of more than LONG_RUN_ROWS tokens reaching position LONG_RUN_CONTEXT.
    Up to max_product_rows tokens (default: max_rows(x.dtype); a model gives its weights' limit) its products run in
    the kernels too.

    Each token is its own attention row over its sequence's blocks, seeing the first position + 1 slots: causal
    attention, so decodes, speculative verification (1 + k tokens of a sequence) and short prompt chunks all fit.
    """
    tokens = x.shape[0]
    if not (tokens > 0 and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and not torch.is_grad_enabled() and cpu_extension.ready() is not None):
        return None
    positions = positions.long().contiguous()
    tables = block_tables.long()
    if tokens != len(query_start_loc) - 1:  # some sequence has several tokens: repeat its table row for each
        starts = torch.tensor(query_start_loc)
        counts = starts.diff()
        long_runs = counts > LONG_RUN_ROWS
        if bool(long_runs.any()) and int(positions[starts[1:][long_runs] - 1].max()) >= LONG_RUN_CONTEXT:
            return None
        tables = tables.repeat_interleave(counts, dim=0)
    return DecodeStep(positions, slot_mapping.long().contiguous(), tables.contiguous(), positions + 1,
                      tokens <= (max_rows(x.dtype) if max_product_rows is None else max_product_rows))


Product = Callable[[torch.Tensor], torch.Tensor]


class ShmGroup(NamedTuple):
    """A tensor-parallel group's shared memory as the C++ layer reduces over it (kernels/csrc/tp_reduce.h; made by
    workers.shm_communicator, whose rounds it shares): the addresses of its slots, its round counters and this rank's
    round count, a slot's bytes, the FIFOs, this rank, the group's size and how long a waiter polls (ns)."""

    slots: int
    slot_bytes: int
    counters: int
    round: int
    fifos: list[int]
    rank: int
    size: int
    spin_ns: int


class PreparedLayers:
    """A stage's layers, their (key, value) caches and the final norm (of the layers' norm kind, its bias where a
    LayerNorm has one) as the kernel takes them, checked and turned into pointer lists once rather than every step
    (the weights stay where loading put them; a model makes these again when its caches are bound anew). The caches
    hold the layers' dtype, or all one fp8 format with each layer's (k_scale, v_scale) in `scales` (default 1.0)."""

    def __init__(self, layers: Sequence[DecoderLayerWeights], caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 dtype: torch.dtype, final_norm: torch.Tensor | None = None, final_eps: float = 0.0,
                 final_norm_bias: torch.Tensor | None = None,
                 scales: Sequence[tuple[float, float]] | None = None) -> None:
        self.module = _checked(layers, caches, dtype, final_norm, final_norm_bias)
        self.cache_kind = cache_kind(*caches[0], dtype)
        scales = [(1.0, 1.0)] * len(caches) if scales is None else list(scales)
        if len(scales) != len(caches):
            raise ValueError("scales: one (k_scale, v_scale) per layer")
        self.scales = scales
        self.layers, self.caches, self.dtype = list(layers), list(caches), dtype
        self.layer_args = [w.args() for w in layers]
        self.block_size = caches[0][0].shape[2]
        self.final_norm = final_norm
        # module.cpp's StageArgs
        self.stage_args = ([a[0] for a in self.layer_args], [a[1] for a in self.layer_args],
                           [a[2] for a in self.layer_args], [k.data_ptr() for k, _ in caches],
                           [v.data_ptr() for _, v in caches], self.cache_kind,
                           [float(s) for pair in scales for s in pair], pointer(final_norm),
                           pointer(final_norm_bias), final_eps)

    def check(self, x: torch.Tensor) -> None:
        if x.dtype != self.dtype:
            raise TypeError(f"the layers were prepared for {self.dtype}, not {x.dtype}")

    def serves(self, caches: Sequence[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> bool:
        """Whether these are still the caches (and dtype) it was prepared for."""
        return dtype == self.dtype and len(caches) == len(self.caches) and all(
            a is b for a, b in zip(caches, self.caches))


def decoder_layers(prepared: PreparedLayers, x: torch.Tensor, residual: torch.Tensor | None, step: DecodeStep,
                   lora_slots: torch.Tensor | None = None, group: ShmGroup | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The prepared layers in order in one call: (out, residual), whose sum is the last layer's output (llama's
    layers return them so); with a final norm, (its norm of that sum, the sum). Saves the per-layer Python and
    dispatch of a step (~0.3 ms per token of batch-1 decode on the benchmark model). lora_slots: int64 [tokens],
    each token's adapter slot (-1: none), whose deltas its rows of the layers' projections get. group: the
    tensor-parallel group whose shard of each (dense, non-MLA) layer these are; their row-parallel products (o and
    down) are summed over it inside the call, the biases added after the sum."""
    prepared.check(x)
    if lora_slots is not None and not (lora_slots.dtype == torch.int64 and lora_slots.shape == x.shape[:1]
                                       and lora_slots.is_contiguous()):
        raise ValueError("lora_slots must be a contiguous int64 slot per token")
    x = x.contiguous()  # kept in locals: the kernel gets raw pointers, which must outlive the call
    residual = None if residual is None else residual.contiguous()
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    prepared.module.decoder_layers(
        x.dtype == torch.bfloat16, prepared.stage_args, x.data_ptr(), pointer(residual), out.data_ptr(),
        residual_out.data_ptr(), step.positions.data_ptr(), step.slot_mapping.data_ptr(), prepared.block_size,
        step.block_tables.data_ptr(), step.block_tables.shape[1], step.seq_lens.data_ptr(), x.shape[0],
        pointer(lora_slots), group)
    return out, residual_out


def decoder_layers_with_products(prepared: PreparedLayers,
                                 products: Sequence[tuple[Product, Product, Product, Product | None]], x: torch.Tensor,
                                 residual: torch.Tensor | None, step: DecodeStep) -> tuple[torch.Tensor, torch.Tensor]:
    """decoder_layers() for a step of more tokens than the kernels' products take: each layer's (qkv, o, gate_up,
    down) products are the given functions (the model's linear layers: torch's GEMMs; a mixture of experts gives its
    whole MLP as gate_up and None as down), everything between them the kernel's layer phases, in four calls per
    layer instead of the op path's ~50 tensor ops."""
    prepared.check(x)
    module = prepared.module
    bf16, tokens = x.dtype == torch.bfloat16, x.shape[0]
    rows = step.positions.data_ptr(), step.slot_mapping.data_ptr()
    tables = step.block_tables.data_ptr(), step.block_tables.shape[1], step.seq_lens.data_ptr()
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    residual_out, normed = torch.empty_like(x), torch.empty_like(x)
    key_caches, value_caches = prepared.stage_args[3:5]
    for i, (weights, (qkv_proj, o_proj, gate_up_proj, down_proj), layer) in enumerate(
            zip(prepared.layers, products, prepared.layer_args, strict=True)):
        before = residual_out.data_ptr() if i else pointer(residual)
        module.before_attention(bf16, layer, x.data_ptr(), before, residual_out.data_ptr(), normed.data_ptr(), tokens)
        qkv = qkv_proj(normed).contiguous()
        attn = torch.empty(tokens, weights.attn_width, dtype=x.dtype)
        module.attend(bf16, layer, qkv.data_ptr(), *rows, key_caches[i], value_caches[i], prepared.cache_kind,
                      *prepared.scales[i], prepared.block_size, *tables, attn.data_ptr(), tokens)
        o = o_proj(attn).contiguous()
        module.after_attention(bf16, layer, o.data_ptr(), residual_out.data_ptr(), normed.data_ptr(), tokens)
        if down_proj is None:  # a mixture of experts: the product is the layer's whole MLP
            x = gate_up_proj(normed).contiguous()
        else:
            h = gate_up_proj(normed).contiguous()
            act = torch.empty(tokens, weights.intermediate, dtype=x.dtype)
            module.activate(bf16, layer, h.data_ptr(), act.data_ptr(), tokens)
            x = down_proj(act).contiguous()
        module.after_mlp(bf16, layer, x.data_ptr(), o.data_ptr(), tokens)
    if prepared.final_norm is None:
        return x, residual_out
    module.final_norm(bf16, prepared.stage_args, x.data_ptr(), residual_out.data_ptr(), residual_out.data_ptr(),
                      normed.data_ptr(), tokens)
    return normed, residual_out


def final_norm(prepared: PreparedLayers, x: torch.Tensor) -> torch.Tensor:
    """The stage's final norm of x [rows, hidden] (rows of the layers' output), as its C++ calls norm them."""
    if prepared.final_norm is None:
        raise ValueError("the stage was prepared without a final norm")
    prepared.check(x)
    if x.dim() != 2 or x.shape[1] != prepared.final_norm.shape[0]:
        raise ValueError(f"the final norm takes [rows, {prepared.final_norm.shape[0]}] rows")
    x = x.contiguous()
    normed, copy = torch.empty_like(x), torch.empty_like(x)
    prepared.module.final_norm(x.dtype == torch.bfloat16, prepared.stage_args, x.data_ptr(), 0, copy.data_ptr(),
                               normed.data_ptr(), x.shape[0])
    return normed


def _checked(layers: Sequence[DecoderLayerWeights], caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
             dtype: torch.dtype, final_norm: torch.Tensor | None, final_norm_bias: torch.Tensor | None
             ) -> ModuleType:
    """The kernels' module, once the layers (of one norm kind), caches and final norm are found fit for hidden
    states of `dtype`."""
    module = cpu_extension.required()
    if not layers:
        raise ValueError("no layers to run")
    for weights, (key_cache, value_cache) in zip(layers, caches, strict=True):
        if (key_cache.dtype, value_cache.dtype) != (caches[0][0].dtype,) * 2 or weights.input_norm.dtype != dtype:
            raise TypeError("a stage's caches share one dtype, and its norms the hidden states' dtype")
        cache_kind(key_cache, value_cache, dtype)
        weights.check(dtype)
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError("the caches must be contiguous")
    if len({weights.norm_kind for weights in layers}) != 1:
        raise ValueError("a stage's layers share one norm kind")
    if any(t is not None and t.dtype != dtype for t in (final_norm, final_norm_bias)):
        raise TypeError("the final norm must share the hidden states' dtype")
    return module
