"""Write new keys and values into the paged KV cache at their slots, an fp8 cache's quantized with its per-tensor
scale (Triton twin of kv_cache_ref)."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import kv_quant


@triton.jit
def _fp8_grid(x, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """float32 x saturated to ±FP8_MAX and rounded to nearest even on the fp8 format's grid, still as float32.

    The cast to fp8 after this is exact, so every backend stores torch's bytes: the interpreter's own float32 → fp8
    cast rounds ties otherwise than to even (Triton 3.9).
    """
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    magnitude = tl.abs(x)
    bits = magnitude.to(tl.int32, bitcast=True)
    # to nearest even at MANTISSA_BITS on the bits: a carry out of the mantissa moves into the exponent, as it should
    bits += (1 << (22 - MANTISSA_BITS)) - 1 + ((bits >> (23 - MANTISSA_BITS)) & 1)
    normal = (bits & -(1 << (23 - MANTISSA_BITS))).to(tl.float32, bitcast=True)
    # Below the smallest normal the grid's spacing is fixed: adding a power of two whose float32 spacing is that
    # spacing makes the float32 addition round there (torch's own conversion does the same).
    shift = MIN_NORMAL * (1 << (23 - MANTISSA_BITS))
    subnormal = (magnitude + shift) - shift
    rounded = tl.where(magnitude < MIN_NORMAL, subnormal, normal)
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -rounded, rounded)  # the sign bit: -0.0 stays -0.0


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, k_scale, v_scale,
                     num_kv_heads, head_dim, block_size,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_ch, stride_cs,
                     HEADS_PADDED: tl.constexpr, DIM_PADDED: tl.constexpr,
                     FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """One program per token: all its heads, at cache slot slot_mapping[token]. MANTISSA_BITS 0: a cache of
    another dtype, which stores the values as they are."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padded token
        return
    heads = tl.arange(0, HEADS_PADDED)[:, None]
    dims = tl.arange(0, DIM_PADDED)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    cache_offsets = (slot // block_size) * stride_cb + heads * stride_ch + (slot % block_size) * stride_cs + dims
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    # The switch is the int constexpr: Triton before 3.9 takes no float in an `if`.
    if MANTISSA_BITS:  # x / scale divided as IEEE does (Triton's `/` need not round to nearest on a GPU)
        key = _fp8_grid(tl.math.div_rn(key.to(tl.float32), k_scale), FP8_MAX, MANTISSA_BITS, MIN_NORMAL)
        value = _fp8_grid(tl.math.div_rn(value.to(tl.float32), v_scale), FP8_MAX, MANTISSA_BITS, MIN_NORMAL)
    tl.store(key_cache_ptr + cache_offsets, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def cache_scales(cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The scales the kernels apply: an fp8 cache's, checked positive and finite; 1.0 for a cache of another dtype
    (which holds the values themselves)."""
    if not kv_quant.is_fp8(cache.dtype):
        return 1.0, 1.0
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (isinstance(scale, (int, float)) and 0 < scale < math.inf):
            raise ValueError(f"{name} of an fp8 KV cache must be a positive finite number, got {scale!r}")
    return float(k_scale), float(v_scale)


def _fp8_format(dtype: torch.dtype) -> dict[str, float | int]:
    """The write kernel's constexprs for a cache dtype (all 0 for a cache that is not fp8)."""
    if not kv_quant.is_fp8(dtype):
        return {"FP8_MAX": 0.0, "MANTISSA_BITS": 0, "MIN_NORMAL": 0.0}
    info = torch.finfo(dtype)
    return {"FP8_MAX": info.max, "MANTISSA_BITS": -round(math.log2(info.eps)), "MIN_NORMAL": info.tiny}


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Same contract as kv_cache_ref.write_kv_cache; the last dims of key, value and caches are contiguous; both
    caches have one dtype."""
    num_tokens, num_kv_heads, head_dim = key.shape
    k_scale, v_scale = cache_scales(key_cache, k_scale, v_scale)
    if not num_tokens:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, num_kv_heads, head_dim,
        key_cache.shape[2], key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads), DIM_PADDED=triton.next_power_of_2(head_dim),
        **_fp8_format(key_cache.dtype))
