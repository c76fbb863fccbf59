"""The CPU linear kernels (GEMV, then GEMM tiles from 12 rows) against torch's path for the same products, by row
count: where cpu_gemv.max_rows comes from.

The benchmark model's 33 matrices of one decode step (8 layers' qkv, o, gate_up, down and the LM head), each
multiplied once per pass by `rows` random rows, so the weights stream from memory as in decode. torch's path is
what linear() does without the kernel (F.linear, in float32 on CPUs without bf16 instructions). Best of 7.

Then the same for int8 weights (one float32 scale per row, weight-only quantization), three ways: the kernel's
gemv_quantized, torch's int8 weight-only matmul (torch._weight_int8pack_mm, scales in the activations' dtype), and
dequantizing into the GEMM's dtype per call (what kernels.matmul does past max_rows).

--pairs (CPUs with AVX-512 BF16): bf16 products four ways, by row count, on the benchmark model's matrices and the
demo model's 17 (4 layers' qkv, o, gate_up, down and the 4096-row LM head, 192 columns): gemv_bf16.h from the plain
weight (up to 32 rows), gemv_pairs.h from the weight's pair_weight() copy, torch's GEMM from the oneDNN-prepacked copy
(kernels.cpu_prepacked) and F.linear: where cpu_gemv.PAIRS_MAX_ROWS comes from.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import cpu_extension, cpu_gemv, cpu_prepacked, matmul_dtype  # noqa: E402
from kernels.cpu_features import cpu_has_native_bf16  # noqa: E402
from workers.quantization.online import quantize_rows  # noqa: E402

SHAPES = [(1024, 512), (512, 512), (2816, 512), (512, 1408)] * 8 + [(8192, 512)]
DEMO_SHAPES = [(384, 192), (192, 192), (1152, 192), (192, 576)] * 4 + [(4096, 192)]


def torch_path(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    compute = matmul_dtype(weight.dtype, weight.device)
    return F.linear(x.to(compute), weight.to(compute)).to(weight.dtype)


def seconds_per_pass(fn, weights: list[torch.Tensor], inputs: dict[int, torch.Tensor], passes: int = 7) -> float:
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for weight in weights:
            fn(inputs[weight.shape[1]], weight)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    if cpu_extension.load() is None:
        print("the C++ CPU kernels did not build")
        return 1
    if "--pairs" in sys.argv[1:]:
        return compare_pairs()
    print(f"CPU native bf16: {cpu_has_native_bf16()}; torch threads: {torch.get_num_threads()}; "
          f"max_rows: bf16 {cpu_gemv.max_rows(torch.bfloat16)}, float32 {cpu_gemv.max_rows(torch.float32)}")
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            weights = [torch.randn(n, k).to(dtype) for n, k in SHAPES]
            size = sum(w.numel() * w.element_size() for w in weights)
            for rows in (1, 2, 4, 8, 12, 16, 32, 64, 128, 256, 512, 1024, 2048):
                inputs = {k: torch.randn(rows, k).to(dtype) for k in (512, 1408)}
                ours = seconds_per_pass(cpu_gemv.gemv, weights, inputs)
                theirs = seconds_per_pass(torch_path, weights, inputs)
                flops = 2 * rows * sum(w.numel() for w in weights)
                print(f"{str(dtype):15s} rows {rows:4d}: kernel {ours * 1e3:7.2f} ms ({size / ours / 1e9:5.1f} GB/s, "
                      f"{flops / ours / 1e9:5.1f} GFLOP/s), torch {theirs * 1e3:7.2f} ms: kernel {theirs / ours:.2f}x")
        compare_int8()
    return 0


def compare_pairs() -> int:
    if not cpu_gemv.pairs_cpu():
        print("gemv_pairs.h needs AVX-512 BF16 and BW, which this CPU lacks")
        return 1
    print(f"CPU native bf16: True; torch threads: {torch.get_num_threads()}; each: ms per pass over the matrices "
          "(GFLOP/s), best of 3-40 passes")
    with torch.inference_mode():
        for label, shapes in (("benchmark model", SHAPES), ("demo model", DEMO_SHAPES)):
            weights = [torch.randn(n, k).bfloat16() * 0.1 for n, k in shapes]
            pairs = {id(w): cpu_gemv.pair_weight(w) for w in weights}
            prepacked = {id(w): cpu_prepacked.prepack(w) for w in weights}
            ways = {"gemv_bf16": cpu_gemv.gemv, "pairs": lambda x, w: cpu_gemv.gemv(x, w, None, pairs[id(w)]),
                    "prepacked": lambda x, w: cpu_prepacked.linear(x, prepacked[id(w)]), "F.linear": F.linear}
            for rows in (1, 2, 4, 8, 16, 32, 64, 96, 128, 256, 512, 2048):
                inputs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in shapes}}
                flops = 2 * rows * sum(w.numel() for w in weights)
                passes = max(3, min(40, 2000 // rows))
                times = {name: seconds_per_pass(fn, weights, inputs, passes) for name, fn in ways.items()
                         if name != "gemv_bf16" or rows <= cpu_gemv.SMALL_BF16_MAX_ROWS}
                print(f"{label} rows {rows:4d}: " + ", ".join(
                    f"{name} {t * 1e3:7.2f} ({flops / t / 1e9:5.1f})" for name, t in times.items()))
    return 0


def compare_int8() -> None:
    quantized = [quantize_rows(torch.randn(n, k)) for n, k in SHAPES]
    size = sum(q.numel() for q, _ in quantized)
    for dtype in (torch.bfloat16, torch.float32):
        scales = {id(q): (scale, scale.to(dtype)) for q, scale in quantized}
        ways = {
            "gemv_quantized": lambda x, q: cpu_gemv.gemv_quantized(x, q, scales[id(q)][0]),
            "_weight_int8pack_mm": lambda x, q: torch._weight_int8pack_mm(x, q, scales[id(q)][1]),
            "dequantize+GEMM": lambda x, q: torch_path(x, (q.float() * scales[id(q)][0][:, None]).to(dtype)),
        }
        for rows in (1, 4, 16, 64, 256):
            inputs = {k: torch.randn(rows, k).to(dtype) for k in (512, 1408)}
            times = {name: seconds_per_pass(fn, [q for q, _ in quantized], inputs) for name, fn in ways.items()}
            line = ", ".join(f"{name} {t * 1e3:7.2f} ms" for name, t in times.items())
            rate = size / times["gemv_quantized"] / 1e9
            print(f"int8 weights, {str(dtype):15s} rows {rows:3d}: {line} (gemv_quantized {rate:.1f} GB/s)")


if __name__ == "__main__":
    sys.exit(main())
