"""The C++ fast path at tensor parallel 2 (no Ray: two gloo ranks forked from one driver). The decoder layer sums
the row-parallel products and the experts' outputs over the group's shared memory itself (kernels/csrc/tp_reduce.h),
the biases added after the sum, and equals bit for bit the layers whose products are the model's own linear layers,
which all-reduce in Python (the two take turns on one group's rounds; a mixture's experts within their products'
roundings, as at one rank); a llama stage takes that path for its decodes; and a whole model's greedy steps in one
C++ call (its embeddings summed, its logits gathered over the group) take on every rank the tokens that the model's
steps in Python take."""
from __future__ import annotations

import copy
import math
import sys

import numpy as np
import torch
from transformers import DeepseekV2Config, DeepseekV3Config

from forked_ranks import drive, kernel_rank, run_kernel_driver
from kernels import cpu_decoder_layer, cpu_extension, cpu_gemv
from test_cpu_decoder_layer import BLOCK_SIZE, CASES, SEQS, make_layer, step_batch, with_pairs
from test_cpu_mla_layer import YARN
from test_cpu_pp_steps import seeded_llama
from workers.distributed import tp_all_reduce, tp_kernel_group
from workers.layers.attention import AttentionMetadata
from workers.models.deepseek_v2 import DeepseekV2DecoderLayer
from workers.models.deepseek_v3 import DeepseekV3DecoderLayer
from workers.models.llama import LlamaDecoderLayer, LlamaModel, head_dim_of

# Families' forms with what a shard changes: GQA heads split, q/k/v biases (column-parallel), o and down biases
# added after the sum (OPT, GPT-NeoX), a parallel residual (two sums joined), sandwich norms, a slice of every
# expert's MLP (the routed sum reduced, then a gated shared expert's).
FAMILIES = ["llama head_dim 64", "qwen2 biases, head_dim 128, window", "gemma2 sandwich norms, soft cap, window",
            "gpt_neox LayerNorm, parallel residual, partial rotary, q/k/v per head, gelu",
            "opt learned positions, q scaled first, relu", "mixtral experts, top 2 of 5",
            "qwen2_moe experts, top 3 of 6, shared expert"]
# DeepSeek's latent attention (the latent whole on every rank, the heads split) and its experts' routing.
MLA_SHAPE = dict(hidden_size=80, num_attention_heads=4, kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=12,
                 v_head_dim=10, intermediate_size=72, max_position_embeddings=512, num_hidden_layers=1,
                 rope_parameters=YARN, first_k_dense_replace=0, n_routed_experts=6, moe_intermediate_size=16,
                 n_shared_experts=1, num_experts_per_tok=3, n_group=3, topk_group=2)
CASES = {**CASES,
         "deepseek_v2 MLA, groups": (DeepseekV2DecoderLayer, DeepseekV2Config(
             **MLA_SHAPE, q_lora_rank=None, topk_method="group_limited_greedy", norm_topk_prob=True)),
         "deepseek_v3 q_lora, sigmoid, bias": (DeepseekV3DecoderLayer, DeepseekV3Config(
             **MLA_SHAPE, q_lora_rank=24, routed_scaling_factor=2.5))}
FAMILIES += list(CASES)[-2:]
STEPS = ["three decodes", "mixed"]


def test_layers_reduce_in_cpp_as_the_linear_layers_do() -> None:
    run_kernel_driver(__file__, timeout=240)


def _rank_main(rank: int, tp_size: int, port: int, run: int) -> None:
    with kernel_rank(port, rank, tp_size, 0, 1):
        group = tp_kernel_group()
        assert group is not None and group.rank == rank and group.size == tp_size
        forms = [(torch.float32, False), (torch.bfloat16, False)] + [(torch.bfloat16, True)] * cpu_gemv.pairs_cpu()
        for case in FAMILIES:
            for dtype, paired in forms:
                for seqs in STEPS:
                    _check_layers(case, dtype, paired, SEQS[seqs], group)
        _check_llama_stage_takes_it()
        for dtype in (torch.float32, torch.bfloat16):
            _check_greedy_steps_in_one_call(dtype)


def _check_layers(case: str, dtype: torch.dtype, paired: bool, seqs: list[tuple[int, int]],
                  group: cpu_decoder_layer.ShmGroup) -> None:
    """Two layers of this rank's shards, each path on the same inputs and caches: the same bits out."""
    layer_class, config = CASES[case]
    layers = [with_pairs(make_layer(layer_class, config, dtype, seed=seed), paired) for seed in (1, 2)]
    generator = torch.Generator().manual_seed(len(seqs))  # the same inputs on every rank, as a TP layer's are
    tokens = sum(new for _, new in seqs)
    num_blocks = sum(-(-length // BLOCK_SIZE) for length, _ in seqs) + 3
    form = layers[0].fused_weights
    caches = [[torch.randn(num_blocks, form.num_kv_heads, BLOCK_SIZE, form.head_dim, generator=generator).to(dtype)
               for _ in range(2)] for _ in layers]
    metadata, positions = step_batch(seqs, num_blocks, generator)
    x, residual = (torch.randn(tokens, config.hidden_size, generator=generator).to(dtype) for _ in range(2))
    step = cpu_decoder_layer.decode_step(x, positions, metadata.slot_mapping, metadata.block_tables,
                                         metadata.query_start_loc)
    outputs = []
    for in_cpp in (True, False):
        bound = [tuple(c.clone() for c in pair) for pair in caches]
        prepared = cpu_decoder_layer.PreparedLayers([layer.fused_weights for layer in layers], bound, dtype)
        if in_cpp:
            out = cpu_decoder_layer.decoder_layers(prepared, x, residual, step, group=group)
        else:
            out = cpu_decoder_layer.decoder_layers_with_products(
                prepared, [layer.fused_products for layer in layers], x, residual, step)
        outputs.append([*out, *(c for pair in bound for c in pair)])
    for got, expected in zip(*outputs, strict=True):
        message = f"{case} {dtype} pairs={paired} {seqs}: {(got - expected).abs().max()}"
        if layers[0].fused_weights.experts_gate_up is None:
            assert torch.equal(got, expected), message
        elif dtype == torch.float32:  # torch's experts sum in other orders than the kernel's (as at one rank)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=4e-6 * expected.abs().max().item(), msg=message)
        else:  # ... and round each expert's output to bf16 after them: an element a step or two apart
            step = 2.0 ** (math.floor(math.log2(expected.abs().max().item())) - 7)
            assert (got.float() - expected.float()).abs().max() <= 2 * step, message


def _check_llama_stage_takes_it() -> None:
    """A llama stage's step of decodes runs its layers in one C++ call that reduces over the group."""
    config = copy.deepcopy(CASES["llama head_dim 64"][1])
    config.num_hidden_layers, config.vocab_size = 2, 64
    stage = LlamaModel(config, LlamaDecoderLayer)
    for layer in stage.layers:
        for name, param in layer.named_parameters():
            param.data.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(param.shape))
    generator = torch.Generator().manual_seed(0)
    metadata, positions = step_batch(SEQS["three decodes"], 40, generator)
    for layer in stage.layers:
        layer.fused_attention.kv_cache = tuple(torch.zeros(40, layer.fused_weights.num_kv_heads, BLOCK_SIZE,
                                                           head_dim_of(config)) for _ in range(2))
    x = torch.randn(3, config.hidden_size, generator=generator)
    step = stage.fused_step(x, positions, metadata)
    assert step is not None and step.kernel_products, "a TP stage's decodes should take the kernels' products"
    calls = []
    run = cpu_decoder_layer.decoder_layers
    cpu_decoder_layer.decoder_layers = lambda *args: calls.append(args[-1]) or run(*args)
    try:
        stage.fused_forward(x, None, step)
    finally:
        cpu_decoder_layer.decoder_layers = run
    assert calls == [tp_kernel_group()], "the stage's C++ call should reduce over the group"


def _check_greedy_steps_in_one_call(dtype: torch.dtype, rows: int = 3, steps: int = 6) -> None:
    """A tp=2 llama's greedy steps from a token at position 0 per row, each row in its own blocks: in Python (the
    driver's argmax shared as the engine shares it) and in one greedy_decode call, the same tokens on every rank."""
    config = copy.deepcopy(CASES["llama head_dim 64"][1])
    config.num_hidden_layers, config.vocab_size, config.tie_word_embeddings = 2, 61, False  # rows padded at rank 1
    model = seeded_llama(config, dtype)
    blocks = -(-steps // BLOCK_SIZE)
    table = torch.arange(rows * blocks).view(rows, blocks)
    first = torch.tensor([3, 40, 60])  # on each rank's rows of the vocabulary, and the last real one

    def bind_caches() -> None:
        for layer in model.model.layers:
            layer.fused_attention.kv_cache = tuple(
                torch.zeros(rows * blocks, layer.fused_weights.num_kv_heads, BLOCK_SIZE, head_dim_of(config),
                            dtype=dtype) for _ in range(2))

    bind_caches()
    tokens, python_steps = first, []
    for position in range(steps):
        positions = torch.full((rows,), position)
        metadata = AttentionMetadata(slot_mapping=table[:, position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE,
                                     block_tables=table, query_start_loc=list(range(rows + 1)),
                                     seq_lens=[position + 1] * rows, num_decodes=rows)
        logits = model.compute_logits(model(tokens, positions, metadata))
        argmax = logits.argmax(dim=-1) if logits is not None else torch.zeros(rows, dtype=torch.int64)
        tokens = tp_all_reduce(argmax)  # the driver's tokens, its peer's zeros
        python_steps.append(tokens.tolist())
    assert model.greedy_model() is not None, "a tp=2 llama's later steps should take the C++ call"
    bind_caches()
    model.model.forget_fused_layers()  # prepared again for the new caches, as the engine's first step does
    model.model.prepared_layers(dtype, prepare=True)
    run = model.greedy_decode(first.numpy(), np.zeros(rows, dtype=np.int64), table.numpy(),
                              np.full(rows, steps, dtype=np.int64), [set()] * rows, steps)
    assert run is not None
    assert run.tokens[:, :steps].tolist() == [list(row) for row in zip(*python_steps)], dtype


if __name__ == "__main__":
    cpu_extension.load()  # loaded once, before the ranks fork
    sys.exit(drive(2, 1, _rank_main))
