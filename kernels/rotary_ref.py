"""Rotary position embedding, rotate-half convention as HF llama, from a cos/sin table (torch)."""
from __future__ import annotations

import torch


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query: [tokens, heads, dim], key: [tokens, kv_heads, dim]; cos/sin: [max_position, dim] (both halves equal).

    Returns the rotated (query, key) as new tensors.
    """
    cos = cos[positions].unsqueeze(1).to(query.dtype)
    sin = sin[positions].unsqueeze(1).to(query.dtype)
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
