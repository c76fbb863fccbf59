"""The C++ decoder layer against its twin, the model's own op-by-op layer, and in the engine."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from frontend import LLM, SamplingParams
from kernels import cpu_decoder_layer, cpu_extension, cpu_gemv
from tests.conftest import tiny_model
from workers.layers.attention import AttentionMetadata
from workers.layers.rotary import RotaryEmbedding
from workers.models.llama import LlamaDecoderLayer, head_dim_of, rope_parameters_of
from workers.models.qwen2 import Qwen2DecoderLayer

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
        layer = layer_class(config, 0, rotary)
    finally:
        torch.set_default_dtype(previous)
    for param in layer.parameters():  # norms near one, like trained ones: small weights elsewhere
        base = 1.0 if param.dim() == 1 and param.shape[0] == config.hidden_size else 0.0
        param.data.copy_(base + 0.1 * torch.randn(param.shape, generator=generator))
    return layer


def decode_batch(lengths: list[int], num_blocks: int, config, generator) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata of one decode token per sequence over random, scattered blocks; the new tokens' positions."""
    tables, free = [], torch.randperm(num_blocks, generator=generator).tolist()
    width = max(-(-n // BLOCK_SIZE) for n in lengths)
    for n in lengths:
        table = [free.pop() for _ in range(-(-n // BLOCK_SIZE))]
        tables.append(table + [0] * (width - len(table)))
    block_tables = torch.tensor(tables, dtype=torch.long)
    positions = torch.tensor([n - 1 for n in lengths])
    slots = block_tables[torch.arange(len(lengths)), positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    metadata = AttentionMetadata(slot_mapping=slots, block_tables=block_tables,
                                 query_start_loc=list(range(len(lengths) + 1)), seq_lens=lengths,
                                 num_decodes=len(lengths))
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
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[1], [37, 5, 200], [9, 64, 65, 130, 2, 17, 300, 48]])
@pytest.mark.parametrize("first_layer", [True, False])
def test_equals_the_layers_own_forward(case, dtype, lengths, first_layer):
    layer_class, config = CASES[case]
    lengths = lengths[:cpu_gemv.max_rows(dtype)]  # fewer where the CPU has bf16 GEMMs of its own
    generator = torch.Generator().manual_seed(len(lengths) * 7 + first_layer)
    layer = make_layer(layer_class, config, dtype, seed=len(lengths))
    head_dim, kv_heads = head_dim_of(config), config.num_key_value_heads
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in lengths) + 3
    caches = [torch.randn(num_blocks, kv_heads, BLOCK_SIZE, head_dim, generator=generator).to(dtype)
              for _ in range(2)]
    metadata, positions = decode_batch(lengths, num_blocks, config, generator)
    x = torch.randn(len(lengths), config.hidden_size, generator=generator).to(dtype)
    residual = None if first_layer else torch.randn(len(lengths), config.hidden_size, generator=generator).to(dtype)

    with torch.inference_mode():
        layer.self_attn.attn.kv_cache = tuple(c.clone() for c in caches)
        expected = layer(positions, x, residual, metadata)
        expected_caches = layer.self_attn.attn.kv_cache
        step = cpu_decoder_layer.decode_step(x, positions, metadata.slot_mapping, metadata.block_tables,
                                             metadata.seq_lens, metadata.num_decodes)
        assert step is not None
        layer.self_attn.attn.kv_cache = tuple(c.clone() for c in caches)
        got = layer.fused_decode(x, residual, step)

    for tensor, reference in [*zip(got, expected), *zip(layer.self_attn.attn.kv_cache, expected_caches)]:
        assert tensor.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(tensor, reference, rtol=1e-5, atol=1e-5)
        else:  # the statistics' summation order may move a rounding: a bf16 step or two, rarely
            torch.testing.assert_close(tensor.float(), reference.float(), rtol=2**-6, atol=2e-2)


def test_declines_steps_it_does_not_compute():
    x, positions, slots, tables = torch.randn(2, 8), torch.tensor([3, 4]), torch.tensor([3, 4]), torch.zeros(2, 1)
    with torch.inference_mode():
        assert cpu_decoder_layer.decode_step(x, positions, slots, tables, [4, 5], 2) is not None
        assert cpu_decoder_layer.decode_step(x, positions, slots, tables, [4, 5], 1) is None  # a prefill row
        assert cpu_decoder_layer.decode_step(x.half(), positions, slots, tables, [4, 5], 2) is None
        n = cpu_gemv.max_rows(torch.float32) + 1
        assert cpu_decoder_layer.decode_step(torch.randn(n, 8), torch.arange(n), torch.arange(n), torch.zeros(n, 1),
                                             list(range(1, n + 1)), n) is None
    assert cpu_decoder_layer.decode_step(x, positions, slots, tables, [4, 5], 2) is None  # autograd on


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_engine_outputs_equal_the_op_by_op_path(arch, monkeypatch):
    """Greedy float32 through the engine, batch 1 and 3: the same tokens and logprobs with the kernel as without."""
    model = tiny_model(arch)
    prompts = [{"prompt_token_ids": list(range(5 + i, 45 + 13 * i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=3, ignore_eos=True)
    calls = []
    layer = cpu_decoder_layer.decoder_layer
    monkeypatch.setattr(cpu_decoder_layer, "decoder_layer", lambda *args: calls.append(1) or layer(*args))

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
