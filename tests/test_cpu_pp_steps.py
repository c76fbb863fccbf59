"""A multi-step call's later steps over pipeline stages in one C++ call at every rank (no Ray: gloo ranks forked from
one driver): the first stage embeds, each stage hands the next its hidden states and residual over the world's shared
memory, the last one computes the logits and the driver's tokens reach every rank; the tokens of a whole model's
steps at one rank, on every rank. With drafts the driver alone proposes (prompt lookup over a history only it
holds) and verifies them, and every rank feeds them."""
from __future__ import annotations

import copy
import sys
import zlib

import numpy as np
import torch

from forked_ranks import drive, kernel_rank, run_kernel_driver
from kernels import cpu_extension
from kernels.cpu_greedy_decode import PromptLookupDrafts
from test_cpu_decoder_layer import BLOCK_SIZE, CASES
from workers.distributed import parallel_state, pipeline_kernel_group, single_rank
from workers.layers.attention import AttentionMetadata
from workers.models.llama import LlamaForCausalLM, head_dim_of

STAGES = 3  # a first, a middle (neither embedding nor head) and a last stage
ROWS, STEPS = 3, 6


def test_pipeline_stages_take_the_steps_of_one_rank() -> None:
    run_kernel_driver(__file__, timeout=240)


def _rank_main(rank: int, world: int, port: int, run: int) -> None:
    with kernel_rank(port, 0, 1, rank, world):
        assert pipeline_kernel_group() is not None, "ranks on one host should hand over in shared memory"
        for dtype, k in ((torch.float32, 0), (torch.bfloat16, 0), (torch.float32, 3)):
            _check_steps(dtype, k)


def seeded_llama(config, dtype: torch.dtype) -> LlamaForCausalLM:
    """This rank's stage of the model (its share of it under tp), each parameter from a seed of its name (the same values in every layout)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    for name, param in model.named_parameters():
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        param.data.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(param.shape, generator=generator))
    return model


def _bind_caches(model: LlamaForCausalLM, config, dtype: torch.dtype, blocks: int) -> None:
    for i in model.model.stage_layers:
        layer = model.model.layers[i]
        layer.fused_attention.kv_cache = tuple(
            torch.zeros(blocks, layer.fused_weights.num_kv_heads, BLOCK_SIZE, head_dim_of(config), dtype=dtype)
            for _ in range(2))


def _check_steps(dtype: torch.dtype, k: int) -> None:
    """The whole model's steps at one rank (forward, logits, argmax in Python) from a token at position 0 per row,
    each row in its own blocks; then this stage's greedy_decode call over the stages: the same tokens. With k > 0 the
    driver looks up drafts in a history that holds each row's greedy tokens after its first (the others: none), so
    it drafts the argmax's tokens and the steps accept some."""
    config = copy.deepcopy(CASES["llama head_dim 64"][1])
    config.num_hidden_layers, config.vocab_size, config.tie_word_embeddings = 4, 61, False
    blocks = -(-STEPS // BLOCK_SIZE)
    table = torch.arange(ROWS * blocks).view(ROWS, blocks)
    first = torch.tensor([3, 40, 60])
    with single_rank():
        whole = seeded_llama(config, dtype)
        _bind_caches(whole, config, dtype, ROWS * blocks)
        tokens, expected = first, []
        for position in range(STEPS):
            positions = torch.full((ROWS,), position)
            metadata = AttentionMetadata(
                slot_mapping=table[:, position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE,
                block_tables=table, query_start_loc=list(range(ROWS + 1)), seq_lens=[position + 1] * ROWS,
                num_decodes=ROWS)
            tokens = whole.compute_logits(whole(tokens, positions, metadata)).argmax(dim=-1)
            expected.append(tokens.tolist())
    model = seeded_llama(config, dtype)
    _bind_caches(model, config, dtype, ROWS * blocks)
    model.model.prepared_layers(dtype, prepare=True)
    greedy = model.greedy_model()
    assert greedy is not None and greedy.pipeline is not None, "a stage's later steps should take the C++ call"
    assert (greedy.embedding is None, greedy.head is None) == (parallel_state().pp_rank > 0,
                                                               parallel_state().pp_rank < STAGES - 1)
    rows = [list(row) for row in zip(*expected)]
    driver = parallel_state().is_driver
    drafts = PromptLookupDrafts(k, 1, 1, [[int(t), *row, int(t)] if driver else [] for t, row in zip(first, rows)]) \
        if k else None
    run = model.greedy_decode(first.numpy(), np.zeros(ROWS, dtype=np.int64), table.numpy(),
                              np.full(ROWS, STEPS, dtype=np.int64), [set()] * ROWS, STEPS, drafts)
    assert run is not None
    assert run.tokens[:, :STEPS].tolist() == rows, (dtype, k, parallel_state().pp_rank)
    if k and driver:
        assert run.verified[..., 1].max() > 0, "the driver's drafts should be accepted"


if __name__ == "__main__":
    cpu_extension.load()  # loaded once, before the ranks fork
    sys.exit(drive(STAGES, 1, _rank_main))
