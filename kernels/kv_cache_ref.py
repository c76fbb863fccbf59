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
    """key/value: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim].

    slot = block_id * block_size + offset; a negative slot marks a padded token and is skipped.
    """
    num_blocks, block_size = key_cache.shape[:2]
    flat_k = key_cache.view(num_blocks * block_size, *key_cache.shape[2:])
    flat_v = value_cache.view(num_blocks * block_size, *value_cache.shape[2:])
    if (slot_mapping < 0).any():
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))
