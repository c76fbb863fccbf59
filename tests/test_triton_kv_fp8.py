"""fp8 KV caches in the Triton kernels (under the interpreter on CPU, natively on a GPU): the write stores
kernels.kv_quant's bytes, the attention kernels equal the torch reference over the dequantized caches."""
from __future__ import annotations

import math
import os

import pytest
import torch

import triton  # noqa: F401  (on CPU, conftest has set TRITON_INTERPRET=1 before anything imported it)

from kernels import attention_ref, attention_triton, decode_split_k_triton, kv_cache_triton, kv_quant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
TOLERANCE = {"atol": 2e-5, "rtol": 2e-5}  # float32 queries: the kernels and torch differ in summation order only
UNWRITTEN = 0x5A  # the byte every cache slot starts as: a slot the write skips still holds it


def grid_and_ties(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the format (±0 included), each midpoint between neighbours (a tie: to even), the
    float32s just either side of each midpoint, and values past the largest finite one (saturated)."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    codes = codes[codes.isfinite()]
    positive = codes[codes > 0].sort().values
    mids = (positive[:-1] + positive[1:]) / 2
    near = torch.cat([torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, torch.full_like(mids, 1e9))])
    most = torch.finfo(dtype).max
    beyond = torch.tensor([most * 1.01, most * 4, 3e38, math.inf])
    smallest = positive[:1]
    others = torch.cat([mids, near, beyond, smallest / 4, smallest / 2, smallest * 0.75])  # and around the first step
    return torch.cat([codes, others, -others])


def write(values: torch.Tensor, cache_dtype: torch.dtype, k_scale: float, v_scale: float, block_size: int = 8):
    """values [tokens, 2, 16] as K and -V at shuffled slots, each token followed by a padded one (slot -1); returns
    the caches and the values' slots."""
    tokens = values.shape[0]
    num_blocks = 2 * tokens // block_size + 1
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(tokens))[:tokens]
    with_padding = torch.stack([values, torch.full_like(values, 7.0)], 1).flatten(0, 1).to(DEVICE)
    padded_slots = torch.stack([slots, torch.full_like(slots, -1)], 1).flatten().to(DEVICE)
    shape = (num_blocks, 2, block_size, 16 * cache_dtype.itemsize)
    caches = [torch.full(shape, UNWRITTEN, dtype=torch.uint8).view(cache_dtype).to(DEVICE) for _ in range(2)]
    kv_cache_triton.write_kv_cache(with_padding, -with_padding, *caches, padded_slots, k_scale=k_scale,
                                   v_scale=v_scale)
    return [cache.cpu() for cache in caches], slots


def stored_at(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The [tokens, heads, dim] entries at the given slots."""
    block_size = cache.shape[2]
    return cache[slots // block_size, :, slots % block_size]


def check_written(values: torch.Tensor, cache_dtype: torch.dtype, k_scale: float, v_scale: float):
    """The written slots hold kv_quant.quantize's bytes, the others are untouched; returns write's result."""
    caches, slots = write(values, cache_dtype, k_scale, v_scale)
    for cache, x, scale in zip(caches, (values, -values), (k_scale, v_scale)):
        # on the CPU, where torch divides as IEEE does (on CUDA it multiplies by a Python scalar's reciprocal)
        expected = kv_quant.quantize(x, scale, cache_dtype)
        assert torch.equal(stored_at(cache, slots).view(torch.uint8), expected.view(torch.uint8))
        untouched = torch.ones(cache.shape[0] * cache.shape[2], dtype=torch.bool)
        untouched[slots] = False
        rest = cache.transpose(1, 2).reshape(-1, cache.shape[1], cache.shape[3])[untouched]
        assert (rest.view(torch.uint8) == UNWRITTEN).all()
    return caches, slots


def as_tokens(values: torch.Tensor) -> torch.Tensor:
    """Flat values as [tokens, 2 heads, 16 dims], padded with zeros."""
    padded = torch.zeros(-(-values.numel() // 32) * 32)
    padded[:values.numel()] = values
    return padded.view(-1, 2, 16)


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
def test_write_rounds_every_value_and_tie_as_torch(cache_dtype):
    """A power-of-two scale keeps x / scale exact, so the values reach the rounding as chosen: every tie, saturation,
    signed zeros, the smallest subnormal steps."""
    values = as_tokens(grid_and_ties(cache_dtype) * 0.25)
    caches, slots = check_written(values, cache_dtype, 0.25, 4.0)
    read_back = stored_at(caches[0], slots).float() * 0.25
    grid = values
    on_grid = torch.isin(grid, torch.arange(256, dtype=torch.uint8).view(cache_dtype).float() * 0.25) & grid.isfinite()
    assert torch.equal(read_back[on_grid], grid[on_grid]), "a value the format holds reads back as itself"
    most = torch.finfo(cache_dtype).max * 0.25
    assert torch.equal(read_back[grid.abs() >= most].abs(), torch.full_like(read_back[grid.abs() >= most], most))


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_random_values_with_any_scale(cache_dtype, dtype):
    """Scales that are not powers of two (x / scale rounds in float32 first, as torch divides), inputs in bfloat16."""
    values = (torch.randn(24, 2, 16, generator=torch.Generator().manual_seed(3)) * 40).to(dtype)
    check_written(values, cache_dtype, 0.37, 0.0123)


def test_caches_of_other_dtypes_ignore_the_scales():
    values = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(4))
    caches, slots = write(values, torch.float32, 3.0, 0.5)
    assert torch.equal(stored_at(caches[0], slots), values) and torch.equal(stored_at(caches[1], slots), -values)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_bad_scale_is_refused_by_name(bad):
    caches = [torch.zeros(2, 2, 8, 16, device=DEVICE).to(torch.float8_e4m3fn) for _ in range(2)]
    key = torch.zeros(1, 2, 16, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="v_scale of an fp8 KV cache"):
        kv_cache_triton.write_kv_cache(key, key, *caches, slots, k_scale=1.0, v_scale=bad)
    with pytest.raises(ValueError, match="k_scale of an fp8 KV cache"):
        attention_triton.paged_attention(key, *caches, slots.view(1, 1), slots.int(), slots.int() + 1, 0.25, None,
                                         torch.empty_like(key), k_scale=bad)


def paged_batch(seqs: list[tuple[int, int]], block_size: int, heads: int, cache_dtype: torch.dtype,
                k_scale: float, v_scale: float, seed: int):
    """Random K/V of 2 KV heads stored in fp8 in shuffled blocks: the query, the fp8 caches, the caches they read
    as (float32), the block tables and the query start offsets."""
    generator = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-ctx // block_size) for ctx, _ in seqs)
    num_blocks = len(seqs) * max_blocks + 3
    tables = torch.randperm(num_blocks, generator=generator)[:len(seqs) * max_blocks].view(len(seqs), max_blocks)
    stored, read = [], []
    for scale in (k_scale, v_scale):
        cache = kv_quant.quantize(torch.randn(num_blocks, 2, block_size, 16, generator=generator) * 3, scale,
                                  cache_dtype)
        stored.append(cache.to(DEVICE))
        read.append(kv_quant.dequantize(cache, scale, torch.float32).to(DEVICE))
    starts = [0]
    for _, new in seqs:
        starts.append(starts[-1] + new)
    query = torch.randn(starts[-1], heads, 16, generator=generator).to(DEVICE)
    return query, stored, read, tables.to(DEVICE), starts


def int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def run_mixed(cache_dtype: torch.dtype, block_size: int, gqa: int, window: int | None, soft_cap: float | None):
    """Decodes and prefill chunks (with and without a cached prefix, one spanning two query tiles)."""
    seqs = [(1, 1), (block_size + 1, 1), (3 * block_size - 1, 1), (5, 5), (2 * block_size + 3, 7), (40, 20)]
    query, stored, read, tables, starts = paged_batch(seqs, block_size, 2 * gqa, cache_dtype, 0.031, 0.0047, gqa)
    seq_lens = [ctx for ctx, _ in seqs]
    expected = attention_ref.paged_attention(query, *read, tables, starts, seq_lens, 3, 0.25, window,
                                             soft_cap=soft_cap)
    out = torch.empty_like(query)
    attention_triton.paged_attention(query, *stored, tables, int32(starts), int32(seq_lens), 0.25, window, out,
                                     soft_cap, k_scale=0.031, v_scale=0.0047)
    torch.testing.assert_close(out, expected, **TOLERANCE)


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(("gqa", "window", "soft_cap"), [(1, None, None), (4, 20, 0.5)])
def test_paged_attention_over_fp8_caches(cache_dtype, gqa, window, soft_cap):
    run_mixed(cache_dtype, 8, gqa, window, soft_cap)


@pytest.mark.slow
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("gqa", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 20])
def test_paged_attention_over_fp8_caches_every_shape(cache_dtype, block_size, gqa, window):
    run_mixed(cache_dtype, block_size, gqa, window, None)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the interpreter's tl.dot multiplies bfloat16 bit patterns (triton-lang/triton#11584)")
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
def test_bfloat16_queries_over_fp8_caches(cache_dtype):
    """The model's dtype on a GPU: fp8 tiles converted to bfloat16 for the products, against the reference that
    reads the same bytes as bfloat16 values (a few bfloat16 ulps apart: it rounds stored * scale to bfloat16)."""
    seqs = [(1, 1), (37, 1), (300, 1), (40, 20)]
    query, stored, _, tables, starts = paged_batch(seqs, 16, 4, cache_dtype, 0.031, 0.0047, 11)
    query = query.to(torch.bfloat16)
    seq_lens = [ctx for ctx, _ in seqs]
    expected = attention_ref.paged_attention(query, *stored, tables, starts, seq_lens, 3, 0.25, 50,
                                             k_scale=0.031, v_scale=0.0047)
    out = torch.empty_like(query)
    attention_triton.paged_attention(query, *stored, tables, int32(starts), int32(seq_lens), 0.25, 50, out,
                                     k_scale=0.031, v_scale=0.0047)
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
def test_split_k_decode_over_fp8_caches(cache_dtype):
    """Long decodes in slices (GQA, a window), and the same rows through the mixed-batch kernel."""
    seqs = [(1, 1), (17, 1), (300, 1)]
    query, stored, read, tables, starts = paged_batch(seqs, 16, 4, cache_dtype, 0.02, 0.009, 7)
    seq_lens = [ctx for ctx, _ in seqs]
    expected = attention_ref.decode_attention(query, *read, tables, seq_lens, 0.25, 50)
    split_k, single = torch.empty_like(query), torch.empty_like(query)
    decode_split_k_triton.decode_attention(query, *stored, tables, int32(seq_lens), 0.25, 50, 3, split_k,
                                           k_scale=0.02, v_scale=0.009)
    attention_triton.paged_attention(query, *stored, tables, int32(starts), int32(seq_lens), 0.25, 50, single,
                                     k_scale=0.02, v_scale=0.009)
    torch.testing.assert_close(split_k, expected, **TOLERANCE)
    torch.testing.assert_close(single, expected, **TOLERANCE)


@pytest.mark.parametrize("num_sms", [132, 1], ids=["split-K", "one-kernel"])
def test_dispatch_passes_the_scales_and_equals_the_reference_on_fp8_caches(num_sms):
    """kernels.attention's Triton dispatch (two long decodes split or not, then a chunk after a cached prefix)
    against attention_ref reading the same fp8 caches with the same scales."""
    from kernels.attention import triton_paged_attention

    seqs = [(600, 1), (520, 1), (40, 9)]
    query, stored, _, tables, starts = paged_batch(seqs, 16, 4, torch.float8_e4m3fn, 0.021, 0.0083, 5)
    seq_lens = [ctx for ctx, _ in seqs]
    expected = attention_ref.paged_attention(query, *stored, tables, starts, seq_lens, 2, 0.25, 100,
                                             k_scale=0.021, v_scale=0.0083)
    out = triton_paged_attention(query, *stored, tables, starts, seq_lens, 2, 0.25, 100, num_sms, k_scale=0.021,
                                 v_scale=0.0083)
    torch.testing.assert_close(out, expected, **TOLERANCE)
