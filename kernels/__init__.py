"""Attention kernels over the paged KV cache: torch reference twins, a fused CPU decode kernel (Triton later)."""
from kernels.attention import paged_attention
from kernels.cpu_decode_attention import load as load_cpu_decode_kernel
from kernels.cpu_features import matmul_dtype
from kernels.kv_cache_ref import write_kv_cache

__all__ = ["load_cpu_decode_kernel", "matmul_dtype", "paged_attention", "write_kv_cache"]
