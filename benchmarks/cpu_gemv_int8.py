"""int8 weights' products against bf16's, by row count (CPUs with AVX-512 BF16): gemv_pairs.h from each weight's
pair_weight() copy, bf16 and int8 (scale per row), and the int8 weight read as stored (gemv_quantized without the
copy: gemv.h's rows, gemm.h's tiles from 12 rows).

A decode step's matrices (qkv, o, gate_up, down of each layer): the 30m llama's 8 layers (in a large L3), or with
--beyond-cache a 2048-wide llama's layers until its int8 weights are 1.5x the last-level cache. One thread is timed by
its own CPU time (time.thread_time: a busy machine's other processes leave it less wrong than wall time), more by wall
time; best of --repeats, the kinds taking turns.

    python benchmarks/cpu_gemv_int8.py [--threads 1] [--rows 1 8 32] [--beyond-cache]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from residency import BEYOND_CACHE_FACTOR, last_level_cache_bytes  # noqa: E402

from kernels import cpu_extension, cpu_gemv  # noqa: E402

KINDS = ("bf16 pairs", "int8 pairs", "int8 as stored")


def decode_shapes(beyond_cache: bool) -> list[tuple[int, int]]:
    """[N, K] of each product of a decode step."""
    if not beyond_cache:
        return [(1024, 512), (512, 512), (2816, 512), (512, 1408)] * 8
    hidden, inter = 2048, 5632
    layers = math.ceil(BEYOND_CACHE_FACTOR * last_level_cache_bytes() / (4 * hidden * hidden + 3 * inter * hidden))
    return [(3 * hidden, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)] * layers


def shape_of(q: torch.Tensor) -> torch.Tensor:
    """A bf16 weight of q's shape for the pairs kernel's checks, holding no memory (the copy holds its values)."""
    return torch.zeros((), dtype=torch.bfloat16).expand(q.shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--beyond-cache", action="store_true")
    args = parser.parse_args()
    if cpu_extension.load() is None or not cpu_gemv.pairs_cpu():
        raise SystemExit("needs the C++ kernels on a CPU with AVX-512 BF16")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    shapes = decode_shapes(args.beyond_cache)
    weights = []
    for rows, columns in shapes:
        q = torch.randint(-127, 128, (rows, columns), dtype=torch.int8)
        weights.append((q, torch.rand(rows) / 64, cpu_gemv.pair_weight(q), cpu_gemv.pair_weight(q.bfloat16())))
    int8_bytes = sum(q.numel() for q, *_ in weights)
    print(f"{len(shapes)} matrices, {int8_bytes / 1e9:.2f} GB of int8 (last-level cache "
          f"{last_level_cache_bytes() / 2**20:.0f} MiB), {args.threads} thread(s), ms per pass, best of "
          f"{args.repeats}", flush=True)

    def one_pass(kind: str, x: dict[int, torch.Tensor]) -> float:
        start = clock()
        for q, scale, int8_pairs, bf16_pairs in weights:
            rows = x[q.shape[1]]
            if kind == "bf16 pairs":
                cpu_gemv.gemv(rows, shape_of(q), None, bf16_pairs)
            elif kind == "int8 pairs":
                cpu_gemv.gemv_quantized(rows, q, scale, None, int8_pairs)
            else:
                cpu_gemv.gemv_quantized(rows, q, scale)
        return clock() - start

    for rows in args.rows:
        x = {columns: torch.randn(rows, columns).bfloat16() for columns in {k for _, k in shapes}}
        best = dict.fromkeys(KINDS, math.inf)
        for _ in range(args.repeats):
            for kind in KINDS:
                best[kind] = min(best[kind], one_pass(kind, x))
        print(f"rows {rows:3}: " + ", ".join(f"{kind} {best[kind] * 1e3:7.2f}" for kind in KINDS)
              + f" | bf16 / int8 pairs {best['bf16 pairs'] / best['int8 pairs']:.2f}x, bf16 / int8 as stored "
              f"{best['bf16 pairs'] / best['int8 as stored']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
