"""The decode attention's V pass on bf16 pairs of rows: every query-group size and odd counts, bf16 and fp8 caches."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_decode_attention, cpu_extension, kv_quant
from kernels.attention_ref import paged_attention

LENGTHS = [1, 2, 3, 15, 16, 17, 33, 47, 100, 129]


@pytest.fixture(scope="module", autouse=True)
def extension():
    if cpu_extension.load() is None:
        pytest.fail("the extension did not build")


def caches(cache_dtype, blocks, kv_heads, block_size, head_dim, generator):
    """K and V of cache_dtype and their values as float32 (fp8 at scale 1)."""
    values = [torch.randn(blocks, kv_heads, block_size, head_dim, generator=generator) * 2 for _ in range(2)]
    if cache_dtype == torch.bfloat16:
        stored = [v.bfloat16() for v in values]
        return stored, [s.float() for s in stored]
    stored = [kv_quant.quantize(v, 1.0, cache_dtype) for v in values]
    return stored, [s.float() for s in stored]


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("head_dim", [64, 128, 96, 288])
@pytest.mark.parametrize("group", [3, 5, 6])
def test_query_groups_of_any_size_and_odd_lengths(cache_dtype, head_dim, group):
    """Groups past what one call's registers hold (4 heads of 64, 2 of 128, 4 slices of the run-time dims) and
    contexts of odd lengths (the last row paired with itself at probability 0) match the float32 reference."""
    generator = torch.Generator().manual_seed(head_dim * group)
    kv_heads, block_size = 2, 16
    needed = [-(-n // block_size) for n in LENGTHS]
    (k, v), (kf, vf) = caches(cache_dtype, sum(needed) + 3, kv_heads, block_size, head_dim, generator)
    tables = torch.zeros(len(LENGTHS), max(needed), dtype=torch.long)
    free = torch.randperm(sum(needed) + 3, generator=generator).tolist()
    for row, count in enumerate(needed):
        tables[row, :count] = torch.tensor([free.pop() for _ in range(count)])
    query = torch.randn(len(LENGTHS), kv_heads * group, head_dim, generator=generator).bfloat16()
    n = len(LENGTHS)
    expected = paged_attention(query.float(), kf, vf, tables, list(range(n + 1)), LENGTHS, n, head_dim ** -0.5)
    out = cpu_decode_attention.decode_attention(query, k, v, tables, torch.tensor(LENGTHS), head_dim ** -0.5)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("window", [None, 7])
def test_causal_rows_of_one_sequence_start_and_end_anywhere(cache_dtype, window):
    """Rows of one sequence (a prompt chunk, drafts) share the V pass, each over its own range of a block: ranges
    that start and end at odd positions pair their rows from there."""
    generator = torch.Generator().manual_seed(5)
    (k, v), (kf, vf) = caches(cache_dtype, 8, 1, 16, 64, generator)
    lengths = list(range(20, 31))
    tables = torch.randperm(8, generator=generator)[:2].repeat(len(lengths), 1)
    query = torch.randn(len(lengths), 2, 64, generator=generator).bfloat16()
    n = len(lengths)
    expected = paged_attention(query.float(), kf, vf, tables, list(range(n + 1)), lengths, n, 0.125, window)
    out = cpu_decode_attention.decode_attention(query, k, v, tables, torch.tensor(lengths), 0.125, window)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
