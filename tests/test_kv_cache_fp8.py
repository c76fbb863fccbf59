"""fp8 KV cache (kv_cache_dtype fp8, fp8_e5m2) in the kernels: the C++ decode attention against the torch reference
on the same bytes, the fused layer's writes and outputs against the op path, quantization, scales, refusals (the
engine's: tests/test_kv_cache_fp8_engine.py)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from kernels import (
    attention_ref,
    cpu_decode_attention,
    cpu_decoder_layer,
    cpu_extension,
    kv_quant,
)
from kernels.attention_ref import paged_attention
from kernels.kv_cache_ref import write_kv_cache
from workers.layers.attention import Attention, AttentionMetadata
from workers.model_loader import load_kv_scales
from workers.models.llama import LlamaDecoderLayer

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
LENGTHS = [1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 64, 65, 100, 257, 640]


@pytest.fixture(scope="module", autouse=True)
def extension():
    if cpu_extension.load() is None:
        pytest.fail("the extension did not build")


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_saturates_rounds_and_reads_back_scaled(fmt):
    x = torch.tensor([0.0, 1.0, -3.3, 1e9, -1e9, 1e-9, 0.1])
    stored = kv_quant.quantize(x, 0.5, fmt)
    assert stored.dtype == fmt and not stored.float().isnan().any() and not stored.float().isinf().any()
    most = torch.finfo(fmt).max
    assert stored.float()[3] == most and stored.float()[4] == -most
    assert kv_quant.dequantize(stored, 0.5, torch.float32)[1] == 1.0  # 2.0 stored, exact in both formats
    assert torch.equal(stored, (x / 0.5).clamp(-most, most).to(fmt))


def test_cache_dtype_names_and_refusals():
    assert kv_quant.cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_quant.cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_quant.cache_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_quant.cache_dtype("int8", torch.float32)
    mla = Attention(4, 1, 64, 0.125, shared_kv=True)
    with pytest.raises(ValueError, match="kv_cache_dtype fp8 is not supported for MLA models yet"):
        mla.kv_block_bytes(16, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="not supported for MLA"):
        mla.bind_kv_cache(4, 16, torch.float8_e5m2, torch.device("cpu"))
    plain = Attention(4, 2, 64, 0.125)
    assert plain.kv_block_bytes(16, torch.float8_e4m3fn) * 2 == plain.kv_block_bytes(16, torch.bfloat16)


def fp8_caches(lengths, block_size, kv_heads, head_dim, fmt, scales, generator):
    """Random K/V quantized with their scales into randomly permuted blocks, and the block table."""
    needed = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(needed) + 3
    caches = [kv_quant.quantize(torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=generator) * 3,
                                scale, fmt) for scale in scales]
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(lengths), max(needed), dtype=torch.long)
    for row, count in enumerate(needed):
        tables[row, :count] = torch.tensor([free.pop() for _ in range(count)])
    return *caches, tables


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("window, soft_cap", [(None, None), (20, None), (None, 5.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_reads_fp8_as_the_reference(fmt, block_size, gqa, window, soft_cap, dtype):
    generator = torch.Generator().manual_seed(block_size + gqa)
    kv_heads, head_dim, scales = 2, 64, (0.7, 0.05)
    k_cache, v_cache, tables = fp8_caches(LENGTHS, block_size, kv_heads, head_dim, fmt, scales, generator)
    query = torch.randn(len(LENGTHS), kv_heads * gqa, head_dim, generator=generator).to(dtype)
    n = len(LENGTHS)
    expected = paged_attention(query.float(), k_cache, v_cache, tables, list(range(n + 1)), LENGTHS, n, 0.125,
                               window, soft_cap=soft_cap, k_scale=scales[0], v_scale=scales[1])
    out = cpu_decode_attention.decode_attention(query, k_cache, v_cache, tables, torch.tensor(LENGTHS), 0.125,
                                                window, soft_cap, k_scale=scales[0], v_scale=scales[1])
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("head_dim", [24, 128, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_fp8_other_head_sizes(head_dim, dtype):
    """bf16 queries of a head dim of 32's multiples but no unrolled loop (96) take the bf16 path too."""
    generator = torch.Generator().manual_seed(head_dim)
    k_cache, v_cache, tables = fp8_caches(LENGTHS, 16, 1, head_dim, torch.float8_e4m3fn, (1.0, 1.0), generator)
    query = torch.randn(len(LENGTHS), 2, head_dim, generator=generator).to(dtype)
    n = len(LENGTHS)
    expected = paged_attention(query.float(), k_cache, v_cache, tables, list(range(n + 1)), LENGTHS, n, 0.1)
    out = cpu_decode_attention.decode_attention(query, k_cache, v_cache, tables, torch.tensor(LENGTHS), 0.1)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_decode_attention_refuses_mixed_caches():
    k_cache = torch.zeros(2, 1, 8, 32, dtype=torch.float8_e4m3fn)
    query, tables, lens = torch.zeros(1, 1, 32), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(TypeError, match="one fp8 format"):
        cpu_decode_attention.decode_attention(query, k_cache, k_cache.to(torch.float8_e5m2), tables, lens, 1.0)


def llama_layer(dtype: torch.dtype) -> LlamaDecoderLayer:
    from workers.layers.rotary import RotaryEmbedding, rope_parameters_of
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=344,
                         max_position_embeddings=512)
    generator = torch.Generator().manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = LlamaDecoderLayer(config, 0, RotaryEmbedding(64, 512, rope_parameters_of(config)))
    finally:
        torch.set_default_dtype(previous)
    for name, param in layer.named_parameters():
        param.data.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(param.shape, generator=generator))
    return layer


def step_batch(seqs: list[tuple[int, int]], num_blocks: int, block_size: int, generator
               ) -> tuple[AttentionMetadata, torch.Tensor]:
    """A step over (context length after it, new tokens) sequences, single tokens first, in scattered blocks."""
    free = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(-(-length // block_size) for length, _ in seqs)
    tables = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, (length, _) in enumerate(seqs):
        tables[row, :-(-length // block_size)] = torch.tensor([free.pop() for _ in range(-(-length // block_size))])
    rows = torch.tensor([i for i, (_, new) in enumerate(seqs) for _ in range(new)])
    positions = torch.tensor([p for length, new in seqs for p in range(length - new, length)])
    slots = tables[rows, positions // block_size] * block_size + positions % block_size
    starts = [0]
    for _, new in seqs:
        starts.append(starts[-1] + new)
    return AttentionMetadata(slot_mapping=slots, block_tables=tables, query_start_loc=starts,
                             seq_lens=[length for length, _ in seqs],
                             num_decodes=sum(new == 1 for _, new in seqs)), positions


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("products", ["kernel", "torch"])
def test_fused_layer_equals_the_op_path_with_fp8_caches(fmt, dtype, products):
    """Decodes, a verification and a short prompt: the C++ layer writes the bytes the reference writes (a small k_scale
    saturates many) and its outputs equal the op path's, which reads the same caches."""
    seqs = [(9, 1), (70, 5), (130, 3), (6, 6)]
    layer = llama_layer(dtype)
    attention = layer.fused_attention
    attention.k_scale, attention.v_scale = 0.02, 1.7
    generator = torch.Generator().manual_seed(1)
    num_blocks = sum(-(-length // 8) for length, _ in seqs) + 3
    caches = [kv_quant.quantize(torch.randn(num_blocks, 2, 8, 64, generator=generator), 0.5, fmt) for _ in range(2)]
    metadata, positions = step_batch(seqs, num_blocks, 8, generator)
    tokens = sum(new for _, new in seqs)
    x = torch.randn(tokens, 256, generator=generator).to(dtype)
    residual = torch.randn(tokens, 256, generator=generator).to(dtype)
    with torch.inference_mode():
        attention.kv_cache = tuple(c.clone() for c in caches)
        expected = [*layer(positions, x, residual, metadata), *attention.kv_cache]
        attention.kv_cache = tuple(c.clone() for c in caches)
        step = cpu_decoder_layer.decode_step(x, positions, metadata.slot_mapping, metadata.block_tables,
                                             metadata.query_start_loc, None if products == "kernel" else 0)
        prepared = cpu_decoder_layer.PreparedLayers([layer.fused_weights], [attention.kv_cache], dtype,
                                                    scales=[(attention.k_scale, attention.v_scale)])
        if products == "kernel":
            out = cpu_decoder_layer.decoder_layers(prepared, x, residual, step)
        else:
            out = cpu_decoder_layer.decoder_layers_with_products(prepared, [layer.fused_products], x, residual, step)
        got = [*out, *attention.kv_cache]
    for cache, reference in zip(got[2:], expected[2:]):
        assert cache.dtype == fmt
        same = cache.view(torch.uint8) == reference.view(torch.uint8)
        # float32 rotary in another order may move a value across a rounding midpoint: at most a rare byte
        assert same.all() if dtype == torch.bfloat16 else same.float().mean() > 0.999
    for tensor, reference in zip(got[:2], expected[:2]):
        tensor, reference = tensor.float(), reference.float()
        if dtype == torch.float32:
            torch.testing.assert_close(tensor, reference, atol=1e-4, rtol=1e-4)
        else:  # bf16 rounds in other places on the two paths: a few steps of the outputs' magnitude at worst
            step = 2.0 ** (math.floor(math.log2(reference.abs().max().item())) - 7)
            assert (tensor - reference).abs().max() <= 4 * step and (tensor - reference).abs().mean() <= step / 4


def test_write_kv_cache_stores_quantized_and_skips_padding():
    key, value = torch.randn(3, 2, 8) * 100, torch.randn(3, 2, 8)
    k_cache, v_cache = (torch.zeros(2, 2, 4, 8, dtype=torch.float8_e4m3fn) for _ in range(2))
    write_kv_cache(key, value, k_cache, v_cache, torch.tensor([0, -1, 6]), 0.1, 2.0)
    assert torch.equal(k_cache[1, :, 2].view(torch.uint8), kv_quant.quantize(key[2], 0.1, k_cache.dtype).view(
        torch.uint8))
    assert torch.equal(v_cache[0, :, 0].float(), kv_quant.quantize(value[0], 2.0, v_cache.dtype).float())
    assert k_cache[0, :, 1:].float().abs().sum() == 0 and k_cache[1, :, 3].float().abs().sum() == 0


def test_checkpoint_scales_reach_their_layers():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(3))
    for layer in model.layers:
        layer.attn = Attention(2, 1, 8, 1.0)
    tensors = {"model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.5),
               "model.layers.0.self_attn.v_proj.v_scale": torch.tensor([0.25]),
               "model.layers.2.self_attn.kv_scale": torch.tensor(3.0),
               "model.layers.1.mlp.down_proj.weight_scale": torch.tensor(9.0)}
    reader = SimpleNamespace(get_tensor=tensors.__getitem__)
    load_kv_scales(model, {name: reader for name in tensors})
    assert [(layer.attn.k_scale, layer.attn.v_scale) for layer in model.layers] == [(0.5, 0.25), (1.0, 1.0),
                                                                                   (3.0, 3.0)]
    tensors["model.layers.1.self_attn.k_scale"] = torch.tensor(-1.0)
    with pytest.raises(ValueError, match="layers.1.self_attn.k_scale: a KV cache scale must be positive"):
        load_kv_scales(model, {name: reader for name in tensors})


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim", [32, 64, 96])
def test_every_fp8_byte_reads_exactly_as_its_bf16_value(fmt, head_dim):
    """An fp8 cache read by the decode attention equals a bf16 cache holding its dequantized values bit for bit (the
    scales chosen so that the kernels fold in exactly nothing: 2^-8 for e4m3, whose readers count in 2^-8 units):
    every finite byte, subnormals and signs included, converted exactly on every path (64, 32 and 1 at a time)."""
    generator = torch.Generator().manual_seed(head_dim)
    finite = torch.arange(256, dtype=torch.uint8).view(fmt)
    finite = finite[finite.float().isfinite()]
    unit = 2.0 ** -8 if fmt == torch.float8_e4m3fn else 1.0
    lengths = [1, 5, 17, 40, 63]
    caches = [finite[torch.randint(len(finite), (24, 2, 16, head_dim), generator=generator)] for _ in range(2)]
    tables = torch.randperm(24, generator=generator)[:20].view(5, 4)
    query = torch.randn(len(lengths), 4, head_dim, generator=generator).to(torch.bfloat16)
    lens = torch.tensor(lengths)
    out = cpu_decode_attention.decode_attention(query, *caches, tables, lens, 0.125, k_scale=unit, v_scale=unit)
    bf16 = [kv_quant.dequantize(c, unit, torch.bfloat16) for c in caches]
    assert torch.equal(out, cpu_decode_attention.decode_attention(query, *bf16, tables, lens, 0.125))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_reads_its_fp8_context_as_the_reference_does(fmt, dtype):
    """The prefill's reader of a cached context (attention_ref.read: e4m3 in the C++ kernels) gives kv_quant's
    values bit for bit: every finite byte, at scales that round and one that does not."""
    finite = torch.arange(256, dtype=torch.uint8).view(fmt)
    finite = finite[finite.float().isfinite()]
    context = finite[torch.randperm(len(finite), generator=torch.Generator().manual_seed(1))][:240].view(1, 2, 30, 4)
    for scale in (0.037, 1.0, 3.7, 2.0 ** -8):
        got = attention_ref.read(context, scale, dtype)
        assert got.dtype == dtype and got.shape == context.shape
        assert torch.equal(got, kv_quant.dequantize(context, scale, dtype))
