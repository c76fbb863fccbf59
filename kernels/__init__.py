"""Attention kernels over the paged KV cache: torch reference implementations (Triton twins come later)."""
from kernels.attention_ref import DecodeGroup, paged_attention, plan_decode_groups
from kernels.cpu_features import matmul_dtype
from kernels.kv_cache_ref import write_kv_cache

__all__ = ["DecodeGroup", "matmul_dtype", "paged_attention", "plan_decode_groups", "write_kv_cache"]
