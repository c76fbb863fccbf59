"""Paged attention (the dispatched path: fused CPU decode + torch prefill, and the pure torch reference) and
the KV write, against a dense, unpaged float64 attention."""
from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import pairwise
from core.engine_spawn import child_env
from kernels import paged_attention, write_kv_cache
from kernels.attention_ref import paged_attention as paged_attention_ref
from kernels.attention_ref import prefill_chunk


def dense_attention(q, k, v, scale, window):
    """q: [new, heads, dim] at the end of k/v: [ctx, kv_heads, dim]; plain softmax attention, float64."""
    new, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    k = k.repeat_interleave(heads // kv_heads, dim=1).double()
    v = v.repeat_interleave(heads // kv_heads, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(ctx - new, ctx)[:, None]
    k_pos = torch.arange(ctx)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def build_batch(seqs, block_size, kv_heads, head_dim, heads, generator):
    """seqs: (context_len, new_tokens). Writes every context token through write_kv_cache in shuffled blocks."""
    max_blocks = max(math.ceil(ctx / block_size) for ctx, _ in seqs)
    num_blocks = len(seqs) * max_blocks + 3
    k_cache = torch.zeros(num_blocks, kv_heads, block_size, head_dim)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
    contexts, queries = [], []
    for i, (ctx, new) in enumerate(seqs):
        blocks = [free.pop() for _ in range(math.ceil(ctx / block_size))]
        block_tables[i, :len(blocks)] = torch.tensor(blocks)
        k = torch.randn(ctx, kv_heads, head_dim, generator=generator)
        v = torch.randn(ctx, kv_heads, head_dim, generator=generator)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(ctx)])
        write_kv_cache(k, v, k_cache, v_cache, slots)
        contexts.append((k, v))
        queries.append(torch.randn(new, heads, head_dim, generator=generator))
    return k_cache, v_cache, block_tables, contexts, queries


ATTENTION_IDS = {paged_attention: "dispatch", paged_attention_ref: "reference"}


@pytest.mark.parametrize("block_size, gqa, window, pass_new_kv, attention",
                         pairwise([8, 16, 32], [1, 2, 4], [None, 20], [False, True], list(ATTENTION_IDS),
                                  ids=ATTENTION_IDS.get))
def test_paged_attention_matches_dense(block_size, gqa, window, pass_new_kv, attention):
    generator = torch.Generator().manual_seed(block_size * 10 + gqa)
    kv_heads, head_dim = 2, 16
    heads = kv_heads * gqa
    # Decode sequences first (one new token each), then prefill chunks, some after a cached prefix.
    seqs = [(1, 1), (block_size, 1), (block_size + 1, 1), (3 * block_size - 1, 1),
            (5, 5), (2 * block_size + 3, 2 * block_size + 3), (3 * block_size + 2, 7)]
    k_cache, v_cache, tables, contexts, queries = build_batch(seqs, block_size, kv_heads, head_dim, heads, generator)
    query = torch.cat(queries)
    starts = [0]
    for q in queries:
        starts.append(starts[-1] + q.shape[0])
    scale = head_dim**-0.5
    # This step's K/V (the last `new` tokens of each context); prefills without a cached prefix use them directly.
    new_k = torch.cat([k[ctx - new:] for (k, _), (ctx, new) in zip(contexts, seqs)]) if pass_new_kv else None
    new_v = torch.cat([v[ctx - new:] for (_, v), (ctx, new) in zip(contexts, seqs)]) if pass_new_kv else None
    out = attention(query, k_cache, v_cache, tables, starts, [c for c, _ in seqs], 4, scale, window,
                    key=new_k, value=new_v)
    for i, ((k, v), q) in enumerate(zip(contexts, queries)):
        expected = dense_attention(q, k, v, scale, window).float()
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("attention", list(ATTENTION_IDS), ids=ATTENTION_IDS.get)
def test_long_decode_batches_split_into_groups_and_stay_exact(attention):
    """Decode contexts long enough that the batch is split into several gathered groups."""
    generator = torch.Generator().manual_seed(3)
    seqs = [(900 - 7 * i, 1) for i in range(6)] + [(40, 1), (70, 12)]
    k_cache, v_cache, tables, contexts, queries = build_batch(seqs, 16, 2, 16, 4, generator)
    starts = [0]
    for q in queries:
        starts.append(starts[-1] + q.shape[0])
    out = attention(torch.cat(queries), k_cache, v_cache, tables, starts, [c for c, _ in seqs], 7, 0.25)
    for i, ((k, v), q) in enumerate(zip(contexts, queries)):
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], dense_attention(q, k, v, 0.25, None).float(),
                                   atol=2e-5, rtol=2e-5)


def test_write_kv_cache_skips_padded_slots():
    k_cache = torch.zeros(4, 1, 8, 2)
    v_cache = torch.zeros_like(k_cache)
    key = torch.arange(6, dtype=torch.float32).view(3, 1, 2) + 1
    value = -key
    write_kv_cache(key, value, k_cache, v_cache, torch.tensor([9, -1, 31]))
    flat_k, flat_v = k_cache.view(32, 1, 2), v_cache.view(32, 1, 2)
    assert torch.equal(flat_k[9], key[0]) and torch.equal(flat_k[31], key[2])
    assert torch.equal(flat_v[31], value[2])
    assert int((flat_k != 0).any(-1).sum()) == 2, "the padded token (slot -1) must not be written"


def test_paged_attention_bfloat16_close_to_float32():
    generator = torch.Generator().manual_seed(0)
    seqs = [(40, 1), (33, 9)]
    k_cache, v_cache, tables, _, queries = build_batch(seqs, 16, 2, 16, 4, generator)
    query = torch.cat(queries)
    args = (tables, [0, 1, 10], [40, 33], 1, 0.25)
    reference = paged_attention(query, k_cache, v_cache, *args)
    low = paged_attention(query.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), *args)
    torch.testing.assert_close(low.float(), reference, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("num_new, context", [(7, 7), (5, 23)])
def test_prefill_chunk_equals_sdpa_with_the_lower_right_causal_bias(num_new, context):
    from torch.nn.attention.bias import causal_lower_right

    generator = torch.Generator().manual_seed(num_new)
    query = torch.randn(num_new, 4, 16, generator=generator)
    key, value = (torch.randn(1, 2, context, 16, generator=generator) for _ in range(2))
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0), key, value, attn_mask=causal_lower_right(num_new, context), scale=0.25,
        enable_gqa=True)[0].transpose(0, 1)
    assert torch.equal(prefill_chunk(query, key, value, 0.25), expected)


def test_an_engine_on_the_cpu_never_imports_torch_dynamo():
    """torch.nn.attention.bias imports torch._dynamo, a large share of an engine process's start: the CPU's prefill
    takes the causal mask without it (no GPU visible to the child, as on a CPU-only machine)."""
    code = """
        import sys, torch
        import core.engine_process
        from kernels.attention_ref import prefill_chunk
        for num_new, context in ((3, 3), (3, 9)):
            prefill_chunk(torch.randn(num_new, 2, 8), torch.randn(1, 1, context, 8), torch.randn(1, 1, context, 8), 0.5)
        print("torch._dynamo" in sys.modules)
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          env={**child_env(), "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().split() == ["False"]
