"""The fused CPU decode-attention kernel against the torch reference decode path."""
from __future__ import annotations

import math
import os

from pathlib import Path

import pytest
import torch

from conftest import pairwise
from kernels import cpu_decode_attention, cpu_extension
from kernels.attention_ref import paged_attention

LENGTHS = [1, 2, 7, 8, 9, 15, 16, 17, 19, 20, 21, 31, 32, 33, 63, 64, 65, 100, 257, 511, 640, 899]


@pytest.fixture(scope="module", autouse=True)
def extension():
    if cpu_extension.load() is None:
        pytest.fail("the extension did not build")


def build_caches(lengths, block_size, kv_heads, head_dim, generator, pad=0):
    """Random K/V for each context in randomly permuted blocks; unused block-table entries hold `pad`."""
    needed = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(needed) + 5
    k_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=generator)
    v_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=generator)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.full((len(lengths), max(needed)), pad, dtype=torch.long)
    for row, count in enumerate(needed):
        tables[row, :count] = torch.tensor([free.pop() for _ in range(count)])
    return k_cache, v_cache, tables


def reference(query, k_cache, v_cache, tables, lengths, scale, window):
    n = len(lengths)
    return paged_attention(query, k_cache, v_cache, tables, list(range(n + 1)), lengths, n, scale, window)


def fused(query, k_cache, v_cache, tables, lengths, scale, window):
    return cpu_decode_attention.decode_attention(query, k_cache, v_cache, tables, torch.tensor(lengths), scale,
                                                 window)


@pytest.mark.parametrize("block_size, gqa, window, dtype",
                         pairwise([8, 16, 32], [1, 2, 4], [None, 20], [torch.float32, torch.bfloat16]))
def test_matches_reference(block_size, gqa, window, dtype):
    generator = torch.Generator().manual_seed(block_size * 100 + gqa * 10 + (window or 0))
    kv_heads, head_dim = 2, 64
    lengths = LENGTHS[::-1] if gqa == 2 else LENGTHS  # either row order
    k_cache, v_cache, tables = build_caches(lengths, block_size, kv_heads, head_dim, generator)
    query = torch.randn(len(lengths), kv_heads * gqa, head_dim, generator=generator)
    scale = head_dim**-0.5
    if dtype == torch.float32:
        expected = reference(query, k_cache, v_cache, tables, lengths, scale, window)
        out = fused(query, k_cache, v_cache, tables, lengths, scale, window)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:
        query, k_cache, v_cache = query.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
        expected = reference(query.float(), k_cache.float(), v_cache.float(), tables, lengths, scale, window)
        out = fused(query, k_cache, v_cache, tables, lengths, scale, window)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 20])
def test_soft_cap_matches_reference(window):
    """Gemma 2's tanh cap on the scores, large enough scores that it changes the result."""
    generator = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables = build_caches(LENGTHS, 16, 2, 64, generator)
    query = torch.randn(len(LENGTHS), 4, 64, generator=generator)
    n = len(LENGTHS)
    expected = paged_attention(query, k_cache, v_cache, tables, list(range(n + 1)), LENGTHS, n, 1.0, window,
                               soft_cap=5.0)
    out = cpu_decode_attention.decode_attention(query, k_cache, v_cache, tables, torch.tensor(LENGTHS), 1.0, window,
                                                soft_cap=5.0)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, reference(query, k_cache, v_cache, tables, LENGTHS, 1.0, window), atol=1e-3)


@pytest.mark.parametrize("window, head_dim, dtype",
                         pairwise([None, 6], [32, 64, 24, 96], [torch.float32, torch.bfloat16]))
def test_rows_of_one_sequence_attend_causally(window, head_dim, dtype):
    """Consecutive rows sharing a block table (a verified run of drafts, a prompt chunk) are attended together:
    each still sees only its own first seq_len positions (and window)."""
    generator = torch.Generator().manual_seed(head_dim + (window or 0))
    contexts = [45, 9, 130]  # each sequence's context after the step
    runs = [5, 1, 9]  # its tokens in the step: the last ones of its context
    k_cache, v_cache, tables = build_caches(contexts, 8, 2, head_dim, generator)
    rows = [i for i, run in enumerate(runs) for _ in range(run)]
    lengths = [contexts[i] - runs[i] + 1 + j for i, run in enumerate(runs) for j in range(run)]
    tables = tables[rows]
    query = torch.randn(len(rows), 6, head_dim, generator=generator)
    q, k, v = (t.to(dtype) for t in (query, k_cache, v_cache))
    expected = reference(q.float(), k.float(), v.float(), tables, lengths, head_dim**-0.5, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused(q, k, v, tables, lengths, head_dim**-0.5, window).float(), expected,
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_prompt_chunk_attends_in_pieces_as_each_row_alone(window, dtype):
    """300 rows of one sequence over 700 positions: their scores outgrow the kernel's budget, so the run goes in
    pieces of rows; every row equals itself attended alone (bit for bit) and the reference."""
    generator = torch.Generator().manual_seed(7 + (window or 0))
    context, run, heads, kv_heads, head_dim = 700, 300, 6, 2, 64
    k_cache, v_cache, tables = build_caches([context], 16, kv_heads, head_dim, generator)
    lengths = list(range(context - run + 1, context + 1))
    tables = tables[[0] * run]
    query = torch.randn(run, heads, head_dim, generator=generator)
    q, k, v = (t.to(dtype) for t in (query, k_cache, v_cache))
    together = fused(q, k, v, tables, lengths, head_dim**-0.5, window)
    for row in (0, 61, 62, 63, 150, 299):  # about the pieces' edges and inside them
        alone = fused(q[row:row + 1], k, v, tables[row:row + 1], lengths[row:row + 1], head_dim**-0.5, window)
        assert torch.equal(together[row:row + 1], alone), row
    expected = reference(q.float(), k.float(), v.float(), tables, lengths, head_dim**-0.5, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(together.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("head_dim", [16, 40, 128, 96, 288])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_head_dims(head_dim, dtype):
    """Head dims of no unrolled loop: multiples of 32 (MLA's latent rows: 288 of DeepSeek's 30m model) take the bf16
    path on AVX-512 BF16 in slices of 64 and 32 dims, others the float32 loops."""
    generator = torch.Generator().manual_seed(head_dim)
    lengths = [1, 17, 130, 333]
    k_cache, v_cache, tables = build_caches(lengths, 16, 2, head_dim, generator)
    query = torch.randn(len(lengths), 8, head_dim, generator=generator)
    q, k, v = (t.to(dtype) for t in (query, k_cache, v_cache))
    expected = reference(q.float(), k.float(), v.float(), tables, lengths, 0.3, 50)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused(q, k, v, tables, lengths, 0.3, 50).float(), expected, atol=tol, rtol=tol)


def test_only_valid_block_table_entries_are_read():
    generator = torch.Generator().manual_seed(1)
    lengths = [5, 40, 900]
    k_cache, v_cache, tables = build_caches(lengths, 16, 2, 64, generator, pad=-(1 << 40))
    query = torch.randn(3, 4, 64, generator=generator)
    expected = reference(query, k_cache, v_cache, tables.clamp(min=0), lengths, 0.125, None)
    torch.testing.assert_close(fused(query, k_cache, v_cache, tables, lengths, 0.125, None), expected,
                               atol=1e-5, rtol=1e-5)


def test_window_of_zero_or_less_means_none():
    generator = torch.Generator().manual_seed(2)
    lengths = [70, 3]
    k_cache, v_cache, tables = build_caches(lengths, 8, 1, 64, generator)
    query = torch.randn(2, 2, 64, generator=generator)
    expected = fused(query, k_cache, v_cache, tables, lengths, 0.125, None)
    for window in (0, -5):
        assert torch.equal(fused(query, k_cache, v_cache, tables, lengths, 0.125, window), expected)


def test_bfloat16_output_rounds_like_torch():
    """A zero query weighs two keys equally: the output is their float32 mean, which must round exactly as torch's."""
    generator = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables = build_caches([2], 8, 1, 64, generator)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    out = fused(torch.zeros(1, 1, 64, dtype=torch.bfloat16), k_cache, v_cache, tables, [2], 1.0, None)
    rows = v_cache[tables[0, 0], 0, :2].float()
    assert torch.equal(out[0, 0], ((rows[0] + rows[1]) * 0.5).bfloat16())


def test_background_build_serves_the_torch_path_until_ready(monkeypatch):
    """Start-up never waits for the compiler: decode runs on the reference until the low-priority build is done."""
    import threading
    from types import SimpleNamespace

    from kernels import attention

    release, policy = threading.Event(), []
    built = SimpleNamespace(decode_attention=None)

    def slow_build(build_directory):
        policy.append(os.sched_getscheduler(threading.get_native_id()))
        release.wait(30)
        return built

    monkeypatch.setattr(cpu_extension, "_build", slow_build)
    monkeypatch.setattr(cpu_extension, "_library", lambda build_directory: Path("/nonexistent/kernels.so"))
    monkeypatch.setattr(cpu_extension, "_done", threading.Event())
    monkeypatch.setattr(cpu_extension, "_module", None)
    monkeypatch.setattr(cpu_extension, "_builder", None)
    cpu_extension.start_background_build()
    generator = torch.Generator().manual_seed(5)
    k_cache, v_cache, tables = build_caches([9, 30], 8, 2, 64, generator)
    query = torch.randn(2, 4, 64, generator=generator)
    out = attention.paged_attention(query, k_cache, v_cache, tables, [0, 1, 2], [9, 30], 2, 0.125)
    assert cpu_extension.ready() is None  # not waited for: the call above ran on the torch path
    torch.testing.assert_close(out, reference(query, k_cache, v_cache, tables, [9, 30], 0.125, None))
    release.set()
    cpu_extension._builder.join(30)
    assert cpu_extension.ready() is built and policy == [os.SCHED_IDLE]
