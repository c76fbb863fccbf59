"""Rotary position embedding (rotate-half convention, as HF llama), with a precomputed cos/sin table."""
from __future__ import annotations

import math

import torch
from torch import nn
from transformers import PretrainedConfig

from kernels import rotary_embedding


def rope_parameters_of(config: PretrainedConfig) -> dict:
    """transformers 5 keeps rope settings in `rope_parameters`; older configs use rope_theta/rope_scaling."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    return {"rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}


class RotaryEmbedding(nn.Module):
    """Rotates the first `rotary_dim` = head_dim * partial_rotary_factor dims of each head (GPT-NeoX, Phi)."""

    def __init__(self, head_dim: int, max_position: int, rope_parameters: dict) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * rope_parameters.get("partial_rotary_factor", 1.0))
        inv_freq, attention_factor = _inv_freq(self.rotary_dim, max_position, rope_parameters)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """query: [tokens, heads, dim], key: [tokens, kv_heads, dim]; on CUDA they are rotated in place."""
        if self.rotary_dim == query.shape[-1]:
            return rotary_embedding(positions, query, key, self.cos, self.sin)
        dim = self.rotary_dim
        q_rot, k_rot = rotary_embedding(positions, query[..., :dim].contiguous(), key[..., :dim].contiguous(),
                                        self.cos, self.sin)
        return torch.cat((q_rot, query[..., dim:]), dim=-1), torch.cat((k_rot, key[..., dim:]), dim=-1)


def _inv_freq(dim: int, max_position: int, rope: dict) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, the factor cos and sin are scaled by) as HF transformers' rope init functions."""
    base = float(rope.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = rope_type_of(rope)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":  # positions divided by `factor` (Gemma 3's global layers)
        return inv_freq / rope["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope), 1.0
    if rope_type == "yarn":
        return _yarn(dim, base, max_position, rope)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: 'default', 'linear', 'llama3', 'yarn')")


def rope_type_of(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `scale` times the original."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, max_position: int, rope: dict) -> tuple[torch.Tensor, float]:
    """YaRN: high frequencies kept (extrapolated), low ones divided by `factor` (interpolated), a linear ramp over
    the dims between the correction range beta_fast..beta_slow rotations; cos/sin scaled by the attention factor."""
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_position / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) \
            if mscale and mscale_all_dim else yarn_mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


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
