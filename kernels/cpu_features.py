"""What the CPU can do: its instruction-set flags, and which dtype its matmuls should run in."""
from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags (empty where /proc/cpuinfo is unavailable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


@functools.cache
def cpu_has_native_bf16() -> bool:
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """float32 for bfloat16 data on a CPU that would emulate bf16 GEMMs (about 5x slower than float32).

    bf16 x bf16 products are exact in float32 and bf16 GEMMs accumulate in float32, so the float32 GEMM
    computes what a native bf16 one does.
    """
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_native_bf16():
        return torch.float32
    return dtype
