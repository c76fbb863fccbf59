"""The CPU decode-attention kernel's read bandwidth from memory against a plain copy's, in one run.

The benchmark model's heads (8 query / 4 KV heads of 64, bf16), a 16,384-block cache on huge pages (a whole engine
KV cache's size, 128 MiB per K or V), each sequence's blocks drawn at random from all of it as a long-running engine
hands them out; the K/V bytes over the median call time, the caches flushed before each call (64 MiB written). The
reference: a 256 MiB float32 tensor summed, its bytes over the time. Target (issue 24's decode attention): the kernel
near the reference's read rate.
    python benchmarks/cpu_decode_attention.py
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.cpu_decode_attention import decode_attention  # noqa: E402
from kernels.cpu_features import cpu_has_native_bf16  # noqa: E402
from workers.cpu_allocator import huge_page_zeros  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 8, 4, 64, 16, 16384
CASES = [(96, 300), (48, 310), (16, 400)]  # (sequences, context): the throughput workload's decode batches


def median_seconds(fn, calls: int = 30, before=lambda: None) -> float:
    times = []
    for _ in range(calls):
        before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_rate() -> float:
    """Bytes per second a plain sum reads (best of 5)."""
    values = torch.ones(64 << 20, dtype=torch.float32)
    return values.numel() * 4 / min(median_seconds(values.sum, 1) for _ in range(5))


def main() -> int:
    torch.manual_seed(0)
    shape = (NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    key_cache = huge_page_zeros(shape, torch.bfloat16).normal_()
    value_cache = huge_page_zeros(shape, torch.bfloat16).normal_()
    reference = read_rate()
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    print(f"CPU native bf16: {cpu_has_native_bf16()}; a plain sum reads {reference / 1e9:.1f} GB/s")
    for seqs, context in CASES:
        blocks = -(-context // BLOCK_SIZE)
        tables = torch.randperm(NUM_BLOCKS)[:seqs * blocks].view(seqs, blocks).contiguous()
        query = torch.randn(seqs, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        lens = torch.full((seqs,), context, dtype=torch.int64)
        run = lambda: decode_attention(query, key_cache, value_cache, tables, lens, HEAD_DIM ** -0.5)  # noqa: E731
        run()
        seconds = median_seconds(run, before=lambda: flush.fill_(1))
        rate = 2 * seqs * context * KV_HEADS * HEAD_DIM * 2 / seconds
        print(f"{seqs} sequences x {context} positions: {seconds * 1e3:.3f} ms, K/V read at {rate / 1e9:.1f} GB/s = "
              f"{rate / reference:.0%} of the sum's rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
