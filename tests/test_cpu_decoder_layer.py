"""The C++ decoder layer against its twin, the model's own op-by-op layer, and in the engine."""
from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
from transformers import (Gemma2Config, Gemma3TextConfig, GPTNeoXConfig, LlamaConfig, MixtralConfig, OPTConfig,
                          Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

from frontend import LLM, SamplingParams
from kernels import cpu_decoder_layer, cpu_extension, cpu_gemv, cpu_layer_weights, cpu_projections
from tests.conftest import pairwise, tiny_model
from workers.layers.attention import AttentionMetadata
from workers.layers.linear import ColumnParallelLinear, Linear
from workers.lora.slots import LoRAContext, LoRALayerSlots
from workers.layers.rotary import RotaryEmbedding, rope_parameters_of
from workers.models.gemma2 import Gemma2DecoderLayer
from workers.models.gemma3 import Gemma3DecoderLayer
from workers.models.gpt_neox import GPTNeoXLayer
from workers.models.llama import LlamaDecoderLayer, head_dim_of
from workers.models.mixtral import MixtralDecoderLayer
from workers.models.opt import OPTDecoderLayer
from workers.models.qwen2 import Qwen2DecoderLayer
from workers.models.qwen2_moe import Qwen2MoeDecoderLayer
from workers.models.qwen3 import Qwen3DecoderLayer
from workers.models.qwen3_moe import Qwen3MoeDecoderLayer
from workers.prepacking import prepack_linear_weights
from workers.quantization.fp8_blocks import FP8BlockFormat
from workers.quantization.online import quantize_model_rows

BLOCK_SIZE = 8


@pytest.fixture(scope="module", autouse=True)
def extension():
    if cpu_extension.load() is None:
        pytest.fail("the extension did not build")


def make_layer(layer_class, config, dtype: torch.dtype, seed: int) -> LlamaDecoderLayer:
    generator = torch.Generator().manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_parameters_of(config))
        if layer_class is GPTNeoXLayer:
            layer = layer_class(config, rotary)
        elif layer_class is OPTDecoderLayer:
            layer = layer_class(config)
        else:
            layer = layer_class(config, 0, rotary)
    finally:
        torch.set_default_dtype(previous)
    for name, param in layer.named_parameters():  # norms near one, like trained ones: small weights elsewhere
        base = 1.0 if "norm" in name else 0.0
        param.data.copy_(base + 0.1 * torch.randn(param.shape, generator=generator))
    return layer


def step_batch(seqs: list[tuple[int, int]], num_blocks: int, generator) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata of a step over (context length after the step, new tokens) sequences, single-token ones first as
    the model runner orders them, in random scattered blocks; and the new tokens' positions."""
    tables, free = [], torch.randperm(num_blocks, generator=generator).tolist()
    width = max(-(-length // BLOCK_SIZE) for length, _ in seqs)
    for length, _ in seqs:
        table = [free.pop() for _ in range(-(-length // BLOCK_SIZE))]
        tables.append(table + [0] * (width - len(table)))
    block_tables = torch.tensor(tables, dtype=torch.long)
    rows = torch.tensor([i for i, (_, new) in enumerate(seqs) for _ in range(new)])
    positions = torch.tensor([p for length, new in seqs for p in range(length - new, length)])
    slots = block_tables[rows, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    starts = [0]
    for _, new in seqs:
        starts.append(starts[-1] + new)
    metadata = AttentionMetadata(slot_mapping=slots, block_tables=block_tables, query_start_loc=starts,
                                 seq_lens=[length for length, _ in seqs],
                                 num_decodes=sum(new == 1 for _, new in seqs))
    return metadata, positions


CASES = {
    "llama head_dim 64": (LlamaDecoderLayer, LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                                         intermediate_size=344, max_position_embeddings=512)),
    "qwen2 biases, head_dim 128, window": (
        Qwen2DecoderLayer, Qwen2Config(hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                                       intermediate_size=300, max_position_embeddings=512, sliding_window=40, num_hidden_layers=1,
                                       use_sliding_window=True, max_window_layers=0, layer_types=["sliding_attention"])),
    "llama head_dim 24, llama3 rope": (
        LlamaDecoderLayer, LlamaConfig(hidden_size=72, num_attention_heads=3, num_key_value_heads=3,
                                       intermediate_size=100, max_position_embeddings=512, rope_scaling={
                                           "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen3 q/k head norms, head_dim 32": (
        Qwen3DecoderLayer, Qwen3Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                       intermediate_size=200, max_position_embeddings=512, num_hidden_layers=1)),
    "gemma2 sandwich norms, soft cap, window": (
        Gemma2DecoderLayer, Gemma2Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         intermediate_size=200, max_position_embeddings=512, num_hidden_layers=2,
                                         query_pre_attn_scalar=24, attn_logit_softcapping=2.0, sliding_window=40,
                                         layer_types=["sliding_attention", "full_attention"])),
    "gemma3 (1 + w) q/k head norms, window": (
        Gemma3DecoderLayer, Gemma3TextConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                             intermediate_size=200, max_position_embeddings=512, num_hidden_layers=2,
                                             query_pre_attn_scalar=24, sliding_window=40,
                                             layer_types=["sliding_attention", "full_attention"])),
    "gpt_neox LayerNorm, parallel residual, partial rotary, q/k/v per head, gelu": (
        GPTNeoXLayer, GPTNeoXConfig(hidden_size=128, num_attention_heads=4, intermediate_size=200,
                                    max_position_embeddings=512, rotary_pct=0.25, use_parallel_residual=True,
                                    hidden_act="gelu")),
    "gpt_neox sequential residual, tanh gelu": (
        GPTNeoXLayer, GPTNeoXConfig(hidden_size=96, num_attention_heads=3, intermediate_size=130,
                                    max_position_embeddings=512, use_parallel_residual=False,
                                    hidden_act="gelu_pytorch_tanh")),
    "mixtral experts, top 2 of 5": (
        MixtralDecoderLayer, MixtralConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                           intermediate_size=72, max_position_embeddings=512, num_local_experts=5,
                                           num_experts_per_tok=2)),
    "qwen2_moe experts, top 3 of 6, shared expert": (
        Qwen2MoeDecoderLayer, Qwen2MoeConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                             intermediate_size=160, moe_intermediate_size=48, num_experts=6,
                                             num_experts_per_tok=3, shared_expert_intermediate_size=96,
                                             norm_topk_prob=False, max_position_embeddings=512, qkv_bias=True)),
    # Experts' products of a partial tile (74 rows) and an odd number of columns (37): the paired copies' edges.
    "qwen3_moe experts, top 4 of 7, odd inter": (
        Qwen3MoeDecoderLayer, Qwen3MoeConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                             moe_intermediate_size=37, num_experts=7, num_experts_per_tok=4,
                                             norm_topk_prob=False, max_position_embeddings=512, num_hidden_layers=1)),
    "qwen3_moe experts, top 1 of 3, renormalized": (
        Qwen3MoeDecoderLayer, Qwen3MoeConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                             moe_intermediate_size=40, num_experts=3, num_experts_per_tok=1,
                                             norm_topk_prob=True, max_position_embeddings=512, num_hidden_layers=1)),
    "opt learned positions, q scaled first, relu": (
        OPTDecoderLayer, OPTConfig(hidden_size=128, num_attention_heads=4, ffn_dim=200, max_position_embeddings=512,
                                   word_embed_proj_dim=128, activation_function="relu")),
}


SEQS = {
    "one decode": [(1, 1)],
    "three decodes": [(37, 1), (5, 1), (200, 1)],
    "eight decodes": [(9, 1), (64, 1), (65, 1), (130, 1), (2, 1), (17, 1), (300, 1), (48, 1)],
    "short prompt": [(6, 6)],  # from its start
    "mixed": [(9, 1), (70, 5), (130, 3), (17, 2)],  # decodes and speculative verifications
    "sixteen tokens": [(300, 16)],
    "sixty-four tokens": [(9, 1), (70, 5), (300, 40), (130, 18)],  # prompt chunks beside decodes, up to 64 rows
    "a hundred decodes": [(length, 1) for length in range(5, 405, 4)] + [(77, 5)] * 6,  # past 64 rows
}
# Where the products run, with the dtype as one axis: the paired copies are of bf16 weights alone.
PRODUCTS = [("kernel", torch.float32), ("kernel", torch.bfloat16), ("torch", torch.float32),
            ("torch", torch.bfloat16), ("pairs", torch.bfloat16)]


@pytest.mark.parametrize("case, seqs, first_layer, form", pairwise(
    list(CASES), list(SEQS), [True, False], PRODUCTS,
    ids=lambda value: "-".join(str(v).removeprefix("torch.") for v in value) if isinstance(value, tuple) else None))
def test_equals_the_layers_own_forward(case, seqs, first_layer, form):
    """Products in the kernels (up to max_rows tokens: fewer where the CPU has bf16 GEMMs; from the projections'
    paired copies, which the op path's linear layers then read too, up to PAIRS_MAX_ROWS) or torch's between the
    kernel's calls (any count)."""
    products, dtype = form
    seqs = SEQS[seqs]
    if products == "pairs" and not cpu_gemv.pairs_cpu():
        pytest.skip("paired copies: bf16 weights on CPUs with AVX-512 BF16")
    layer_class, config = CASES[case]
    limit = with_pairs(make_layer(layer_class, config, dtype, seed=0), products == "pairs").fused_weights.max_rows()
    while products != "torch" and sum(new for _, new in seqs) > limit:
        seqs = seqs[:-1] if len(seqs) > 1 else [(seqs[0][0], seqs[0][1] - 1)]
    tokens = sum(new for _, new in seqs)
    layer = with_pairs(make_layer(layer_class, config, dtype, seed=tokens), products == "pairs")
    assert_fused_matches(layer, layer_class, config, dtype, seqs, first_layer,
                         products="torch" if products == "torch" else "kernel")


def with_pairs(layer: LlamaDecoderLayer, paired: bool) -> LlamaDecoderLayer:
    """The layer, its linear projections and a mixture's stacked experts given their paired copies (as
    workers.prepacking gives them) if `paired`: every product then reaches the pairs' row limit."""
    if paired:
        prepack_linear_weights(layer, available_bytes=1 << 40)
        assert layer.fused_weights.max_rows() == cpu_gemv.PAIRS_MAX_ROWS
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        assert experts is None or layer.fused_weights.experts_down_pairs is experts.down_pairs is not None
    return layer


@pytest.mark.skipif(not cpu_gemv.pairs_cpu(), reason="paired copies: bf16 weights on CPUs with AVX-512 BF16")
def test_experts_pairs_of_another_shape_are_refused():
    layer_class, config = CASES["mixtral experts, top 2 of 5"]
    weights = with_pairs(make_layer(layer_class, config, torch.bfloat16, seed=0), True).fused_weights
    cache = torch.zeros(4, config.num_key_value_heads, BLOCK_SIZE, head_dim_of(config), dtype=torch.bfloat16)
    for name, wrong in (("experts_down_pairs", weights.experts_gate_up_pairs),
                        ("experts_gate_up_pairs", weights.experts_gate_up_pairs[:2])):
        with pytest.raises(ValueError, match=name):
            cpu_decoder_layer.PreparedLayers([dataclasses.replace(weights, **{name: wrong})], [(cache, cache)],
                                             torch.bfloat16)


@pytest.mark.skipif(not cpu_gemv.pairs_cpu(), reason="int8 pairs copies: bf16 rows on CPUs with AVX-512 BF16")
@pytest.mark.parametrize("seqs", [[(1, 1)], [(3, 1), (9, 5)], [(9, 1), (70, 5), (130, 3)]],
                         ids=["one decode", "verify", "mixed"])
def test_int8_pairs_copies_equal_the_layers_own_forward(seqs):
    layer_class, config = CASES["qwen2 biases, head_dim 128, window"]
    layer = make_layer(layer_class, config, torch.bfloat16, seed=3)
    assert_fused_matches(layer, layer_class, config, torch.bfloat16, seqs, first_layer=False, int8="paired rows")
    got = fused_and_op_by_op(layer, config, torch.bfloat16, seqs, first_layer=False)[0]
    layer.mlp.down_proj.pairs_weight.zero_()  # the C++ layer reads the copies: its output follows them
    assert not torch.equal(fused_and_op_by_op(layer, config, torch.bfloat16, seqs, first_layer=False)[0][0], got[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqs", [[(1, 1)], [(9, 1), (70, 5), (130, 3)]], ids=["one decode", "mixed"])
@pytest.mark.parametrize("scales", ["rows", "groups"])
@pytest.mark.parametrize("products", ["kernel", "torch"])
def test_int8_projections_equal_the_layers_own_forward(dtype, seqs, scales, products):
    """Weight-only int8: the kernel reads each projection as int8 with its row scales (workers/quantization) or
    its scales per 32 columns (GGUF's Q8_0; 8 where 32 does not divide the columns: the llama case's 344)."""
    layer_class, config = CASES["qwen2 biases, head_dim 128, window" if scales == "rows" else "llama head_dim 64"]
    layer = make_layer(layer_class, config, dtype, seed=3)
    assert_fused_matches(layer, layer_class, config, dtype, seqs, first_layer=False, int8=scales, products=products)
    assert layer.self_attn.qkv_proj.weight.dtype == torch.int8
    assert layer.mlp.down_proj.weight_scale.dim() == (1 if scales == "rows" else 2)
    assert layer.takes_one_call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqs", [[(1, 1)], [(9, 1), (70, 5), (130, 3)]], ids=["one decode", "mixed"])
@pytest.mark.parametrize("scales", ["rows", "blocks"])
def test_fp8_projections_equal_the_layers_own_forward(dtype, seqs, scales):
    """fp8 e4m3 weights: the kernel reads each projection as fp8 with its scales per row, or per block of 16 rows by
    128 columns (8 where 128 does not divide the columns) as the fp8 checkpoint loader keeps them (groups along K)."""
    layer_class, config = CASES["qwen2 biases, head_dim 128, window" if scales == "rows" else "llama head_dim 64"]
    layer = make_layer(layer_class, config, dtype, seed=3)
    exact = make_layer(layer_class, config, torch.float32, seed=0) if dtype == torch.bfloat16 else None
    if exact is not None:
        exact.load_state_dict({name: value.float() for name, value in layer.state_dict().items()})
    for each in (layer, exact):
        if each is not None:
            quantize_fp8(each, scales)
    assert_fused_matches(layer, layer_class, config, dtype, seqs, first_layer=False, exact_layer=exact)
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.down_proj.weight_scale.dim() == (1 if scales == "rows" else 2)
    assert layer.takes_one_call and layer.fused_weights.max_rows() == cpu_gemv.INT8_MAX_ROWS


def quantize_fp8(model: torch.nn.Module, scales: str) -> None:
    """Every projection to fp8 e4m3: absmax / 448 per row, or per block through the checkpoint loader's convert."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, Linear)):
            weight = module.weight.data.float()
            if scales == "rows":
                scale = (weight.abs().amax(-1) / 448).clamp(min=1e-12)
                q = (weight / scale[:, None]).to(torch.float8_e4m3fn)
            else:
                rows, columns = weight.shape
                block = (16, next(g for g in (128, 8) if columns % g == 0))
                padded = torch.nn.functional.pad(weight, (0, 0, 0, -rows % block[0]))
                blocks = padded.view(-1, block[0], columns // block[1], block[1])
                block_scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
                q = (blocks / block_scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(padded.shape)[:rows]
                fmt = FP8BlockFormat({"weight_block_size": list(block)})
                converted = fmt.convert("projection", {"weight": q, "weight_scale_inv": block_scale})
                q, scale = converted.weight, converted.scale
            module.weight = torch.nn.Parameter(q, requires_grad=False)
            module.weight_scale = scale


# Adapter cases: (max rank, each slot's adapter: (rank, the (projection, part) pairs it adapts, None: every part) or
# None for an unused slot, the slot of each row of the step in turn, the step's (length, new tokens) sequences).
ADAPTER_CASES = {
    "rank 4, one decode": (4, [(4, None), None], [0], [(1, 1)]),
    "rank 4, mixed": (4, [(4, None), None], [0, -1, 1], [(9, 1), (70, 5), (130, 3), (17, 2)]),
    # Runs of one slot past a block of 8 rows and of fewer, no-adapter and unused-slot rows among them, a lower
    # rank in its slots, an adapter on q and v only (k's rows and the MLP without deltas), q/k/v of uneven size.
    **{f"rank {rank}, four slots": (rank, [(rank, None), (rank // 2, None), (rank, {(0, 0), (0, 2)}), None],
                                    [0, -1, 0, 1, 0, 2, 0, 3, 0, 1, -1, 0, 2, 0, 1, 0, 0, 2, 0, -1, 0, 1, 3, 0],
                                    [(40, 1)] * 17 + [(70, 7)]) for rank in (8, 16, 64)},
    "rank 5 (an odd column), two slots": (5, [(5, None), (3, {(0, 1), (3, 0)})], [1, 0, 0, -1, 0, 1, 0, 0, 0, 1],
                                          [(9, 1)] * 7 + [(30, 3)]),
    # Every row of a batch-32 decode with one adapter: whole blocks of 8 rows of one slot, the shrink split over the
    # product's threads.
    "rank 16, one adapter, 32 rows": (16, [(16, None)], [0], [(40, 1)] * 32),
}


@pytest.mark.parametrize("dtype, paired", [(torch.float32, False), (torch.bfloat16, False),
                                           pytest.param(torch.bfloat16, True, marks=pytest.mark.skipif(
                                               not cpu_gemv.pairs_cpu(), reason="paired copies: AVX-512 BF16"))])
@pytest.mark.parametrize("case", ADAPTER_CASES)
def test_adapter_deltas_equal_the_layers_own_forward(dtype, paired, case):
    """Every projection with adapter slots (workers/lora/slots.py): the C++ layer adds the deltas the op path's
    linear layers add, row by row whatever slot its neighbours run with; paired, the pairs product's threads add
    them."""
    max_rank, adapters, pattern, seqs = ADAPTER_CASES[case]
    layer_class, config = CASES["llama head_dim 64" if len(adapters) > 2 else "qwen2 biases, head_dim 128, window"]
    layer = make_layer(layer_class, config, dtype, seed=5)
    exact = make_layer(layer_class, config, torch.float32, seed=0) if dtype == torch.bfloat16 else None
    if exact is not None:
        exact.load_state_dict({name: value.float() for name, value in layer.state_dict().items()})
    slots = [pattern[i % len(pattern)] for i in range(sum(new for _, new in seqs))]
    context = LoRAContext()
    for each in (layer, exact):
        if each is not None:
            add_adapter_slots(each, context, max_rank, adapters)
    with_pairs(layer, paired)
    context.set_tokens(slots, torch.device("cpu"))
    assert layer.fused_weights.qkv_lora is not None
    assert_fused_matches(layer, layer_class, config, dtype, seqs, first_layer=False, exact_layer=exact,
                         lora_slots=torch.tensor(slots))


@pytest.mark.skipif(not cpu_gemv.pairs_cpu(), reason="paired copies: bf16 weights on CPUs with AVX-512 BF16")
def test_an_adapted_rows_delta_does_not_depend_on_the_rows_adapted_beside_it():
    """Paired bf16 products, the deltas added by the product's threads: two adapted rows among unadapted ones (shrunk
    on the calling thread: 2 x 48 x 256 products, under lora_row_deltas.h's kCallerShrinkProducts) get, bit for bit,
    what they get in a step where every row is adapted (24 x 48 x 256: shrunk across the product's threads)."""
    layer_class, config = CASES["llama head_dim 64"]
    layer = make_layer(layer_class, config, torch.bfloat16, seed=5)
    context = LoRAContext()
    add_adapter_slots(layer, context, 16, [(16, None), (8, None)])
    with_pairs(layer, True)
    seqs = [(40, 1)] * 24
    outputs = []
    for slots in ([0, 1] * 12, [0, 1] + [-1] * 22):
        context.set_tokens(slots, torch.device("cpu"))
        outputs.append(fused_and_op_by_op(layer, config, torch.bfloat16, seqs, False,
                                          lora_slots=torch.tensor(slots))[0])
    for every_row, two_rows in zip(outputs[0][:2], outputs[1][:2]):  # the layer's output and residual
        assert torch.equal(every_row[:2], two_rows[:2])
        assert not torch.equal(every_row[2:], two_rows[2:])  # the other rows' adapters did act in the first step


def add_adapter_slots(layer, context: LoRAContext, max_rank: int, adapters: list) -> None:
    """Slots of max_rank on each of the layer's projections, one per adapter (ADAPTER_CASES' form), random and the
    same for every layer given them."""
    generator = torch.Generator().manual_seed(9)
    for index, linear in enumerate(layer.fused_products):
        parts = linear.output_sizes if isinstance(linear, ColumnParallelLinear) else [linear.weight.shape[0]]
        linear.lora = LoRALayerSlots(context, parts, linear.weight.shape[1], len(adapters), max_rank,
                                     layer.input_layernorm.weight.dtype, torch.device("cpu"))
        for slot, (rank, targets) in ((s, a) for s, a in enumerate(adapters) if a is not None):
            for part, size in enumerate(parts):
                if targets is None or (index, part) in targets:
                    linear.lora.set(slot, part, 0.3 * torch.randn(rank, linear.weight.shape[1], generator=generator),
                                    0.3 * torch.randn(size, rank, generator=generator))


def quantize_groups(model: torch.nn.Module) -> None:
    """Every projection to int8 with one symmetric scale per 32 (else 16 or 8) columns, as GGUF's Q8_0 stores them."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, Linear)):
            weight = module.weight.data.float()
            group = next(g for g in (32, 16, 8) if weight.shape[1] % g == 0)
            grouped = weight.view(weight.shape[0], -1, group)
            scale = (grouped.abs().amax(-1) / 127).clamp(min=1e-8)
            q = torch.round(grouped / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
            module.weight = torch.nn.Parameter(q.reshape(weight.shape), requires_grad=False)
            module.weight_scale = scale


def assert_fused_matches(layer: LlamaDecoderLayer, layer_class, config, dtype: torch.dtype, seqs, first_layer: bool,
                         int8: str | None = None, products: str = "kernel", exact_layer=None,
                         lora_slots: torch.Tensor | None = None) -> None:
    """The one-call layer equals forward() (float32), or (bf16) is as close to the float32 layer as forward() is
    (exact_layer, where given: that float32 layer)."""
    exact = exact_layer
    if dtype == torch.bfloat16 and exact is None:  # the same step in float32, from the same bf16 values
        exact = make_layer(layer_class, config, torch.float32, seed=0)
        exact.load_state_dict({name: value.float() for name, value in layer.state_dict().items()})
    for each in (layer, exact):
        if int8 in ("rows", "paired rows") and each is not None:
            quantize_model_rows(each, quantize_lm_head=False)
        if int8 == "paired rows" and each is layer:  # int8 pairs copies (gemv_pairs.h), as workers.prepacking gives
            prepack_linear_weights(layer, available_bytes=1 << 40)
            assert layer.self_attn.qkv_proj.pairs_weight.dtype == layer.mlp.down_proj.pairs_weight.dtype == torch.int8
        if int8 == "groups" and each is not None:
            quantize_groups(each)
    got, expected = fused_and_op_by_op(layer, config, dtype, seqs, first_layer, products=products,
                                       lora_slots=lora_slots)
    if exact is not None:
        exact = fused_and_op_by_op(exact, config, torch.float32, seqs, first_layer, values=torch.bfloat16,
                                   lora_slots=lora_slots)[1]
    for i, (tensor, reference) in enumerate(zip(got, expected)):
        assert tensor.dtype == dtype
        if dtype == torch.float32:
            # The kernel sums in other orders than torch (RMSNorm's squares in 16 lanes; past 16 tokens the op path
            # attends to prompt chunks with SDPA's blocked sums): a row's error scales with the row, so the bound is
            # a few float32 ulps of the output's scale.
            atol = max(1e-5, 4e-6 * reference.abs().max().item())
            torch.testing.assert_close(tensor, reference, rtol=1e-5, atol=atol)
        else:
            # bf16 takes roundings in other places (the op path's SDPA rounds prompt attention to bf16; the
            # kernel keeps float32): the kernel must be as close to the float32 layer as the op path is, on average
            # and at worst. The worst element may round the other way (one bf16 step of the outputs' magnitude, a
            # coin flip where torch's bf16 GEMMs and the kernel's sums run in other orders): two steps of slack.
            kernel_error, op_error = ((t.float() - exact[i]).abs() for t in (tensor, reference))
            step = 2.0 ** (math.floor(math.log2(exact[i].abs().max().item())) - 7)
            if i == 0 and hasattr(getattr(layer, "mlp", None), "experts"):
                # A token whose k-th and next experts score within a rounding of each other takes either one,
                # by the ulps its input differs by: a few such rows, the rest as close as the op path's.
                rerouted = (tensor.float() - reference.float()).abs().amax(-1) > 8 * step
                assert rerouted.float().mean() <= 0.1, rerouted.sum()
                kernel_error, op_error = kernel_error[~rerouted], op_error[~rerouted]
            assert kernel_error.mean() <= 1.1 * op_error.mean() + 1e-5, (kernel_error.mean(), op_error.mean())
            assert kernel_error.max() <= op_error.max() + 2 * step, (kernel_error.max(), op_error.max(), step)


def fused_and_op_by_op(layer: LlamaDecoderLayer, config, dtype: torch.dtype, seqs, first_layer: bool,
                       values: torch.dtype | None = None, products: str = "kernel",
                       lora_slots: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the C++ layer's outputs and caches, its products the kernels' or torch's, forward()'s) on random caches and
    inputs, rounded to `values` (default: dtype) before they are cast to dtype."""
    tokens = sum(new for _, new in seqs)
    generator = torch.Generator().manual_seed(tokens * 7 + first_layer)
    head_dim = head_dim_of(config)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    num_blocks = sum(-(-length // BLOCK_SIZE) for length, _ in seqs) + 3
    values = values or dtype
    caches = [torch.randn(num_blocks, kv_heads, BLOCK_SIZE, head_dim, generator=generator).to(values).to(dtype)
              for _ in range(2)]
    metadata, positions = step_batch(seqs, num_blocks, generator)
    x = torch.randn(tokens, config.hidden_size, generator=generator).to(values).to(dtype)
    residual = None if first_layer else \
        torch.randn(tokens, config.hidden_size, generator=generator).to(values).to(dtype)

    def op_by_op(layer: LlamaDecoderLayer, cast: torch.dtype) -> list[torch.Tensor]:
        attention = layer.fused_attention
        attention.kv_cache = tuple(c.to(cast) for c in caches)
        if isinstance(layer, LlamaDecoderLayer):
            out = layer(positions, x.to(cast), None if residual is None else residual.to(cast), metadata)
        else:  # one stream: the layer's input is the sum the kernel adds first, its output the sum it leaves
            stream = x.to(cast) if residual is None else x.to(cast) + residual.to(cast)
            out = [layer(stream, metadata) if isinstance(layer, OPTDecoderLayer) else
                   layer(positions, stream, metadata)]
        return [*out, *attention.kv_cache]

    with torch.inference_mode():
        expected = op_by_op(layer, dtype)
        step = cpu_decoder_layer.decode_step(x, positions, metadata.slot_mapping, metadata.block_tables,
                                             metadata.query_start_loc, layer.fused_weights.max_rows())
        assert step is not None
        if products == "torch":
            run = functools.partial(cpu_decoder_layer.decoder_layers_with_products, products=[layer.fused_products])
        else:
            assert step.kernel_products
            run = functools.partial(cpu_decoder_layer.decoder_layers, lora_slots=lora_slots)
        attention = layer.fused_attention
        attention.kv_cache = tuple(c.clone() for c in caches)
        prepared = cpu_decoder_layer.PreparedLayers([layer.fused_weights], [attention.kv_cache], x.dtype)
        assert prepared.serves([attention.kv_cache], x.dtype)
        assert not prepared.serves([caches], x.dtype)  # caches bound anew: prepared again
        out = run(prepared, x=x, residual=residual, step=step)
        if not isinstance(layer, LlamaDecoderLayer):
            out = [out[0] + out[1]]
        got = [*out, *attention.kv_cache]
    return got, expected


def test_a_layer_takes_the_fewest_rows_its_weights_allow(monkeypatch):
    """int8 weights: INT8_MAX_ROWS; with bf16 instructions, small bf16 weights (the kernels' blocks at every row
    count) SMALL_BF16_MAX_ROWS, others NATIVE_BF16_MAX_ROWS; the layer: the least of its weights'."""
    monkeypatch.setattr(cpu_gemv, "cpu_has_native_bf16", lambda: True)
    small, short_rows, large = torch.zeros(64, 64).bfloat16(), torch.zeros(4096, 256).bfloat16(), \
        torch.zeros(1024, 512).bfloat16()
    int8 = torch.zeros(1024, 512, dtype=torch.int8)
    limits = {"small": cpu_gemv.SMALL_BF16_MAX_ROWS, "short rows": cpu_gemv.SMALL_BF16_MAX_ROWS,
              "large": cpu_gemv.NATIVE_BF16_MAX_ROWS, "int8": cpu_gemv.INT8_MAX_ROWS}
    for name, weight in (("small", small), ("short rows", short_rows), ("large", large), ("int8", int8)):
        assert cpu_gemv.max_rows(torch.bfloat16, weight) == limits[name]
    assert cpu_projections.max_rows(torch.bfloat16, [small, int8]) == cpu_gemv.SMALL_BF16_MAX_ROWS
    assert cpu_projections.max_rows(torch.bfloat16, [small, large]) == cpu_gemv.NATIVE_BF16_MAX_ROWS
    assert cpu_projections.max_rows(torch.float32, [torch.zeros(64, 64)]) == cpu_gemv.FLOAT32_MAX_ROWS
    pairs = cpu_gemv.pair_weight(large)  # a paired copy: PAIRS_MAX_ROWS for its weight alone
    assert cpu_projections.max_rows(torch.bfloat16, [large], [pairs]) == cpu_gemv.PAIRS_MAX_ROWS
    assert cpu_projections.max_rows(torch.bfloat16, [large, int8], [pairs, None]) == cpu_gemv.INT8_MAX_ROWS
    assert cpu_projections.max_rows(torch.bfloat16, [large, large], [pairs, None]) == cpu_gemv.NATIVE_BF16_MAX_ROWS


@pytest.mark.skipif(not cpu_gemv.pairs_cpu(), reason="paired copies: bf16 weights on CPUs with AVX-512 BF16")
def test_paired_experts_take_the_rows_their_products_allow(monkeypatch):
    """A mixture of paired experts: PAIRS_MAX_ROWS, or fewer where an expert's mean share of the rows (top_k /
    experts of them) would pass EXPERT_MAX_PRODUCTS multiply-adds; unpaired experts: their weights' limit."""
    layer_class, config = CASES["mixtral experts, top 2 of 5"]  # experts 2 x 72 + 72 by 128: 27648 weights each
    weights = with_pairs(make_layer(layer_class, config, torch.bfloat16, seed=0), True).fused_weights
    monkeypatch.setattr(cpu_layer_weights, "EXPERT_MAX_PRODUCTS", 27648 * 10 * 2 // 5)
    assert weights.max_rows() == 10
    monkeypatch.setattr(cpu_layer_weights, "EXPERT_MAX_PRODUCTS", 1)
    assert weights.max_rows() == 1
    unpaired = dataclasses.replace(weights, experts_gate_up_pairs=None, experts_down_pairs=None)
    assert unpaired.max_rows() == cpu_projections.max_rows(torch.bfloat16, [unpaired.experts_gate_up[0]])


def test_declines_steps_it_does_not_compute():
    x, positions, slots, tables = torch.randn(2, 8), torch.tensor([3, 4]), torch.tensor([3, 4]), torch.zeros(2, 1)
    with torch.inference_mode():
        assert cpu_decoder_layer.decode_step(x, positions, slots, tables, [0, 1, 2]) is not None
        assert cpu_decoder_layer.decode_step(x.half(), positions, slots, tables, [0, 1, 2]) is None
        # a whole prompt reaching position LONG_RUN_CONTEXT: the op path; one token shorter: the kernel
        for n, takes in ((cpu_decoder_layer.LONG_RUN_CONTEXT + 1, False), (cpu_decoder_layer.LONG_RUN_CONTEXT, True)):
            assert (cpu_decoder_layer.decode_step(torch.randn(n, 8), torch.arange(n), torch.arange(n),
                                                  torch.zeros(1, 1), [0, n]) is not None) == takes
        # a decode deep in its context beside a shallow prompt chunk: the kernel (each run's own depth counts)
        n = cpu_decoder_layer.LONG_RUN_ROWS + 1
        positions_of = torch.cat([torch.tensor([cpu_decoder_layer.LONG_RUN_CONTEXT * 4]), torch.arange(n)])
        assert cpu_decoder_layer.decode_step(torch.randn(n + 1, 8), positions_of, torch.arange(n + 1),
                                             torch.zeros(2, 1), [0, 1, n + 1]) is not None
        # n decodes: always taken, their products in the kernels up to the kernels' rows (torch's past them)
        for dtype, given, limit in ((torch.float32, None, cpu_gemv.max_rows(torch.float32)),
                                    (torch.bfloat16, None, cpu_gemv.max_rows(torch.bfloat16)),
                                    (torch.bfloat16, 50, 50)):
            for n in (min(limit, 1024), min(limit, 1024) + 1):
                step = cpu_decoder_layer.decode_step(torch.randn(n, 8).to(dtype), torch.arange(n), torch.arange(n),
                                                     torch.zeros(n, 1), list(range(n + 1)), given)
                assert step.kernel_products == (n <= limit)
        # a long prompt chunk deep into its context: the op path; as deep with few rows, or shallow: the kernel
        rows = cpu_decoder_layer.LONG_RUN_ROWS + 1
        for first, many, takes in ((cpu_decoder_layer.LONG_RUN_CONTEXT, rows, False),
                                   (cpu_decoder_layer.LONG_RUN_CONTEXT, rows - 1, True), (0, rows, True)):
            assert (cpu_decoder_layer.decode_step(torch.randn(many, 8), torch.arange(first, first + many),
                                                  torch.arange(many), torch.zeros(1, 1), [0, many]) is not None) == takes
    assert cpu_decoder_layer.decode_step(x, positions, slots, tables, [0, 1, 2]) is None  # autograd on


@pytest.mark.parametrize(("arch", "products"), [("llama", "kernel"), ("qwen2", "kernel"), ("mistral", "kernel"),
                                               ("qwen3", "kernel"), ("gemma2", "kernel"), ("gpt_neox", "kernel"),
                                               ("opt", "kernel"), ("phi3", "kernel"), ("mixtral", "kernel"),
                                               ("qwen3_moe", "kernel"), ("llama", "torch"), ("qwen3", "torch"),
                                               ("gemma2", "torch"), ("gpt_neox", "torch"), ("qwen2_moe", "torch")])
def test_engine_outputs_equal_the_op_by_op_path(arch, products, monkeypatch):
    """Greedy float32 through the engine, batch 1 and 3: the same tokens and logprobs with the kernel as without
    (its products the kernels', or torch's as past max_rows)."""
    model = tiny_model(arch)
    prompts = [{"prompt_token_ids": list(range(5 + i, 45 + 13 * i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=3, ignore_eos=True)
    calls = []
    name = "decoder_layers" if products == "kernel" else "decoder_layers_with_products"
    if products == "torch":
        monkeypatch.setattr(cpu_projections, "max_rows", lambda *args: 0)
    layers = getattr(cpu_decoder_layer, name)
    monkeypatch.setattr(cpu_decoder_layer, name, lambda *args: calls.append(1) or layers(*args))

    def run() -> list:
        llm = LLM(model, in_process=True, dtype="float32", block_size=16)
        try:
            return [llm.generate(prompts[:1], params, use_tqdm=False)[0]] + llm.generate(prompts, params,
                                                                                          use_tqdm=False)
        finally:
            llm.shutdown()

    fused = run()
    assert calls, "the engine never took the C++ layer"
    monkeypatch.setattr(cpu_decoder_layer, "decode_step", lambda *args: None)
    reference = run()
    for got, expected in zip(fused, reference):
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        for got_step, expected_step in zip(got.outputs[0].logprobs, expected.outputs[0].logprobs):
            assert got_step.keys() == expected_step.keys()
            for token in got_step:
                assert got_step[token].logprob == pytest.approx(expected_step[token].logprob, abs=1e-5)
