"""fp8 KV cache storage: the cache dtype a kv_cache_dtype names, quantize / dequantize (the reference every kernel
matches), and which checkpoint tensors give the per-tensor scales.

A layer's K (and its V) cache holds round(x / scale) saturated to the format's largest finite value (never inf or
NaN), read back as stored * scale. One scale per tensor per layer: the checkpoint's `k_scale` / `v_scale` (or a
single `kv_scale` for both), as vLLM names them, else 1.0 (vLLM's default). No calibration is run at start-up.
"""
from __future__ import annotations

import re

import torch

FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# The C++ kernels' cache kinds (kernels/csrc/kv_cache.h): the model dtype, e4m3, e5m2.
CACHE_KINDS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
MLA_REFUSAL = "kv_cache_dtype fp8 is not supported for MLA models yet"
_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\..*\b(k_scale|v_scale|kv_scale)$")


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype K and V are stored in: the model's for "auto", else the fp8 format named."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(FP8_DTYPES)}, got {kv_cache_dtype!r}")
    return FP8_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in CACHE_KINDS


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in float32, saturated to the format's finite range, rounded to nearest even into `dtype`."""
    most = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-most, most).to(dtype)


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """stored * scale as `dtype` (the value every reader computes with)."""
    return (stored.float() * scale).to(dtype)


def stored_as(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `cache_dtype` gives it back: quantized and read again for fp8, else x itself."""
    return dequantize(quantize(x, scale, cache_dtype), scale, x.dtype) if is_fp8(cache_dtype) else x


def scale_target(name: str) -> tuple[int, tuple[str, ...]] | None:
    """A checkpoint tensor name → (its decoder layer's index, the scales it gives: ("k",), ("v",) or both for a
    kv_scale); None for any other tensor."""
    match = _SCALE_NAME.search(name)
    if match is None:
        return None
    which = match.group(2)
    return int(match.group(1)), ("k", "v") if which == "kv_scale" else (which[0],)


def layer_index(module_name: str) -> int | None:
    """The decoder layer index in a module's qualified name (…layers.N…), or None."""
    match = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", module_name)
    return None if match is None else int(match.group(1))


def checked_scale(value: torch.Tensor, name: str) -> float:
    """A per-tensor scale as a positive finite float; a ValueError naming the tensor otherwise."""
    if value.numel() != 1:
        raise ValueError(f"{name}: a KV cache scale is one value per tensor, got shape {tuple(value.shape)}")
    scale = float(value.float().reshape(()))
    if not (scale > 0 and scale < float("inf")):
        raise ValueError(f"{name}: a KV cache scale must be positive and finite, got {scale}")
    return scale
