"""Write new keys and values into the paged KV cache at their slots (torch reference)."""
from __future__ import annotations

import torch


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, num_kv_heads, block_size, head_dim].

    slot = block_id * block_size + offset; a negative slot marks a padded token and is skipped.
    """
    block_size = key_cache.shape[2]
    if (slot_mapping < 0).any():
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache[blocks, :, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value.to(value_cache.dtype)
