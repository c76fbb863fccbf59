"""The decode attention's scores as AMX tile products (groups of 8+ query heads per KV head): blocks of any size,
query groups past one tile's 16, windows, and fp8 caches giving the bf16 kernel's output exactly."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_decode_attention, cpu_extension, kv_quant
from kernels.attention_ref import paged_attention


@pytest.fixture(scope="module", autouse=True)
def extension():
    if cpu_extension.load() is None:
        pytest.fail("the extension did not build")


def tables_for(lengths, block_size, blocks, generator):
    needed = [-(-n // block_size) for n in lengths]
    free = torch.randperm(blocks, generator=generator).tolist()
    tables = torch.zeros(len(lengths), max(needed), dtype=torch.long)
    for row, count in enumerate(needed):
        tables[row, :count] = torch.tensor([free.pop() for _ in range(count)])
    return tables


@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
@pytest.mark.parametrize("group, head_dim", [(8, 64), (12, 128), (16, 64)])
@pytest.mark.parametrize("window", [None, 21])
def test_groups_blocks_and_windows_match_the_reference_and_fp8_the_bf16_kernel(block_size, group, head_dim, window):
    """Sequences of lengths that end mid-piece (a piece: 16 rows of a block), in blocks shorter and longer than a
    piece; 8 and 12 query heads (a tile product of fewer than 16 per piece) and 16: the reference's output within
    bf16's rounding, and an e4m3 cache the bf16 kernel's output over the same values bit for bit."""
    generator = torch.Generator().manual_seed(block_size * group + head_dim)
    lengths = [1, 5, 16, 17, 40, 129, 300]
    kv_heads, blocks = 2, sum(-(-n // block_size) for n in lengths) + 2
    values = [torch.randn(blocks, kv_heads, block_size, head_dim, generator=generator) * 2 for _ in range(2)]
    fp8 = [kv_quant.quantize(v, 1.0, torch.float8_e4m3fn) for v in values]
    bf16 = [f.float().bfloat16() for f in fp8]  # e4m3's values are exact in bf16
    tables = tables_for(lengths, block_size, blocks, generator)
    query = torch.randn(len(lengths), kv_heads * group, head_dim, generator=generator).bfloat16()
    lens, scale = torch.tensor(lengths), head_dim ** -0.5
    out = cpu_decode_attention.decode_attention(query, *bf16, tables, lens, scale, window)
    n = len(lengths)
    expected = paged_attention(query.float(), *(b.float() for b in bf16), tables, list(range(n + 1)), lengths, n,
                               scale, window)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    assert torch.equal(cpu_decode_attention.decode_attention(query, *fp8, tables, lens, scale, window), out)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_rows_of_one_sequence_past_one_tile_of_queries_each_as_alone(cache_dtype):
    """11 rows of one sequence with 8 query heads each: 88 queries, in tile groups of 16 (the last of 8); every row
    equals itself attended alone bit for bit (a query's sums do not depend on the queries beside it)."""
    generator = torch.Generator().manual_seed(11)
    kv_heads, block_size, head_dim = 2, 16, 64
    values = [torch.randn(6, kv_heads, block_size, head_dim, generator=generator) for _ in range(2)]
    k, v = (kv_quant.quantize(x, 1.0, cache_dtype) if cache_dtype != torch.bfloat16 else x.bfloat16()
            for x in values)
    lengths = list(range(60, 71))
    tables = torch.randperm(6, generator=generator)[:5].repeat(len(lengths), 1)
    query = torch.randn(len(lengths), kv_heads * 8, head_dim, generator=generator).bfloat16()
    together = cpu_decode_attention.decode_attention(query, k, v, tables, torch.tensor(lengths), 0.125)
    for row, length in enumerate(lengths):
        alone = cpu_decode_attention.decode_attention(query[row:row + 1], k, v, tables[row:row + 1],
                                                      torch.tensor([length]), 0.125)
        assert torch.equal(together[row:row + 1], alone), row
    n = len(lengths)
    expected = paged_attention(query.float(), k.float(), v.float(), tables, list(range(n + 1)), lengths, n, 0.125)
    torch.testing.assert_close(together.float(), expected, atol=2e-2, rtol=2e-2)
