"""Rotary position embedding (rotate-half convention, as HF llama), with a precomputed cos/sin table."""
from __future__ import annotations

import math

import torch
from torch import nn

from kernels import rotary_embedding


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope_parameters: dict) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, rope_parameters)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """query: [tokens, heads, dim], key: [tokens, kv_heads, dim]; on CUDA they are rotated in place."""
        return rotary_embedding(positions, query, key, self.cos, self.sin)


def _inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    base = float(rope.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: 'default', 'llama3')")


def _llama3_scaled(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, a smooth ramp in between."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)
