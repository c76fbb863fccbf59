"""Write new keys and values into the paged KV cache at their slots (torch reference)."""
from __future__ import annotations

import torch

from kernels import kv_quant


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, num_kv_heads, block_size, head_dim].

    slot = block_id * block_size + offset; a negative slot marks a padded token and is skipped. fp8 caches store
    kv_quant.quantize(key, k_scale) and of value, v_scale; other caches the values as they are (scales unused).
    """
    block_size = key_cache.shape[2]
    if (slot_mapping < 0).any():
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache[blocks, :, offsets] = _stored(key, k_scale, key_cache.dtype)
    value_cache[blocks, :, offsets] = _stored(value, v_scale, value_cache.dtype)


def _stored(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return kv_quant.quantize(x, scale, dtype) if kv_quant.is_fp8(dtype) else x.to(dtype)
