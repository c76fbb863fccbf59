"""The CPU decode-attention kernel's read bandwidth from memory against a plain copy's, bf16 and fp8 caches in one run.

The benchmark model's heads (8 query / 4 KV heads of 64, bf16), a 16,384-block cache on huge pages (a whole engine
KV cache's size, 128 MiB per K or V in bf16), each sequence's blocks drawn at random from all of it as a
long-running engine hands them out; the K/V bytes over the median call time, the caches flushed before each call
(64 MiB written). The reference: a 256 MiB float32 tensor summed, its bytes over the time. Target (issue 24's decode
attention): the kernel near the reference's read rate. Each --formats cache (fp8 e4m3 by default; fp8_e5m2) holds
the bf16 cache's values quantized (scale 1), timed on the same tables and queries; fp8 / bf16 is its time over bf16's
(issue 57 wants <= 0.5). --cpu-time times one thread's CPU time per call (time.thread_time, OMP_NUM_THREADS=1): on a
busy machine that is what the call itself costs, where the wall time also counts the other processes' turns.
--heads H KV and --head-dim D time other models' heads (groups of 8+ query heads per KV head take the AMX scores).
    python benchmarks/cpu_decode_attention.py [--formats fp8 fp8_e5m2] [--cpu-time] [--heads 32 8] [--head-dim 128]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import kv_quant  # noqa: E402
from kernels.cpu_decode_attention import decode_attention  # noqa: E402
from kernels.cpu_features import cpu_has_native_bf16  # noqa: E402
from workers.cpu_allocator import huge_page_zeros  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 8, 4, 64, 16, 16384
CASES = [(96, 300), (48, 310), (16, 400)]  # (sequences, context): the throughput workload's decode batches


def median_seconds(fn, calls: int = 30, before=lambda: None, clock=time.perf_counter) -> float:
    times = []
    for _ in range(calls):
        before()
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def read_rate() -> float:
    """Bytes per second a plain sum reads (best of 5)."""
    values = torch.ones(64 << 20, dtype=torch.float32)
    return values.numel() * 4 / min(median_seconds(values.sum, 1) for _ in range(5))


def compare_formats(formats: list[str], clock=time.perf_counter, reference: float | None = None,
                    heads: tuple[int, int] = (HEADS, KV_HEADS), head_dim: int = HEAD_DIM) -> None:
    """Each case's median time per call and K/V read rate for the bf16 cache and each fp8 format's, and the ratio
    (heads: query and KV heads)."""
    torch.manual_seed(0)
    (num_heads, kv_heads), blocks = heads, NUM_BLOCKS * KV_HEADS * HEAD_DIM // (heads[1] * head_dim)
    shape = (blocks, kv_heads, BLOCK_SIZE, head_dim)
    bf16 = [huge_page_zeros(shape, torch.bfloat16).normal_() for _ in range(2)]
    caches = {"bf16": bf16}
    for name in formats:
        fmt = kv_quant.cache_dtype(name, torch.bfloat16)
        caches[name] = [huge_page_zeros(shape, fmt).copy_(kv_quant.quantize(c, 1.0, fmt)) for c in bf16]
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    timed = "one thread's CPU time" if clock is time.thread_time else "wall time"
    print(f"decode attention (CPU native bf16: {cpu_has_native_bf16()}), {num_heads} heads over {kv_heads} KV heads "
          f"of {head_dim}, {timed}:")
    for seqs, context in CASES:
        tables = torch.randperm(blocks)[:seqs * -(-context // BLOCK_SIZE)].view(seqs, -1).contiguous()
        query = torch.randn(seqs, num_heads, head_dim, dtype=torch.bfloat16)
        lens = torch.full((seqs,), context, dtype=torch.int64)
        times = {}
        for name, (k, v) in caches.items():
            def run(k=k, v=v):
                return decode_attention(query, k, v, tables, lens, head_dim ** -0.5)
            run()
            times[name] = median_seconds(run, before=lambda: flush.fill_(1), clock=clock)
        kv_elements = 2 * seqs * context * kv_heads * head_dim
        rates = {name: kv_elements * caches[name][0].element_size() / t for name, t in times.items()}
        line = ", ".join(f"{name} {t * 1e3:.3f} ms ({rates[name] / 1e9:.1f} GB/s"
                         + (f", {rates[name] / reference:.0%} of the sum's" if reference else "") + ")"
                         for name, t in times.items())
        ratios = ", ".join(f"{name} / bf16 {t / times['bf16']:.2f}" for name, t in times.items() if name != "bf16")
        print(f"  {seqs} x {context}: {line}" + (f"; {ratios} of the time" if ratios else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="*", default=["fp8"], choices=["fp8", "fp8_e5m2"])
    parser.add_argument("--cpu-time", action="store_true", help="one thread's CPU time per call (busy machines)")
    parser.add_argument("--heads", nargs=2, type=int, default=[HEADS, KV_HEADS], metavar=("QUERY", "KV"))
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
    args = parser.parse_args()
    if args.heads[0] % args.heads[1]:
        raise ValueError(f"--heads: {args.heads[0]} query heads are not a multiple of {args.heads[1]} KV heads")
    if args.cpu_time:
        torch.set_num_threads(1)
    reference = None if args.cpu_time else read_rate()
    if reference:
        print(f"a plain sum reads {reference / 1e9:.1f} GB/s")
    compare_formats(args.formats, time.thread_time if args.cpu_time else time.perf_counter, reference,
                    tuple(args.heads), args.head_dim)
    return 0


if __name__ == "__main__":
    sys.exit(main())
