"""Attention kernels over the paged KV cache: torch reference implementations (Triton twins come later)."""
from kernels.attention_ref import paged_attention
from kernels.kv_cache_ref import write_kv_cache

__all__ = ["paged_attention", "write_kv_cache"]
