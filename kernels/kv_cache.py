"""Write new keys and values into the paged KV cache: the Triton kernel on CUDA, else the torch reference."""
from __future__ import annotations

import torch

from kernels import kv_cache_ref
from kernels.backend import use_triton


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Same contract as kv_cache_ref.write_kv_cache."""
    if use_triton(key):
        from kernels import kv_cache_triton  # lazily: see kernels.backend
        kv_cache_triton.write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale,
                                       v_scale=v_scale)
    else:
        kv_cache_ref.write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
