"""Each Triton kernel equals its torch twin: under the Triton interpreter on CPU (CI), natively on a GPU."""
from __future__ import annotations

import os

import pytest
import torch

import triton  # noqa: E402,F401  (the test extra; on CPU, conftest has set TRITON_INTERPRET=1 before anything imported it)

from conftest import pairwise  # noqa: E402
from kernels import (  # noqa: E402
    activation_ref,
    activation_triton,
    attention_ref,
    attention_triton,
    decode_split_k_triton,
    gemv_triton,
    kv_cache_ref,
    kv_cache_triton,
    norm_ref,
    norm_triton,
    quantized_matmul_triton,
    rotary_ref,
    rotary_triton,
)
from kernels import gemv_choice, matmul  # noqa: E402
from kernels.attention import triton_paged_attention  # noqa: E402
from test_kernels import build_batch  # noqa: E402
from workers.layers.rotary import RotaryEmbedding  # noqa: E402
from workers.quantization.online import quantize_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32: both sides compute in float32 and differ only in summation order (and fused multiply-adds on a GPU).
# bfloat16: a few bf16 ulps, because the interpreter rounds float32 to bfloat16 by truncation where torch and GPUs
# round to nearest even, and the attention twins keep different intermediates in bfloat16.
TOLERANCE = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}


def int32(values: list[int]) -> torch.Tensor:
    """Lengths and offsets as the kernels read them: int32 on the device."""
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def mixed_batch(seqs, block_size, kv_heads, heads, head_dim, dtype, seed):
    """build_batch on DEVICE in `dtype`, the query a strided view (as split from a fused QKV projection)."""
    generator = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables, _, queries = build_batch(seqs, block_size, kv_heads, head_dim, heads, generator)
    query = torch.cat(queries)
    fused = torch.cat([query.flatten(1), torch.randn(query.shape[0], 8, generator=generator)], dim=1)
    query = fused.to(DEVICE, dtype)[:, :heads * head_dim].view(-1, heads, head_dim)
    starts = [0]
    for q in queries:
        starts.append(starts[-1] + q.shape[0])
    return query, k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype), tables.to(DEVICE), starts


def run_mixed(block_size, gqa, window, dtype, head_dim=16, soft_cap=None):
    kv_heads = 2
    # Decodes first (contexts crossing block boundaries), then prefill chunks: two without a cached prefix,
    # two after one, the last spanning more than one query tile.
    seqs = [(1, 1), (block_size, 1), (block_size + 1, 1), (3 * block_size - 1, 1),
            (5, 5), (2 * block_size + 3, 2 * block_size + 3), (3 * block_size + 2, 7), (2 * block_size + 71, 70)]
    query, k_cache, v_cache, tables, starts = mixed_batch(seqs, block_size, kv_heads, kv_heads * gqa, head_dim,
                                                          dtype, seed=block_size * 10 + gqa)
    seq_lens = [ctx for ctx, _ in seqs]
    expected = attention_ref.paged_attention(query, k_cache, v_cache, tables, starts, seq_lens, 4, 0.25, window,
                                             soft_cap=soft_cap)
    out = torch.empty(query.shape, dtype=dtype, device=DEVICE)
    attention_triton.paged_attention(query, k_cache, v_cache, tables, int32(starts), int32(seq_lens), 0.25, window,
                                     out, soft_cap)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("block_size, gqa, window", pairwise([8, 16, 32], [1, 2, 4], [None, 20]))
def test_paged_attention_mixed_batch(block_size, gqa, window):
    run_mixed(block_size, gqa, window, torch.float32)


def test_paged_attention_soft_cap():
    run_mixed(16, 2, 20, torch.float32, soft_cap=0.5)


def test_paged_attention_head_dim_not_a_power_of_two():
    run_mixed(8, 4, None, torch.float32, head_dim=24)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the interpreter's tl.dot multiplies bfloat16 bit patterns (triton-lang/triton#11584)")
def test_paged_attention_bfloat16():
    run_mixed(16, 2, 20, torch.bfloat16)


@pytest.mark.parametrize(("block_size", "gqa", "window", "splits", "soft_cap"),
                         [(8, 1, None, 4, None), (16, 2, 50, 3, 0.5), (32, 4, None, 8, None)])
def test_split_k_decode_and_decode_only_batch(block_size, gqa, window, splits, soft_cap):
    """Long decode contexts: split-K and the mixed-batch kernel (a decode-only batch) against the reference."""
    seqs = [(1, 1), (block_size + 1, 1), (7 * block_size - 1, 1), (300, 1)]
    query, k_cache, v_cache, tables, starts = mixed_batch(seqs, block_size, 2, 2 * gqa, 16, torch.float32, seed=7)
    seq_lens = [ctx for ctx, _ in seqs]
    expected = attention_ref.decode_attention(query, k_cache, v_cache, tables, seq_lens, 0.25, window, soft_cap)
    split_k, single = (torch.empty(query.shape, device=DEVICE) for _ in range(2))
    decode_split_k_triton.decode_attention(query, k_cache, v_cache, tables, int32(seq_lens), 0.25, window, splits,
                                           split_k, soft_cap)
    attention_triton.paged_attention(query, k_cache, v_cache, tables, int32(starts), int32(seq_lens), 0.25, window,
                                     single, soft_cap)
    torch.testing.assert_close(split_k, expected, **TOLERANCE[torch.float32])
    torch.testing.assert_close(single, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("num_sms", [132, 1], ids=["split-K", "one-kernel"])
@pytest.mark.parametrize("device_copies", [False, True], ids=["lists", "device-copies"])
def test_triton_dispatch_splits_long_decodes_and_keeps_prefills(num_sms, device_copies):
    """Two long decodes split (on a 132-SM device) or not, then a prefill chunk after a cached prefix; the
    lengths' device copies made by the dispatcher or given by the caller (as the model runner does)."""
    seqs = [(600, 1), (520, 1), (40, 9)]
    query, k_cache, v_cache, tables, starts = mixed_batch(seqs, 16, 2, 4, 16, torch.float32, seed=5)
    seq_lens = [ctx for ctx, _ in seqs]
    expected = attention_ref.paged_attention(query, k_cache, v_cache, tables, starts, seq_lens, 2, 0.25, 100)
    copies = (int32(starts), int32(seq_lens)) if device_copies else ()
    out = triton_paged_attention(query, k_cache, v_cache, tables, starts, seq_lens, 2, 0.25, 100, num_sms, *copies)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_num_splits_fills_the_device_only_for_long_contexts():
    assert decode_split_k_triton.num_splits([], 8, 132) == 1
    assert decode_split_k_triton.num_splits([8000] * 32, 8, 132) == 1  # 256 programs already fill 132 SMs
    assert decode_split_k_triton.num_splits([300, 200], 8, 132) == 1  # too short to split
    assert decode_split_k_triton.num_splits([8000], 8, 132) == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_skips_padded_slots(dtype):
    generator = torch.Generator().manual_seed(1)
    key, value = (torch.randn(6, 2, 16, generator=generator).to(DEVICE, dtype) for _ in range(2))
    slot_mapping = torch.tensor([9, -1, 31, 0, -1, 17], device=DEVICE)
    caches = [torch.zeros(4, 2, 8, 16, dtype=dtype, device=DEVICE) for _ in range(4)]
    kv_cache_ref.write_kv_cache(key, value, caches[0], caches[1], slot_mapping)
    kv_cache_triton.write_kv_cache(key, value, caches[2], caches[3], slot_mapping)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    generator = torch.Generator().manual_seed(2)
    x, residual = (torch.randn(7, 48, generator=generator).to(DEVICE, dtype) for _ in range(2))
    weight = torch.randn(48, generator=generator).to(DEVICE, dtype)
    residual = residual if with_residual else None
    torch.testing.assert_close(norm_triton.rms_norm(x, weight, 1e-6, residual),
                               norm_ref.rms_norm(x, weight, 1e-6, residual), **TOLERANCE[dtype])


@pytest.mark.parametrize("config", gemv_choice.CONFIGS, ids=lambda c: f"{c.block_n}x{c.block_k}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, bias, row_stride", [(37, 300, True, 300), (64, 1024, False, 1024),
                                                    (37, 1024, False, 1024), (64, 300, True, 320)],
                         ids=["ragged-bias", "even", "ragged-rows", "ragged-columns-bias-strided"])
def test_gemv_equals_linear_in_every_launch_shape(config, dtype, n, k, bias, row_stride):
    """Ragged rows, columns or both: the last program's rows or the last input tile masked; even: no masks; the
    weight a view of every row's first k columns where its rows are longer (a row stride past k)."""
    generator = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, row_stride, generator=generator) / k ** 0.5).to(DEVICE, dtype)[:, :k]
    x = torch.randn(1, 1, k, generator=generator).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype) if bias else None
    out = gemv_triton.gemv(x, weight, b, config)
    assert out.shape == (1, 1, n) and out.dtype == dtype
    expected = torch.nn.functional.linear(x.float(), weight.float(), None if b is None else b.float()).to(dtype)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("config", [gemv_choice.CONFIGS[0], *gemv_choice.CONFIGS[-2:]],
                         ids=lambda c: f"{c.block_n}x{c.block_k}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, bias", [(37, 300, True), (64, 1024, False)], ids=["ragged-bias", "even"])
def test_gemv_streams_int8_weights_scaled_per_row_as_the_quantized_kernel_computes(config, dtype, n, k, bias):
    """int8 weights as online quantization stores them (a float32 scale per row): the real weight's product, as
    the quantized kernel that serves them otherwise computes it."""
    generator = torch.Generator().manual_seed(n + k)
    q, scale = quantize_rows(torch.randn(n, k, generator=generator) / k ** 0.5)
    q, scale = q.to(DEVICE), scale.to(DEVICE)
    x = torch.randn(1, k, generator=generator).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype) if bias else None
    out = gemv_triton.gemv(x, q, b, config, scale)
    assert out.shape == (1, n) and out.dtype == dtype
    real = q.float() * scale[:, None]
    expected = torch.nn.functional.linear(x.float(), real, None if b is None else b.float()).to(dtype)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(out, quantized_matmul_triton.quantized_linear(x, q, scale, bias=b), **TOLERANCE[dtype])


def test_gemv_refuses_what_f_linear_would_not_compute_alike():
    """Another dtype for x than the weight's (F.linear raises), a bias of another dtype or strided, more rows; an
    int8 weight without its scale per row, or with groups of scales."""
    weight, config = torch.randn(8, 32).to(DEVICE), gemv_choice.CONFIGS[0]
    for x, bias in [(torch.randn(1, 32).to(DEVICE, torch.bfloat16), None), (torch.randn(1, 32).to(DEVICE),
                    torch.randn(8).to(DEVICE, torch.bfloat16)), (torch.randn(1, 32).to(DEVICE),
                    torch.randn(16).to(DEVICE)[::2]), (torch.randn(2, 32).to(DEVICE), None)]:
        with pytest.raises(ValueError, match="gemv takes one row"):
            gemv_triton.gemv(x, weight, bias, config)
    q, x = torch.ones(8, 32, dtype=torch.int8).to(DEVICE), torch.randn(1, 32).to(DEVICE)
    for scale in (None, torch.ones(8, 2).to(DEVICE), torch.ones(8, dtype=torch.float64).to(DEVICE)):
        with pytest.raises(ValueError, match="gemv takes one row"):
            gemv_triton.gemv(x, q, None, config, scale)


def test_gemv_choice_keeps_cublas_unless_a_launch_shape_beats_it_clearly():
    first, second = gemv_choice.CONFIGS[:2]
    assert gemv_choice.pick({None: 10.0, first: 9.0, second: 8.5}) == second
    assert gemv_choice.pick({None: 10.0, first: 9.9, second: 12.0}) is None  # 1%: within the timing's noise
    assert gemv_choice.pick({None: 8.0, first: 9.0, second: 8.5}) is None
    assert gemv_choice.pick({None: 8.0}) is None  # no launch shape ran on this GPU


def test_linear_takes_the_gemv_for_one_row_only(monkeypatch):
    """A layer's chosen launch shape serves its one-row products; more rows go to the GEMM as before."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(24, 40, generator=generator).to(DEVICE)
    served = []
    gemv = gemv_triton.gemv
    monkeypatch.setattr(gemv_triton, "gemv", lambda *args: served.append(args[0].shape) or gemv(*args))
    for rows in (1, 3):
        x = torch.randn(rows, 40, generator=generator).to(DEVICE)
        out = matmul.linear(x, weight, gemv=gemv_choice.CONFIGS[1])
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), **TOLERANCE[torch.float32])
    assert served == [(1, 40)]
    q, scale = quantize_rows(weight)
    for rows in (1, 3):  # an int8 weight's scale travels with it
        x = torch.randn(rows, 40, generator=generator).to(DEVICE)
        out = matmul.linear(x, q, weight_scale=scale, gemv=gemv_choice.CONFIGS[1])
        torch.testing.assert_close(out, torch.nn.functional.linear(x, q.float() * scale[:, None]),
                                   **TOLERANCE[torch.float32])
    assert served == [(1, 40), (1, 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 2 * 1100)])  # 1100: a row spans two programs, the last masked
def test_silu_and_mul(dtype, shape):
    x = (4 * torch.randn(*shape, generator=torch.Generator().manual_seed(3))).to(DEVICE, dtype)
    out = activation_triton.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out, activation_ref.silu_and_mul(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_in_place(dtype):
    rotary = RotaryEmbedding(16, 64, {}).to(DEVICE)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    query, key = qkv[:, :64].view(5, 4, 16), qkv[:, 64:96].view(5, 2, 16)
    positions = torch.tensor([0, 3, 7, 63, 20], device=DEVICE)
    expected = rotary_ref.rotary_embedding(positions, query, key, rotary.cos, rotary.sin)
    untouched_value = qkv[:, 96:].clone()
    rotated = rotary_triton.rotary_embedding(positions, query, key, rotary.cos, rotary.sin)
    assert rotated[0].data_ptr() == qkv.data_ptr(), "rotated in place"
    torch.testing.assert_close(rotated, expected, **TOLERANCE[dtype])
    assert torch.equal(qkv[:, 96:], untouched_value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, experts, top_k, first_expert, local", [(5, 4, 2, 0, 4), (37, 6, 3, 2, 3)])
def test_fused_moe_equals_twin(tokens, experts, top_k, first_expert, local, dtype):
    """Padding runs to the row block, experts without tokens, and an expert-parallel share (first_expert)."""
    from kernels import fused_moe_ref, fused_moe_triton

    generator = torch.Generator().manual_seed(tokens)
    hidden, inter = 40, 24
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    gate_up = (torch.randn(local, 2 * inter, hidden, generator=generator) / hidden**0.5).to(dtype)
    down = (torch.randn(local, hidden, inter, generator=generator) / inter**0.5).to(dtype)
    weights, ids = fused_moe_ref.select_experts(torch.randn(tokens, experts, generator=generator), top_k, True)
    expected = fused_moe_ref.fused_experts(x, gate_up, down, weights, ids, first_expert)
    args = [t.to(DEVICE) for t in (x, gate_up, down, weights, ids)]
    got = fused_moe_triton.fused_experts(*args, first_expert=first_expert)
    torch.testing.assert_close(got.cpu(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("storage", ["int8 rows", "int8 groups", "int4 zero act-order", "int4 symmetric",
                                     "int4 rows zero"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_matmul_equals_twin(storage, dtype):
    """Every storage kernels.quantized_matmul describes but fp8 (the interpreter cannot load fp8; on CUDA fp8
    tiles dequantize in torch), with rows, columns and groups that do not fill the blocks."""
    from kernels import quantized_matmul, quantized_matmul_triton

    generator = torch.Generator().manual_seed(len(storage))
    n, k, groups = 40, 96, 3
    x = torch.randn(5, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype)
    scale = torch.rand(n, groups, generator=generator) / 50
    int4 = quantized_matmul.pack_int4(torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8))
    zero = torch.randint(0, 16, (n, groups), generator=generator).float()
    g_idx = (torch.randperm(k, generator=generator) % groups).to(torch.int32)
    int8 = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    weight, s, z, g = {"int8 rows": (int8, scale[:, 0], None, None), "int8 groups": (int8, scale, None, None),
                       "int4 zero act-order": (int4, scale, zero, g_idx), "int4 symmetric": (int4, scale, None, None),
                       "int4 rows zero": (int4, scale[:, 0], zero[:, 0], None)}[storage]
    args = [t if t is None else t.contiguous().to(DEVICE) for t in (x, weight, s, z, g, bias)]
    expected = quantized_matmul.quantized_linear(*args)
    got = quantized_matmul_triton.quantized_linear(*args)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("runs", [[(0, 0, 5)], [(0, 0, 3), (2, 3, 20), (3, 20, 21)], [(1, 0, 17), (3, 17, 19)]],
                         ids=["one adapter", "three uneven", "two, slots apart"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_delta_equals_twin(runs, dtype):
    """The shrink/expand kernels against lora_ref: runs of other lengths than the blocks, slots not in a row, ranks
    (48: three parts of 16) not a power of two."""
    from kernels import lora_ref, lora_triton

    generator = torch.Generator().manual_seed(len(runs))
    rows, k, n, ranks = runs[-1][2], 40, 72, 48
    x = torch.randn(rows, k, generator=generator).to(dtype).to(DEVICE)
    a = torch.randn(4, ranks, k, generator=generator).to(dtype).to(DEVICE)
    b = torch.randn(4, n, ranks, generator=generator).to(dtype).to(DEVICE)
    expected = lora_ref.lora_delta(x.float(), a.float(), b.float(), runs)
    got = lora_triton.lora_delta(x, a, b, runs)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, **{torch.float32: {"atol": 1e-3, "rtol": 1e-4},
                                                         torch.bfloat16: {"atol": 0.5, "rtol": 3e-2}}[dtype])
